"""How a route runs a generation: submit, wait for the start, then drain the reply channel.

The reply channel's receive end is entered into the request scope first thing, so whatever ends
the request (a finished body, an error, a disconnect in any phase) closes it, and the model
thread's next send fails: that is the whole cancellation protocol.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack, aclosing
from typing import Any

import attrs
import trio

from ..errors import ShuttingDown
from ..turns.guardrails import Accept, Guardrails, Rescued, inspect
from ..messages import (
    ChatPrompt,
    Delta,
    Failed,
    Finished,
    GenerationJob,
    Reply,
    Started,
    TextPrompt,
    TokenLogprob,
    ToolCall,
)
from ..model.backend import SamplingParams
from ..model.output import call_id
from .._system import System
from ..web.app import request_scope, system

__all__ = ["Completion", "Replies", "collect", "events", "gather", "generate_turn", "start", "turn"]

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


@attrs.frozen
class Completion:
    """A whole generation: each choice's content, reasoning, tool calls and ending, by index."""

    texts: list[str]
    finished: list[Finished]
    logprobs: list[list[TokenLogprob]]  # per choice, one per token (when asked)
    reasoning: list[str]
    calls: list[tuple[ToolCall, ...]]


async def start(
    *,
    request_id: int,
    model: str,
    prompt: ChatPrompt | TextPrompt,
    params: SamplingParams,
    n: int = 1,
    clamp: bool = False,
    on_started: Callable[[Started], None] | None = None,
    context: Context | None = None,
    admit: Callable[[Started], None] | None = None,
) -> Replies:
    """Queue a generation and wait until the model has started on it; return its replies.
    With ``clamp``, a budget past what the context window leaves is cut to it instead of
    refused; ``on_started`` sees the ``Started`` message (the prompt's length).

    Raises the error the queue or the model answered with (``QueueFull``, ``RequestInvalid``,
    ``ContextOverflow`` ...) before any response byte is sent.  ``context`` is the request's
    (``Context.here()``), for a generation started while a response body streams, outside the
    app context.  ``admit`` may refuse the started generation by raising (a limit the route
    checks on the prompt's token count); the request scope then closes its replies, which stops
    it within a step.
    """
    sys_, scope = context or Context.here()
    buffer = n * (params.max_tokens + 1) + REPLY_SLACK
    reply_send, reply_recv = trio.open_memory_channel[Reply](buffer)
    scope.enter_context(reply_recv)
    job = GenerationJob(request_id, model, prompt, params, reply_send, time.monotonic(), n, clamp)
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


async def gather(replies: Replies, n: int = 1, *, keepalive: float = math.inf) -> AsyncIterator[Completion | None]:
    """Drain a generation of ``n`` choices: ``None`` each time ``keepalive`` seconds pass
    quietly (a long prefill: the caller may ping its client), then the ``Completion``.  Raises
    the error it failed with."""
    parts: list[list[str]] = [[] for _ in range(n)]
    reasoning: list[list[str]] = [[] for _ in range(n)]
    calls: list[tuple[ToolCall, ...]] = [() for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finished: dict[int, Finished] = {}
    async for msg in events(replies, keepalive=keepalive, n=n):
        if msg is None:
            yield None
        elif isinstance(msg, Delta):
            parts[msg.index].append(msg.text)
            reasoning[msg.index].append(msg.reasoning)
            calls[msg.index] += msg.tool_calls
            if msg.logprob is not None:
                logprobs[msg.index].append(msg.logprob)
        elif isinstance(msg, Finished):
            finished[msg.index] = msg
            if len(finished) == n:
                yield Completion(
                    ["".join(p) for p in parts],
                    [finished[i] for i in range(n)],
                    logprobs,
                    ["".join(r) for r in reasoning],
                    calls,
                )
                return
        else:
            raise msg.error


async def collect(replies: Replies, n: int = 1) -> Completion:
    """Drain a non-streaming generation of ``n`` choices."""
    async with aclosing(gather(replies, n)) as items:
        async for done in items:
            if done is not None:
                return done
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


async def generate_turn(
    *,
    request_id: int,
    model: str,
    prompt: ChatPrompt,
    params: SamplingParams,
    n: int,
    call_required: bool,
    guardrails: Guardrails,
    parallel: bool = True,
    clamp: bool = False,
    admit: Callable[[Started], None] | None = None,
) -> Completion:
    """``turn`` drained, for a response sent whole; ``admit`` as for ``start`` (first try)."""
    first = await start(
        request_id=request_id, model=model, prompt=prompt, params=params, n=n, clamp=clamp, admit=admit
    )
    async with aclosing(turn(
        first, request_id=request_id, model=model, prompt=prompt, params=params, n=n,
        call_required=call_required, guardrails=guardrails, parallel=parallel, clamp=clamp,
    )) as items:
        async for done in items:
            if done is not None:
                return done
    raise ShuttingDown()


def turn(
    first: Replies,
    *,
    request_id: int,
    model: str,
    prompt: ChatPrompt,
    params: SamplingParams,
    n: int,
    call_required: bool,
    guardrails: Guardrails,
    parallel: bool = True,
    keepalive: float = math.inf,
    clamp: bool = False,
) -> AsyncIterator[Completion | None]:
    """A whole turn that offered tools, under the guardrails, from its first generation
    (already started, so a refusal was an HTTP error): a call the parser missed is rescued from
    the text (which it then replaces); a missing required call or arguments that break their
    schema get a corrective turn and another try, at most ``guardrails.retries`` times; then the
    last answer stands.  With several choices each is rescued, none retried.  Without
    ``parallel``, a turn keeps its first call only.  Yields ``None`` every ``keepalive`` quiet
    seconds, then the ``Completion``.  It may run while a response body streams (a stream's
    pings): the request's context, for the retries, is captured here, in the route."""
    return _turn(
        first, Context.here(), request_id=request_id, model=model, prompt=prompt, params=params,
        n=n, call_required=call_required, guardrails=guardrails, parallel=parallel,
        keepalive=keepalive, clamp=clamp,
    )


async def _turn(
    first: Replies,
    context: Context,
    *,
    request_id: int,
    model: str,
    prompt: ChatPrompt,
    params: SamplingParams,
    n: int,
    call_required: bool,
    guardrails: Guardrails,
    parallel: bool = True,
    keepalive: float = math.inf,
    clamp: bool = False,
) -> AsyncIterator[Completion | None]:
    attempts = 0
    replies = first
    while True:
        done = None
        async for item in gather(replies, n, keepalive=keepalive):
            if item is None:
                yield None
            else:
                done = item
        if done is None:
            raise ShuttingDown()
        retry = None
        for i in range(n):
            verdict = inspect(
                content=done.texts[i], calls=done.calls[i], tools=prompt.tools,
                call_required=call_required, guardrails=guardrails, new_id=call_id,
            )
            if isinstance(verdict, Rescued):
                done.texts[i], done.calls[i] = "", verdict.calls
            elif not isinstance(verdict, Accept):
                retry = verdict
        if not parallel:
            done.calls[:] = [c[:1] for c in done.calls]
        if retry is None or n != 1 or attempts >= guardrails.retries:
            yield done
            return
        attempts += 1
        said: dict[str, Any] = {"role": "assistant", "content": done.texts[0]}
        if retry.calls:
            said["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in retry.calls
            ]
        turns = ([said] if said["content"].strip() or retry.calls else []) + [
            {"role": "user", "content": retry.nudge}
        ]
        prompt = attrs.evolve(prompt, messages=(*prompt.messages, *turns))
        replies = await start(
            request_id=request_id, model=model, prompt=prompt, params=params, n=n, clamp=clamp,
            context=context,
        )


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
