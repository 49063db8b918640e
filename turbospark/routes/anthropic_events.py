"""Typed generation results as an Anthropic Messages response (sans-io).

``MessageStream`` is one response: whole (``whole``, the ``message`` object) or as its stream of
server-sent events: ``message_start`` (its usage split as the end will split it), ``ping``,
then content blocks (``content_block_start``, ``content_block_delta``...,
``content_block_stop``: ``thinking``, ``text`` and ``tool_use``, one index each), then
``message_delta`` with the stop reason and the real usage, and ``message_stop``.  It is fed a
turn's events (``turns/turn_events``: a call streams as ``input_json_delta`` pieces, text and
calls in the order the model wrote them) and returns the frames to send; ``whole`` builds the
same blocks from the events collected.  A retried turn says so in ``usage.retries``; usage counts
every attempt.

With MCP servers (``mcp``: the model-side names the server runs, ``routes/_mcp``) a call to one
of their tools is an ``mcp_tool_use`` block (``server_name``), and its outcome an
``mcp_tool_result`` block after it (``ran``), both in the assistant's content as Anthropic's MCP
connector writes them; the blocks streamed are kept (``blocks``) for a response sent whole.

Usage splits the prompt into disjoint parts from the prefix cache: ``cache_read_input_tokens``
were reused; when the request marks anything with ``cache_control`` the rest was written to the
cache (``cache_creation_input_tokens``), otherwise it is plain ``input_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..actors.mcp import McpListing, McpOutcome
from ..messages import Started, ToolCall
from ..turns.mcp_uses import McpRoute, McpUse
from ..turns.turn_events import (
    ArgumentsDelta, CallEnd, CallStart, Collected, Finish, Reasoning, Text, TurnEvent, Usage,
    arguments_object,
)
from ..web import sse as _sse

__all__ = ["PING", "MessageStream", "stop_reason", "tool_use", "usage"]

PING = _sse.event("ping", {"type": "ping"})


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, cache_marked: bool,
          retries: int = 0) -> dict[str, Any]:
    fresh = prompt_tokens - cached_tokens
    out = {
        "input_tokens": 0 if cache_marked else fresh,
        "cache_creation_input_tokens": fresh if cache_marked else 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }
    return out | ({"retries": retries} if retries else {})


def stop_reason(fin: Finish) -> str:
    if fin.called and fin.reason != "length":
        return "tool_use"
    if fin.stop_reason == "StopString":
        return "stop_sequence"
    return "max_tokens" if fin.reason == "length" else "end_turn"


def tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as a ``tool_use`` block."""
    return {"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": arguments_object(call.arguments)}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _mcp_id(call_id: str) -> str:
    return "mcptoolu_" + call_id.removeprefix("call_")


def _usage(u: Usage, cache_marked: bool) -> dict[str, Any]:
    return usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens, cache_marked, u.retries)


@attrs.define
class MessageStream:
    """One Messages response being built: the envelope, the blocks, the stream's block index."""

    id: str
    model: str
    cache_marked: bool
    began: Started | None = None  # the first generation's start (the prompt, its cache hit)
    index: int = 0
    open: str | None = None  # the type of the block being streamed
    finish: Finish | None = None
    mcp: Mapping[str, McpRoute] = attrs.field(factory=dict)  # the MCP tools offered, by model-side name
    blocks: list[dict[str, Any]] = attrs.field(factory=list)  # with ``mcp``: every block streamed, as sent whole
    result: dict[str, Any] | None = None  # the final message, once ``end``ed

    def envelope(self, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def whole(self, done: Collected) -> dict[str, Any]:
        """The ``message`` object of a turn's events, collected: its blocks in order."""
        (choice,) = done.choices
        content: list[dict[str, Any]] = []
        for kind, value in choice.parts:
            if kind == "reasoning":
                content.append({"type": "thinking", "thinking": value, "signature": ""})
            elif kind == "text":
                content.append({"type": "text", "text": value})
            else:
                content.append(tool_use(value))
        assert choice.finish is not None and done.usage is not None
        return self.envelope(content, stop_reason(choice.finish), choice.finish.stop_sequence,
                             _usage(done.usage, self.cache_marked))

    # --- the stream ------------------------------------------------------------------------

    def opening(self) -> list[bytes]:
        """``message_start``, its usage split as the end will split it (the prefix-cache hit the
        model reported when it started), then a ``ping``."""
        began = self.began
        prompt, cached = (began.prompt_tokens, began.cached_tokens) if began is not None else (0, 0)
        return [
            _sse.event("message_start", {
                "type": "message_start",
                "message": self.envelope([], None, None, usage(prompt, cached, 0, self.cache_marked)),
            }),
            PING,
        ]

    def tick(self) -> list[bytes]:
        return [PING]

    def feed(self, event: TurnEvent) -> list[bytes]:
        """The frames for one event of the turn."""
        if isinstance(event, Reasoning):
            out = [] if self.open == "thinking" else self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            return [*out, self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, Text):
            out = [] if self.open == "text" else self._open("text", {"type": "text", "text": ""})
            return [*out, self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, CallStart):
            route = self.mcp.get(event.name)
            block = {"type": "tool_use", "id": _tool_id(event.id), "name": event.name, "input": {}}
            if route is not None:
                block = {"type": "mcp_tool_use", "id": _mcp_id(event.id), "name": route.tool,
                         "server_name": route.label, "input": {}}
            return self._open(block["type"], block)
        if isinstance(event, ArgumentsDelta):
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        if isinstance(event, CallEnd):
            if self.mcp:
                self.blocks[-1]["input"] = arguments_object(event.call.arguments)
            return self.close()
        if isinstance(event, Finish):
            self.finish = event
        elif isinstance(event, Usage):
            return self.end(event)
        return []

    def listed(self, use: McpUse, listing: McpListing) -> list[bytes]:
        return []  # the connector lists nothing in the message

    def ran(self, call: ToolCall, route: McpRoute, outcome: McpOutcome, approval: str | None = None) -> list[bytes]:
        """An MCP call's outcome, as the ``mcp_tool_result`` block after its ``mcp_tool_use``."""
        text = outcome.text if outcome.error is None else outcome.error
        block = {"type": "mcp_tool_result", "tool_use_id": _mcp_id(call.id), "is_error": outcome.error is not None,
                 "content": [{"type": "text", "text": text}]}
        return [*self._open("mcp_tool_result", block), *self.close()]

    def end(self, u: Usage) -> list[bytes]:
        assert self.finish is not None
        self.result = self.envelope(self.blocks, stop_reason(self.finish), self.finish.stop_sequence,
                                    _usage(u, self.cache_marked))
        out = self.close()
        out.append(_sse.event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(self.finish), "stop_sequence": self.finish.stop_sequence},
            "usage": _usage(u, self.cache_marked),
        }))
        out.append(_sse.event("message_stop", {"type": "message_stop"}))
        return out

    def error(self, body: dict[str, Any]) -> list[bytes]:
        """The ``error`` event ending a failed stream; ``body`` is the error in Anthropic's shape."""
        return [_sse.event("error", body)]

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
        if self.mcp:  # kept for a response sent whole (the one-turn path builds it from ``whole``)
            self.blocks.append({k: (list(v) if isinstance(v, list) else v) for k, v in block.items()})
        out.append(_sse.event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block,
        }))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        if self.mcp and delta["type"] in ("text_delta", "thinking_delta"):
            key = delta["type"].removesuffix("_delta")
            self.blocks[-1][key] += delta[key]
        return _sse.event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
