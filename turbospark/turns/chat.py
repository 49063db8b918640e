"""Turning a caller's conversation into what the chat template renders (sans-io).

Shared by every API family: messages become plain dicts with string content, tool calls keep
their arguments as objects where they parse (templates expect that), empty messages are dropped,
and the server's default system prompt is put first only when the caller sent none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "TemplateMessage", "apply_default_system", "image_urls", "text_of", "tool_call", "tools_in_preamble",
]

TemplateMessage = dict[str, Any]


def text_of(content: str | Iterable[Mapping[str, Any]] | None) -> tuple[str, int]:
    """The text of a message's content and how many non-text parts (images ...) it carried."""
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    texts, other = [], 0
    for part in content:
        if part.get("type") in ("text", "input_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            other += 1
    return "\n".join(texts), other


def image_urls(content: str | Iterable[Mapping[str, Any]] | None) -> list[str]:
    """The URLs of a message's image parts (OpenAI's ``image_url``, Responses' ``input_image``)."""
    if content is None or isinstance(content, str):
        return []
    urls = []
    for part in content:
        if part.get("type") == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else image
        elif part.get("type") == "input_image":
            url = part.get("image_url")
        else:
            continue
        urls.append(url if isinstance(url, str) else "")
    return urls


def tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call as templates expect it: ``function.arguments`` as an object if it parses."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {"id": call.get("id"), "type": call.get("type", "function"), "function": function}


def apply_default_system(
    messages: list[TemplateMessage], default_system: str | None
) -> list[TemplateMessage]:
    if default_system and not any(m["role"] in ("system", "developer") for m in messages):
        return [{"role": "system", "content": default_system}, *messages]
    return messages


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
