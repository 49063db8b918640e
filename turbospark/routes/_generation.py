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
    Queued,
    Reply,
    Started,
    TextPrompt,
)
from ..model.backend import SamplingParams
from ._app import request_scope, system

__all__ = ["Completion", "Replies", "collect", "events", "start"]

# Room for Queued, Started, a stop-string tail and Finished beyond one Delta per token of the
# budget: the model thread never has to wait for a slow reader.
REPLY_SLACK = 8

Replies = trio.MemoryReceiveChannel[Reply]


@attrs.frozen
class Completion:
    text: str
    finished: Finished


async def start(
    *, request_id: int, model: str, prompt: ChatPrompt | TextPrompt, params: SamplingParams
) -> Replies:
    """Queue a generation and wait until the model has started on it; return its replies.

    Raises the error the queue or the model answered with (``QueueFull``, ``RequestInvalid``,
    ``ContextOverflow`` ...) before any response byte is sent.
    """
    sys_ = system()
    reply_send, reply_recv = trio.open_memory_channel[Reply](params.max_tokens + REPLY_SLACK)
    request_scope().enter_context(reply_recv)
    job = GenerationJob(request_id, model, prompt, params, reply_send, time.monotonic())
    started = False
    try:
        await sys_.submit(job)
        async for msg in reply_recv:
            if isinstance(msg, Started):
                started = True
                return reply_recv
            if isinstance(msg, Failed):
                raise msg.error
            assert isinstance(msg, Queued), msg
        raise ShuttingDown()
    finally:
        if not started:
            sys_.withdraw(job)


async def collect(replies: Replies) -> Completion:
    """Drain a non-streaming generation."""
    parts: list[str] = []
    async for msg in replies:
        if isinstance(msg, Delta):
            parts.append(msg.text)
        elif isinstance(msg, Finished):
            return Completion("".join(parts), msg)
        else:
            assert isinstance(msg, Failed), msg
            raise msg.error
    raise ShuttingDown()


async def events(
    replies: Replies, *, keepalive: float
) -> AsyncIterator[Delta | Finished | Failed | None]:
    """The replies of a streaming generation; ``None`` when ``keepalive`` seconds pass quietly.

    Ends after ``Finished`` or ``Failed`` (a ``Failed`` stands in for a model side that ended
    without either, at shutdown).  The cancel scope covers the receive only, never the yield.
    """
    with replies:
        while True:
            msg: Reply | None = None
            with trio.move_on_after(keepalive):
                try:
                    msg = await replies.receive()
                except trio.EndOfChannel:
                    msg = Failed(ShuttingDown())
            yield msg
            if isinstance(msg, (Finished, Failed)):
                return
