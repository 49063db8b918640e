"""A turn's replies read into live events, under the guardrails (sans-io).

Theory of operation: ``TurnStream`` is fed the model's replies (``Delta``, ``Finished``) one by
one and returns the events (``turn_events``) that became safe to send.  Reasoning and content go
out as the model writes them; only content that may begin a call the guardrails would rescue is
held back (``holdback``) until its span closes, then rescued into calls or released as content.
Calls (the parser's, or rescued) become ``CallStart``, ``ArgumentsDelta`` pieces and ``CallEnd``
with a stable index per choice, in the order they were written among the text.  A call the
parser decides while it is written (``Delta.writing``) streams its arguments as they come
whenever nothing must be checked first (the guardrails off or out of retries, a forced call,
whose grammar already keeps its schema); otherwise it is sent once complete, in pieces split at
the top level of its arguments.

Validation: while a corrective retry is still possible (one choice, retries left, a chat
prompt, and no call of this attempt sent yet), a call whose arguments break its schema is held,
and everything after it; when the attempt ends, ``guardrails.inspect`` gives the verdict on what
was not sent.  A retry (``again``: the assistant's turn and the nudge to add to the
conversation) discards what was held, so nothing of a refused call was ever sent; the retry's
events then follow what the first attempt sent.  Otherwise the held events are released: the
last answer stands.  A forced call cut by the budget is handed back as far as it got
(``inspect`` with ``truncated``).  ``Usage`` adds up every attempt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..messages import Delta, Finished, TokenLogprob
from ..model.output import CallPiece, ToolCall, call_id
from .chat import tool_call
from .guardrails import Guardrails, Rescued, Retry, inspect, rescue, validate
from .holdback import Holdback, Release
from .turn_events import (
    ArgumentsDelta, CallEnd, CallStart, Finish, Reasoning, Retried, Text, TurnEvent, Usage,
    split_arguments,
)

__all__ = ["Again", "TurnStream"]


@attrs.frozen
class Again:
    """A corrective retry: ``turns`` follow the conversation (what the model said, the nudge)."""

    turns: tuple[dict[str, Any], ...]
    nudge: str


@attrs.define
class _Choice:
    holdback: Holdback | None
    sent: int = 0  # calls sent, every attempt
    pending: list[TokenLogprob] = attrs.field(factory=list)  # log-probabilities not yet reported
    completion_tokens: int = 0
    said: list[str] = attrs.field(factory=list)  # this attempt's content
    made: list[ToolCall] = attrs.field(factory=list)  # this attempt's calls, sent or held
    live: dict[str, int] = attrs.field(factory=dict)  # calls streaming as written: id -> index
    whole: set[str] = attrs.field(factory=set)  # calls being written that go out once complete
    sent_now: bool = False  # a call of this attempt was sent
    held: list[TurnEvent] | None = None  # behind a refused call; None when nothing is held
    finished: Finished | None = None
    decode_seconds: float = 0.0  # every attempt's


class TurnStream:
    """One turn's replies, every attempt, as events.  ``retryable``: a corrective turn can be
    replayed (a chat prompt; a raw text prompt has no template to add it to)."""

    def __init__(
        self,
        *,
        n: int = 1,
        tools: Sequence[Mapping[str, Any]] = (),
        call_required: bool = False,
        parallel: bool = True,
        guardrails: Guardrails | None = None,
        retryable: bool = True,
        new_id: Callable[[], str] = call_id,
    ) -> None:
        self.n = n
        self.tools = tuple(tools)
        self.call_required = call_required
        self.parallel = parallel
        self.guardrails = guardrails or Guardrails.off()
        self.retryable = retryable and n == 1
        self.new_id = new_id
        self.attempt = 0  # retries begun
        self.again: Again | None = None
        self.done = False
        self._prompt_tokens = self._cached_tokens = 0
        self._prompt_seconds = 0.0
        self._choices = [self._choice() for _ in range(n)]

    def _choice(self) -> _Choice:
        held = bool(self.tools) and (self.guardrails.rescue or self.call_required)
        return _Choice(Holdback() if held else None)

    def _checks(self, c: _Choice) -> bool:
        """Whether a call of ``c`` is validated before any of it is sent (a corrective retry
        can still replace it)."""
        return self.guardrails.validate and self._can_retry and not c.sent_now

    @property
    def _can_retry(self) -> bool:
        return self.retryable and self.attempt < self.guardrails.retries and bool(self.tools)

    # --- feeding -----------------------------------------------------------------------------

    def feed(self, msg: Delta | Finished) -> list[TurnEvent]:
        """The events one reply makes safe to send."""
        assert not self.done and self.again is None, "fed past the end of an attempt"
        c = self._choices[msg.index]
        out: list[TurnEvent] = []
        if isinstance(msg, Finished):
            return self._finished(c, msg)
        if msg.logprob is not None:
            c.pending.append(msg.logprob)
        if msg.reasoning:
            self._emit(c, Reasoning(msg.reasoning, msg.index, self._logprobs(c)), out)
        if msg.text:
            for piece in c.holdback.feed(msg.text) if c.holdback is not None else [Release(msg.text)]:
                found = rescue(piece.text, self.tools) if not isinstance(piece, Release) and self.guardrails.rescue else []
                if found:
                    for name, arguments in found:
                        self._call(c, ToolCall(0, self.new_id(), name, arguments), out, msg.index)
                else:
                    self._text(c, piece.text, out, msg.index)
        for piece in msg.writing:
            self._piece(c, piece, out, msg.index)
        for call in msg.tool_calls:
            self._call(c, call, out, msg.index)
        return out

    def _logprobs(self, c: _Choice) -> tuple[TokenLogprob, ...]:
        taken, c.pending = tuple(c.pending), []
        return taken

    def _emit(self, c: _Choice, event: TurnEvent, out: list[TurnEvent]) -> None:
        (c.held if c.held is not None else out).append(event)

    def _text(self, c: _Choice, text: str, out: list[TurnEvent], index: int) -> None:
        c.said.append(text)
        self._emit(c, Text(text, index, self._logprobs(c)), out)

    def _piece(self, c: _Choice, piece: CallPiece, out: list[TurnEvent], index: int) -> None:
        """Part of a call being written: sent at once, unless the call must be checked (or,
        one call per turn, dropped) when complete."""
        at = c.live.get(piece.id)
        if at is None:
            if piece.id in c.whole:
                return
            # a forced call's grammar already keeps its schema: nothing to check
            if c.held is not None or (self._checks(c) and not self.call_required) or (not self.parallel and c.sent >= 1):
                c.whole.add(piece.id)
                return
            at = c.live[piece.id] = c.sent
            c.sent += 1
            c.sent_now = True
            out.append(CallStart(at, piece.id, piece.name, index))
        out.append(ArgumentsDelta(at, piece.text, index))

    def _call(self, c: _Choice, call: ToolCall, out: list[TurnEvent], index: int, check: bool = True) -> None:
        if (at := c.live.pop(call.id, None)) is not None:  # its arguments went out as written
            call = attrs.evolve(call, index=at)
            c.made.append(call)
            out.append(CallEnd(call, index))
            return
        held = sum(1 for e in c.held or () if isinstance(e, CallEnd))
        if not self.parallel and c.sent + held >= 1:
            return  # one call per turn: the first stands
        call = attrs.evolve(call, index=c.sent + held)
        c.made.append(call)
        if check and c.held is None and self._checks(c) \
                and validate([call], self.tools):
            c.held = []  # refused: held, and all after it, until the attempt's verdict
        events: list[TurnEvent] = [CallStart(call.index, call.id, call.name, index)]
        events += [ArgumentsDelta(call.index, piece, index) for piece in split_arguments(call.arguments)]
        events.append(CallEnd(call, index))
        if c.held is not None:
            c.held += events
        else:
            out += events
            c.sent += 1
            c.sent_now = True

    # --- the end of a choice, of an attempt ----------------------------------------------

    def _finished(self, c: _Choice, fin: Finished) -> list[TurnEvent]:
        c.finished = fin
        c.completion_tokens += fin.completion_tokens
        c.decode_seconds += fin.decode_seconds
        if fin.index == 0:
            self._prompt_tokens += fin.prompt_tokens
            self._cached_tokens += fin.cached_tokens
            self._prompt_seconds += fin.prefill_seconds
        out: list[TurnEvent] = []
        leftover = c.holdback.finish() if c.holdback is not None else ""
        verdict = inspect(
            content=leftover, calls=c.made, tools=self.tools, call_required=self.call_required,
            guardrails=self.guardrails, new_id=self.new_id, truncated=fin.finish_reason == "length",
        )
        if isinstance(verdict, Retry) and self._can_retry and not c.sent_now:
            return self._retry(c, verdict, leftover)
        if c.held is not None:
            out += c.held
            c.sent += sum(1 for e in c.held if isinstance(e, CallEnd))
            c.held = None
        if isinstance(verdict, Rescued):
            for call in verdict.calls:
                if call not in c.made:  # rescued from the leftover, or a forced call cut short
                    self._call(c, call, out, fin.index, check=False)
        elif leftover:
            self._text(c, leftover, out, fin.index)
        out.append(Finish(
            fin.finish_reason, fin.stop_reason, fin.stop_sequence, c.sent > 0, c.completion_tokens,
            fin.index, self._logprobs(c),
        ))
        if all(ch.finished is not None for ch in self._choices):
            self.done = True
            out.append(Usage(
                self._prompt_tokens, sum(ch.completion_tokens for ch in self._choices),
                self._cached_tokens, self.attempt, self._prompt_seconds,
                max(ch.decode_seconds for ch in self._choices),
            ))
        return out

    def _retry(self, c: _Choice, verdict: Retry, leftover: str) -> list[TurnEvent]:
        said: dict[str, Any] = {"role": "assistant", "content": "".join(c.said) + leftover}
        if verdict.calls:
            said["tool_calls"] = [
                tool_call({"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})
                for call in verdict.calls
            ]
        turns = ([said] if said["content"].strip() or verdict.calls else []) + [
            {"role": "user", "content": verdict.nudge}
        ]
        self.attempt += 1
        self.again = Again(tuple(turns), verdict.nudge)
        pending = c.pending
        self._choices = [self._choice()]
        fresh = self._choices[0]
        fresh.sent, fresh.pending, fresh.completion_tokens = c.sent, pending, c.completion_tokens
        return [Retried(self.attempt, verdict.nudge)]

    def retry_started(self) -> None:
        """The corrective turn is running: feed its replies."""
        self.again = None

