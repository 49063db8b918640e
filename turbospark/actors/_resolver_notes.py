"""The resolver's internal messages, posted by its own tasks (``resolver``): a lookup's answer,
the library read on a worker thread, a model's start and end."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from ..errors import TurboSparkError
from ._residency import Instance
from .lifecycle import Loadable
from .registry import ModelEntry, Registry
from .resolution import Resolve

__all__ = ["Ended", "Known", "Looked", "Ready"]


@attrs.frozen
class Looked:
    request: Resolve
    result: ModelEntry | TurboSparkError
    asked: float


@attrs.frozen
class Known:
    loadables: tuple[Loadable, ...]
    reply: trio.MemorySendChannel[Registry] | None = None


@attrs.frozen
class Ready:
    model: Instance
    info: Any


@attrs.frozen
class Ended:
    model: Instance
    error: BaseException | None
