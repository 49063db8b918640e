"""Speculative decoding on mlx-lm's generation batch: check drafts in one forward pass.

Runs on the model thread, inside a step, in place of ``GenerationBatch.next`` (mlx-lm's own
speculative decoding, ``speculative_generate_step``, drives one sequence with a draft model and
its own cache; the batch engine has none).  ``verify`` feeds each row its pending token (the one
sampled last step) followed by its draft, in one forward pass of ``1 + k`` positions, and
samples every position with that row's own sampler and logits processors, exactly as ``k + 1``
single steps would.  A row keeps its draft up to the first position where the model's own choice
differs; that choice becomes its next pending token.

- Greedy rows: the output is exactly what decoding one token at a time gives.
- Sampled rows: the model's draw at each position is compared with the draft token.  For a
  deterministic draft (prompt lookup) this *is* the standard rejection rule: the draft token
  ``d`` is kept with probability ``p(d)``, and otherwise the token drawn is distributed as
  ``p`` with ``d`` removed and renormalised.  The key is rewound for the rejected positions
  (``Sampler.rewind``), so a sequence's ``i``-th token is drawn with the ``i``-th key of its seed
  either way: a seeded request gives the same text with speculation as without it.
- The KV cache is trimmed back to what was kept: the batch drops the positions no row kept, and
  a row that kept fewer than the longest is shifted right into its left padding (what mlx-lm's
  ``BatchKVCache.finalize`` does for right-padded prompts).

- Logits processors see each row's pending token and its own draft, never the padding after
  it.  A stateful one (a grammar's matcher) has then consumed the whole draft: the caller drafts
  only what the grammar allows and rolls the refused tokens back.  Each emitted token comes
  with the log-probabilities it was drawn from, for requests that report them.

Only plain ``BatchKVCache`` layers can be cut per row (``can_speculate``); other caches never
speculate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from .backend import StepOutput
from .mlx_sampling import Sampler, greedy, top_logprobs

__all__ = ["can_speculate", "pending_tokens", "speculative_step", "verify"]


def can_speculate(batch: Any) -> bool:
    """Whether every layer of the generation batch's KV cache can be cut back per row."""
    return bool(batch.prompt_cache) and all(type(c) is BatchKVCache for c in batch.prompt_cache)


def pending_tokens(batch: Any) -> list[int]:
    """The token each row sampled last step, not yet in its KV cache (a sync)."""
    mx.eval(batch._next_tokens)
    return batch._next_tokens.tolist()


def verify(
    batch: Any, drafts: Sequence[Sequence[int]], samplers: Sequence[Sampler | None]
) -> tuple[list[list[int]], list[list[mx.array]]]:
    """One step of ``batch`` (mlx-lm's ``GenerationBatch``) that checks each row's draft.

    ``samplers[e]`` is row ``e``'s own ``Sampler`` (None: greedy).  Returns, per row, the
    tokens this step emits (its pending token, then the draft tokens it kept) and the
    log-probability vectors each of them was drawn from (lazy: evaluated only if read)."""
    rows = len(batch.uids)
    ys = pending_tokens(batch)
    drawn_from = list(batch._next_logprobs)  # the pending tokens' distributions
    k = max(len(d) for d in drafts)
    width = k + 1
    inputs = mx.array([[y, *d, *[0] * (k - len(d))] for y, d in zip(ys, drafts, strict=True)], dtype=mx.uint32)
    logits = batch.model(inputs, cache=batch.prompt_cache)  # rows x width x vocab

    processed = []
    for e in range(rows):
        row = logits[e]
        processors = batch.logits_processors[e] or ()
        if processors:
            context = batch._token_context[e].update_and_fetch(inputs[e])
            base = context.shape[0] - width
            # only the columns of the row's own draft: a processor that keeps state (a grammar's
            # matcher) must never see the padding
            cols = []
            for i in range(len(drafts[e]) + 1):
                col = row[i:i + 1]
                for processor in processors:
                    col = processor(context[:base + i + 1], col)
                cols.append(col)
            row = mx.concatenate([*cols, row[len(cols):]], axis=0)
        processed.append(row)
    logits = mx.stack(processed)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    engine_samplers = [batch.fallback_sampler if s is None else s for s in batch.samplers]
    if all(s is greedy for s in engine_samplers):
        sampled = [greedy(logprobs)]  # one call for the whole batch
    else:
        sampled = []
        for e, (draw, own) in enumerate(zip(engine_samplers, samplers, strict=True)):
            if draw is greedy:
                sampled.append(greedy(logprobs[e]).reshape(1, width))
                continue
            if own is not None:
                own.mark()
            # each position its own draw, in order (the engine's sampler may wrap ``own``)
            cols = [draw(logprobs[e, i:i + 1]) for i in range(len(drafts[e]) + 1)]
            cols += [mx.zeros((1,), dtype=cols[0].dtype)] * (width - len(cols))
            sampled.append(mx.concatenate(cols).reshape(1, width))
    chosen = mx.concatenate(sampled).reshape(rows, width)
    mx.eval(chosen)
    picks = chosen.tolist()

    kept: list[int] = []
    for draft, pick in zip(drafts, picks, strict=True):
        n = 0
        while n < len(draft) and pick[n] == draft[n]:
            n += 1
        kept.append(n)
    for own, n in zip(samplers, kept, strict=True):
        if own is not None:
            own.rewind(n + 1)

    # Cut the KV back: every row fed ``width`` positions and keeps ``1 + kept``.
    longest = max(kept) + 1
    shift = [longest - (n + 1) for n in kept]
    for c in batch.prompt_cache:
        c.trim(width - longest)
        if any(shift):
            c._right_padding = mx.array(shift)
            c.finalize()
    emitted, dists = [], []
    for e, (y, draft, n) in enumerate(zip(ys, drafts, kept, strict=True)):
        out = [y, *draft[:n]]
        emitted.append(out)
        dists.append([drawn_from[e], *(logprobs[e, i] for i in range(n))])
        batch.tokens[e].extend(out)
        batch._num_tokens[e] += len(out)
        if batch.logits_processors[e]:
            batch._token_context[e]._size -= width - len(out)
    batch._current_tokens = mx.array(ys, dtype=mx.uint32)
    batch._next_tokens = mx.array([pick[n] for pick, n in zip(picks, kept, strict=True)], dtype=mx.uint32)
    batch._next_logprobs = [logprobs[e, n] for e, n in enumerate(kept)]
    mx.async_eval(batch._next_tokens, batch._next_logprobs)
    return emitted, dists


def speculative_step(backend: Any) -> StepOutput | None:
    """A speculative step of ``backend`` (an ``MlxBackend``), when only a few sequences decode,
    none reads a prompt, and one at least has a draft from its own prompt and output; otherwise
    None (the engine's plain step runs)."""
    engine = backend.engine
    batch = engine._generation_batch
    if (not 0 < len(batch) <= backend.speculate_up_to or len(engine._prompt_batch)
            or engine._unprocessed_sequences):
        return None
    seqs = [backend._by_uid.get(uid) for uid in batch.uids]
    if None in seqs:
        return None
    runs = [backend._running[s] for s in seqs]  # type: ignore[index]
    if all(r.drafter is None for r in runs) or not can_speculate(batch) or not backend.looks.due():
        return None
    with mx.stream(backend.stream):
        drafts = []
        for e, (run, y) in enumerate(zip(runs, pending_tokens(batch), strict=True)):
            if run.drafter is None:
                drafts.append([])
                continue
            run.drafter.extend(batch.tokens[e][len(run.drafter.tokens):])
            run.drafter.extend([y])
            room = batch.max_tokens[e] - 3 - batch._num_tokens[e]  # our budget, after y
            draft = run.drafter.draft(min(run.pace.k, room))
            if run.matcher is not None and draft:  # only what the grammar allows after y
                draft = draft[:max(0, run.matcher.allows([y, *draft]) - 1)]
            drafts.append(draft)
        if not any(drafts):
            backend.looks.record(kept=False)
            return None
        before = [r.matcher.consumed if r.matcher else 0 for r in runs]
        emitted, dists = verify(batch, drafts, [r.sampler for r in runs])
        backend.looks.record(kept=any(len(out) > 1 for out in emitted))
        for run, was, out in zip(runs, before, emitted, strict=True):
            if run.matcher is not None:  # it consumed the pending token and the whole draft
                run.matcher.rollback(run.matcher.consumed - was - len(out))
        asked = [((seq, i), lp, token, run.logprobs)
                 for seq, run, out, lps in zip(seqs, runs, emitted, dists, strict=True) if run.logprobs is not None
                 for i, (token, lp) in enumerate(zip(out, lps, strict=True))]
        reported = top_logprobs(asked)
    backend.engine_steps += 1
    tokens: dict[int, int] = {}
    more: dict[int, tuple[int, ...]] = {}
    for seq, run, draft, out in zip(seqs, runs, drafts, emitted, strict=True):
        assert seq is not None
        run.pace.record(len(draft), len(out) - 1)
        backend.drafted += len(draft)
        backend.accepted += len(out) - 1
        backend.decode_steps += len(out)
        tokens[seq] = out[0]
        if len(out) > 1:
            more[seq] = tuple(out[1:])
    failed = backend._drop_failed(tokens)
    logprobs = {s: tuple(reported[s, i] for i in range(len(o))) for s, o in zip(seqs, emitted, strict=True)
                if s in tokens and (s, 0) in reported}
    return StepOutput(tokens=tokens, more={s: m for s, m in more.items() if s in tokens}, failed=failed,
                      logprobs={s: v[0] for s, v in logprobs.items()},
                      more_logprobs={s: v[1:] for s, v in logprobs.items() if len(v) > 1})
