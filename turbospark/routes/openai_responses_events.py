"""Typed generation results as a Responses ``response`` object and its events (sans-io).

Output is a list of items on one output-index cursor: a ``reasoning`` item, ``message`` items
and ``function_call`` items, in the order the model wrote them.  ``ResponseStream`` is one
response: its items built whole (``whole``), or streamed as ``response.created``, then per item
``response.output_item.added``, its deltas and its done events, ``response.output_item.done``,
and at the end ``response.completed`` (or ``response.failed``), every event numbered by
``sequence_number``.  It is fed a turn's events (``turns/turn_events``: a call streams as
``response.function_call_arguments.delta`` pieces) and returns the frames to send; ``whole``
builds the same items from the events collected.  The final object goes to ``keep`` (the route
stores it); a retried turn says so in ``usage.retries``.

With MCP tools (``mcp``: the model-side names the server runs, ``routes/_mcp``) there are three
items more: ``mcp_list_tools`` (``listed``), ``mcp_call`` (its arguments streamed as
``response.mcp_call_arguments.delta``, then ``response.mcp_call.in_progress`` until ``ran``
completes or fails it) and ``mcp_approval_request`` (a call that waits for the user's
``mcp_approval_response``, sent whole).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ..actors.mcp import McpListing, McpOutcome
from ..messages import ToolCall
from ..turns.mcp_uses import McpRoute, McpUse
from ..turns.turn_events import (
    ArgumentsDelta, CallEnd, CallStart, Collected, Finish, Reasoning, Retried, Text, TurnEvent, Usage,
)
from ..web import sse as _sse
from ..wire.openai import ResponsesRequest

__all__ = ["ResponseStream", "new_id", "status", "usage"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(u: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
    if u.retries:
        out["retries"] = u.retries
    return out


def status(fin: Finish) -> str:
    return "incomplete" if fin.reason == "length" else "completed"


# --- output items ---------------------------------------------------------------------------

def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id, "type": "message", "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed" else [],
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id, "type": "reasoning",
        "summary": [{"type": "summary_text", "text": text}] if text else [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


def _call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "id": f"fc_{call.id}", "type": "function_call", "call_id": call.id, "name": call.name,
        "arguments": call.arguments if status == "completed" else "", "status": status,
    }


def _mcp_call_item(call: ToolCall, route: McpRoute, outcome: McpOutcome | None = None,
                   approval: str | None = None) -> dict[str, Any]:
    status = "in_progress" if outcome is None else "completed" if outcome.error is None else "failed"
    return {
        "id": f"mcp_{call.id}", "type": "mcp_call", "server_label": route.label, "name": route.tool,
        "arguments": call.arguments, "output": outcome.text if outcome is not None and outcome.error is None else None,
        "error": outcome.error if outcome is not None else None, "approval_request_id": approval, "status": status,
    }


def _approval_item(call: ToolCall, route: McpRoute) -> dict[str, Any]:
    return {"id": f"mcpr_{call.id}", "type": "mcp_approval_request", "server_label": route.label,
            "name": route.tool, "arguments": call.arguments}


@attrs.define
class ResponseStream:
    """One response being built: its envelope, its items, and (streaming) its events."""

    id: str
    model: str
    body: ResponsesRequest
    created_at: int = attrs.field(factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = attrs.field(factory=list)
    keep: Callable[[dict[str, Any]], None] | None = None  # handed the final object
    seq: int = 0
    open: dict[str, Any] | None = None  # the item being streamed
    open_text: str = ""
    finish: Finish | None = None
    mcp: Mapping[str, McpRoute] = attrs.field(factory=dict)  # the MCP tools offered, by model-side name
    calling: dict[str, int] = attrs.field(factory=dict)  # an MCP call running: its output index, by call id
    result: dict[str, Any] | None = None  # the final object

    def envelope(self, status: str, usage: dict[str, Any] | None = None,
                 finished: Finish | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = finished is not None and finished.reason == "length"
        return {
            "id": self.id, "object": "response", "type": "response", "created_at": self.created_at,
            "status": status, "model": self.model,
            "output": list(self.output),
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id,
            "tools": b.tools or [],
            "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": b.text or {"format": {"type": "text"}},
            "reasoning": b.reasoning,
            "store": b.store is not False,
            "metadata": b.metadata or {},
            "usage": usage,
        }

    def final(self, u: Usage) -> dict[str, Any]:
        """The finished response object (what is stored and sent whole), handed to ``keep``."""
        assert self.finish is not None
        final = self.result = self.envelope(status(self.finish), usage(u), self.finish)
        if self.keep is not None:
            self.keep(final)
        return final

    def whole(self, done: Collected) -> dict[str, Any]:
        """The response object of a turn's events, collected."""
        (choice,) = done.choices
        for kind, value in choice.parts:
            if kind == "reasoning":
                self.output.append(_reasoning_item(new_id("rs"), value))
            elif kind == "text":
                self.output.append(_message_item(new_id("msg"), value))
            else:
                self.output.append(_call_item(value))
        self.finish = choice.finish
        assert done.usage is not None
        return self.final(done.usage)

    # --- events: one output-index cursor for every item ---------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _sse.event(kind, payload)

    def created(self) -> bytes:
        return self.event("response.created", response=self.envelope("in_progress"))

    def completed(self, final: dict[str, Any]) -> bytes:
        """``response.completed``, after ``close``: ``final`` is ``self.final(...)``."""
        return self.event("response.completed", response=final)

    def failed(self, error: dict[str, Any]) -> bytes:
        """``response.failed``: ``error`` is the error object in OpenAI's shape."""
        return self.event("response.failed", response=self.envelope("failed", error=error)
                          | {"status_details": {"error": error}})

    def opening(self) -> list[bytes]:
        return [self.created()]

    def tick(self) -> list[bytes]:
        return [_sse.KEEPALIVE]

    def error(self, body: dict[str, Any]) -> list[bytes]:
        """``response.failed``: ``body`` is the error in OpenAI's shape."""
        return [self.failed(body["error"])]

    def feed(self, event: TurnEvent) -> list[bytes]:
        """The frames for one event of the turn."""
        if isinstance(event, Text):
            return self.text(event.text)
        if isinstance(event, Reasoning):
            return self.reasoning(event.text)
        if isinstance(event, CallStart):
            out = self.close()
            call, route = ToolCall(event.index, event.id, event.name, ""), self.mcp.get(event.name)
            self.open_text = ""
            if route is not None and route.approval:
                self.open = _approval_item(call, route)  # sent whole at its end
                return out
            if route is not None:
                self.open = _mcp_call_item(call, route)
                return [*out, self.event("response.output_item.added", output_index=self._index(), item=self.open),
                        self.event("response.mcp_call.in_progress", item_id=self.open["id"], output_index=self._index())]
            self.open = _call_item(call, "in_progress")
            return [*out, self.event("response.output_item.added", output_index=self._index(), item=self.open)]
        if isinstance(event, ArgumentsDelta):
            assert self.open is not None
            self.open_text += event.text
            if self.open["type"] == "mcp_approval_request":
                return []
            kind = "mcp_call_arguments" if self.open["type"] == "mcp_call" else "function_call_arguments"
            return [self.event(f"response.{kind}.delta", item_id=self.open["id"],
                               output_index=self._index(), delta=event.text)]
        if isinstance(event, CallEnd):
            return self.call(event.call)
        if isinstance(event, Finish):
            self.finish = event
        elif isinstance(event, Usage):
            return [*self.close(), self.completed(self.final(event))]
        elif isinstance(event, Retried):
            pass
        return []

    def text(self, delta: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self.close()
            self.open, self.open_text = _message_item(new_id("msg"), "", "in_progress"), ""
            out.append(self.event("response.output_item.added", output_index=self._index(), item=self.open))
            out.append(self.event(
                "response.content_part.added", item_id=self.open["id"], output_index=self._index(),
                content_index=0, part={"type": "output_text", "text": "", "annotations": []},
            ))
        self.open_text += delta
        out.append(self.event(
            "response.output_text.delta", item_id=self.open["id"], output_index=self._index(),
            content_index=0, delta=delta, logprobs=[],
        ))
        return out

    def reasoning(self, delta: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self.close()
            self.open, self.open_text = _reasoning_item(new_id("rs"), ""), ""
            out.append(self.event("response.output_item.added", output_index=self._index(), item=self.open))
        self.open_text += delta
        out.append(self.event(
            "response.reasoning_text.delta", item_id=self.open["id"], output_index=self._index(),
            content_index=0, delta=delta,
        ))
        return out

    def call(self, call: ToolCall) -> list[bytes]:
        """A call's end: its arguments done, its item done (its deltas went before).  An MCP
        call's item stays in progress until ``ran``; an approval request goes out whole."""
        route = self.mcp.get(call.name)
        if route is not None:
            index, self.open = self._index(), None
            if route.approval:
                item = _approval_item(call, route)
                self.output.append(item)
                return [self.event("response.output_item.added", output_index=index, item=item),
                        self.event("response.output_item.done", output_index=index, item=item)]
            item = _mcp_call_item(call, route)
            self.output.append(item)
            self.calling[call.id] = index
            return [self.event("response.mcp_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=call.arguments)]
        index, item = self._index(), _call_item(call)
        self.open = None
        self.output.append(item)
        return [
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def listed(self, use: McpUse, listing: McpListing) -> list[bytes]:
        """An ``mcp_list_tools`` item: the tools of ``use``'s server it may offer."""
        index, item_id = self._index(), new_id("mcpl")
        item = {"id": item_id, "type": "mcp_list_tools", "server_label": use.label, "tools": []}
        out = [self.event("response.output_item.added", output_index=index, item=dict(item)),
               self.event("response.mcp_list_tools.in_progress", item_id=item_id, output_index=index)]
        item["tools"] = [t.wire() for t in listing.tools if use.offers(t.name)]
        item["error"] = None if listing.state == "up" else f"the MCP server is {listing.state}: {listing.error}"
        self.output.append(item)
        kind = "completed" if listing.state == "up" else "failed"
        return [*out, self.event(f"response.mcp_list_tools.{kind}", item_id=item_id, output_index=index),
                self.event("response.output_item.done", output_index=index, item=item)]

    def ran(self, call: ToolCall, route: McpRoute, outcome: McpOutcome, approval: str | None = None) -> list[bytes]:
        """An MCP call's outcome; a call approved in an earlier response is added here whole."""
        out = []
        index = self.calling.pop(call.id, None)
        if index is None:
            index = self._index()
            self.output.append(_mcp_call_item(call, route, approval=approval))
            out += [self.event("response.output_item.added", output_index=index, item=self.output[index]),
                    self.event("response.mcp_call.in_progress", item_id=f"mcp_{call.id}", output_index=index)]
        item = self.output[index] = _mcp_call_item(call, route, outcome, approval)
        kind = "completed" if outcome.error is None else "failed"
        return [*out, self.event(f"response.mcp_call.{kind}", item_id=item["id"], output_index=index),
                self.event("response.output_item.done", output_index=index, item=item)]

    def close(self) -> list[bytes]:
        """Close the open item: its done events, then it joins the output."""
        if self.open is None:
            return []
        item, text, index = self.open, self.open_text, self._index()
        self.open = None
        if item["type"] == "message":
            done = _message_item(item["id"], text)
            part = done["content"][0]
            out = [
                self.event("response.output_text.done", item_id=item["id"], output_index=index,
                           content_index=0, text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index,
                           content_index=0, part=part),
            ]
        else:
            done = _reasoning_item(item["id"], text)
            out = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text)]
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        return out

    def _index(self) -> int:
        return len(self.output)
