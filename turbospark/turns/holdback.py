"""What of a live turn's content may be the start of a tool call, held back until decided
(sans-io).

Theory of operation: with tools offered, the output parser already holds the model's own call
markup until its block closes.  What it releases as content may still hold a call the
guardrails would rescue: a bare JSON object (``{"name": .., "arguments": ..}``, or a list of
them), another model's markup (``<tool_call>``, ``<function=``, ``<invoke name=``,
``<|python_tag|>``, ``[TOOL_CALLS]``, Kimi's and MiniMax's sections, Gemma's ``call:NAME{`` and
```` ```tool_code ```` blocks).
``Holdback`` is fed content and returns ``Release(text)`` for what cannot begin such a span,
and ``Span(text)`` for a span that closed (its object balanced, its closing marker written),
for the caller to rescue or release.  A span is held from its first character; one that stops
looking like a start (``{`` not followed by a quoted key, a marker that goes another way) is
released at once, so prose and code stream with no more than a few characters of delay.
``finish`` hands back what is still held at the end of the turn.
"""

from __future__ import annotations

import attrs

from ..model.call_reader import JsonEnd

__all__ = ["Holdback", "Release", "Span"]

# marker -> the marker that closes its span; None: a JSON value follows and closes it
_MARKUPS: dict[str, str | None] = {
    "<tool_call>": "</tool_call>",
    "<function=": "</function>",
    "<invoke name=": "</invoke>",
    "<minimax:tool_call>": "</minimax:tool_call>",
    "<|tool_calls_section_begin|>": "<|tool_calls_section_end|>",
    "<|tool_call_begin|>": "<|tool_call_end|>",
    "<|python_tag|>": None,
    "[TOOL_CALLS]": None,
    "```tool_code": "```",  # Gemma's block of Python calls
}
_GEMMA = "call:"
_WS = " \t\r\n"
_WAIT, _NO = -1, -2  # a span's end: not yet known / not a span at all


@attrs.frozen
class Release:
    text: str


@attrs.frozen
class Span:
    text: str


@attrs.define
class _Scan:
    """A held span being read.  Once its value has begun (or, for a closing marker, at once) it
    reads each new piece alone (``advance``), so a long span costs no more than its length."""

    kind: str  # "json", "marker" (a JSON value follows the marker), "closer", "gemma", "partial"
    closer: str = ""
    at: int = 0  # where its value (or, for "closer", its body) starts, from the span's start
    started: bool = False  # the value has begun: read piece by piece from now on
    depth: int = 0  # "gemma": braces open
    value: JsonEnd = attrs.field(factory=JsonEnd)  # "json", "marker": where the value closes
    tail: str = ""  # "closer": the end of what was read, where the closer may have begun

    def end(self, text: str) -> int:
        """Where the span ends in ``text`` (its whole text so far); ``_WAIT`` or ``_NO``."""
        if self.kind == "partial":
            return _WAIT
        if self.kind != "closer":
            at = self._value_start(text)
            if at < 0:
                return at
            self.at = at
        self.started = True
        return self.advance(text[self.at :], self.at)

    def advance(self, piece: str, offset: int) -> int:
        """Read ``piece``, which starts ``offset`` characters into the span: where the span
        ends, or ``_WAIT``."""
        if self.kind == "closer":
            seen = self.tail + piece
            found = seen.find(self.closer)
            if found != -1:
                return offset - len(self.tail) + found + len(self.closer)
            self.tail = seen[max(0, len(seen) - len(self.closer) + 1) :]
            return _WAIT
        if self.kind == "gemma":
            for i, ch in enumerate(piece):
                self.depth += {"{": 1, "}": -1}.get(ch, 0)
                if self.depth == 0:
                    return offset + i + 1
            return _WAIT
        end = self.value.feed(piece)
        return _WAIT if end == -1 else offset + end

    def _value_start(self, text: str) -> int:
        at = self.at
        if self.kind == "gemma":
            if at == len(text):
                return _WAIT
            if not (text[at].isalpha() or text[at] == "_"):
                return _NO
            while at < len(text) and (text[at].isalnum() or text[at] in "_.-"):
                at += 1
        while at < len(text) and text[at] in _WS:
            at += 1
        if at == len(text):
            return _WAIT
        if self.kind == "gemma":
            return at if text[at] == "{" else _NO
        if text[at] not in "{[":
            return _NO
        # the first thing inside must be a quoted key ({) or an object ([)
        inner = at + 1
        while inner < len(text) and text[inner] in _WS:
            inner += 1
        if inner == len(text):
            return _WAIT
        return at if text[inner] == ('"' if text[at] == "{" else "{") else _NO


def _scan(text: str, at: int) -> _Scan | None:
    """How to read a span that may start at ``text[at]`` (positions from the span's start):
    None when none can start there; kind ``"partial"`` while a marker is still being written
    at the end of ``text``."""
    for marker, closer in (*_MARKUPS.items(), (_GEMMA, "")):
        if text.startswith(marker, at):
            if marker == _GEMMA:
                return _Scan("gemma", at=len(marker))
            if closer is None:
                return _Scan("marker", at=len(marker))
            return _Scan("closer", closer, at=len(marker))
        if marker.startswith(text[at : at + len(marker)]):
            return _Scan("partial")
    return _Scan("json") if text[at] in "{[" else None


@attrs.define
class Holdback:
    """One choice's content, with what may begin a call held back until it is decided."""

    held: list[str] = attrs.Factory(list)  # the held span, in the pieces it came in
    size: int = 0
    scan: _Scan | None = None  # how the held span is being read

    def feed(self, text: str) -> list[Release | Span]:
        scan = self.scan
        if scan is not None and scan.started:  # a span being read: only the new piece
            end = scan.advance(text, self.size)
            if end == _WAIT:
                self.held.append(text)
                self.size += len(text)
                return []
            whole = "".join(self.held) + text
            self.held, self.size, self.scan = [], 0, None
            return [Span(whole[:end]), *self.feed(whole[end:])]
        out: list[Release | Span] = []
        buf = "".join(self.held) + text
        self.held, self.size, self.scan = [], 0, None
        start = at = 0  # released up to start; looking at at
        while at < len(buf):
            if scan is None or scan.kind == "partial":
                scan = _scan(buf, at) if buf[at] in "{[<c`" else None
                if scan is None:
                    at += 1
                    continue
            end = scan.end(buf[at:] if at else buf)
            if end == _NO:
                scan = None
                at += 1
                continue
            if at > start:
                out.append(Release(buf[start:at]))
            if end == _WAIT:
                self.held, self.size, self.scan = [buf[at:]], len(buf) - at, scan
                return out
            out.append(Span(buf[at : at + end]))
            start = at = at + end
            scan = None
        if start < len(buf):
            out.append(Release(buf[start:]))
        return out

    def finish(self) -> str:
        """What is still held at the end of the turn (an unfinished span), given up."""
        held = "".join(self.held)
        self.held, self.size, self.scan = [], 0, None
        return held
