"""How audio routes talk to the audio jobs actor: ask it, or hand work to a model and read the
worker's answers.  The work's reply channel is entered into the request scope (or the WebSocket
handler's own scope) at once, so whatever ends the request closes it and the worker drops the
work before it starts, or stops it at its next step."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import trio

from ..actors._mailbox import call
from ..audio.messages import AudioWork, Endpoint, SubmitAudio, Synthesize, Transcribe, WorkReply
from ..errors import ShuttingDown, TurboSparkError
from ..web.app import system

__all__ = ["ask", "submit"]


async def ask(make: Callable[[trio.MemorySendChannel[Any]], Any]) -> Any:
    """The audio actor's answer to ``make(reply)``; an error answer is raised."""
    inbox = system().audio
    assert inbox is not None
    try:
        result = await call(inbox, make)
    except (trio.ClosedResourceError, trio.BrokenResourceError, trio.EndOfChannel):
        raise ShuttingDown() from None
    if isinstance(result, TurboSparkError):
        raise result
    return result


async def submit(
    scope: ExitStack, *, request_id: int, model: str, endpoint: Endpoint, args: Transcribe | Synthesize
) -> trio.MemoryReceiveChannel[WorkReply]:
    """Queue work on ``model``; the channel its answers come on (closed with ``scope``)."""
    inbox = system().audio
    assert inbox is not None
    send, recv = trio.open_memory_channel[WorkReply](16)
    scope.enter_context(recv)
    work = AudioWork(request_id, model, endpoint, args, send, trio.current_time())
    try:
        await inbox.send(SubmitAudio(work))
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        send.close()
        raise ShuttingDown() from None
    return recv


async def receive(recv: trio.MemoryReceiveChannel[WorkReply]) -> WorkReply:
    try:
        return await recv.receive()
    except trio.EndOfChannel:
        raise ShuttingDown() from None
