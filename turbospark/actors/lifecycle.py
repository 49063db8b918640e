"""What a loadable model is, how long it stays, and which idle ones make room (sans-io).

- ``Loadable``: a model the server may load on demand (a stored model, or a backend, encoder or
  audio engine handed to ``serve``: ``loadable_for``), of one ``kind`` (generation, embedding,
  speech-to-text, text-to-speech), with what is known about it before it is loaded:
  capabilities, context window, the memory it takes, and its ``ModelCard`` (what its files say:
  architecture, parameters, quantization, what it can do; the store reads it, ``store/card.py``);
  ``entry_for``: its registry row, before it is loaded or from what its actor reported.
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
from typing import Any, Literal

import attrs

from ..audio.engines import AudioSpec
from ..errors import RequestInvalid
from ..images.messages import ImageSpec
from ..model.encoder import EncoderSpec
from .registry import Capability, ModelEntry, alias_for

__all__ = [
    "FOREVER",
    "KINDS",
    "Kind",
    "Loadable",
    "ModelCard",
    "Resident",
    "described",
    "entry_for",
    "evictions",
    "loadable_for",
    "parse_keep_alive",
    "parse_size",
]

FOREVER = math.inf


#: What a model does, as the store's manifests say it.
Kind = Literal["generation", "embedding", "speech-to-text", "text-to-speech", "text-to-image"]
KINDS: tuple[Kind, ...] = ("generation", "embedding", "speech-to-text", "text-to-speech", "text-to-image")
#: The registry capability of each kind that is not a generation model.
_CAPABILITY: dict[str, Capability] = {
    "embedding": "embedding", "speech-to-text": "speech_to_text", "text-to-speech": "text_to_speech",
    "text-to-image": "text_to_image",
}


@attrs.frozen
class ModelCard:
    """What a model's files say about it, for ``/api/show``, ``/api/tags`` and ``/v1/models``
    (Ollama's field names).  ``capabilities`` are Ollama's words (``completion``, ``tools``,
    ``thinking``, ``embedding``) and the audio tasks (``speech_to_text``, ``text_to_speech``)."""

    format: str = "mlx"
    family: str = ""
    parameter_size: str = ""
    quantization_level: str = ""
    template: str = ""
    parameters: str = ""  # Ollama's "name value" lines
    model_info: Mapping[str, Any] = attrs.field(factory=dict)
    digest: str = ""
    modified_at: float = 0.0  # seconds since the epoch
    architecture: str = ""
    parameter_count: int = 0
    context_length: int = 0
    capabilities: tuple[str, ...] = ()


@attrs.frozen(eq=False)
class Loadable:
    """A model that can be loaded: ``make`` builds its backend (an encoder, an audio engine) on
    its own thread."""

    id: str
    make: Callable[[], Any]
    capabilities: frozenset[Capability]
    context_window: int
    size: int  # bytes it holds once loaded (its weights)
    card: ModelCard = attrs.field(factory=ModelCard)
    pinned: bool = False  # named on --model (or handed to serve): loaded at start, kept
    kind: Kind = "generation"
    #: known only by how to build it (a spec handed to ``serve``): what the library knows of a
    #: model of that id (its card and size) describes it
    bare: bool = False


def loadable_for(spec: Any, kind: Kind = "generation") -> Loadable:
    """A backend, encoder or audio engine handed to ``serve`` directly (``--model scripted``,
    ``--embedding-model``, ``--stt-model``, tests): loaded at start, kept."""
    if kind == "generation":
        return Loadable(
            id=spec.id, make=spec.make, capabilities=frozenset({"chat", "completion"}),
            context_window=0, size=0, pinned=True, bare=True,
            card=ModelCard(format="scripted", family="scripted", capabilities=("completion", "tools")),
        )
    capability = _CAPABILITY[kind]
    return Loadable(
        id=spec.id, make=spec.make, capabilities=frozenset({capability}), context_window=0, size=0,
        pinned=True, kind=kind, bare=True, card=ModelCard(format="", capabilities=(capability,)),
    )


def pinned_loadable(spec: Any) -> Loadable:
    """A model handed to ``serve`` (a ``Loadable``, or a backend, encoder, audio or image spec), as
    the resolver loads it at start and keeps it."""
    if isinstance(spec, Loadable):
        return attrs.evolve(spec, pinned=True)
    if isinstance(spec, EncoderSpec):
        return loadable_for(spec, "embedding")
    if isinstance(spec, AudioSpec):
        return loadable_for(spec, "speech-to-text" if spec.task == "speech_to_text" else "text-to-speech")
    return loadable_for(spec, "text-to-image" if isinstance(spec, ImageSpec) else "generation")


def described(pinned: Loadable, known: Loadable | None) -> Loadable:
    """A pinned model, with what the library knows of it when it was handed over bare."""
    if not pinned.bare or known is None or known.kind != pinned.kind:
        return pinned
    return attrs.evolve(known, make=pinned.make, pinned=True)


def entry_for(loadable: Loadable, info: Any | None = None, *, now: float) -> ModelEntry:
    """The registry row of a model: from what its actor reported once loaded (``info``: a model
    thread's ``ModelInfo``, an ``EncoderInfo``, an ``AudioInfo``), else from what the library
    knows; ``now`` (wall clock) dates a model the library does not."""
    created = int(loadable.card.modified_at or now)
    generative = loadable.kind == "generation"
    aliases = (alias_for(loadable.id),) if generative else ()
    if info is None:
        return ModelEntry(
            id=loadable.id,
            context_window=loadable.context_window,
            capabilities=loadable.capabilities,
            aliases=aliases,
            created=created,
        )
    if loadable.kind == "embedding":
        return ModelEntry(
            id=loadable.id, context_window=info.max_tokens, capabilities=loadable.capabilities,
            created=created, fingerprint=info.fingerprint, dimensions=info.dimensions, inbox=info.inbox,
            matryoshka=info.matryoshka,
        )
    if loadable.kind == "text-to-image":  # routes reach it through the images actor
        return ModelEntry(
            id=loadable.id, context_window=0, capabilities=loadable.capabilities, created=created, image=info,
        )
    if not generative:  # an audio model: routes reach it through the audio actor
        return ModelEntry(
            id=loadable.id, context_window=loadable.context_window, capabilities=loadable.capabilities,
            created=created, audio=info,
        )
    return ModelEntry(
        id=info.id,
        context_window=info.context_window,
        capabilities=frozenset({"chat", "completion"} if info.has_chat_template else {"completion"})
        | (loadable.capabilities & {"vision"}),
        aliases=(*aliases, *getattr(info, "adapters", ())),
        adapters=tuple(getattr(info, "adapters", ())),
        created=created,
        sampling_defaults=info.sampling_defaults,
        fingerprint=info.fingerprint,
        tokenizer=getattr(info, "tokenizer", None),
        inbox=getattr(info, "inbox", None),  # its model thread's slot commands
        kernels=getattr(info, "kernels", ""),
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
