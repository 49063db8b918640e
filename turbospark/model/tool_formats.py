"""Tool-call formats of model families that mlx-lm has no parser for (sans-io).

- Llama 3.x (its template writes tool results under the ``ipython`` role): a call is a JSON
  object ``{"name": N, "parameters": {..}}``, bare or after ``<|python_tag|>``; several are
  separated by ``;``.  The bare form is found by the guardrails' rescue, the tagged one here.
- Phi-4-mini (its template reads the tools from the system message, ``<|tool|>…<|/tool|>``):
  ``<|tool_call|>[{"name": N, "arguments": {..}}, ..]<|/tool_call|>``.
- Mistral templates that write ``[CALL_ID]`` in the history (Small 3.2): the model may copy it
  into its own call, ``[TOOL_CALLS]N[CALL_ID]id[ARGS]{..}``; mlx-lm's parser reads the form
  without it, so the id is dropped first.

``family_format`` names the format a chat template implies, as (start marker, end marker,
parser, name), or None; ``parse_json_calls`` reads every call such a block holds, in the shape
mlx-lm's parsers return (``{"name": .., "arguments": {..}}`` or a list of them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

__all__ = ["family_format", "parse_json_calls", "reads_system_tools"]


def parse_json_calls(text: str, tools: Any = None) -> list[dict[str, Any]]:
    """Every call in ``text``: JSON objects (or lists of them) one after another, separated by
    whitespace, ``;`` or ``,``.  ``parameters`` is read as ``arguments`` and an OpenAI-shaped
    ``{"type": "function", "function": {..}}`` as the function it wraps."""
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    at = 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at == len(text):
            break
        value, at = decoder.raw_decode(text, at)
        for item in value if isinstance(value, list) else [value]:
            calls.append(_call(item))
    if not calls:
        raise ValueError("no tool call")
    return calls


def _call(item: Any) -> dict[str, Any]:
    if isinstance(item, dict) and isinstance(item.get("function"), dict):
        item = item["function"]
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ValueError("not a tool call")
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool call arguments are not an object")
    return {"name": item["name"], "arguments": args}


def reads_system_tools(chat_template: str | None) -> bool:
    """Whether the template takes the tools from the system message (Phi-4-mini's
    ``message['tools']``, a JSON text) rather than from a ``tools`` variable."""
    return bool(chat_template) and "<|tool|>" in chat_template and "message['tools']" in chat_template  # type: ignore[operator]


_CALL_ID = re.compile(r"\[CALL_ID\][\w-]*")


def parse_mistral_with_ids(text: str, tools: Any = None) -> Any:
    from mlx_lm.tool_parsers import mistral

    return mistral.parse_tool_call(_CALL_ID.sub("", text), tools)


def family_format(
    chat_template: str | None, mlx_parser: str | None = None
) -> tuple[str, str, Callable[..., Any], str] | None:
    """(start, end, parser, name) of the tool-call format ``chat_template`` implies, when it is
    one of the families above; ``mlx_parser`` is the one mlx-lm's inference names."""
    if not chat_template or mlx_parser not in (None, "json_tools", "mistral"):
        return None
    if mlx_parser == "mistral":
        return ("[TOOL_CALLS]", "", parse_mistral_with_ids, "mistral") if "[CALL_ID]" in chat_template else None
    if "<|python_tag|>" in chat_template or "<|start_header_id|>ipython<|end_header_id|>" in chat_template:
        return "<|python_tag|>", "", parse_json_calls, "llama3"
    if reads_system_tools(chat_template):
        return "<|tool_call|>", "<|/tool_call|>", parse_json_calls, "phi4_mini"
    return None
