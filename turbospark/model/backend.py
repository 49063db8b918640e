"""What a backend is: the synchronous interface the model thread drives.

A backend is created, loaded and used on its model's one pinned OS thread (MLX streams are
thread-local), so nothing here is async and nothing imports Trio.  ``generate`` is a generator:
it yields ``PrefillProgress`` once before the first chunk and after every prefill chunk, then one
token id per decode step.  The caller stops a generation by not asking for the next item (and
closing the generator); that is how cancellation reaches the model between chunks and steps.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Protocol

import attrs

from .tokenizer import Tokenizer

__all__ = ["Backend", "BackendSpec", "PrefillProgress", "SamplingParams"]


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


@attrs.frozen
class PrefillProgress:
    """``done`` of ``total`` prompt tokens are in the KV cache; ``cached`` of them were reused."""

    done: int
    total: int
    cached: int


class Backend(Protocol):
    model_id: str
    context_window: int
    tokenizer: Tokenizer
    #: The model's own defaults for sampling fields a request leaves out (``SamplingParams`` field
    #: names), e.g. from its ``generation_config.json``.
    sampling_defaults: Mapping[str, float]

    def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> Generator[PrefillProgress | int, None, None]: ...


@attrs.frozen
class BackendSpec:
    """A model to attach: its id, and how its thread builds the backend."""

    id: str
    make: Callable[[], Backend]
