"""How a route starts a generation: submit, wait for the start, hand back the reply channel
(which the turn driver, ``_turn``, drains).

The reply channel's receive end is entered into the request scope first thing, so whatever ends
the request (a finished body, an error, a disconnect in any phase) closes it, and the model
thread's next send fails: that is the whole cancellation protocol.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack

import attrs
import trio

from ..errors import ShuttingDown
from ..messages import (
    ChatPrompt,
    Failed,
    GenerationJob,
    Reply,
    Started,
    TextPrompt,
)
from ..model.backend import SamplingParams
from ..turns.images import decode_whole
from .._system import System
from ..web.app import request_scope, system

__all__ = ["Context", "REPLY_SLACK", "Replies", "start"]

# Room for Started and Failed beyond one Delta per token of the budget and one Finished,
# for each choice: the model thread never has to wait for a slow reader.
REPLY_SLACK = 8

Replies = trio.MemoryReceiveChannel[Reply]


@attrs.frozen
class Context:
    """What starting a generation needs from the request: the system and the request scope."""

    system: System
    scope: ExitStack

    @classmethod
    def here(cls) -> Context:
        return cls(system(), request_scope())

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter((self.system, self.scope))


async def _images_ahead(sys_: System, scope: ExitStack, model: str, prompt: ChatPrompt | TextPrompt) -> None:
    """A vision model's images decoded whole (a truncated one is a 400 naming its part) and
    processed in a worker thread before the job is queued, so that neither the request's task
    (which shares the Trio thread with every stream's) nor the model thread, which decodes the
    other streams, does it."""
    if not isinstance(prompt, ChatPrompt) or not prompt.images:
        return
    entry = (await sys_.lease(model, "chat", scope=scope)).entry
    ahead = getattr(entry.tokenizer, "process_images", None)

    def ready() -> None:
        decode_whole(prompt.messages)
        if ahead is not None:
            ahead(prompt.images)

    await trio.to_thread.run_sync(ready, abandon_on_cancel=True)


async def start(
    *,
    request_id: int,
    model: str,
    prompt: ChatPrompt | TextPrompt,
    params: SamplingParams,
    n: int = 1,
    clamp: bool = False,
    truncate: bool = False,
    on_started: Callable[[Started], None] | None = None,
    context: Context | None = None,
    admit: Callable[[Started], None] | None = None,
) -> Replies:
    """Queue a generation and wait until the model has started on it; return its replies.
    With ``clamp``, a budget past what the context window leaves is cut to it instead of
    refused; with ``truncate`` (or ``serve --context-shift``), a prompt past it loses its oldest
    messages instead (``threads/prompt.py``); ``on_started`` sees the ``Started`` message (the prompt's length).

    Raises the error the queue or the model answered with (``QueueFull``, ``RequestInvalid``,
    ``ContextOverflow`` ...) before any response byte is sent.  ``context`` is the request's
    (``Context.here()``), for a generation started while a response body streams, outside the
    app context.  ``admit`` may refuse the started generation by raising (a limit the route
    checks on the prompt's token count); the request scope then closes its replies, which stops
    it within a step.
    """
    sys_, scope = context or Context.here()
    if params.reasoning_budget is None and sys_.settings.reasoning_budget is not None:  # serve --reasoning-budget
        params = attrs.evolve(params, reasoning_budget=sys_.settings.reasoning_budget)
    truncate = truncate or sys_.settings.context_shift  # serve --context-shift: every family's
    await _images_ahead(sys_, scope, model, prompt)
    buffer = n * (params.max_tokens + 1) + REPLY_SLACK
    reply_send, reply_recv = trio.open_memory_channel[Reply](buffer)
    scope.enter_context(reply_recv)
    job = GenerationJob(request_id, model, prompt, params, reply_send, time.monotonic(), n, clamp, truncate)
    started = False
    try:
        await sys_.submit(job)
        try:
            msg = await reply_recv.receive()  # Started, or Failed
        except trio.EndOfChannel:
            raise ShuttingDown() from None
        if isinstance(msg, Failed):
            raise msg.error
        assert isinstance(msg, Started), msg
        if admit is not None:
            admit(msg)
        started = True
        if on_started is not None:
            on_started(msg)
        return reply_recv
    finally:
        if not started:
            sys_.withdraw(job)
