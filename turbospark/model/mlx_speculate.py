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

from .mlx_sampling import Sampler, greedy

__all__ = ["can_speculate", "pending_tokens", "verify"]


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
