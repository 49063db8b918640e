"""Ollama's Modelfile, read and written back (sans-io).

A Modelfile is one instruction a line, case-insensitive: ``FROM`` (the base model), ``SYSTEM``,
``TEMPLATE``, ``PARAMETER name value`` (repeatable; ``stop`` accumulates), ``LICENSE``
(repeatable), ``MESSAGE role content`` (repeatable) and ``ADAPTER`` (a LoRA adapter's path: an
mlx-lm adapter directory or a GGUF LoRA; the derived model carries it, decision 0046).  A value is the rest of the line, or ``"quoted"``, or
``\"\"\"triple quoted\"\"\"`` across lines.  ``#`` starts a comment line.

``ModelSpec`` is what both forms of Ollama's create (a Modelfile, or ``/api/create``'s JSON)
come to; ``render`` writes a spec back as the Modelfile ``/api/show`` prints.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

__all__ = ["ModelSpec", "ModelfileError", "parse", "parameter_value", "render"]

_ROLES = ("system", "user", "assistant", "tool")
_INT_PARAMETERS = {"num_ctx", "num_predict", "top_k", "seed", "repeat_last_n", "num_keep", "num_batch", "num_gpu",
                   "num_thread", "mirostat"}  # fmt: skip


class ModelfileError(ValueError):
    """A Modelfile or create request that cannot make a model (the message says why)."""


@attrs.frozen
class ModelSpec:
    """A derived model: its base and what it sets."""

    base: str
    system: str | None = None
    template: str | None = None
    parameters: dict[str, Any] = attrs.field(factory=dict)
    licenses: tuple[str, ...] = ()
    messages: tuple[dict[str, str], ...] = ()
    adapter: str | None = None  # a LoRA adapter's path, applied to every request of the model


def parameter_value(name: str, value: Any) -> Any:
    """A ``PARAMETER``'s value in its type (Ollama's options: ints, floats, booleans, strings)."""
    if not isinstance(value, str):
        return value
    if name in _INT_PARAMETERS:
        try:
            return int(value)
        except ValueError:
            raise ModelfileError(f"PARAMETER {name} must be an integer, got {value!r}") from None
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return float(value)
    except ValueError:
        return value


def _values(text: str) -> list[tuple[int, str, str]]:
    """(line number, instruction, raw value) for each instruction."""
    out: list[tuple[int, str, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        start = i + 1
        i += 1
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if '"""' in rest:
            opening = rest.index('"""')
            head, body = rest[:opening], rest[opening + 3:]
            while '"""' not in body:
                if i >= len(lines):
                    raise ModelfileError(f"line {start}: a \"\"\" that is never closed")
                body += "\n" + lines[i]
                i += 1
            body, _, after = body.partition('"""')
            if after.strip():
                raise ModelfileError(f"line {start}: text after the closing \"\"\"")
            rest = head + json.dumps(body)  # quoted from here on: one form to read below
        out.append((start, word.upper(), rest))
    return out


def _unquote(text: str, where: str) -> str:
    text = text.strip()
    if text.startswith('"'):
        try:
            value = json.loads(text)
        except ValueError:
            raise ModelfileError(f"{where}: an unterminated or malformed quoted value") from None
        if not isinstance(value, str):
            raise ModelfileError(f"{where}: a malformed quoted value")
        return value
    return text


def parse(text: str) -> ModelSpec:
    """The spec a Modelfile describes; ``ModelfileError`` when it is malformed or has no ``FROM``."""
    base: str | None = None
    fields: dict[str, Any] = {"parameters": {}, "licenses": [], "messages": []}
    for line, word, rest in _values(text):
        where = f"line {line}"
        if word == "FROM":
            base = _unquote(rest, where)
        elif word in ("SYSTEM", "TEMPLATE"):
            fields[word.lower()] = _unquote(rest, where)
        elif word == "LICENSE":
            fields["licenses"].append(_unquote(rest, where))
        elif word == "PARAMETER":
            name, _, value = rest.partition(" ")
            if not name or not value.strip():
                raise ModelfileError(f"{where}: PARAMETER needs a name and a value")
            name = name.lower()
            value = parameter_value(name, _unquote(value, where))
            if name == "stop":
                fields["parameters"].setdefault("stop", []).append(str(value))
            else:
                fields["parameters"][name] = value
        elif word == "MESSAGE":
            role, _, content = rest.partition(" ")
            if role.lower() not in _ROLES:
                raise ModelfileError(f"{where}: MESSAGE role must be one of {', '.join(_ROLES)}, got {role!r}")
            fields["messages"].append({"role": role.lower(), "content": _unquote(content, where)})
        elif word == "ADAPTER":
            if "adapter" in fields:
                raise ModelfileError(f"{where}: one ADAPTER a model")
            fields["adapter"] = _unquote(rest, where)
        else:
            raise ModelfileError(f"{where}: unknown instruction {word!r}")
    if not base:
        raise ModelfileError("no FROM line: a Modelfile must name its base model")
    return ModelSpec(
        base=base, system=fields.get("system"), template=fields.get("template"), parameters=fields["parameters"],
        licenses=tuple(fields["licenses"]), messages=tuple(fields["messages"]), adapter=fields.get("adapter"),
    )


def _quoted(text: str) -> str:
    if "\n" in text or '"' in text or text != text.strip():
        if '"""' in text:
            return json.dumps(text)
        return f'"""{text}"""'
    return text


def _parameter(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value) if re.search(r"\s|\"", value) or not value else value
    return str(value)


def render(spec: ModelSpec, *, name: str) -> str:
    """The Modelfile ``/api/show`` prints: what made model ``name``."""
    lines = [f"# Modelfile generated by \"turbospark\"\n# To build a new Modelfile based on this, replace FROM with:\n# FROM {name}\n",
             f"FROM {spec.base}"]  # fmt: skip
    if spec.adapter is not None:
        lines.append(f"ADAPTER {spec.adapter}")
    if spec.template is not None:
        lines.append(f"TEMPLATE {_quoted(spec.template)}")
    if spec.system is not None:
        lines.append(f"SYSTEM {_quoted(spec.system)}")
    for key, value in spec.parameters.items():
        for one in value if isinstance(value, list) else [value]:
            lines.append(f"PARAMETER {key} {_parameter(key, one)}")
    for message in spec.messages:
        lines.append(f"MESSAGE {message['role']} {_quoted(message['content'])}")
    for text in spec.licenses:
        lines.append(f"LICENSE {_quoted(text)}")
    return "\n".join(lines) + "\n"
