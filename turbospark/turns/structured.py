"""What a request asks of the output's structure, in terms every API family shares (sans-io).

- ``function_tools`` checks a request's tools (the OpenAI shape, or the flat one of Responses
  and the Anthropic shape translated by their routes) and ``select_tools`` applies
  ``tool_choice``: ``none`` removes the tools from prompt and decoding, a named function keeps
  that one, ``required`` keeps all and demands a call.
- ``grammar_for`` turns the demands into one grammar for constrained decoding: a JSON answer
  (``response_format``, Ollama's ``format``, Responses' ``text.format``) or forced tool calls in
  the ``<tool_call>{"name": .., "arguments": ..}</tool_call>`` form the output parser reads,
  arguments valid against each tool's schema.  The JSON is compact (no free whitespace) and a
  client's object schemas are closed (``closed_objects``, decision 0017); each grammar carries
  its shortest valid outputs, so a budget too small for them is refused before decoding.
- ``check_images`` validates image inputs the way the reference does (data URLs only, base64,
  at most 64), whether or not the model can see them.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jsonschema

from ..errors import RequestInvalid
from ..model.constraint import Grammar

__all__ = [
    "Grammar",
    "MAX_IMAGES",
    "check_images",
    "closed_objects",
    "function_tools",
    "grammar_for",
    "select_tools",
    "shortest_json",
]

MAX_IMAGES = 64
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


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
    that resolve.  Agents send the same tools on every turn, and checking against the
    metaschema is most of a tool turn's set-up, so the verdicts on recent schemas are kept, by
    their JSON text."""
    text = json.dumps(schema, sort_keys=True)
    problem = _schema_problem(text) if len(text) <= _KEPT_SCHEMA_TEXT else _schema_problem.__wrapped__(text)
    if problem is not None:
        raise RequestInvalid(f"{where}{problem}", param=param)


_KEPT_SCHEMA_TEXT = 64 * 1024  # larger schemas are checked every time, never kept


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str | None:
    schema = json.loads(text)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f" is not a valid JSON Schema: {exc.message}"
    for ref in _refs(schema):
        if not ref.startswith("#") or _pointer(schema, ref[1:]) is None:
            return f": the $ref {ref!r} does not resolve within the schema"
    return None


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


# --- compact JSON, closed objects, shortest instances (decision 0017) ------------------------

# llguidance's JSON options, read from the top of each ``%json{..}`` schema: no whitespace
# between tokens (``{"a":1,"b":[2]}``).  Free whitespace lets a small model indent and pad its
# way through the budget; compact is also the shortest a document can be.
_COMPACT = {"whitespace_flexible": False}
_KNOWN_EXTRA = ("additionalProperties", "unevaluatedProperties")


def _compact(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` with compact JSON asked of llguidance (a client's own ``x-guidance`` keys
    win)."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**_COMPACT, **(own if isinstance(own, Mapping) else {})}}


def _is_object(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    if isinstance(kind, str):
        return kind == "object"
    if isinstance(kind, list):
        return "object" in kind
    return "properties" in schema or "patternProperties" in schema


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object subschema that says nothing about extra keys
    (no ``additionalProperties``) has ``additionalProperties: false``, as OpenAI's strict mode
    closes it: in properties, items, ``anyOf``/``oneOf`` branches, ``$defs``, at any depth.  A
    schema that sets ``additionalProperties`` (``true``, or a schema for the values) keeps it.

    Left open, because closing would refuse documents the client's schema means to allow: an
    object whose keys come partly from ``allOf``/``anyOf``/``oneOf``/``$ref`` beside it (and
    the ``allOf`` branches themselves, and the ``anyOf``/``oneOf`` branches of an object that
    names its own properties), and anything under ``not``, ``if``/``then``/``else`` or
    ``dependentSchemas``."""
    return _close(schema, closable=True)


_COMBINED = ("allOf", "anyOf", "oneOf", "$ref")
_OPAQUE = ("not", "if", "then", "else", "dependentSchemas", "const", "enum", "default", "examples")


def _close(node: Any, *, closable: bool) -> Any:
    if isinstance(node, list):
        return [_close(item, closable=True) for item in node]
    if not isinstance(node, Mapping):
        return node
    out: dict[str, Any] = {}
    own_keys = "properties" in node or "patternProperties" in node
    for key, value in node.items():
        if key in _OPAQUE:
            out[key] = value
        elif key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, Mapping):
            out[key] = {k: _close(v, closable=True) for k, v in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_close(branch, closable=False) for branch in value]
        elif key in ("anyOf", "oneOf") and isinstance(value, list):
            out[key] = [_close(branch, closable=not own_keys) for branch in value]
        elif key in ("items", "prefixItems", "additionalProperties", "contains", "propertyNames",
                     "unevaluatedProperties", "unevaluatedItems", "additionalItems"):
            out[key] = _close(value, closable=True)
        else:
            out[key] = value
    if (
        closable
        and _is_object(node)
        and not any(k in node for k in _KNOWN_EXTRA)
        and not any(k in node for k in _COMBINED)
    ):
        out["additionalProperties"] = False
    return out


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def shortest_json(schema: Any, root: Any = None, _seen: frozenset[str] = frozenset()) -> str:
    """Compact JSON text no longer than the shortest document ``schema`` accepts, written as
    the document itself where the schema says enough: the required properties (in the order
    llguidance writes them) with their shortest values, ``minItems`` items, ``minLength``
    characters, the shortest ``const``/``enum`` choice.  Where it cannot tell (a ``pattern``, a
    ``format``, a recursive ``$ref``), it writes less, never more: a lower bound."""
    root = schema if root is None else root
    if schema is True or not isinstance(schema, Mapping):
        return "0"  # the shortest JSON value there is
    if "const" in schema:
        return _dumps(schema["const"])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min((_dumps(v) for v in schema["enum"]), key=len)
    ways = []
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            ways.append(min((shortest_json(b, root, _seen) for b in schema[key]), key=len))
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _pointer(root, ref[1:]) if ref.startswith("#") and ref not in _seen else None
        ways.append(shortest_json(target, root, _seen | {ref}) if target is not None else "0")
    for branch in schema.get("allOf") or ():  # every branch must hold: the longest is a bound
        ways.append(shortest_json(branch, root, _seen))
    own = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf", "allOf", "$ref")}
    if "type" in own or _is_object(own):
        ways.append(_shortest_of_type(own, root, _seen))
    return max(ways, key=len) if ways else "0"


def _shortest_of_type(schema: Mapping[str, Any], root: Any, seen: frozenset[str]) -> str:
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        return min((_shortest_of_type({**schema, "type": k}, root, seen) for k in kind or ["null"]), key=len)
    if kind == "object":
        properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        required = [k for k in schema.get("required") or () if isinstance(k, str)]
        order = [k for k in properties if k in required] + [k for k in required if k not in properties]
        extra = schema.get("additionalProperties", True)
        parts = [f"{_dumps(k)}:{shortest_json(properties.get(k, extra), root, seen)}" for k in order]
        return "{" + ",".join(parts) + "}"
    if kind == "array":
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        count = schema.get("minItems", 0) if isinstance(schema.get("minItems"), int) else 0
        items = [shortest_json(prefix[i] if i < len(prefix) else schema.get("items", True), root, seen)
                 for i in range(min(count, 1024))]
        return "[" + ",".join(items) + "]"
    if kind == "string":
        least = schema.get("minLength", 0) if isinstance(schema.get("minLength"), int) else 0
        return '"' + "a" * min(least, 4096) + '"'
    if kind == "boolean":
        return "true"
    if kind == "null":
        return "null"
    return "0"  # integer, number: no shorter number exists


def _call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    parameters = closed_objects(function.get("parameters") or {"type": "object"})
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
    repeat the call until the budget runs out).  The JSON is compact and the client's object
    schemas closed (``closed_objects``); ``json_object`` (any object) stays open."""
    if call_required and tools:
        schemas = [_call_schema(t) for t in tools]
        schema = _compact(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
        call = f'{_lark_string("<tool_call>")} "\\n" %json{json.dumps(schema)} "\\n" {_lark_string("</tool_call>")}'
        body = 'call ("\\n" call)*' if parallel else "call"
        shortest = tuple(f"<tool_call>\n{shortest_json(s)}\n</tool_call>" for s in schemas)
        return Grammar(f"start: {body}\ncall: {call}\n", "tool_choice", shortest)
    if json_schema is not None:
        closed = closed_objects(json_schema)
        return Grammar(f"start: %json{json.dumps(_compact(closed))}\n", "response_format", (shortest_json(closed),))
    if json_object:
        return Grammar(f'start: %json{json.dumps(_compact({"type": "object"}))}\n', "response_format", ("{}",))
    return None


_DATA_URL = re.compile(r"^data:", re.IGNORECASE)
_REMOTE_URL = re.compile(r"^https?://", re.IGNORECASE)


def check_images(urls: Iterable[str], remote: bool = False) -> int:
    """Validate image URLs (http(s) ones too where ``remote``: ``--image-urls``); the number of images."""
    count = 0
    for url in urls:
        count += 1
        if remote and _REMOTE_URL.match(url):
            continue
        if not _DATA_URL.match(url):
            shown = url[:60]
            raise RequestInvalid(
                "image_url must be a data: URL; this server does not fetch remote images "
                "(serve --image-urls lets vision models fetch them) "
                f"(got {shown}... [{len(url.encode())} bytes])", param="messages",
            )
        comma = url.find(",")  # not partition: the payload may be megabytes, never copied here
        header = url[:comma]
        if comma == -1:
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
