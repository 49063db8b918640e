"""A sequence's output as typed parts: content, reasoning and tool calls (sans-io).

Theory of operation: the model writes its reasoning and its tool calls in its own markup, inside
the text it generates.  ``OutputParser`` is fed that text piece by piece, special tokens visible,
and hands back ``Parts``:

- ``<think>…</think>`` at the start of the output (or a prompt that opened ``<think>`` itself) is
  reasoning;
- Harmony channels (gpt-oss): ``analysis`` is reasoning, ``final`` is content, ``commentary
  to=functions.NAME … <|message|>{args}<|call|>`` is a tool call;
- when the request offers tools, a tool-call block in the model's own format (its chat
  template names it; mlx-lm's parsers read it, ``tool_formats`` the families mlx-lm lacks), or in
  the ``<tool_call>{json}</tool_call>`` form any model may fall back to, becomes a ``ToolCall``.  A block that does not parse, or names a
  tool that was not offered, is released as content, where the guardrails' rescue can still
  find it.

Text that could still grow into a marker is held back (as stop strings are), so no markup leaks
into a streamed piece.  Nothing here does I/O.
"""

from __future__ import annotations

import importlib
import json
import secrets
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs

from .tool_formats import family_format

__all__ = ["MARKUP", "Dialect", "OutputParser", "Parts", "ToolCall", "call_id", "parse_hermes"]

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"

H_CHANNEL, H_MESSAGE, H_END, H_START, H_CALL, H_CONSTRAIN, H_RETURN = (  # Harmony's (gpt-oss)
    "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|constrain|>", "<|return|>")

# mlx-lm's tool parsers, by the name its template inference gives them.
_MLX_PARSERS = (
    "json_tools", "qwen3_coder", "glm47", "mistral", "kimi_k2", "kimi_k3", "pythonic",
    "function_gemma", "gemma4", "longcat", "minimax_m2", "minicpm5", "muse_spark",
)

#: Special-token texts the parser reads; every other special token is dropped from the text.
MARKUP: frozenset[str] = frozenset({
    THINK_START, THINK_END, TOOL_START, TOOL_END,
    H_CHANNEL, H_MESSAGE, H_END, H_START, H_CALL, H_CONSTRAIN,
    "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_call_start|>",
    "<start_function_call>", "<end_function_call>", "<|tool_call>", "<tool_call|>",
    "<longcat_tool_call>", "</longcat_tool_call>", "<minimax:tool_call>", "</minimax:tool_call>",
    "<|tool_call|>", "<|/tool_call|>",
})


@attrs.frozen
class ToolCall:
    """A call the model made: ``arguments`` is JSON text (an object)."""

    index: int
    id: str
    name: str
    arguments: str


@attrs.frozen
class Parts:
    """What became safe to show: content text, reasoning text, finished tool calls."""

    content: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()

    def __add__(self, other: Parts) -> Parts:
        return Parts(self.content + other.content, self.reasoning + other.reasoning,
                     self.calls + other.calls)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


Parse = Callable[[str, Sequence[Mapping[str, Any]] | None], Any]


@attrs.frozen
class Dialect:
    """How a model marks its tool calls and reasoning (read from its template and vocabulary)."""

    tool_start: str = TOOL_START
    tool_end: str = TOOL_END
    parse: Parse | None = None  # the model's own parser (mlx-lm's), tried before the fallbacks
    harmony: bool = False
    name: str = "hermes"

    @classmethod
    def detect(cls, chat_template: str | None, vocab: Collection[str]) -> Dialect:
        if H_CHANNEL in vocab and H_MESSAGE in vocab:
            return cls(harmony=True, name="harmony")
        name = _infer_mlx_parser(chat_template, vocab)
        if family := family_format(chat_template, name):  # formats mlx-lm's parsers lack
            return cls(*family[:3], name=family[3])
        if name is None or name == "json_tools":
            return cls()
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        return cls(module.tool_call_start, module.tool_call_end, module.parse_tool_call, name=name)


def _infer_mlx_parser(chat_template: str | None, vocab: Collection[str]) -> str | None:
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    class _Probe:  # the two things mlx-lm's inference reads from a tokenizer
        def __init__(self) -> None:
            self.chat_template = chat_template

        def get_vocab(self) -> dict[str, int]:
            return dict.fromkeys(vocab, 0)

    try:
        name = _infer_tool_parser(_Probe())
    except Exception:  # an inference that breaks on an odd template: the fallback forms
        return None
    return name if name in _MLX_PARSERS else None


def _exact_arguments(text: str, value: Any) -> str:
    """The JSON text of ``"arguments"`` as the model wrote it, when it can be found; else the
    value serialised."""
    at = text.find('"arguments"')
    if at != -1:
        colon = text.find(":", at + len('"arguments"'))
        if colon != -1:
            start = colon + 1
            while start < len(text) and text[start] in " \t\r\n":
                start += 1
            try:
                found, end = json.JSONDecoder().raw_decode(text, start)
            except json.JSONDecodeError:
                pass
            else:
                if found == value:
                    return text[start:end]
    return json.dumps(value, ensure_ascii=False)


def parse_hermes(text: str) -> list[tuple[str, str]]:
    """``{"name": N, "arguments": {...}}`` (or a list of them): (name, arguments JSON) pairs.
    ``parameters`` is read as ``arguments`` (Llama's spelling); arguments given as a JSON string
    are read as that string's object."""
    stripped = text.strip()
    value = json.loads(stripped)
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError("not a tool call")
        key = "arguments" if "arguments" in item else "parameters"
        args = item.get(key, {})
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            raise ValueError("tool call arguments are not an object")
        exact = _exact_arguments(stripped, args) if len(items) == 1 and key == "arguments" else None
        out.append((item["name"], exact or json.dumps(args, ensure_ascii=False)))
    return out


def _parse_block(dialect: Dialect, inner: str, tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """A tool-call block's calls: the model's own parser, else the JSON and XML forms."""
    attempts: list[Callable[[], list[tuple[str, str]]]] = []
    if dialect.parse is not None:
        attempts.append(lambda: _from_mlx(dialect.parse(inner, list(tools))))  # type: ignore[misc]
    attempts.append(lambda: parse_hermes(inner))
    for name in ("qwen3_coder", "glm47"):
        if dialect.name != name and "<" in inner:
            module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
            attempts.append(lambda m=module: _from_mlx(m.parse_tool_call(inner, list(tools))))
    for attempt in attempts:
        try:
            calls = attempt()
        except Exception:
            continue
        if calls:
            return calls
    return []


def _from_mlx(parsed: Any) -> list[tuple[str, str]]:
    items = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for item in items:
        name, args = item.get("name"), item.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(name, str) or not isinstance(args, dict) or "raw" in args and len(args) == 1:
            raise ValueError("not a tool call")
        out.append((name, json.dumps(args, ensure_ascii=False)))
    return out


class OutputParser:
    """One sequence's markup reader.  ``feed`` a piece of text, get the parts it completed;
    ``finish`` at the end of the sequence for whatever was still held."""

    def __init__(
        self,
        dialect: Dialect,
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        in_reasoning: bool = False,
    ) -> None:
        self.dialect = dialect
        self.tools = list(tools)
        self.names = {_tool_name(t) for t in self.tools} - {None}
        self._held = ""
        self._mode = "reasoning" if in_reasoning else "content"
        self._started = in_reasoning  # past the point where <think> may open
        self._block = ""  # a tool-call block or a Harmony header being read
        self._call_name: str | None = None  # Harmony: the function a commentary call names
        self._opened = dialect.tool_start  # the start marker of the block being read
        self._after = "content"  # the mode a block returns to
        self.calls: list[ToolCall] = []

    # --- markers by state ------------------------------------------------------------------

    def _markers(self) -> tuple[str, ...]:
        d = self.dialect
        if self._mode == "block":
            return (d.tool_end,) if d.tool_end else ()
        if self._mode == "header":
            return (H_MESSAGE,)
        if self._mode == "skip":
            return (H_CHANNEL,)
        if self._mode == "hcall":
            return (H_CALL, H_END)
        if d.harmony:
            # a forced call (constrained decoding) is written as a <tool_call> block
            return (H_CHANNEL, H_END, H_START, H_RETURN, *((TOOL_START,) if self.tools else ()))
        # a call may be written inside reasoning too: it is a call, not reasoning text
        starts = (d.tool_start, *((TOOL_START,) if d.tool_start != TOOL_START else ())) if self.tools else ()
        if self._mode == "reasoning":
            return (THINK_END, *starts)
        return (*((THINK_START,) if not self._started else ()), *starts)

    # --- feeding ---------------------------------------------------------------------------

    def feed(self, text: str) -> Parts:
        out = Parts()
        buf = self._held + text
        self._held = ""
        while buf:
            markers = self._markers()
            at, marker = _earliest(buf, markers)
            if marker is None:
                keep = _partial_tail(buf, markers)
                out += self._emit(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                return out
            out += self._emit(buf[:at])
            buf = buf[at + len(marker) :]
            out += self._marker(marker)
        return out

    def finish(self) -> Parts:
        """The end of the sequence: release what was held, close an open block."""
        held, self._held = self._held, ""
        out = self._emit(held)
        if self._mode == "block":
            out += self._close_block(self.dialect.tool_start)
        elif self._mode == "hcall":
            out += self._close_harmony_call()
        elif self._mode == "header":
            self._block = ""
        return out

    def _emit(self, text: str) -> Parts:
        if not text:
            return Parts()
        if self._mode in ("block", "hcall", "header"):
            self._block += text
            return Parts()
        if self._mode == "skip":
            return Parts()
        if self._mode == "reasoning":
            return Parts(reasoning=text)
        if not self._started and text.strip():
            self._started = True
        return Parts(content=text)

    def _marker(self, marker: str) -> Parts:
        d = self.dialect
        if self._mode == "block":
            return self._close_block(d.tool_start, d.tool_end)
        if self._mode == "header":
            return self._open_channel()
        if self._mode == "skip":
            self._mode = "header"
            return Parts()
        if self._mode == "hcall":
            return self._close_harmony_call()
        if marker == THINK_START:
            self._mode, self._started = "reasoning", True
        elif marker == THINK_END:
            self._mode, self._started = "content", True
        elif marker == H_CHANNEL:
            self._mode, self._block = "header", ""
        elif marker in (H_END, H_RETURN):
            self._mode = "content"
        elif marker == H_START:
            self._mode = "skip"
        else:  # a tool-call start; after the block, back to content or reasoning
            self._after, self._mode, self._block, self._started = self._mode, "block", "", True
            self._opened = marker
        return Parts()

    # --- tool calls ------------------------------------------------------------------------

    def _close_block(self, start: str, end: str = "") -> Parts:
        inner, self._block = self._block, ""
        self._mode, opened = self._after, self._opened
        dialect = self.dialect if opened == self.dialect.tool_start else Dialect()
        calls = _parse_block(dialect, inner, self.tools)
        if not calls or any(name not in self.names for name, _ in calls):
            if self._mode == "reasoning":
                return Parts(reasoning=f"{opened}{inner}{end}")
            return Parts(content=f"{opened}{inner}{end}")  # released for the rescue to read
        return Parts(calls=tuple(self._call(name, args) for name, args in calls))

    def _call(self, name: str, arguments: str) -> ToolCall:
        call = ToolCall(len(self.calls), call_id(), name, arguments)
        self.calls.append(call)
        return call

    # --- Harmony ---------------------------------------------------------------------------

    def _open_channel(self) -> Parts:
        header, self._block = self._block.strip(), ""
        channel = header.split()[0] if header else ""
        target = next((w for w in header.split() if w.startswith("to=")), None)
        if target is not None:
            self._call_name = target[3:].removeprefix("functions.")
            self._mode = "hcall"
        elif channel == "analysis":
            self._mode = "reasoning"
        else:
            self._mode = "content"
        return Parts()

    def _close_harmony_call(self) -> Parts:
        args, self._block = self._block.strip(), ""
        name, self._call_name = self._call_name or "", None
        self._mode = "content"
        try:
            ok = isinstance(json.loads(args), dict)
        except json.JSONDecodeError:
            ok = False
        if not ok or name not in self.names:
            return Parts(content=args)
        return Parts(calls=(self._call(name, args),))


def _tool_name(tool: Mapping[str, Any]) -> str | None:
    function = tool.get("function", tool)
    name = function.get("name") if isinstance(function, Mapping) else None
    return name if isinstance(name, str) else None


def _earliest(buf: str, markers: Iterable[str]) -> tuple[int, str | None]:
    best, found = len(buf) + 1, None
    for m in markers:
        at = buf.find(m)
        if at != -1 and at < best:
            best, found = at, m
    return best, found


def _partial_tail(buf: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best
