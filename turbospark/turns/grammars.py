"""Grammars beyond JSON: the peers' request fields for regex, choice lists and context-free
grammars, as one ``Grammar`` for the constraint engine (sans-io).

llama.cpp's ``grammar`` (GBNF, or Lark) and ``json_schema``; vLLM's ``structured_outputs``
(``regex``, ``choice``, ``grammar``, ``json``, ``json_object``) and its older ``guided_regex``,
``guided_choice``, ``guided_grammar``, ``guided_json`` names.  GBNF becomes Lark through
llguidance's own converter; a regex becomes a Lark token.  A grammar that does not convert is a
400 here; one that does not compile is a 400 from the model thread (``Grammars.compile``),
before any prefill, naming llguidance's error either way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
from llguidance.gbnf_to_lark import any_to_lark

from ..errors import RequestInvalid
from ..model.constraint import Grammar
from .structured import grammar_for

__all__ = ["demanded_grammar", "grammar_demand", "peer_grammar"]

# vLLM's structured_outputs hints this server already follows (compact JSON, closed objects) or
# that name its own backends: accepted, nothing to do
_HINTS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "_backend"}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def grammar_demand(
    *,
    grammar: Any = None,
    json_schema: Any = None,
    structured_outputs: Any = None,
    guided_json: Any = None,
    guided_regex: Any = None,
    guided_choice: Any = None,
    guided_grammar: Any = None,
) -> Grammar | None:
    """The grammar the request's peer fields demand, or None.  At most one may be given."""
    given: list[tuple[str, str, Any]] = []  # (field, kind, value)
    if grammar is not None:
        given.append(("grammar", "grammar", grammar))
    if json_schema is not None:
        given.append(("json_schema", "json", json_schema))
    if structured_outputs is not None:
        if not isinstance(structured_outputs, Mapping):
            raise RequestInvalid("structured_outputs must be an object", param="structured_outputs")
        unknown = sorted(set(structured_outputs) - set(_KINDS) - _HINTS)
        if unknown:
            raise RequestInvalid(
                f"structured_outputs: {', '.join(unknown)} not supported; use one of {', '.join(_KINDS)}",
                param="structured_outputs",
            )
        for kind in _KINDS:
            value = structured_outputs.get(kind)
            if value is not None and value is not False:
                given.append((f"structured_outputs.{kind}", kind, value))
    for field, kind, value in (
        ("guided_json", "json", guided_json), ("guided_regex", "regex", guided_regex),
        ("guided_choice", "choice", guided_choice), ("guided_grammar", "grammar", guided_grammar),
    ):
        if value is not None:
            given.append((field, kind, value))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(field for field, _, _ in given)
        raise RequestInvalid(f"give one output constraint, not several: {names}", param=given[1][0])
    field, kind, value = given[0]
    return _one(field, kind, value)


_FIELDS = ("grammar", "json_schema", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def peer_grammar(body: Any) -> Grammar | None:
    """``grammar_demand`` of a request body that carries the peer fields as attributes."""
    return grammar_demand(**{name: getattr(body, name, None) for name in _FIELDS})


def demanded_grammar(other: Grammar | None, demand: Grammar | None) -> Grammar | None:
    """The request's grammar: the peer field's, or ``other`` (``response_format``, forced tool
    calls); both at once is a 400."""
    if other is not None and demand is not None:
        raise RequestInvalid(
            f"{demand.what} cannot be combined with {other.what}; give one output constraint", param=demand.what
        )
    return demand or other


def _one(field: str, kind: str, value: Any) -> Grammar:
    if kind == "json":
        schema = _schema(field, value)
        return attrs.evolve(grammar_for(json_schema=schema), what=field)  # type: ignore[misc]
    if kind == "json_object":
        return attrs.evolve(grammar_for(json_object=True), what=field)  # type: ignore[misc]
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise RequestInvalid(f"{field} must be a non-empty string", param=field)
        return Grammar(f"start: /{_slashed(value)}/\n", field, kind="grammar")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestInvalid(f"{field} must be a non-empty list of non-empty strings", param=field)
        return Grammar(
            "start: " + " | ".join(json.dumps(c) for c in value) + "\n", field, tuple(value), kind="grammar"
        )
    if not isinstance(value, str) or not value.strip():
        raise RequestInvalid(f"{field} must be a non-empty string (GBNF or Lark)", param=field)
    try:
        lark = any_to_lark(value)
    except Exception as exc:  # llguidance's converter raises plain Exception for unknown rules
        raise RequestInvalid(f"{field}: the grammar does not compile: {exc}", param=field) from None
    return Grammar(lark, field, kind="grammar")


def _schema(field: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):  # vLLM accepts the schema as JSON text too
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RequestInvalid(f"{field} is not valid JSON: {exc.msg}", param=field) from None
    if not isinstance(value, dict):
        raise RequestInvalid(f"{field} must be a JSON Schema object", param=field)
    return value


def _slashed(regex: str) -> str:
    """A regex as the body of a Lark ``/…/`` token: its unescaped slashes escaped."""
    out, escaped = [], False
    for ch in regex:
        if ch == "/" and not escaped:
            out.append("\\/")
        else:
            out.append(ch)
        escaped = ch == "\\" and not escaped
    return "".join(out)
