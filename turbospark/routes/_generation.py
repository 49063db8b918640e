"""How a route runs a generation: submit, wait for the start, then drain the reply channel.

The reply channel's receive end is entered into the request scope first thing, so whatever ends
the request (a finished body, an error, a disconnect in any phase) closes it, and the model
thread's next send fails: that is the whole cancellation protocol.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import trio

from ..errors import ShuttingDown
from ..guardrails import Accept, Guardrails, Rescued, inspect
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
    ToolCall,
)
from ..model.backend import SamplingParams
from ..model.output import call_id
from ._app import request_scope, system

__all__ = ["Completion", "Replies", "collect", "events", "generate_turn", "start"]

# Room for Queued, Started and Failed beyond one Delta per token of the budget and one Finished,
# for each choice: the model thread never has to wait for a slow reader.
REPLY_SLACK = 8

Replies = trio.MemoryReceiveChannel[Reply]


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
    admit: Callable[[Started], None] | None = None,
) -> Replies:
    """Queue a generation and wait until the model has started on it; return its replies.

    Raises the error the queue or the model answered with (``QueueFull``, ``RequestInvalid``,
    ``ContextOverflow`` ...) before any response byte is sent.  ``admit`` may refuse the started
    generation by raising (a limit the route checks on the prompt's token count); the request
    scope then closes its replies, which stops it within a step.
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
                if admit is not None:
                    admit(msg)
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
    reasoning: list[list[str]] = [[] for _ in range(n)]
    calls: list[tuple[ToolCall, ...]] = [() for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finished: dict[int, Finished] = {}
    async for msg in replies:
        if isinstance(msg, Delta):
            parts[msg.index].append(msg.text)
            reasoning[msg.index].append(msg.reasoning)
            calls[msg.index] += msg.tool_calls
            if msg.logprob is not None:
                logprobs[msg.index].append(msg.logprob)
        elif isinstance(msg, Finished):
            finished[msg.index] = msg
            if len(finished) == n:
                return Completion(
                    ["".join(p) for p in parts],
                    [finished[i] for i in range(n)],
                    logprobs,
                    ["".join(r) for r in reasoning],
                    calls,
                )
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
) -> Completion:
    """A whole turn that offered tools, under the guardrails: a call the parser missed is
    rescued from the text (which it then replaces); a missing required call or arguments that
    break their schema get a corrective turn and another try, at most ``guardrails.retries``
    times; then the last answer stands.  With several choices each is rescued, none retried.
    Without ``parallel``, a turn keeps its first call only."""
    attempts = 0
    while True:
        done = await collect(
            await start(request_id=request_id, model=model, prompt=prompt, params=params, n=n), n
        )
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
            return done
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


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
