"""How audio routes talk to the audio jobs actor: resolve a model (through the resolver, which
loads a stored audio model when it is named and keeps it while the request, or the scope given,
holds its lease), ask the actor, or hand work to a model and read the worker's answers.  The
work's reply channel is entered into the request scope (or the WebSocket handler's own scope) at
once, so whatever ends the request closes it and the worker drops the work before it starts, or
stops it at its next step."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import trio

from ..actors._mailbox import call
from ..audio.engines import Task
from ..audio.messages import AudioInfo, AudioWork, Endpoint, SubmitAudio, Synthesize, Transcribe, WorkReply
from ..audio.wire import OPENAI_STT_NAMES, OPENAI_TTS_NAMES
from ..errors import ModelNotFound, NoModel, ShuttingDown, TurboSparkError
from ..web.app import system

__all__ = ["ask", "resolve_audio", "submit"]

_OPENAI_NAMES = {"speech_to_text": OPENAI_STT_NAMES, "text_to_speech": OPENAI_TTS_NAMES}


async def resolve_audio(name: str, task: Task, *, scope: ExitStack | None = None) -> AudioInfo:
    """The audio model ``name`` names for ``task``, loaded, held until ``scope`` closes (the
    request's by default).  Named exactly (unknown: 404; another task: 400), except that
    OpenAI's model names (``whisper-1``, ``tts-1``, ...) reach the only model of the task, or
    the only one loaded (an SDK requires a name)."""
    sys_ = system()
    fallback = name in _OPENAI_NAMES.get(task, ()) and sys_.registry.find(name) is None
    try:
        grant = await sys_.lease(name, task, exact=not fallback, scope=scope)  # type: ignore[arg-type]
    except NoModel:  # no model of the task at all
        raise ModelNotFound(name, []) from None
    return grant.entry.audio


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
