"""Typed generation results as an Anthropic Messages response (sans-io).

``MessageStream`` is one response: whole (``whole``, the ``message`` object) or as its stream of
server-sent events: ``message_start`` (its usage split as the end will split it), ``ping``,
then content blocks (``content_block_start``, ``content_block_delta``...,
``content_block_stop``: ``thinking``, ``text`` and ``tool_use``, one index each), then
``message_delta`` with the stop reason and the real usage, and ``message_stop``.  It is fed
``Delta`` and ``Finished`` messages (``feed``) or a finished turn's parts (``turn``) and returns
the frames to send; the route does the I/O.

Usage splits the prompt into disjoint parts from the prefix cache: ``cache_read_input_tokens``
were reused; when the request marks anything with ``cache_control`` the rest was written to the
cache (``cache_creation_input_tokens``), otherwise it is plain ``input_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from ..messages import Delta, Finished, Started, ToolCall
from ..web import sse as _sse

__all__ = ["PING", "MessageStream", "stop_reason", "tool_use", "usage"]

PING = _sse.event("ping", {"type": "ping"})


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, cache_marked: bool) -> dict[str, Any]:
    fresh = prompt_tokens - cached_tokens
    return {
        "input_tokens": 0 if cache_marked else fresh,
        "cache_creation_input_tokens": fresh if cache_marked else 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def stop_reason(fin: Finished, called: bool) -> str:
    if called:
        return "tool_use"
    if fin.stop_reason == "StopString":
        return "stop_sequence"
    return "max_tokens" if fin.finish_reason == "length" else "end_turn"


def tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as a ``tool_use`` block (arguments that do not parse as an empty input)."""
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": _tool_id(call), "name": call.name, "input": arguments}


def _tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _finished_usage(fin: Finished, cache_marked: bool) -> dict[str, Any]:
    return usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens, cache_marked)


@attrs.define
class MessageStream:
    """One Messages response being built: the envelope, the blocks, the stream's block index."""

    id: str
    model: str
    cache_marked: bool
    index: int = 0
    open: str | None = None  # the type of the block being streamed
    called: bool = False  # whether a tool_use block was sent

    def envelope(self, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def whole(self, reasoning: str, text: str, calls: Sequence[ToolCall], fin: Finished) -> dict[str, Any]:
        """The ``message`` object of a finished turn, sent whole."""
        content: list[dict[str, Any]] = []
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if text:
            content.append({"type": "text", "text": text})
        content += [tool_use(c) for c in calls]
        return self.envelope(content, stop_reason(fin, bool(calls)), fin.stop_sequence,
                             _finished_usage(fin, self.cache_marked))

    # --- the stream ------------------------------------------------------------------------

    def start(self, began: Started | None) -> list[bytes]:
        """``message_start``, its usage split as the end will split it (the prefix-cache hit the
        model reported when it started), then a ``ping``."""
        prompt, cached = (began.prompt_tokens, began.cached_tokens) if began is not None else (0, 0)
        return [
            _sse.event("message_start", {
                "type": "message_start",
                "message": self.envelope([], None, None, usage(prompt, cached, 0, self.cache_marked)),
            }),
            PING,
        ]

    def feed(self, msg: Delta | Finished | None) -> list[bytes]:
        """The frames for one reply of a live generation (``None``: a quiet keep-alive interval)."""
        if msg is None:
            return [PING]
        if isinstance(msg, Delta):
            return self.parts(msg.reasoning, msg.text, msg.tool_calls)
        return self.end(msg)

    def turn(self, reasoning: str, text: str, calls: Sequence[ToolCall], fin: Finished) -> list[bytes]:
        """A turn generated whole (under the guardrails): its blocks, then its end."""
        return self.parts(reasoning, text, calls) + self.end(fin)

    def parts(self, reasoning: str, text: str, calls: Sequence[ToolCall]) -> list[bytes]:
        out: list[bytes] = []
        if reasoning:
            if self.open != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if text:
            if self.open != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in calls:
            self.called = True
            out += self._open("tool_use", {"type": "tool_use", "id": _tool_id(call), "name": call.name, "input": {}})
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            out += self.close()
        return out

    def end(self, fin: Finished) -> list[bytes]:
        out = self.close()
        out.append(_sse.event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(fin, self.called), "stop_sequence": fin.stop_sequence},
            "usage": _finished_usage(fin, self.cache_marked),
        }))
        out.append(_sse.event("message_stop", {"type": "message_stop"}))
        return out

    def error(self, body: dict[str, Any]) -> bytes:
        """The ``error`` event ending a failed stream; ``body`` is the error in Anthropic's shape."""
        return _sse.event("error", body)

    def close(self) -> list[bytes]:
        """Close the open block (a thinking block gets its empty signature first)."""
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(_sse.event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        self.index += 1
        return out

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.open = kind
        out.append(_sse.event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block,
        }))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse.event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
