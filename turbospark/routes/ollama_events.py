"""A turn's events as Ollama's ``/api/chat`` and ``/api/generate`` objects (sans-io).

``OllamaStream`` is one request: its NDJSON stream (one object per piece of content or
thinking, a message with ``tool_calls`` when a call is complete, as Ollama sends its calls
whole, then the ``done: true`` object with Ollama's counters and durations in nanoseconds), or
the same turn whole (``whole``, from the events collected).  A quiet keep-alive interval is an
empty piece: NDJSON has no comments, and Ollama's clients read an empty piece as nothing.  A
retried turn says so with ``retries`` on the final object; ``eval_count`` counts every attempt.
The clock is a parameter, so the durations are tested without waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..errors import TurboSparkError
from ..messages import ToolCall
from ..turns.turn_events import CallEnd, Collected, Finish, Prefill, Reasoning, Text, TurnEvent, Usage, arguments_object
from ..wire.ollama import created_at, ndjson, nanoseconds

__all__ = ["OllamaStream", "call_wire"]


def call_wire(call: ToolCall) -> dict[str, Any]:
    return {"function": {"name": call.name, "arguments": arguments_object(call.arguments)}}


@attrs.define
class OllamaStream:
    """One ``/api/chat`` (``kind`` ``"chat"``) or ``/api/generate`` request's answer."""

    kind: str
    model: str
    clock: Callable[[], float] = time.monotonic
    began: float = attrs.field(default=attrs.Factory(lambda self: self.clock(), takes_self=True))
    load_seconds: float = 0.0
    started: float = 0.0  # when the model started on the prompt
    first: float = 0.0  # when the first piece came
    ended: float = 0.0
    finish: Finish | None = None

    def frame(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.model, "created_at": created_at(), **fields}

    def piece(self, text: str, thinking: str = "", calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
        if self.kind == "generate":
            out = self.frame(response=text)
            if thinking:
                out["thinking"] = thinking
            return out | {"done": False}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [call_wire(c) for c in calls]
        return self.frame(message=message, done=False)

    def final(self, u: Usage, text: str = "", thinking: str = "", calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
        fin = self.finish
        assert fin is not None
        out = self.piece(text, thinking, calls)
        end = self.ended or self.clock()
        first = self.first or self.started or end
        out.update(
            done=True,
            done_reason="length" if fin.reason == "length" and not fin.called else "stop",
            total_duration=nanoseconds(end - self.began),
            load_duration=nanoseconds(self.load_seconds),
            prompt_eval_count=u.prompt_tokens,
            prompt_eval_duration=nanoseconds(first - (self.started or first)),
            eval_count=u.completion_tokens,
            eval_duration=nanoseconds(end - first),
        )
        return out | ({"retries": u.retries} if u.retries else {})

    def error_object(self, exc: TurboSparkError) -> dict[str, Any]:
        return self.frame(done=True, done_reason="error", error=exc.message)

    # --- the stream ------------------------------------------------------------------------

    def opening(self) -> list[bytes]:
        return []

    def tick(self) -> list[bytes]:
        return [ndjson(self.piece(""))]

    def progress(self, event: Prefill) -> list[bytes]:
        return []  # Ollama has no such frame; the keep-alive pieces cover a long prefill

    def error(self, exc: TurboSparkError) -> list[bytes]:
        return [ndjson(self.error_object(exc))]

    def feed(self, event: TurnEvent) -> list[bytes]:
        if isinstance(event, Text | Reasoning):
            self.first = self.first or self.clock()
            text, thinking = (event.text, "") if isinstance(event, Text) else ("", event.text)
            return [ndjson(self.piece(text, thinking))]
        if isinstance(event, CallEnd):
            self.first = self.first or self.clock()
            return [ndjson(self.piece("", "", (event.call,)))]
        if isinstance(event, Finish):
            self.finish, self.ended = event, self.clock()
        elif isinstance(event, Usage):
            return [ndjson(self.final(event))]
        return []

    def whole(self, done: Collected) -> dict[str, Any]:
        """The turn sent as one object."""
        (choice,) = done.choices
        self.finish, self.ended = choice.finish, self.ended or self.clock()
        assert done.usage is not None
        return self.final(done.usage, choice.text, choice.reasoning, choice.calls)
