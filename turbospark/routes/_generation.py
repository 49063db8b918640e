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
    TokenLogprob,
)
from ..model.backend import SamplingParams
from ._app import request_scope, system

__all__ = ["Completion", "Replies", "collect", "events", "start"]

# Room for Queued, Started and Failed beyond one Delta per token of the budget and one Finished,
# for each choice: the model thread never has to wait for a slow reader.
REPLY_SLACK = 8

Replies = trio.MemoryReceiveChannel[Reply]


@attrs.frozen
class Completion:
    """A whole generation: each choice's text and ending, by index."""

    texts: list[str]
    finished: list[Finished]
    logprobs: list[list[TokenLogprob]]  # per choice, one per token (when asked)


async def start(
    *,
    request_id: int,
    model: str,
    prompt: ChatPrompt | TextPrompt,
    params: SamplingParams,
    n: int = 1,
) -> Replies:
    """Queue a generation and wait until the model has started on it; return its replies.

    Raises the error the queue or the model answered with (``QueueFull``, ``RequestInvalid``,
    ``ContextOverflow`` ...) before any response byte is sent.
    """
    sys_ = system()
    buffer = n * (params.max_tokens + 1) + REPLY_SLACK
    reply_send, reply_recv = trio.open_memory_channel[Reply](buffer)
    request_scope().enter_context(reply_recv)
    job = GenerationJob(request_id, model, prompt, params, reply_send, time.monotonic(), n)
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


async def collect(replies: Replies, n: int = 1) -> Completion:
    """Drain a non-streaming generation of ``n`` choices."""
    parts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finished: dict[int, Finished] = {}
    async for msg in replies:
        if isinstance(msg, Delta):
            parts[msg.index].append(msg.text)
            if msg.logprob is not None:
                logprobs[msg.index].append(msg.logprob)
        elif isinstance(msg, Finished):
            finished[msg.index] = msg
            if len(finished) == n:
                texts = ["".join(p) for p in parts]
                return Completion(texts, [finished[i] for i in range(n)], logprobs)
        else:
            assert isinstance(msg, Failed), msg
            raise msg.error
    raise ShuttingDown()


async def events(
    replies: Replies, *, keepalive: float, n: int = 1
) -> AsyncIterator[Delta | Finished | Failed | None]:
    """The replies of a streaming generation; ``None`` when ``keepalive`` seconds pass quietly.

    Ends after ``n`` ``Finished`` (one per choice) or a ``Failed`` (a ``Failed`` stands in for a
    model side that ended without either, at shutdown).  The cancel scope covers the receive
    only, never the yield.
    """
    finished = 0
    with replies:
        while True:
            msg: Reply | None = None
            with trio.move_on_after(keepalive):
                try:
                    msg = await replies.receive()
                except trio.EndOfChannel:
                    msg = Failed(ShuttingDown())
            yield msg
            finished += isinstance(msg, Finished)
            if finished == n or isinstance(msg, Failed):
                return
