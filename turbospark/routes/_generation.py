"""How a route runs a generation: submit, wait for the start, then drain the reply channel.

The reply channel's receive end is entered into the request scope first thing, so whatever ends
the request (a finished body, an error, a disconnect in any phase) closes it, and the model
thread's next send fails: that is the whole cancellation protocol.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import attrs
import trio

from ..errors import ShuttingDown
from ..messages import (
    ChatPrompt,
    Delta,
    Failed,
    Finished,
    GenerationJob,
    PrefillDone,
    Queued,
    Reply,
    Started,
    TextPrompt,
)
from ..model.backend import SamplingParams
from ._app import request_scope, system

__all__ = ["Completion", "Running", "collect", "events", "start"]

REPLY_BUFFER = 64


@attrs.frozen
class Running:
    """A generation that has started: its prompt fits, prefill is under way."""

    job: GenerationJob
    started: Started
    replies: trio.MemoryReceiveChannel[Reply]


@attrs.frozen
class Completion:
    text: str
    finished: Finished


async def start(
    *, request_id: int, model: str, prompt: ChatPrompt | TextPrompt, params: SamplingParams
) -> Running:
    """Queue a generation and wait until the model has started on it.

    Raises the error the queue or the model answered with (``QueueFull``, ``RequestInvalid``,
    ``ContextOverflow`` ...) before any response byte is sent.
    """
    sys_ = system()
    reply_send, reply_recv = trio.open_memory_channel[Reply](REPLY_BUFFER)
    request_scope().enter_context(reply_recv)
    job = GenerationJob(request_id, model, prompt, params, reply_send, time.monotonic())
    started = False
    try:
        await sys_.submit(job)
        async for msg in reply_recv:
            if isinstance(msg, Started):
                started = True
                return Running(job, msg, reply_recv)
            if isinstance(msg, Failed):
                raise msg.error
            assert isinstance(msg, Queued), msg
        raise ShuttingDown()
    finally:
        if not started:
            sys_.withdraw(job)


async def collect(running: Running) -> Completion:
    """Drain a non-streaming generation."""
    parts: list[str] = []
    async for msg in running.replies:
        if isinstance(msg, Delta):
            parts.append(msg.text)
        elif isinstance(msg, Finished):
            return Completion("".join(parts), msg)
        elif isinstance(msg, Failed):
            raise msg.error
        else:
            assert isinstance(msg, PrefillDone), msg
    raise ShuttingDown()


async def events(
    running: Running, *, keepalive: float
) -> AsyncIterator[Delta | Finished | Failed | None]:
    """The replies of a streaming generation; ``None`` when ``keepalive`` seconds pass quietly.

    Ends after ``Finished`` or ``Failed`` (a ``Failed`` stands in for a model side that ended
    without either, at shutdown).  The cancel scope covers the receive only, never the yield.
    """
    with running.replies:
        while True:
            msg: Reply | None = None
            with trio.move_on_after(keepalive):
                try:
                    msg = await running.replies.receive()
                except trio.EndOfChannel:
                    msg = Failed(ShuttingDown())
            if isinstance(msg, (PrefillDone, Queued, Started)):
                continue
            yield msg
            if isinstance(msg, (Finished, Failed)):
                return
