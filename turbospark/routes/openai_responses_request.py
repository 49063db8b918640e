"""A Responses request translated for the generation core (sans-io).

Input items become a conversation (``message``, ``function_call``, ``function_call_output``;
``reasoning`` items are accepted and not re-rendered), after the stored conversation a
``previous_response_id`` continues; ``instructions`` lead it.  Flat function tools, ``tool_choice``,
``text.format`` and ``reasoning.effort`` become the core's tools, grammar and template switches.
``said`` turns a response's output items back into the assistant's turns (and the MCP calls' tool
turns), for the conversation stored with it.  MCP items in the input (``mcp_list_tools``,
``mcp_call``, ``mcp_approval_request``) join the conversation as the calls and results they
were; an ``mcp_approval_response`` that declines tells the model so, one that approves is kept
in ``Plan.approvals`` for the route to run.  Plain functions: no Trio, no Quart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..errors import RequestInvalid
from ..messages import ChatPrompt
from ..turns.chat import TemplateMessage, apply_default_system, image_urls, text_of, tool_call
from ..turns.images import openai_parts, with_images
from ..turns.mcp_uses import DECLINED, tool_message
from ..turns.structured import Grammar, check_images, function_tools, grammar_for, select_tools
from ..wire.openai import ResponsesRequest

__all__ = ["DEFAULT_MAX_OUTPUT", "Plan", "plan", "said", "unhonoured"]

DEFAULT_MAX_OUTPUT = 256


@attrs.frozen
class Plan:
    """A request translated: the conversation (to store), the prompt, and its constraints."""

    conversation: list[TemplateMessage]  # stored history and new input, without instructions
    prompt: ChatPrompt
    call_required: bool
    grammar: Grammar | None
    images: int
    #: the request's ``mcp_approval_response`` items: (approval_request_id, approve)
    approvals: tuple[tuple[str, bool], ...] = ()
    #: the MCP items its input carried, by id (approval requests, listings)
    mcp_items: dict[str, dict[str, Any]] = attrs.field(factory=dict)


def plan(body: ResponsesRequest, history: Sequence[TemplateMessage], default_system: str | None,
         vision: bool = False, remote: bool = False, mcp_tools: Sequence[dict[str, Any]] = ()) -> Plan:
    """The request after ``history`` (the stored conversation it continues, if any).  A
    ``vision`` model's messages keep their images (``turns.images``); others' drop them.
    ``mcp_tools``: the MCP servers' tools offered, as function tools (``turns.mcp_uses``)."""
    mcp: dict[str, Any] = {"approvals": [], "items": {}}
    new, urls = _items(body.input, vision, mcp)
    if not new and not history and not mcp["approvals"]:
        raise RequestInvalid("input must hold at least one message or item", param="input")
    images = check_images(urls, remote and vision)
    conversation = [*history, *new]
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *conversation]
    else:
        messages = apply_default_system(conversation, default_system)
    tools, required = select_tools((*_tools(body), *mcp_tools), _tool_choice(body.tool_choice))
    schema, any_object = _format(body)
    grammar = grammar_for(
        json_schema=schema, json_object=any_object, tools=tools, call_required=required,
        parallel=body.parallel_tool_calls is True,
    )
    return Plan(conversation, ChatPrompt(tuple(messages), tools, _effort(body)), required, grammar,
                0 if vision else images, tuple(mcp["approvals"]), mcp["items"])


def unhonoured(body: ResponsesRequest) -> list[str]:
    """The fields accepted but not honoured, for the degradation header."""
    labels = ["truncation"] if body.truncation == "auto" else []
    return labels + [
        name for name in ("include", "background", "top_logprobs", "prompt", "conversation")
        if getattr(body, name)
    ]


def said(output: Sequence[Mapping[str, Any]]) -> list[TemplateMessage]:
    """A response's output as the assistant's turns, for the conversation it continues: its
    text, reasoning and calls, each MCP call's result after the turn that made it."""
    out: list[TemplateMessage] = []
    turn: TemplateMessage | None = None
    results: list[TemplateMessage] = []

    def current() -> TemplateMessage:
        nonlocal turn
        if results:  # the calls' results close the turn that made them
            out.extend(results)
            results.clear()
            turn = None
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    for item in output:
        kind = item["type"]
        if kind == "message":
            current()["content"] += "".join(part["text"] for part in item["content"])
        elif kind == "reasoning":
            t = current()
            t["reasoning_content"] = t.get("reasoning_content", "") + "".join(p["text"] for p in item["content"])
        elif kind in ("function_call", "mcp_call", "mcp_approval_request"):
            call_id = item["call_id"] if kind == "function_call" else item["id"].split("_", 1)[1]
            if kind == "mcp_call" and item.get("approval_request_id"):  # its call is an earlier turn's
                results.append(tool_message(call_id, item["output"], item["error"]))
                continue
            current().setdefault("tool_calls", []).append(
                tool_call({"id": call_id, "function": {"name": item["name"], "arguments": item["arguments"]}}))
            if kind == "mcp_call":
                results.append(tool_message(call_id, item["output"], item["error"]))
    out.extend(results)
    return [t for t in out if t["role"] != "assistant" or t["content"] or t.get("tool_calls")]


# --- input items -----------------------------------------------------------------------------


def _text(content: Any, where: str) -> tuple[str, list[str]]:
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list) or not all(isinstance(p, Mapping) for p in content):
        raise RequestInvalid(f"{where}.content must be a string or an array of parts", param="input")
    for i, p in enumerate(content):
        if p.get("type") in ("input_text", "output_text", "text") and not isinstance(p.get("text"), str):
            raise RequestInvalid(f"{where}.content[{i}].text must be a string", param="input")
    text, _ = text_of(
        {"type": "text", "text": p["text"]} for p in content
        if p.get("type") in ("input_text", "output_text", "text") and isinstance(p.get("text"), str)
    )
    return text, image_urls(content)


def _items(items: str | list[dict[str, Any]], vision: bool = False,
           mcp: dict[str, Any] | None = None) -> tuple[list[TemplateMessage], list[str]]:
    """The input as template messages, and the image URLs it carried; ``mcp`` gathers its
    approvals and MCP items."""
    mcp = {"approvals": [], "items": {}} if mcp is None else mcp
    if isinstance(items, str):
        return [{"role": "user", "content": items}], []
    out: list[TemplateMessage] = []
    images: list[str] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestInvalid(
                    f"{where}.role must be one of 'user', 'assistant', 'system', 'developer', got {role!r}",
                    param="input",
                )
            text, urls = _text(item.get("content"), where)
            images += urls
            msg = {"role": "system" if role == "developer" else role, "content": text}
            if vision and urls:
                msg["content"] = with_images(openai_parts(item["content"]), where)
            if msg["content"]:
                out.append(msg)
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, str):
                raise RequestInvalid(
                    f"{where}: a function_call item needs string name, call_id and arguments", param="input"
                )
            call = tool_call({"id": call_id, "function": {"name": name, "arguments": arguments}})
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if isinstance(output, list):
                output, _ = _text(output, where)
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise RequestInvalid(
                    f"{where}: a function_call_output item needs a string call_id and output", param="input"
                )
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # the model's earlier reasoning: not part of what it is shown again
        elif kind in ("mcp_list_tools", "mcp_call", "mcp_approval_request"):
            if not isinstance(item.get("id"), str) or "_" not in item["id"]:
                raise RequestInvalid(f"{where}: an {kind} item needs its id", param="input")
            mcp["items"][item["id"]] = item
            if kind != "mcp_list_tools":
                if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                    raise RequestInvalid(f"{where}: an {kind} item needs string name and arguments", param="input")
                out.extend(said([{"output": None, "error": None, **item}]))
        elif kind == "mcp_approval_response":
            request_id, approve = item.get("approval_request_id"), item.get("approve")
            if not isinstance(request_id, str) or not request_id.startswith("mcpr_") or not isinstance(approve, bool):
                raise RequestInvalid(
                    f"{where}: an mcp_approval_response needs approval_request_id (an mcp_approval_request's id) "
                    "and approve (true or false)", param="input",
                )
            mcp["approvals"].append((request_id, approve))
            if not approve:
                out.append(tool_message(request_id.split("_", 1)[1], DECLINED, None))
        else:
            raise RequestInvalid(f"{where}.type {kind!r} is not a supported input item", param="input")
    return out, images


# --- tools, format, reasoning ----------------------------------------------------------------


def _tools(body: ResponsesRequest) -> tuple[dict[str, Any], ...]:
    """Responses' flat function tools, in the chat shape the core takes."""
    nested = []
    for i, tool in enumerate(body.tools or ()):
        kind = tool.get("type", "function")
        if kind == "mcp":
            continue  # the MCP servers' tools: turns.mcp_uses
        if kind != "function":
            raise RequestInvalid(
                f"tools[{i}].type {kind!r} is not supported: this server runs function tools only",
                param="tools",
            )
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
        nested.append({"type": "function", "function": function})
    return function_tools(nested)


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") in ("function", "mcp") and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "mcp":
        return "required"  # a call to one of the server's tools: every tool offered is one
    return choice


def _format(body: ResponsesRequest) -> tuple[dict[str, Any] | None, bool]:
    fmt = (body.text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise RequestInvalid("text.format.schema must be a JSON Schema object", param="text")
        return schema, False
    if kind == "json_object":
        return None, True
    if kind != "text":
        raise RequestInvalid(
            f"text.format.type must be one of 'text', 'json_object', 'json_schema', got {kind!r}", param="text"
        )
    return None, False


def _effort(body: ResponsesRequest) -> dict[str, Any]:
    effort = (body.reasoning or {}).get("effort")
    if effort is None:
        return {}
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise RequestInvalid(
            "reasoning.effort must be one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh', "
            f"got {effort!r}", param="reasoning",
        )
    return {"reasoning_effort": effort, "enable_thinking": effort not in ("none", "minimal")}
