"""Messages of the images actor and its model threads (see ``design/messages.md``).

A route hands an ``ImageJob`` to the images actor, which puts it on the model's own bounded queue;
the model thread answers the route directly on the job's reply channel: a ``Step`` per denoising
step, a ``Preview`` per partial image asked for, then ``Images`` or ``ImageFailed``.  Closing the
reply's receive end is the route's "I am gone": the thread drops a job not yet started and stops
one under way before its next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs
import numpy as np
import trio

from ..errors import TurboSparkError

__all__ = [
    "GenerateArgs", "ImageBusyEvent", "ImageFailed", "ImageInfo", "ImageJob", "ImageJobBegan", "ImageJobEnded", "ImageModelsChanged",
    "ImageReply", "ImageSpec", "Images", "Preview", "Step",
]  # fmt: skip

Kind = Literal["generation", "edit"]


@attrs.frozen
class GenerateArgs:
    """One request's run: ``n`` images of ``width`` x ``height`` pixels (multiples of the
    pipeline's ``multiple``) from ``prompt``; with ``image`` (8-bit RGB, already that size) an
    edit of it, changed by ``strength`` (0: kept, 1: redrawn)."""

    prompt: str
    width: int
    height: int
    n: int = 1
    steps: int = 8
    seed: int = 0
    guidance_scale: float = 0.0
    negative_prompt: str = ""
    partial_images: int = 0
    image: np.ndarray | None = None
    strength: float = 0.6


@attrs.frozen
class ImageSpec:
    """An image model handed to ``serve`` (the scripted one, tests): ``make`` builds it on its
    own thread."""

    id: str
    make: Callable[[], Any]


@attrs.frozen
class ImageInfo:
    """What routes may know about a loaded image model."""

    id: str
    created: int
    multiple: int  # widths and heights are multiples of this many pixels
    patch: int  # pixels per output token (usage)
    can_edit: bool
    default_steps: int
    default_size: int  # pixels per side of ``size: auto``
    max_prompt_tokens: int


@attrs.frozen
class Step:
    done: int
    steps: int


@attrs.frozen(eq=False)
class Preview:
    index: int
    images: list[np.ndarray]


@attrs.frozen(eq=False)
class Images:
    images: list[np.ndarray]
    prompt_tokens: int
    seed: int


@attrs.frozen
class ImageFailed:
    error: TurboSparkError


ImageReply = Step | Preview | Images | ImageFailed


@attrs.frozen(eq=False)
class ImageJob:
    """One request's images: ``args`` (a ``GenerateArgs``) on model ``model``."""

    request_id: int
    model: str
    kind: Kind
    args: object
    reply: trio.MemorySendChannel[ImageReply]


# --- events, for the observer ---------------------------------------------------------------


@attrs.frozen
class ImageJobBegan:
    model: str


@attrs.frozen
class ImageJobEnded:
    """``outcome``: done, failed, cancelled (its client left) or shutdown; ``phase``: queued or
    running; ``steps``: the denoising steps it ran."""

    model: str
    kind: Kind
    outcome: str
    phase: str
    seconds: float
    steps: int
    images: int


@attrs.frozen
class ImageBusyEvent:
    model: str


@attrs.frozen
class ImageModelsChanged:
    loaded: int
