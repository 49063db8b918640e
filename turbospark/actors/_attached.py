"""A model's life as the resolver sees it, for the kinds another actor runs (audio, images):
attached to that actor (which runs its thread) while it is loaded, detached when its life ends."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from ..audio.engines import AudioSpec
from ..errors import ModelLoadFailed, TurboSparkError
from ._mailbox import call
from .audio import AttachModel, AudioMessage, DetachModel

__all__ = ["attached", "attached_audio"]

#: how long an unloaded model's thread may take to stop (its step) before its slot is given back
DETACH_WAIT = 30.0


async def attached(
    inbox: trio.MemorySendChannel[Any] | None, attach: Callable[[Any], Any], detach: Callable[[Any], Any],
    *, task_status: trio.TaskStatus[Any],
) -> None:  # fmt: skip
    """Ask ``inbox`` to ``attach`` (started with its answer), then, when cancelled, to
    ``detach``, waiting (shielded, bounded) for the thread to end."""
    if inbox is None:
        raise ModelLoadFailed()
    try:
        result = await call(inbox, attach)
        if isinstance(result, TurboSparkError):
            raise result
        task_status.started(result)
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(DETACH_WAIT):
            try:
                await call(inbox, detach)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel):
                pass  # the actor has ended (the server is stopping)


async def attached_audio(
    inbox: trio.MemorySendChannel[AudioMessage] | None, spec: AudioSpec, *, task_status: trio.TaskStatus[Any]
) -> None:
    await attached(inbox, partial(AttachModel, spec), partial(DetachModel, spec.id), task_status=task_status)
