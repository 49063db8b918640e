"""A turn's events as OpenAI chat and legacy completions objects (sans-io).

``ChatStream`` frames a turn as ``chat.completion.chunk`` objects: each choice's role chunk,
then a chunk per piece of reasoning or content, a tool call as a chunk with its ``index``,
``id``, ``name`` and empty ``arguments`` followed by chunks that each carry a piece of the
arguments at the same ``index`` (what the SDKs' accumulators join), then each choice's finish
chunk, the usage chunk when ``stream_options.include_usage`` asked for it, and ``[DONE]``.
``chat_whole`` builds the ``chat.completion`` from the same events collected.
``CompletionStream`` and ``completion_whole`` do the same for ``text_completion`` (calls ride
beside the text in the chat shape, whole, an extension as tools are on that endpoint).

A turn that was retried says so: ``usage.retries`` and, on the finish chunk, ``retries``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import attrs

from ..messages import TokenLogprob, ToolCall
from ..turns.turn_events import (
    ArgumentsDelta, CallEnd, CallStart, Collected, Finish, Prefill, Reasoning, Retried, Text, TurnEvent, Usage,
)
from ..web import sse as _sse

__all__ = [
    "ChatStream", "CompletionStream", "Envelope", "call_wire", "chat_logprobs", "chat_whole",
    "completion_logprobs", "completion_whole", "finish_reason", "prompt_progress", "timings", "usage",
]

_ids = itertools.count()


@attrs.frozen
class Envelope:
    """The id, creation time, model name and system fingerprint every object of one response
    carries."""

    id: str
    created: int
    model: str
    fingerprint: str

    @classmethod
    def new(cls, prefix: str, model: str, fingerprint: str) -> Envelope:
        now = int(time.time())
        return cls(f"{prefix}-{now}-{next(_ids)}", now, model, fingerprint)

    def wrap(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id, "object": obj, "created": self.created, "model": self.model,
            "system_fingerprint": self.fingerprint, "choices": choices,
        }


def usage(u: Usage) -> dict[str, Any]:
    """One usage for all choices and every attempt."""
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    if u.retries:
        out["retries"] = u.retries
    return out


def timings(u: Usage) -> dict[str, Any]:
    """llama.cpp's ``timings``: the prompt tokens read (the cached ones are ``cache_n``) and
    the tokens generated, with the model thread's own clock; a rate with nothing to divide is 0."""
    prompt_n = u.prompt_tokens - u.cached_tokens
    prompt_ms, predicted_ms = u.prompt_seconds * 1e3, u.decode_seconds * 1e3

    def per_token(ms: float, n: int) -> float:
        return ms / n if n else 0.0

    def per_second(ms: float, n: int) -> float:
        return 1e3 * n / ms if ms > 0 else 0.0

    return {
        "cache_n": u.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": per_token(prompt_ms, prompt_n),
        "prompt_per_second": per_second(prompt_ms, prompt_n),
        "predicted_n": u.completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": per_token(predicted_ms, u.completion_tokens),
        "predicted_per_second": per_second(predicted_ms, u.completion_tokens),
    }


def prompt_progress(event: Prefill) -> dict[str, Any]:
    """llama.cpp's ``prompt_progress`` object."""
    return {"total": event.total, "cache": event.cache, "processed": event.processed,
            "time_ms": int(event.seconds * 1e3)}


def finish_reason(fin: Finish) -> str:
    """``tool_calls`` when it called and stopped by itself; ``length`` when the budget ended
    it (a call cut short included), else ``stop``."""
    return "tool_calls" if fin.called and fin.reason != "length" else fin.reason


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``logprobs`` object: one entry per token, with its bytes and alternatives."""

    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries],
        "refusal": None,
    }


def call_wire(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class _SSE:
    """What an OpenAI stream writes while nothing else is due, and when it fails after its first
    byte: an SSE comment, and one ``event: error`` frame (no ``[DONE]``).

    The last chunk before ``[DONE]`` carries llama.cpp's ``timings``: the usage chunk, or
    without one the last finish chunk, so a finish chunk waits for the next event."""

    held: list[dict[str, Any]]
    return_progress: bool

    def tick(self) -> list[bytes]:
        return [_sse.KEEPALIVE]

    def progress(self, event: Prefill) -> list[bytes]:
        """The prompt being read: llama.cpp's ``prompt_progress`` chunk when the request asked
        for it (``return_progress``), else an SSE comment that says as much."""
        if not self.return_progress:
            return [_sse.comment(f"prompt_progress {event.processed}/{event.total}")]
        return [*self._release(), _sse.data(self._progress_chunk() | {"prompt_progress": prompt_progress(event)})]

    def _progress_chunk(self) -> dict[str, Any]:
        raise NotImplementedError

    def error(self, body: dict[str, Any]) -> list[bytes]:
        return [*self._release(), _sse.event("error", body)]

    def _release(self) -> list[bytes]:
        out, self.held = [_sse.data(c) for c in self.held], []
        return out

    def _last(self, event: Usage, obj: str, include_usage: bool) -> list[bytes]:
        """The end of the stream: the finish chunks held, the usage chunk, ``[DONE]``."""
        if include_usage:
            self.held.append(self.env.wrap(obj, []) | {"usage": usage(event)})  # type: ignore[attr-defined]
        if self.held:
            self.held[-1] = self.held[-1] | {"timings": timings(event)}
        return [*self._release(), _sse.DONE]


@attrs.define
class ChatStream(_SSE):
    env: Envelope
    n: int = 1
    logprobs: int | None = None  # asked for: each chunk carries its tokens'
    include_usage: bool = False
    retries: int = 0
    return_progress: bool = False
    held: list[dict[str, Any]] = attrs.field(factory=list)

    def _progress_chunk(self) -> dict[str, Any]:
        return self.chunk({"role": "assistant", "content": None}, 0)

    def chunk(self, delta: dict[str, Any], index: int, finish: str | None = None,
              entries: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        reported = chat_logprobs(entries) if self.logprobs is not None and entries else None
        choice = {"index": index, "delta": delta, "logprobs": reported, "finish_reason": finish}
        return self.env.wrap("chat.completion.chunk", [choice])

    def opening(self) -> list[bytes]:
        return [_sse.data(self.chunk({"role": "assistant", "content": ""}, i)) for i in range(self.n)]

    def feed(self, event: TurnEvent) -> list[bytes]:
        if isinstance(event, Usage):
            return self._last(event, "chat.completion.chunk", self.include_usage)
        if isinstance(event, Finish):
            last = self.chunk({}, event.choice, finish_reason(event), event.logprobs)
            self.held.append(last | ({"retries": self.retries} if self.retries else {}))
            return []
        return [*self._release(), *self._piece(event)]

    def _piece(self, event: TurnEvent) -> list[bytes]:
        if isinstance(event, Text):
            return [_sse.data(self.chunk({"content": event.text}, event.choice, None, event.logprobs))]
        if isinstance(event, Reasoning):
            delta = {"reasoning_content": event.text, "reasoning": event.text}
            return [_sse.data(self.chunk(delta, event.choice, None, event.logprobs))]
        if isinstance(event, CallStart):
            call = {"index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
            return [_sse.data(self.chunk({"tool_calls": [call]}, event.choice))]
        if isinstance(event, ArgumentsDelta):
            call = {"index": event.index, "function": {"arguments": event.text}}
            return [_sse.data(self.chunk({"tool_calls": [call]}, event.choice))]
        if isinstance(event, Retried):
            self.retries = event.attempt
        return []  # CallEnd: its deltas were the call


def chat_whole(env: Envelope, done: Collected, logprobs: int | None) -> dict[str, Any]:
    """The ``chat.completion`` of a turn's events, collected."""
    choices = []
    for i, c in enumerate(done.choices):
        assert c.finish is not None
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if c.reasoning:
            message["reasoning_content"] = message["reasoning"] = c.reasoning
        if c.calls:
            message["tool_calls"] = [call_wire(call) for call in c.calls]
        choices.append({
            "index": i, "message": message,
            "logprobs": chat_logprobs(c.logprobs) if logprobs is not None else None,
            "finish_reason": finish_reason(c.finish),
        })
    assert done.usage is not None
    return env.wrap("chat.completion", choices) | {"usage": usage(done.usage), "timings": timings(done.usage)}


# --- legacy completions ------------------------------------------------------------------------


def completion_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, alternatives as {token: logprob}."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


@attrs.define
class CompletionStream(_SSE):
    env: Envelope
    n: int = 1
    logprobs: int | None = None
    include_usage: bool = False
    echoed: str = ""
    return_progress: bool = False
    held: list[dict[str, Any]] = attrs.field(factory=list)

    def _progress_chunk(self) -> dict[str, Any]:
        return self.env.wrap("text_completion", [self.choice("", 0)])

    def choice(self, text: str, index: int, finish: str | None = None,
               entries: Sequence[TokenLogprob] = (), calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
        reported = completion_logprobs(entries) if self.logprobs is not None else None
        out = {"text": text, "index": index, "logprobs": reported, "finish_reason": finish}
        if calls:
            out["tool_calls"] = [call_wire(c) for c in calls]
        return out

    def opening(self) -> list[bytes]:
        if not self.echoed:
            return []
        return [_sse.data(self.env.wrap("text_completion", [self.choice(self.echoed, i)])) for i in range(self.n)]

    def feed(self, event: TurnEvent) -> list[bytes]:
        if isinstance(event, Text):
            piece = self.choice(event.text, event.choice, None, event.logprobs)
        elif isinstance(event, CallEnd):
            piece = self.choice("", event.choice, None, (), (event.call,))
        elif isinstance(event, Finish):
            self.held.append(self.env.wrap("text_completion", [
                self.choice("", event.choice, finish_reason(event), event.logprobs)]))
            return []
        elif isinstance(event, Usage):
            return self._last(event, "text_completion", self.include_usage)
        else:
            return []
        return [*self._release(), _sse.data(self.env.wrap("text_completion", [piece]))]


def completion_whole(stream: CompletionStream, done: Collected) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(done.choices):
        assert c.finish is not None
        choices.append(stream.choice(stream.echoed + c.text, i, finish_reason(c.finish), c.logprobs, c.calls))
    assert done.usage is not None
    return stream.env.wrap("text_completion", choices) | {"usage": usage(done.usage), "timings": timings(done.usage)}
