"""Tools for a chat template that knows nothing of them (sans-io): the tools and the call format
in a system preamble, earlier calls and results as text blocks. The format is the one
``output.py`` reads back (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), which is
why this lives beside it and the tokenizer that renders templates."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["TOOL_PREAMBLE", "tools_in_preamble"]

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
    messages: Iterable[Mapping[str, Any]], tools: Iterable[Mapping[str, Any]]
) -> list[TemplateMessage]:
    """A conversation with tools for a chat template that knows nothing of them: the tools and
    the call format (the one the output parser reads) in the system message, earlier calls as
    ``<tool_call>`` blocks in the assistant's text, tool results as ``<tool_response>`` blocks
    in a user turn."""
    out: list[TemplateMessage] = []
    tools = list(tools)
    if tools:
        listed = "\n".join(json.dumps(_function(t), ensure_ascii=False) for t in tools)
        preamble = TOOL_PREAMBLE.format(tools=listed)
        out.append({"role": "system", "content": preamble})
    for m in messages:
        msg = dict(m)
        if msg["role"] == "system" and out and out[-1]["role"] == "system" and len(out) == 1:
            out[0] = {"role": "system", "content": f"{msg.get('content') or ''}\n\n{out[0]['content']}".strip()}
            continue
        if msg.get("tool_calls"):
            blocks = [
                "<tool_call>\n" + json.dumps(
                    {"name": c["function"].get("name"), "arguments": c["function"].get("arguments", {})},
                    ensure_ascii=False,
                ) + "\n</tool_call>"
                for c in msg.pop("tool_calls")
            ]
            msg["content"] = "\n".join(filter(None, [msg.get("content") or "", *blocks]))
        if msg["role"] == "tool":
            msg = {"role": "user", "content": f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"}
        if msg["role"] == "user" and out and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{msg['content']}"}
            continue
        out.append(msg)
    return out
