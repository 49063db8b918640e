"""Sampling parameters, chosen the same way for every API family (sans-io): each field the
request gave, else the model's own default (its ``generation_config.json``), else the server's
(``SamplingParams``' defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..model.backend import SamplingParams

__all__ = ["sampling"]


def sampling(defaults: Mapping[str, float], given: Mapping[str, Any], **fixed: Any) -> SamplingParams:
    """``given``: the request's sampling fields by ``SamplingParams`` name, ``None`` where it
    said nothing; ``fixed``: what the route decides whatever the model (budget, stops, grammar)."""
    chosen = {name: value for name, value in given.items() if value is not None}
    return SamplingParams(**{**defaults, **chosen, **fixed})
