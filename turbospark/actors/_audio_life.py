"""An audio model's life as the resolver sees it: attached to the audio actor (which runs its
worker thread) while it is loaded, detached when its life ends."""

from __future__ import annotations

from functools import partial
from typing import Any

import trio

from ..audio.engines import AudioSpec
from ..errors import ModelLoadFailed, TurboSparkError
from ._mailbox import call
from .audio import AttachModel, AudioMessage, DetachModel

__all__ = ["attached_audio"]

#: how long an unloaded audio model's worker may take to stop before its slot is given back
DETACH_WAIT = 10.0


async def attached_audio(
    inbox: trio.MemorySendChannel[AudioMessage] | None, spec: AudioSpec, *, task_status: trio.TaskStatus[Any]
) -> None:
    """An audio model's life as the resolver sees it: attached to the audio actor (which runs
    its worker thread) until cancelled, then detached, waiting for its thread to end."""
    if inbox is None:
        raise ModelLoadFailed()
    try:
        result = await call(inbox, partial(AttachModel, spec))
        if isinstance(result, TurboSparkError):
            raise result
        task_status.started(result)
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(DETACH_WAIT):
            try:
                await call(inbox, partial(DetachModel, spec.id))
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel):
                pass  # the audio actor has ended (the server is stopping)
