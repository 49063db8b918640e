"""Sampling parameters, chosen the same way for every API family (sans-io): each field the
request gave, else the model's own default (its ``generation_config.json``), else the server's
(``SamplingParams``' defaults)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from ..model.backend import SamplingParams

__all__ = ["adapters_chosen", "sampling"]


def sampling(defaults: Mapping[str, float], given: Mapping[str, Any], **fixed: Any) -> SamplingParams:
    """``given``: the request's sampling fields by ``SamplingParams`` name, ``None`` where it
    said nothing; ``fixed``: what the route decides whatever the model (budget, stops, grammar)."""
    chosen = {name: value for name, value in given.items() if value is not None}
    return SamplingParams(**{**defaults, **chosen, **fixed})


def adapters_chosen(params: SamplingParams, adapters: Sequence[str], name: str | None,
                    lora: Iterable[Any] | None = None) -> SamplingParams:
    """``params`` with the LoRA adapters a request chose among a model's (``adapters``, by name,
    ``serve --lora``'s order): llama.cpp's ``lora`` entries (``id``, ``scale``) where it gave
    any, else the adapter its model ``name`` is (vLLM's convention; Ollama's ``:latest`` tag
    aside) at scale 1, else none.  An id out of range is the model thread's 400."""
    chosen = tuple((int(c.id), float(c.scale)) for c in lora or ())
    if not chosen and name is not None:
        bare = name.removesuffix(":latest")
        chosen = tuple((i, 1.0) for i, a in enumerate(adapters) if a in (name, bare))[:1]
    return attrs.evolve(params, adapters=chosen) if chosen else params
