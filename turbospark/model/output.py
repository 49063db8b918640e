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

import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from .call_reader import CallPiece, JsonCallReader
from .dialect import H_CHANNEL, H_MESSAGE, TOOL_END, TOOL_START, Dialect, parse_block, parse_hermes

__all__ = ["MARKUP", "CallPiece", "Dialect", "OutputParser", "Parts", "ToolCall", "call_id", "parse_hermes"]

THINK_START, THINK_END = "<think>", "</think>"
H_END, H_START, H_CALL, H_CONSTRAIN, H_RETURN = (  # Harmony's (gpt-oss), beside H_CHANNEL, H_MESSAGE
    "<|end|>", "<|start|>", "<|call|>", "<|constrain|>", "<|return|>")

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
    """What became safe to show: content text, reasoning text, the arguments of calls being
    written (``writing``), finished tool calls."""

    content: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()
    writing: tuple[CallPiece, ...] = ()

    def __add__(self, other: Parts) -> Parts:
        return Parts(self.content + other.content, self.reasoning + other.reasoning,
                     self.calls + other.calls, self.writing + other.writing)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls or self.writing)


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


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
        self._reader: JsonCallReader | None = None  # the JSON call of the block being read
        self._live: CallPiece | None = None  # a call decided while it is written
        self._live_text = ""  # its arguments, as given out so far
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
            return self._writing(text)
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
            self._opened = marker  # one JSON call in a <tool_call> block may be read as written
            self._reader = JsonCallReader(self.names) if marker == TOOL_START else None
        return Parts()

    def _writing(self, text: str) -> Parts:
        """A call decided while it is written gives out its arguments as they come."""
        if self._mode == "block" and self._reader is not None:
            self._reader.feed(text)
            if self._live is None and self._reader.name is not None:
                self._live = CallPiece(len(self.calls), call_id(), self._reader.name, "")
            written = self._reader.arguments
        elif self._mode == "hcall" and self._live is not None:
            written = self._block.strip()  # grows only at its end: the stripped text so far
        else:
            return Parts()
        if self._live is None or len(written) == len(self._live_text):
            return Parts()
        piece = attrs.evolve(self._live, text=written[len(self._live_text):])
        self._live_text = written
        return Parts(writing=(piece,))

    def _close_live(self) -> Parts:
        """The end of a call given out as it was written: it stands as written (a block that
        then fails to parse, or that the budget cut, is that call as far as it got)."""
        assert self._live is not None
        live, arguments = self._live, self._live_text
        self._live, self._live_text, self._reader = None, "", None
        return Parts(calls=(self._call(live.name, arguments, live.id),))

    # --- tool calls ------------------------------------------------------------------------

    def _close_block(self, start: str, end: str = "") -> Parts:
        inner, self._block = self._block, ""
        self._mode, opened = self._after, self._opened
        if self._live is not None:
            return self._close_live()
        self._reader = None
        dialect = self.dialect if opened == self.dialect.tool_start else Dialect()
        calls = parse_block(dialect, inner, self.tools)
        if not calls or any(name not in self.names for name, _ in calls):
            if self._mode == "reasoning":
                return Parts(reasoning=f"{opened}{inner}{end}")
            return Parts(content=f"{opened}{inner}{end}")  # released for the rescue to read
        return Parts(calls=tuple(self._call(name, args) for name, args in calls))

    def _call(self, name: str, arguments: str, id: str | None = None) -> ToolCall:
        call = ToolCall(len(self.calls), id or call_id(), name, arguments)
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
            if self._call_name in self.names:
                self._live = CallPiece(len(self.calls), call_id(), self._call_name, "")
        elif channel == "analysis":
            self._mode = "reasoning"
        else:
            self._mode = "content"
        return Parts()

    def _close_harmony_call(self) -> Parts:
        args, self._block = self._block.strip(), ""
        name, self._call_name = self._call_name or "", None
        self._mode = "content"
        if self._live is not None:
            return self._close_live()
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
