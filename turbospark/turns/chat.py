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
    "TemplateMessage", "apply_default_system", "image_urls", "text_of", "tool_call",
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
