"""The turn driver: how every generation route runs a turn, whatever its API family.

A ``TurnPlan`` (prompt, sampling, choices, tools, what the tools demand) goes in; ``open_turn``
starts its first generation (a refusal is still an HTTP error) and hands back a ``Turn``, whose
``events`` are the turn's typed events (``turns/turn_events``), live, read through a
``TurnStream`` (the guardrails' holdback, validation and verdict, sans-io).  When the verdict
is a corrective retry, the driver starts it here, in the same request scope (a client that left
ends it the same way), and goes on reading; ``Usage`` counts every attempt.  ``None`` in the
events is a keep-alive tick: ``keepalive`` seconds in which nothing was sent, whether the model
is quiet (a long prefill) or writing what is held back (a call being validated).  The
family framers (``*_events.py``, sans-io) turn events into bytes; ``framed`` is the body loop
they share, and ``collect`` gathers the same events for a response sent whole.

The cancel scope of a deadline covers the receive only, never a ``yield``; every attempt's reply
channel is closed when the driver leaves it, whichever way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Protocol

import attrs
import trio

from ..errors import GenerationFailed, ShuttingDown, TurboSparkError
from ..messages import ChatPrompt, Delta, Failed, Finished, Progress, Started, TextPrompt
from ..model.backend import SamplingParams
from ..turns.guardrails import Guardrails
from ..turns.turn_events import Collected, Error, Prefill, Retried, TurnEvent
from ..turns.turn_stream import TurnStream
from ._generation import Context, Replies, start

__all__ = ["Framer", "RETRIES_HEADER", "Turn", "TurnPlan", "framed", "open_turn"]

log = logging.getLogger("turbospark")

#: On a response sent whole whose turn was retried: how many corrective turns ran.
RETRIES_HEADER = "x-turbospark-retries"


@attrs.frozen
class TurnPlan:
    """What a route asks of one turn, in the core's terms."""

    model: str
    prompt: ChatPrompt | TextPrompt
    params: SamplingParams
    n: int = 1
    call_required: bool = False
    parallel: bool = True
    clamp: bool = False
    truncate: bool = False  # Ollama's truncate, serve --context-shift (``GenerationJob.truncate``)


class Framer(Protocol):
    """A family's sans-io framer: a turn's events as its wire format.  A framer with a
    ``progress(Prefill)`` method frames the prompt's progress itself; for the others it is a
    tick (a keep-alive comment, Anthropic's ping, Ollama's empty piece)."""

    def opening(self) -> list[bytes]: ...

    def feed(self, event: TurnEvent) -> list[bytes]: ...

    def tick(self) -> list[bytes]: ...


def _frames(framer: Framer, event: TurnEvent | None) -> list[bytes]:
    if event is None:
        return framer.tick()
    if isinstance(event, Prefill):
        progress = getattr(framer, "progress", None)
        return progress(event) if progress is not None else framer.tick()
    return framer.feed(event)


async def open_turn(
    plan: TurnPlan,
    *,
    request_id: int,
    guardrails: Guardrails,
    admit: Callable[[Started], None] | None = None,
    on_started: Callable[[Started], None] | None = None,
    context: Context | None = None,
) -> Turn:
    """Start the turn's first generation and wait until the model has started on it (errors
    are raised here, before any response byte); the guardrails apply when tools are offered.
    ``context``: the scope its reply channels live in, where it is not the HTTP request's (a
    realtime session's response)."""
    context = context or Context.here()
    replies = await start(
        request_id=request_id, model=plan.model, prompt=plan.prompt, params=plan.params, n=plan.n,
        clamp=plan.clamp, truncate=plan.truncate, admit=admit, on_started=on_started, context=context,
    )
    stream = TurnStream(
        n=plan.n, tools=plan.prompt.tools, call_required=plan.call_required, parallel=plan.parallel,
        guardrails=guardrails, retryable=isinstance(plan.prompt, ChatPrompt),
    )
    return Turn(plan, request_id, context, replies, stream)


@attrs.define
class Turn:
    plan: TurnPlan
    request_id: int
    context: Context
    replies: Replies
    stream: TurnStream

    @property
    def retries(self) -> int:
        return self.stream.attempt

    async def events(self, keepalive: float = math.inf) -> AsyncIterator[TurnEvent | None]:
        """The turn's events, live, with ``None`` after every ``keepalive`` seconds in which
        nothing was sent.  A failure after the start is an ``Error`` event, which ends them."""
        async with aclosing(self.batches(keepalive)) as batches:
            async for batch in batches:
                for event in batch:
                    yield event

    async def batches(self, keepalive: float = math.inf) -> AsyncIterator[list[TurnEvent | None]]:
        """``events``, a list at a time: each wake-up reads every reply already there (one
        step's news for this request: a token, several after a speculative step, the last one
        with its ``Finished``), so a streamed body writes them at once."""
        prompt, replies = self.plan.prompt, self.replies
        quiet_since = trio.current_time()
        while True:
            with replies:
                while not (self.stream.done or self.stream.again):
                    msg: Delta | Finished | Failed | Progress | None = None
                    if keepalive == math.inf:  # no deadline: no cancel scope a message
                        msg = await _receive(replies)
                    else:
                        with trio.move_on_at(quiet_since + keepalive):
                            msg = await _receive(replies)
                    if msg is None:
                        quiet_since = trio.current_time()
                        yield [None]
                        continue
                    batch: list[TurnEvent | None] = []
                    while msg is not None:
                        if isinstance(msg, Failed):
                            batch.append(Error(msg.error))
                            yield batch
                            return
                        assert not isinstance(msg, Started), msg
                        if isinstance(msg, Progress):  # not counted as sent: a framer may send nothing
                            batch.append(Prefill(msg.total, msg.cache, msg.processed, msg.seconds))
                        elif events := self.stream.feed(msg):
                            quiet_since = trio.current_time()
                            batch += events
                        msg = None if self.stream.done or self.stream.again else _waiting(replies)
                    if trio.current_time() >= quiet_since + keepalive:
                        quiet_since = trio.current_time()
                        batch.append(None)  # busy, but all of it held back
                    if batch:
                        yield batch
            if self.stream.done:
                return
            again = self.stream.again
            assert again is not None and isinstance(prompt, ChatPrompt)
            prompt = attrs.evolve(prompt, messages=(*prompt.messages, *again.turns))
            try:
                replies = await start(
                    request_id=self.request_id, model=self.plan.model, prompt=prompt,
                    params=self.plan.params, n=self.plan.n, clamp=self.plan.clamp, truncate=self.plan.truncate,
                    context=self.context,
                )
            except TurboSparkError as exc:  # the retry refused: the queue is full, the model gone
                yield Error(exc)
                return
            self.stream.retry_started()

    async def collect(self) -> Collected:
        """The turn's events gathered, for a response sent whole; raises the error it failed
        with (nothing was sent yet)."""
        out = Collected.of((), self.plan.n)
        async with aclosing(self.events()) as events:
            async for event in events:
                if isinstance(event, Error):
                    raise event.error
                if event is not None:
                    out.feed(event)
        if out.usage is None:
            raise ShuttingDown()
        return out


async def _receive(replies: Replies) -> Delta | Finished | Failed | Progress:
    try:
        return await replies.receive()  # type: ignore[return-value]
    except trio.EndOfChannel:
        return Failed(ShuttingDown())


def _waiting(replies: Replies) -> Delta | Finished | Failed | Progress | None:
    """The next reply if it is there already."""
    try:
        return replies.receive_nowait()  # type: ignore[return-value]
    except trio.WouldBlock:
        return None
    except trio.EndOfChannel:
        return Failed(ShuttingDown())


def framed(turn: Turn, framer: Framer, *, keepalive: float, error: Callable[[TurboSparkError], list[bytes]]) -> AsyncIterator[bytes]:
    """A streamed body: the framer's opening, then each event framed, a tick's frames for each
    quiet ``keepalive`` seconds; a failure is ``error``'s frames and the end.  What one wake-up
    of the turn gives (``Turn.batches``) goes out as one piece: one write for a step's news."""

    async def frames() -> AsyncIterator[bytes]:
        if opening := b"".join(framer.opening()):
            yield opening
        try:
            async with aclosing(turn.batches(keepalive)) as batches:
                async for batch in batches:
                    out: list[bytes] = []
                    for event in batch:
                        if isinstance(event, Error):
                            out += error(event.error)
                            yield b"".join(out)
                            return
                        if isinstance(event, Retried):
                            log.info("request %s: corrective retry %d", turn.request_id, event.attempt)
                        out += _frames(framer, event)
                    if out:
                        yield b"".join(out)
        except TurboSparkError as exc:
            for frame in error(exc):
                yield frame
        except Exception:  # a bug: logged with an id the client sees
            failure = GenerationFailed.new()
            log.exception("a turn failed (error id %s)", failure.error_id)
            for frame in error(failure):
                yield frame

    return frames()
