"""Tools for a chat template that knows nothing of them (sans-io): the tools and the call format
in a system preamble, earlier calls and results as text blocks. The format is the one
``output.py`` reads back (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), which is
why this lives beside it and the tokenizer that renders templates."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["TOOL_PREAMBLE", "short_call_ids", "tools_in_preamble"]

TemplateMessage = dict[str, Any]

TOOL_PREAMBLE = """You can call these tools:
<tools>
{tools}
</tools>
To call a tool, answer with one block per call, each holding a JSON object with the tool's name and its arguments:
<tool_call>
{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>"""


def _function(tool: Mapping[str, Any]) -> Any:
    return tool.get("function", tool)


def tools_in_preamble(
    messages: Iterable[Mapping[str, Any]],
    tools: Iterable[Mapping[str, Any]],
    *,
    system_tools: tuple[str, str] | None = None,
) -> list[TemplateMessage]:
    """A conversation with tools for a chat template that knows nothing of them: the tools and
    the call format (the one the output parser reads) in the system message, earlier calls as
    ``<tool_call>`` blocks in the assistant's text, tool results as ``<tool_response>`` blocks
    in a user turn.

    ``system_tools`` (a call block's start and end markers): the template reads the tools from
    the system message's ``tools`` field, as JSON text (Phi-4-mini); they go there, with no
    preamble, and earlier calls are written as one block listing them, in those markers."""
    out: list[TemplateMessage] = []
    tools = list(tools)
    if tools and system_tools:
        listed = json.dumps([_function(t) for t in tools], ensure_ascii=False)
        out.append({"role": "system", "content": "", "tools": listed})
    elif tools:
        listed = "\n".join(json.dumps(_function(t), ensure_ascii=False) for t in tools)
        preamble = TOOL_PREAMBLE.format(tools=listed)
        out.append({"role": "system", "content": preamble})
    for m in messages:
        msg = dict(m)
        if msg["role"] == "system" and out and out[-1]["role"] == "system" and len(out) == 1:
            out[0] = {**out[0], "content": f"{msg.get('content') or ''}\n\n{out[0]['content']}".strip()}
            continue
        if msg.get("tool_calls"):
            calls = [
                {"name": c["function"].get("name"), "arguments": c["function"].get("arguments", {})}
                for c in msg.pop("tool_calls")
            ]
            if system_tools:
                blocks = [system_tools[0] + json.dumps(calls, ensure_ascii=False) + system_tools[1]]
            else:
                blocks = ["<tool_call>\n" + json.dumps(c, ensure_ascii=False) + "\n</tool_call>" for c in calls]
            msg["content"] = "\n".join(filter(None, [msg.get("content") or "", *blocks]))
        if msg["role"] == "tool":
            msg = {"role": "user", "content": f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"}
        if msg["role"] == "user" and out and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{msg['content']}"}
            continue
        out.append(msg)
    return out


def short_call_ids(messages: Iterable[Mapping[str, Any]]) -> list[TemplateMessage]:
    """The conversation with every tool-call id made nine letters and digits, the same for a
    call and its result (Mistral's templates refuse any other id).  A call without an id (as
    Ollama's clients send them) gets one, and a result without one answers the next call."""

    def short(value: Any, where: str) -> str:
        if isinstance(value, str) and len(value) == 9 and value.isalnum():
            return value
        return hashlib.sha256((value if isinstance(value, str) and value else where).encode()).hexdigest()[:9]

    out: list[TemplateMessage] = []
    pending: list[str] = []  # ids of the last calls that no result has answered yet
    for i, m in enumerate(messages):
        msg = dict(m)
        if msg.get("tool_calls"):
            msg["tool_calls"] = [{**c, "id": short(c.get("id"), f":{i}:{k}")} for k, c in enumerate(msg["tool_calls"])]
            pending = [c["id"] for c in msg["tool_calls"]]
        if msg.get("role") == "tool":
            given = msg.get("tool_call_id")
            msg["tool_call_id"] = short(given, "") if given else (pending[0] if pending else short(None, f":{i}"))
            if msg["tool_call_id"] in pending:
                pending.remove(msg["tool_call_id"])
        out.append(msg)
    return out
