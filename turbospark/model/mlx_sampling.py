"""Sampling for the MLX backend: per-sequence samplers, logits processors and log-probabilities.

Everything here builds or runs per-sequence callables that mlx-lm's ``BatchGenerator`` calls on
the model thread, inside a step.

- A sampler draws with its request's own PRNG key, split per step, so a ``seed`` repeats exactly
  whatever shares the batch; greedy sequences share one sampler (``greedy``), so an all-greedy
  batch samples in one call.
- Penalties, ``logit_bias``, the hold on the turn's end (``min_tokens``, ``ignore_eos``) and a
  grammar are logits processors, given the tokens in the sequence's KV cache (the whole prompt,
  then what was generated).
- ``top_logprobs`` evaluates the chosen token's log-probability and the top ``k`` in one go for
  the sequences that asked (the others never pay for the sync).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import TypeVar

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)

from .backend import SamplingParams
from .constraint import Matcher

K = TypeVar("K", bound=Hashable)

__all__ = [
    "Sampler", "constrain", "greedy", "guard", "hold_ends", "make_processors", "make_sampler", "think_budget",
    "think_ids", "top_logprobs",
]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class Sampler:
    """A draw with one request's own key: top-k / top-p / min-p, then a categorical draw.

    Each call splits the key once.  ``mark`` and ``rewind`` let a speculative step draw for
    several positions and then give back the draws of the positions it rejected, so the
    ``i``-th token of a sequence always comes from the ``i``-th split of its seed's key,
    speculating or not."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.params = params
        self.key = mx.random.key(seed % 2**64)
        self.inv_temp = 1.0 / params.temperature
        self._keys: list[mx.array] | None = None  # since ``mark``: the key after each draw

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, draw = mx.random.split(self.key)
        if self._keys is not None:
            self._keys.append(self.key)
        params = self.params
        if 0 < params.top_k < logprobs.shape[-1]:  # a k past the vocabulary filters nothing
            logprobs = apply_top_k(logprobs, params.top_k)
        if params.top_p < 1:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p > 0:
            logprobs = apply_min_p(logprobs, params.min_p)
        return mx.random.categorical(logprobs * self.inv_temp, key=draw)

    def mark(self) -> None:
        """Remember the key as it is now: the draws after this one may be given back."""
        self._keys = [self.key]

    def rewind(self, kept: int) -> None:
        """Keep only the first ``kept`` draws since ``mark``."""
        assert self._keys is not None, "rewind without mark"
        self.key = self._keys[min(kept, len(self._keys) - 1)]  # fewer: a guard stood in
        self._keys = None


def guard(
    failed: dict[int, BaseException], seq: int, fn: Callable[..., mx.array], stand_in: Callable[..., mx.array]
) -> Callable[..., mx.array]:
    """``fn`` for one sequence; if it raises, the sequence is marked failed (in ``failed``) and
    the step goes on with ``stand_in`` for it."""

    def guarded(*args: mx.array) -> mx.array:
        if seq not in failed:
            try:
                return fn(*args)
            except Exception as exc:
                failed[seq] = exc
        return stand_in(*args)

    return guarded


def make_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """Greedy at temperature 0 (or ``top_p`` 0, OpenAI's most restrictive nucleus); otherwise
    a ``Sampler`` with this request's own key."""
    if params.temperature == 0 or params.top_p == 0:
        return greedy
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return Sampler(params, seed)


def make_processors(
    params: SamplingParams, prompt_len: int, ends: Collection[int] = (), matcher: Matcher | None = None,
    think: tuple[int, int] | None = None,
) -> list[Callable[..., mx.array]]:
    """Penalties, ``logit_bias``, the hold on ``ends`` (the tokens that end the turn) and the
    grammar ``matcher`` enforces, as logits processors for the batch engine, in that order.

    The engine hands each processor the tokens in the sequence's KV cache: the whole prompt, then
    what was generated.  Presence and frequency penalties see the generated text only (OpenAI's
    meaning); the repetition penalty sees the end of the prompt as well (Hugging Face's meaning,
    over mlx-lm's 20-token window).
    """
    processors: list[Callable[..., mx.array]] = []
    generated_only = [
        make_presence_penalty(params.presence_penalty, params.max_tokens)
        if params.presence_penalty
        else None,
        make_frequency_penalty(params.frequency_penalty, params.max_tokens)
        if params.frequency_penalty
        else None,
    ]
    for penalty in filter(None, generated_only):
        processors.append(
            lambda tokens, logits, penalty=penalty: penalty(tokens[prompt_len:], logits)
        )
    if params.repetition_penalty != 1:
        processors.append(make_repetition_penalty(params.repetition_penalty, 20))
    if params.logit_bias:
        ids = mx.array([i for i, _ in params.logit_bias])
        bias = mx.array([b for _, b in params.logit_bias], dtype=mx.float32)
        processors.append(lambda tokens, logits: logits.at[:, ids].add(bias.astype(logits.dtype)))
    holding = _holding(params, prompt_len) if ends else None
    if matcher is not None:
        processors.append(constrain(matcher, ends, holding))
    elif holding is not None:
        processors.append(hold_ends(ends, holding))
    if params.reasoning_budget is not None and think is not None:
        processors.append(think_budget(params.reasoning_budget, *think))
    return processors


def think_ids(vocab: Mapping[str, int]) -> tuple[int, int] | None:
    """A vocabulary's ``<think>`` and ``</think>`` tokens, where each is one token."""
    start, end = vocab.get("<think>"), vocab.get("</think>")
    return None if start is None or end is None else (start, end)


def think_budget(budget: int, start: int, end: int) -> Callable[[mx.array, mx.array], mx.array]:
    """A hard cap on reasoning as a logits processor: once ``budget`` tokens follow an unclosed
    ``start`` (``<think>``, the prompt's own or one the model wrote), ``end`` is the only token
    allowed, and the model answers after it.  The context is read as it grows, each token once; one
    no longer than the last (a speculative step's rewind) is read again from its start."""
    seen = 0
    opened: int | None = None  # where the reasoning began: the position after its <think>

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal seen, opened
        n = tokens.shape[0]
        if n <= seen:  # a rewind (a plain step adds one token, a speculative one more)
            seen, opened = 0, None
        for i, token in enumerate(tokens[seen:].tolist() if n > seen else (), seen):
            if token == start:
                opened = i + 1
            elif token == end:
                opened = None
        seen = n
        if opened is None or n - opened < budget:
            return logits
        only = mx.arange(logits.shape[-1]) == end
        return mx.where(only, logits, mx.array(-mx.inf, dtype=logits.dtype))

    return process


def _holding(params: SamplingParams, prompt_len: int) -> Callable[[mx.array], bool] | None:
    """Whether the turn's end is held back, given the context; None where it never is.  What
    was generated is what the KV cache holds past the prompt: the same count in a plain step and
    at each position of a speculative one (``mlx_speculate``)."""
    if not (params.ignore_eos or params.min_tokens):
        return None
    return lambda tokens: params.holds_end(tokens.shape[0] - prompt_len)


def _end_mask(ends: Collection[int], width: int) -> np.ndarray:
    mask = np.zeros(width, dtype=bool)
    mask[[i for i in ends if 0 <= i < width]] = True
    return mask


def hold_ends(ends: Collection[int], holding: Callable[[mx.array], bool]) -> Callable[[mx.array, mx.array], mx.array]:
    """``min_tokens`` and ``ignore_eos`` as a logits processor: while ``holding`` says so (given
    the context), every token of ``ends`` gets a logit of -inf, so no sampler, greedy or not,
    can draw one.  Only its own sequence's row is touched: its batch-mates end as they would."""
    masks: dict[int, mx.array] = {}  # by vocabulary width, built once

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if not holding(tokens):
            return logits
        width = logits.shape[-1]
        if width not in masks:
            masks[width] = mx.array(_end_mask(ends, width))
        return mx.where(masks[width], mx.array(-mx.inf, dtype=logits.dtype), logits)

    return process


def constrain(
    matcher: Matcher, ends: Collection[int] = (), holding: Callable[[mx.array], bool] | None = None,
) -> Callable[[mx.array, mx.array], mx.array]:
    """Constrained decoding as a logits processor: consume the token sampled last step (the
    engine feeds it back as the newest context token; the first call sees the prompt's last
    token), then mask every token the grammar does not allow next.

    While ``holding`` (``min_tokens``, ``ignore_eos``), ``ends`` are masked too, wherever the
    grammar allows anything else: where its end is all it allows (a JSON answer closed), the end
    is taken, so a constrained answer never runs on past its grammar."""
    calls = 0
    held: np.ndarray | None = None  # ``ends`` over the vocabulary, built once

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls, held
        if calls:
            matcher.consume(int(tokens[-1].item()))
        calls += 1
        if matcher.done:
            return logits
        allowed = matcher.allowed()
        mask = np.zeros(logits.shape[-1], dtype=bool)
        width = min(len(allowed), mask.size)
        mask[:width] = allowed[:width]
        if holding is not None and holding(tokens):
            if held is None:
                held = _end_mask(ends, mask.size)
            others = mask & ~held
            if others.any():
                mask = others
        return mx.where(mx.array(mask), logits, mx.array(-mx.inf, dtype=logits.dtype))

    return process


def top_logprobs(
    asked: list[tuple[K, mx.array, int, int]],
) -> dict[K, tuple[float, tuple[tuple[int, float], ...]]]:
    """The chosen token's log-probability and the ``k`` most likely tokens, for the sequences
    that asked (one evaluation for all of them; nothing for the others).  ``asked`` holds
    ``(key, logprobs, token, k)``, a key per token (a sequence, or a sequence and a position)."""
    if not asked:
        return {}
    picks = []
    for _, lp, token, k in asked:
        top = mx.argpartition(-lp, k - 1)[:k] if k else mx.array([], dtype=mx.uint32)
        picks.append((lp[token], top, lp[top] if k else top))
    mx.eval(picks)
    out = {}
    for (seq, _, _, _), (chosen, top, values) in zip(asked, picks, strict=True):
        pairs = sorted(zip(top.tolist(), values.tolist(), strict=True), key=lambda p: -p[1])
        out[seq] = (chosen.item(), tuple(pairs))
    return out
