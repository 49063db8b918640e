"""What a loadable model is, how long it stays, and which idle ones make room (sans-io).

- ``Loadable``: a model the server may load on demand (a stored model, or a scripted backend
  handed to ``serve``: ``loadable_for``), with what is known about it before it is loaded:
  capabilities, context window, the memory it takes, and its card for ``/api/show``;
  ``entry_for``: its registry row, before it is loaded or from what its thread reported.
- ``parse_keep_alive``: Ollama's ``keep_alive`` (seconds as a number, a Go duration such as
  ``"5m"`` or ``"1h30m"``, a number in a string; negative: forever; ``0``: unload after the
  request) as seconds, ``math.inf`` for forever; ``parse_size``: ``--max-loaded-memory``.
- ``evictions``: which idle models to unload, least recently used first, so that one more model
  fits under ``--max-loaded-models`` and ``--max-loaded-memory``; None when it cannot fit
  because busy models hold the room (the load waits).

The resolver's load state machine that uses these is ``_residency``.  Imports only ``errors``
and ``registry``: no Trio, no clock.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..errors import RequestInvalid
from .registry import Capability, ModelEntry, alias_for

__all__ = [
    "FOREVER",
    "Loadable",
    "ModelCard",
    "Resident",
    "entry_for",
    "evictions",
    "loadable_for",
    "parse_keep_alive",
    "parse_size",
]

FOREVER = math.inf


@attrs.frozen
class ModelCard:
    """What ``/api/show`` and ``/api/tags`` say about a model (Ollama's field names)."""

    format: str = "mlx"
    family: str = ""
    parameter_size: str = ""
    quantization_level: str = ""
    template: str = ""
    parameters: str = ""  # Ollama's "name value" lines
    model_info: Mapping[str, Any] = attrs.field(factory=dict)
    digest: str = ""
    modified_at: float = 0.0  # seconds since the epoch


@attrs.frozen(eq=False)
class Loadable:
    """A model that can be loaded: ``make`` builds its backend on its own model thread."""

    id: str
    make: Callable[[], Any]
    capabilities: frozenset[Capability]
    context_window: int
    size: int  # bytes it holds once loaded (its weights)
    card: ModelCard = attrs.field(factory=ModelCard)
    pinned: bool = False  # named on --model (or handed to serve): loaded at start, kept


def loadable_for(spec: Any) -> Loadable:
    """A backend handed to ``serve`` directly (tests, scripted runs): loaded at start, kept."""
    return Loadable(
        id=spec.id, make=spec.make, capabilities=frozenset({"chat", "completion"}),
        context_window=0, size=0, pinned=True, card=ModelCard(format="scripted", family="scripted"),
    )


def entry_for(loadable: Loadable, info: Any | None = None, *, now: float) -> ModelEntry:
    """The registry row of a model: from what its thread reported once loaded (``info``), else
    from what the library knows; ``now`` (wall clock) dates a model the library does not."""
    created = int(loadable.card.modified_at or now)
    if info is None:
        return ModelEntry(
            id=loadable.id,
            context_window=loadable.context_window,
            capabilities=loadable.capabilities,
            aliases=(alias_for(loadable.id),),
            created=created,
        )
    return ModelEntry(
        id=info.id,
        context_window=info.context_window,
        capabilities=frozenset({"chat", "completion"} if info.has_chat_template else {"completion"}),
        aliases=(alias_for(info.id),),
        created=created,
        sampling_defaults=info.sampling_defaults,
        fingerprint=info.fingerprint,
        tokenizer=getattr(info, "tokenizer", None),
    )


@attrs.frozen
class Resident:
    """A loaded (or loading) model, as eviction sees it."""

    id: str
    size: int
    busy: bool  # leases held, or still loading: never evicted
    pinned: bool
    last_used: float


def evictions(
    residents: Sequence[Resident], size: int, *, max_models: int, max_memory: int
) -> list[str] | None:
    """The idle models to unload so that a model of ``size`` bytes fits; ``[]`` when it fits
    already; None when it cannot fit now (busy models hold the room).  Least recently used go
    first, models named on ``--model`` last; a model bigger than the whole budget loads alone."""
    count, used = len(residents), sum(r.size for r in residents)

    def fits() -> bool:  # a model bigger than the budget still loads alone
        return count + 1 <= max_models and (used + size <= max_memory or count == 0)

    out: list[str] = []
    for victim in sorted((r for r in residents if not r.busy), key=lambda r: (r.pinned, r.last_used)):
        if fits():
            break
        out.append(victim.id)
        count -= 1
        used -= victim.size
    return out if fits() else None


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object) -> float | None:
    """Seconds a model stays loaded after a request; ``math.inf`` for forever; None when the
    request does not say (the model's default applies)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise RequestInvalid("keep_alive must be a duration such as \"5m\" or a number of seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _go_duration(text)
    else:
        raise RequestInvalid("keep_alive must be a duration such as \"5m\" or a number of seconds")
    if math.isnan(seconds):
        raise RequestInvalid("keep_alive must be a number")
    return FOREVER if seconds < 0 else seconds


def _go_duration(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    pos, total = 0, 0.0
    while pos < len(body):
        match = _DURATION.match(body, pos)
        if match is None:
            break
        total += float(match.group(1)) * _UNIT[match.group(2)]
        pos = match.end()
    if not body or pos != len(body):
        raise RequestInvalid(
            f"keep_alive {text!r} is not a duration: use a number of seconds or units such as "
            "\"30s\", \"5m\", \"1h\" (negative: forever)"
        )
    return sign * total


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A memory size such as ``8G``, ``512M``, ``1.5GiB``; a bare number is MiB."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"expected a size such as 8G or 512M, got {text!r}")
    number, unit = float(match.group(1)), (match.group(2) or "m").lower()
    return int(number * (1 << (10 * " kmgt".index(unit))))
