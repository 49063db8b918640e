"""Tool-call guardrails: rescue calls the markup parser missed, validate arguments, decide on a
retry (sans-io).

Theory of operation: a turn that offered tools ends with the parser's calls and the content
text.  ``inspect`` gives the verdict:

1. no tools offered: accept;
2. no calls parsed: try the rescue strategies on the content (bare JSON objects, Qwen/ChatML XML,
   Mistral ``[TOOL_CALLS]``, Llama ``<|python_tag|>``, GLM, Gemma's ``call:`` and ``tool_code``
   blocks, Kimi, MiniMax); the first that
   finds calls to offered tools wins;
3. still none: retry with a nudge when ``tool_choice`` demanded a call, else accept (prose is a
   fair answer under ``auto``);
4. validate every call's arguments against its tool's JSON Schema; errors become one corrective
   message and a retry.

The route runs the loop (at most ``retries`` more turns, then the last answer stands).

A forced call (``tool_choice`` required or named: the grammar writes nothing but calls) that the
budget cut short is no matter for retries: ``inspect`` with ``truncated`` hands back the calls
as far as they got (``cut_short``), never the markup as content, and the route answers
``finish_reason: "length"`` with them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jsonschema

from ..model.output import ToolCall, parse_hermes

__all__ = [
    "Accept",
    "Guardrails",
    "Rescued",
    "Retry",
    "Verdict",
    "cut_short",
    "inspect",
    "rescue",
    "truncated_call",
    "validate",
]


@attrs.frozen
class Guardrails:
    """``--guardrails on|off``: rescue missed calls, validate arguments, retries allowed."""

    rescue: bool = True
    validate: bool = True
    retries: int = 1

    @property
    def active(self) -> bool:
        return self.rescue or self.validate

    @classmethod
    def off(cls) -> Guardrails:
        return cls(rescue=False, validate=False, retries=0)


@attrs.frozen
class Accept:
    pass


@attrs.frozen
class Rescued:
    """Calls found in the text: they replace it (the markup is not content)."""

    calls: tuple[ToolCall, ...]


@attrs.frozen
class Retry:
    nudge: str
    calls: tuple[ToolCall, ...] = ()  # what the model called, for the assistant turn replayed


Verdict = Accept | Rescued | Retry


def _name(tool: Mapping[str, Any]) -> str | None:
    function = tool.get("function", tool)
    return function.get("name") if isinstance(function, Mapping) else None


def _schema(tool: Mapping[str, Any]) -> Any:
    function = tool.get("function", tool)
    return function.get("parameters") if isinstance(function, Mapping) else None


# --- rescue ---------------------------------------------------------------------------------

def _bare_json(text: str) -> list[tuple[str, str]]:
    """Every ``{"name": .., "arguments": {..}}`` object anywhere in the text (also in a
    ``[TOOL_CALLS]`` list or after ``<|python_tag|>``)."""
    decoder = json.JSONDecoder()
    out: list[tuple[str, str]] = []
    at = 0
    while (start := _next_json(text, at)) != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            at = start + 1
            continue
        try:
            out.extend(parse_hermes(text[start:end]))
        except (ValueError, TypeError):
            pass
        at = end
    return out


def _next_json(text: str, at: int) -> int:
    brace, bracket = text.find("{", at), text.find("[", at)
    found = [i for i in (brace, bracket) if i != -1]
    return min(found) if found else -1


def _mlx(parser: str, pattern: str) -> Callable[[str, list[Any]], list[tuple[str, str]]]:
    """A strategy from one of mlx-lm's parsers, applied to every span ``pattern`` finds."""

    def strategy(text: str, tools: list[Any]) -> list[tuple[str, str]]:
        import importlib

        module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
        out = []
        for span in re.findall(pattern, text, re.DOTALL):
            try:
                parsed = module.parse_tool_call(span, tools)
            except Exception:
                continue
            for item in parsed if isinstance(parsed, list) else [parsed]:
                args = item.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        continue
                if isinstance(item.get("name"), str) and isinstance(args, dict) and "raw" not in args:
                    out.append((item["name"], json.dumps(args, ensure_ascii=False)))
        return out

    return strategy


_GEMMA = re.compile(r"call:([A-Za-z_][\w.-]*)\s*\{")


def _gemma(text: str, tools: list[Any]) -> list[tuple[str, str]]:
    """``call:NAME{"k": v}`` or ``call:NAME{k: v, ...}`` (a balanced-brace scan)."""
    out = []
    for match in _GEMMA.finditer(text):
        start = match.end() - 1
        depth, end = 0, -1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                end = i + 1
                break
        if end == -1:
            continue
        body = text[start:end]
        try:
            args = json.loads(body)
        except json.JSONDecodeError:
            quoted = re.sub(r"([{,]\s*)([A-Za-z_]\w*)\s*:", r'\1"\2":', body)
            try:
                args = json.loads(quoted)
            except json.JSONDecodeError:
                continue
        if isinstance(args, dict):
            out.append((match.group(1), json.dumps(args, ensure_ascii=False)))
    return out


_TOOL_CODE = re.compile(r"```tool_code\s*\n(.*?)```", re.DOTALL)


def _tool_code(text: str, tools: list[Any]) -> list[tuple[str, str]]:
    """Gemma's ```` ```tool_code ```` blocks of Python calls (``get_weather(city="Oslo")``), read
    with mlx-lm's pythonic parser."""
    pythonic = _mlx("pythonic", r"(.+)")
    out = []
    for block in _TOOL_CODE.findall(text):
        calls = [line.strip() for line in block.strip().splitlines() if line.strip()]
        out += pythonic("[" + ", ".join(calls) + "]", tools)
    return out


_STRATEGIES: tuple[Callable[[str, list[Any]], list[tuple[str, str]]], ...] = (
    _mlx("glm47", r"([\w.-]+\s*(?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)+)"),
    _mlx("minimax_m2", r"(<invoke name=.*?</invoke>)"),
    _mlx("qwen3_coder", r"(<function=.*?</function>)"),
    _gemma,
    _tool_code,
    _mlx("kimi_k2", r"(<\|tool_call_begin\|>.*?<\|tool_call_end\|>)"),
    lambda text, tools: _bare_json(text),
)


def rescue(text: str, tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Calls to offered tools written in any known markup, in order of the strategies."""
    names = {_name(t) for t in tools}
    for strategy in _STRATEGIES:
        try:
            found = strategy(text, list(tools))
        except Exception:
            continue
        calls = [(n, a) for n, a in found if n in names]
        if calls:
            return calls
    return []


# --- a forced call cut short ---------------------------------------------------------------

# What the forced-call grammar writes (structured.grammar_for): ``<tool_call>\n{"name":"N",
# "arguments":{..}}\n</tool_call>``, name first.  Whitespace is tolerated, the order is not.
_CUT_NAME = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]*)(")?')
_CUT_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


def truncated_call(
    text: str, tools: Sequence[Mapping[str, Any]], *, index: int, new_id: Callable[[], str]
) -> ToolCall | None:
    """The last call in ``text`` (the forced-call markup a budget cut short), as far as it
    got: its name (a name cut short is completed when one offered tool starts with it) and its
    arguments as written so far (JSON text, unfinished, as OpenAI returns a call cut by
    ``max_tokens``; ``""`` when the budget ended before them).  None when no name can be told."""
    at = text.rfind("<tool_call>")
    found = _CUT_NAME.match(text, at) if at != -1 else None
    if found is None:
        return None
    written, closed = found.group(1), found.group(2) is not None
    names = [n for t in tools if isinstance(n := _name(t), str)]
    matching = [n for n in names if (n == written if closed else n.startswith(written))]
    if len(matching) != 1:
        return None
    arguments = ""
    if closed and (after := _CUT_ARGUMENTS.match(text, found.end())) is not None:
        rest = text[after.end():]
        try:
            _, end = json.JSONDecoder().raw_decode(rest)
            arguments = rest[:end]  # finished; the budget ended in the closing markup
        except json.JSONDecodeError:
            arguments = rest
    return ToolCall(index, new_id(), matching[0], arguments)


def cut_short(
    content: str, calls: Sequence[ToolCall], tools: Sequence[Mapping[str, Any]], *, new_id: Callable[[], str]
) -> tuple[str, tuple[ToolCall, ...]]:
    """A forced-call turn that the budget ended (``finish_reason`` ``length``): no content
    (under the forced-call grammar every character was call markup), the calls it finished,
    then the one it was writing, as far as it got (``truncated_call``)."""
    partial = truncated_call(content, tools, index=len(calls), new_id=new_id)
    return "", (*calls, *((partial,) if partial is not None else ()))


# --- validation -----------------------------------------------------------------------------

def validate(calls: Sequence[ToolCall], tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """One message per call that is wrong: an unknown tool, or arguments its schema refuses."""
    by_name = {_name(t): t for t in tools}
    messages = []
    for call in calls:
        tool = by_name.get(call.name)
        if tool is None:
            offered = ", ".join(f"`{n}`" for n in by_name if n)
            messages.append(f"There is no tool named `{call.name}`; the tools are {offered}.")
            continue
        schema = _schema(tool)
        if not isinstance(schema, Mapping):
            continue
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            errors = ["the arguments must be a JSON object"]
        else:
            try:
                errors = [_error(e) for e in jsonschema.Draft202012Validator(schema).iter_errors(args)]
            except Exception:  # a schema jsonschema cannot apply (checked at the door; belt and braces)
                continue
        if errors:
            messages.append(f"Your call to `{call.name}` had invalid arguments: {'; '.join(errors)}.")
    return messages


def _error(error: jsonschema.ValidationError) -> str:
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


# --- the verdict ----------------------------------------------------------------------------

RETRY_NUDGE = (
    "You must answer with a tool call. Call one of the offered tools, in the tool-call format "
    "given, with arguments that match its parameters."
)


def inspect(
    *,
    content: str,
    calls: Sequence[ToolCall],
    tools: Sequence[Mapping[str, Any]],
    call_required: bool,
    guardrails: Guardrails,
    new_id: Callable[[], str],
    truncated: bool = False,
) -> Verdict:
    """The verdict on one choice.  ``truncated``: the budget ended it (``finish_reason``
    ``length``); a forced call it cut short comes back as far as it got (``cut_short``), with
    or without the guardrails, and is not retried."""
    if truncated and call_required and tools:
        return Rescued(cut_short(content, calls, tools, new_id=new_id)[1])
    if not tools or not guardrails.active:
        return Accept()
    rescued: tuple[ToolCall, ...] = ()
    if not calls and guardrails.rescue:
        rescued = tuple(
            ToolCall(i, new_id(), name, args) for i, (name, args) in enumerate(rescue(content, tools))
        )
        calls = rescued
    if not calls:
        return Retry(RETRY_NUDGE) if call_required else Accept()
    if guardrails.validate and (messages := validate(calls, tools)):
        return Retry(" ".join(messages) + " Call the tool again with corrected arguments.", tuple(calls))
    return Rescued(rescued) if rescued else Accept()
