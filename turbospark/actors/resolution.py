"""The resolver's interface: what it is told and what it answers (its inbox's messages),
``Lifecycle`` (how it runs models, handed in by ``_system``) and ``Published``, the registry
snapshot it keeps up to date for the routes that never resolve.

- ``Resolve(name, want, reply, keep_alive, exact)``: which model answers, loaded; the answer is
  ``Grant(entry, lease, load_seconds)`` or the error (``ResolutionBusy`` at once when every
  resolution slot is taken, ``ModelNotFound``, ``NoModel``, ``ModelLoadFailed``,
  ``ShuttingDown``).  The route holds the lease until its request ends (``Release``).
- ``Abandon(resolve)``: the asker left before its answer (sent with ``send_nowait``).
- ``Release(lease)``: a request ended (sent with ``send_nowait`` from the request scope).
- ``Unload(name, reply)``: unload now if idle, else once its requests end; answers the entry.
- ``Running(reply)``: the loaded models, ``LoadedModel`` (``/api/ps``).
- ``Refresh(reply)``: read the library again (after a pull, copy or delete).
- ``Adopt(loadable, reply)``: know this model too, pinned (``POST /v1/audio/models``); answers
  the registry.  It loads when a request names it.

Data only: imports ``lifecycle``, ``registry`` and ``errors`` (and Trio for the reply channels'
types); ``_system`` and the routes use these without importing the actor.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from ..errors import TurboSparkError
from .lifecycle import Loadable
from .registry import Capability, ModelEntry, Registry

__all__ = [
    "Abandon",
    "Adopt",
    "Grant",
    "Lifecycle",
    "LoadedModel",
    "Published",
    "Refresh",
    "Release",
    "Resolve",
    "ResolverMessage",
    "Running",
    "Unload",
]


@attrs.frozen
class Grant:
    """The model that answers, and the lease the request holds on it until it ends."""

    entry: ModelEntry
    lease: int | None  # None: a model that is never unloaded (the resolver's fixed entries)
    load_seconds: float = 0.0  # how long this request waited for the model to load


@attrs.frozen(eq=False)
class Resolve:
    name: str | None
    want: Capability
    reply: trio.MemorySendChannel[Grant | TurboSparkError]
    keep_alive: float | None = None  # seconds; None: the model's default
    exact: bool = False  # no single-model fallback (Ollama names models exactly)


@attrs.frozen
class Abandon:
    request: Resolve


@attrs.frozen
class Release:
    lease: int


@attrs.frozen
class Unload:
    name: str
    reply: trio.MemorySendChannel[ModelEntry | TurboSparkError]


@attrs.frozen
class LoadedModel:
    """A loaded model for ``/api/ps``: ``expires`` is a wall-clock time, None for never."""

    entry: ModelEntry
    loadable: Loadable
    expires: float | None
    requests: int


@attrs.frozen
class Running:
    reply: trio.MemorySendChannel[list[LoadedModel]]


@attrs.frozen
class Refresh:
    reply: trio.MemorySendChannel[Registry] | None = None


@attrs.frozen
class Adopt:
    loadable: Loadable
    reply: trio.MemorySendChannel[Registry]


ResolverMessage = Resolve | Abandon | Release | Unload | Running | Refresh | Adopt


@attrs.define
class Published:
    """The resolver's latest registry of every known model: an immutable snapshot that routes
    which never resolve (``/v1/models``, ``/health``) read."""

    registry: Registry = attrs.field(factory=Registry)
    loadables: Mapping[str, Loadable] = attrs.field(factory=dict)  # what the library says of each


@attrs.frozen
class Lifecycle:
    """How the resolver runs models (from ``Settings``, plus how to start one)."""

    #: ``start_model(loadable, *, task_status)``: runs the model until cancelled (a generation
    #: model's actor, an embedding actor, an audio model attached to the audio actor), started
    #: with what it reports once loaded (``entry_for``'s ``info``)
    start_model: Callable[..., Awaitable[None]]
    queue: trio.MemorySendChannel[Any]  # the generation queue (Open, before a generation model)
    emit: Callable[[object], None]
    keep_alive: float = 300.0
    max_models: int = 3
    max_memory: int = 1 << 62
