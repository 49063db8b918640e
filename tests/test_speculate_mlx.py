"""Speculative steps on mlx-lm's batch engine, with a tiny random model (no download): drafts
checked in one forward pass give exactly the tokens plain steps give, greedy or seeded, in a batch
whose rows keep different numbers of draft tokens; and a draft token that is checked is kept or
replaced with the model's own distribution (a statistical test over many seeds)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator

from turbospark.model.backend import SamplingParams
from turbospark.model.lookup import Lookup
from turbospark.model.mlx_sampling import Sampler, greedy
from turbospark.model.mlx_speculate import can_speculate, pending_tokens, verify

from ._support import tiny_llama

VOCAB = 8

MODEL = tiny_llama(VOCAB, layers=2, seed=0)  # peaked: drafts are often right
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6]]
KEPT: list[tuple[int, int]] = []  # (drafted, kept) per row of each speculative step


def run(prompts: list[list[int]], samplers: list, new: int, drafts_from=None) -> list[list[int]]:
    """``new`` tokens per prompt: plain engine steps, or (``drafts_from``) speculative ones."""
    engine = BatchGenerator(MODEL, sampler=greedy, completion_batch_size=8, prefill_batch_size=8)
    engine.insert(prompts, max_tokens=[new + 20] * len(prompts),
                  samplers=[s or greedy for s in samplers])
    out: list[list[int]] = [[] for _ in prompts]
    lookups = [Lookup(min_n=1) for _ in prompts]
    while min(len(o) for o in out) < new:
        batch = engine._generation_batch
        if drafts_from is not None and len(batch) == len(prompts) and not len(engine._prompt_batch):
            assert can_speculate(batch)
            drafts = []
            for e, y in enumerate(pending_tokens(batch)):
                lookups[e].extend(batch.tokens[e][len(lookups[e].tokens):] + [y])
                drafts.append(drafts_from(e, lookups[e]))
            if any(drafts):
                for e, tokens in enumerate(verify(batch, drafts, samplers)[0]):
                    out[batch.uids[e]].extend(tokens)
                    KEPT.append((len(drafts[e]), len(tokens) - 1))
                continue
        _, generated = engine.next()
        for r in generated:
            out[r.uid].append(r.token)
    engine.close()
    return [o[:new] for o in out]


def test_greedy_drafts_give_exactly_the_plain_tokens_in_a_batch() -> None:
    plain = run(PROMPTS, [None, None], 24)
    KEPT.clear()
    # row 0 drafts from its own text (often right), row 1 a fixed wrong guess half the time:
    # the rows keep different numbers of draft tokens, and their caches are cut back per row
    drafts = lambda e, lk: lk.draft(4) if e == 0 else ([0, 0, 0] if len(lk.tokens) % 2 else lk.draft(2))  # noqa: E731
    assert run(PROMPTS, [None, None], 24, drafts) == plain
    assert any(0 < kept for _, kept in KEPT) and any(kept < drafted for drafted, kept in KEPT)


def test_a_seed_gives_the_same_text_with_speculation_as_without() -> None:
    params = SamplingParams(temperature=1.0)
    for seed in range(6):
        plain = run(PROMPTS, [Sampler(params, seed), Sampler(params, seed + 100)], 16)
        spec = run(PROMPTS, [Sampler(params, seed), Sampler(params, seed + 100)], 16,
                   lambda e, lk: lk.draft(3))
        assert spec == plain


def test_a_checked_draft_token_keeps_the_models_distribution() -> None:
    """The token after the first, drawn while checking a draft of the most likely token, over
    400 seeds: its counts against the model's own probabilities (chi-square, 7 degrees of
    freedom; 24.3 is the 0.001 level)."""
    params = SamplingParams(temperature=1.0, top_k=0)
    prompt = PROMPTS[0]
    counts = np.zeros(VOCAB)
    expected = np.zeros(VOCAB)
    accepted = 0
    for seed in range(400):
        sampler = Sampler(params, seed)
        first: list[int] = []

        def draft_argmax(e: int, lk: Lookup) -> list[int]:
            if first:
                return []
            first.append(lk.tokens[-1])
            probs = mx.softmax(MODEL(mx.array([prompt + first]))[0, -1]).tolist()
            expected[:] += probs
            return [int(np.argmax(probs))]

        (tokens,) = run([prompt], [sampler], 2, draft_argmax)
        counts[tokens[1]] += 1
        accepted += tokens[1] == int(np.argmax(expected))  # a rough tally only
    chi2 = float(((counts - expected) ** 2 / np.maximum(expected, 1e-9)).sum())
    assert counts.sum() == 400
    assert chi2 < 24.3, (counts, expected.round(1), chi2)
