"""What a backend is: the synchronous, batched interface the model thread drives.

A backend is created, loaded and used on its model's one pinned OS thread (MLX streams are
thread-local), so nothing here is async and nothing imports Trio.  It runs many sequences at
once, each named by an id the model thread chooses:

- ``insert(seq, prompt, params)`` adds a sequence (its prefill starts at the next ``step``) and
  says how many prompt tokens it found in the prefix cache;
- ``step()`` does one engine step for every sequence it holds: one prefill chunk for sequences
  still reading their prompt (the chunk is the cancellation bound of prefill) and one decode step
  for the others; it reports progress, one token per decoding sequence (and, after a
  speculative step, the further tokens it accepted), and the sequences that failed alone (they are already out of the batch);
- ``fork(seq, new)`` starts more sequences from ``seq``'s prompt once ``seq`` has read it (the
  choices of one request: the prompt is prefilled once), or says it cannot share that cache;
- ``remove(seq)`` takes a sequence out (finished, or its client left) and hands its KV cache back
  to the prefix cache; ``keep_cache=False`` drops it (its state is not trusted);
- ``reset()`` drops everything, after a step that failed as a whole.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs

from .constraint import Grammar
from .tokenizer import Tokenizer

__all__ = [
    "Backend", "BackendSpec", "PrefillProgress", "SamplingParams", "StepOutput", "common_prefix", "fingerprint",
]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start: what a prefix cache can reuse."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def fingerprint(*parts: str) -> str:
    """OpenAI's ``system_fingerprint``: a short stable digest of what decides a model's output
    (its weights' digest, dtype, the engine's versions), the same across restarts."""
    return "fp_" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


@attrs.frozen
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 64
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    grammar: Grammar | None = None  # constrained decoding: only what the grammar accepts
    speculative: bool = True  # prompt-lookup drafts may be checked (the backend decides when)
    # vLLM's and llama.cpp's: the tokens that end a turn (``Tokenizer.stop_ids``) are never
    # sampled before ``min_tokens`` tokens (nor stop strings matched), and never at all with
    # ``ignore_eos`` (stop strings still end it); a grammar's end is taken where it is the only
    # token the grammar allows (``mlx_sampling.hold_ends``)
    min_tokens: int = 0
    ignore_eos: bool = False
    # LoRA adapters the model was served with (``serve --lora``), by index, each with its scale:
    # the request's model name (the adapter's), or llama.cpp's ``lora`` field (``mlx_adapters``)
    adapters: tuple[tuple[int, float], ...] = ()
    # a hard cap on reasoning (Anthropic's thinking.budget_tokens, vLLM's thinking_token_budget,
    # serve --reasoning-budget): past this many tokens inside <think>, the model is made to
    # close it (``mlx_sampling.think_budget``) and answer
    reasoning_budget: int | None = None

    def holds_end(self, generated: int) -> bool:
        """Whether the ending tokens are held back for the token after ``generated`` ones."""
        return self.ignore_eos or generated < self.min_tokens


@attrs.frozen
class PrefillProgress:
    """``done`` of ``total`` prompt tokens are in the KV cache; ``cached`` of them were reused."""

    done: int
    total: int
    cached: int


@attrs.frozen
class StepOutput:
    """What one engine step did, per sequence id."""

    progress: Mapping[int, PrefillProgress] = attrs.field(factory=dict)
    tokens: Mapping[int, int] = attrs.field(factory=dict)
    #: Tokens a speculative step accepted after ``tokens[seq]``, in order (usually none).
    more: Mapping[int, tuple[int, ...]] = attrs.field(factory=dict)
    failed: Mapping[int, BaseException] = attrs.field(factory=dict)
    #: For sequences that asked: the token's log-probability, and the most likely alternatives
    #: as (token id, log-probability), most likely first.
    logprobs: Mapping[int, tuple[float, tuple[tuple[int, float], ...]]] = attrs.field(factory=dict)
    #: The same for each of ``more[seq]``, in order.
    more_logprobs: Mapping[int, tuple[tuple[float, tuple[tuple[int, float], ...]], ...]] = attrs.field(factory=dict)

    def emitted(self, seq: int) -> tuple[int, ...]:
        """Every token this step gave ``seq``, in order: ``tokens[seq]`` and a speculative step's
        further ones (none for a sequence that got no token)."""
        return (self.tokens[seq], *self.more.get(seq, ())) if seq in self.tokens else ()


class Backend(Protocol):
    model_id: str
    context_window: int
    tokenizer: Tokenizer
    #: The model's own defaults for sampling fields a request leaves out (``SamplingParams`` field
    #: names), from its ``generation_config.json``.
    sampling_defaults: Mapping[str, float]
    #: ``system_fingerprint`` of everything this backend generates (see ``fingerprint``).
    fingerprint: str

    def kv_estimate(self, tokens: int) -> int:
        """Bytes of KV cache a sequence of ``tokens`` tokens holds (for admission)."""
        ...

    def kv_bytes(self) -> int:
        """Bytes of KV cache the running sequences hold now."""
        ...

    def insert(self, seq: int, prompt: list[int], params: SamplingParams, images: Any = None) -> int:
        """``seq`` starts; how many of its prompt's tokens came from the prefix cache.  ``images``:
        what a vision model's ``vision.see`` made of the request's images (``mlx_vision``)."""
        ...

    def cached_prefix(self, prompt: list[int], images: Any = None) -> int:
        """How many of ``prompt``'s tokens ``insert`` would find in the prefix cache now."""
        ...

    def step(self) -> StepOutput: ...

    def fork(self, seq: int, new: Mapping[int, SamplingParams]) -> bool: ...

    def remove(self, seq: int, *, keep_cache: bool = True) -> None: ...

    def reset(self) -> None: ...


@attrs.frozen
class BackendSpec:
    """A model to attach: its id, and how its thread builds the backend."""

    id: str
    make: Callable[[], Backend]
