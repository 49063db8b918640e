"""What a request asks of the output's structure, in terms every API family shares (sans-io).

- ``function_tools`` checks a request's tools (the OpenAI shape, or the flat one of Responses
  and the Anthropic shape translated by their routes) and ``select_tools`` applies
  ``tool_choice``: ``none`` removes the tools from prompt and decoding, a named function keeps
  that one, ``required`` keeps all and demands a call.
- ``grammar_for`` turns the demands into one grammar for constrained decoding: a JSON answer
  (``response_format``, Ollama's ``format``, Responses' ``text.format``) or forced tool calls in
  the ``<tool_call>{"name": .., "arguments": ..}</tool_call>`` form the output parser reads,
  arguments valid against each tool's schema.
- ``check_images`` validates image inputs the way the reference does (data URLs only, base64,
  at most 64), whether or not the model can see them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import jsonschema

from ..errors import RequestInvalid

__all__ = [
    "Grammar",
    "MAX_IMAGES",
    "check_images",
    "function_tools",
    "grammar_for",
    "select_tools",
]

MAX_IMAGES = 64
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@attrs.frozen
class Grammar:
    """A constraint on a sequence's output, as a Lark grammar for llguidance (``%json{..}``
    embeds a JSON Schema).  ``what`` names the request field it enforces, for error messages."""

    lark: str
    what: str


def function_tools(tools: Sequence[Any] | None, *, param: str = "tools") -> tuple[dict[str, Any], ...]:
    """The request's tools in the OpenAI shape ``{"type": "function", "function": {...}}``."""
    out = []
    for i, tool in enumerate(tools or ()):
        where = f"{param}[{i}]"
        if not isinstance(tool, Mapping):
            raise RequestInvalid(f"{where} must be an object", param=param)
        if tool.get("type", "function") != "function":
            raise RequestInvalid(
                f"{where}.type {tool.get('type')!r} is not supported: only function tools are",
                param=param,
            )
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise RequestInvalid(f"{where}.function must be an object", param=param)
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RequestInvalid(
                f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                param=param,
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise RequestInvalid(f"{where}.function.parameters must be a JSON Schema object", param=param)
        if parameters is not None:
            _check_schema(parameters, f"{where}.function.parameters", param)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestInvalid(f"{where}.function.description must be a string", param=param)
        out.append({"type": "function", "function": dict(function)})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise RequestInvalid(f"{param} names a function more than once", param=param)
    return tuple(out)


def _check_schema(schema: Mapping[str, Any], where: str, param: str) -> None:
    """A JSON Schema the validator can apply: valid against the metaschema, local references
    that resolve."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise RequestInvalid(f"{where} is not a valid JSON Schema: {exc.message}", param=param) from None
    for ref in _refs(schema):
        if not ref.startswith("#") or _pointer(schema, ref[1:]) is None:
            raise RequestInvalid(f"{where}: the $ref {ref!r} does not resolve within the schema", param=param)


def _refs(schema: Any) -> list[str]:
    found, stack = [], [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            if isinstance(item.get("$ref"), str):
                found.append(item["$ref"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _pointer(schema: Any, pointer: str) -> Any:
    """The part of ``schema`` a JSON pointer (``/$defs/x``) names, or None."""
    node = schema
    for token in filter(None, pointer.split("/")):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def json_demand(response_format: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, bool]:
    """OpenAI's ``response_format``: a JSON Schema to enforce, or any JSON object."""
    fmt = response_format or {}
    if fmt.get("type") == "json_schema":
        spec = fmt["json_schema"]
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise RequestInvalid("response_format.json_schema.schema must be an object", param="response_format")
        return (schema, False) if schema is not None else (None, True)
    return None, fmt.get("type") == "json_object"


def select_tools(
    tools: tuple[dict[str, Any], ...], choice: str | Mapping[str, Any] | None
) -> tuple[tuple[dict[str, Any], ...], bool]:
    """The tools ``tool_choice`` leaves in play, and whether a call is required."""
    if choice is None or choice == "auto":
        return tools, False
    if choice == "none":
        return (), False
    if not tools:
        raise RequestInvalid("tool_choice requires tools", param="tool_choice")
    if choice == "required":
        return tools, True
    assert isinstance(choice, Mapping)
    function = choice.get("function") if "function" in choice else choice
    name = function.get("name") if isinstance(function, Mapping) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise RequestInvalid(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}', param="tool_choice",
        )
    kept = tuple(t for t in tools if t["function"]["name"] == name)
    if not kept:
        raise RequestInvalid(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return kept, True


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def grammar_for(
    *,
    json_schema: Mapping[str, Any] | None = None,
    json_object: bool = False,
    tools: Sequence[Mapping[str, Any]] = (),
    call_required: bool = False,
    parallel: bool = False,
) -> Grammar | None:
    """One grammar for what the request demands, or None when the output is free.  Forced
    calls are one call unless the caller allowed several explicitly (small models otherwise
    repeat the call until the budget runs out)."""
    if call_required and tools:
        schemas = [_call_schema(t) for t in tools]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        call = f'{_lark_string("<tool_call>")} "\\n" %json{json.dumps(schema)} "\\n" {_lark_string("</tool_call>")}'
        body = 'call ("\\n" call)*' if parallel else "call"
        return Grammar(f"start: {body}\ncall: {call}\n", "tool_choice")
    if json_schema is not None:
        return Grammar(f"start: %json{json.dumps(json_schema)}\n", "response_format")
    if json_object:
        return Grammar('start: %json{"type": "object"}\n', "response_format")
    return None


_DATA_URL = re.compile(r"^data:", re.IGNORECASE)


def check_images(urls: Iterable[str]) -> int:
    """Validate image URLs; the number of images."""
    count = 0
    for url in urls:
        count += 1
        if not _DATA_URL.match(url):
            shown = url[:60]
            raise RequestInvalid(
                "image_url must be a data: URL; this server does not fetch remote images "
                f"(got {shown}... [{len(url.encode())} bytes])", param="messages",
            )
        header, comma, _ = url.partition(",")
        if not comma:
            raise RequestInvalid(
                "malformed data: URL, expected a comma between the media type and the payload",
                param="messages",
            )
        if ";base64" not in header.lower():
            media = header[5:] or "text/plain"
            raise RequestInvalid(
                f'data: URL is not base64-encoded (media type "{media}"); send ;base64 data',
                param="messages",
            )
    if count > MAX_IMAGES:
        raise RequestInvalid(
            f"too many images: {count} exceeds the {MAX_IMAGES}-image limit per request",
            param="messages",
        )
    return count
