"""What of a live turn's content may be the start of a tool call, held back until decided
(sans-io).

Theory of operation: with tools offered, the output parser already holds the model's own call
markup until its block closes.  What it releases as content may still hold a call the
guardrails would rescue: a bare JSON object (``{"name": .., "arguments": ..}``, or a list of
them), another model's markup (``<tool_call>``, ``<function=``, ``<invoke name=``,
``<|python_tag|>``, ``[TOOL_CALLS]``, Kimi's and MiniMax's sections, Gemma's ``call:NAME{``).
``Holdback`` is fed content and returns ``Release(text)`` for what cannot begin such a span,
and ``Span(text)`` for a span that closed (its object balanced, its closing marker written),
for the caller to rescue or release.  A span is held from its first character; one that stops
looking like a start (``{`` not followed by a quoted key, a marker that goes another way) is
released at once, so prose and code stream with no more than a few characters of delay.
``finish`` hands back what is still held at the end of the turn.
"""

from __future__ import annotations

import attrs

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
    """A held span being read, incrementally: ``at`` is how far it has been read."""

    kind: str  # "json", "marker" (a JSON value follows the marker), "closer", "gemma"
    closer: str = ""
    at: int = 0
    value_at: int = -1  # where the JSON value starts (after its marker and blanks)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end(self, text: str) -> int:
        """Where the span ends in ``text`` (its whole text so far); ``_WAIT`` or ``_NO``."""
        if self.kind == "closer":
            found = text.find(self.closer, max(self.at - len(self.closer), 0))
            self.at = len(text)
            return _WAIT if found == -1 else found + len(self.closer)
        if self.value_at < 0:
            if (value_at := self._value_start(text)) < 0:
                return value_at
            self.value_at = self.at = value_at
        return self._braces(text) if self.kind == "gemma" else self._json(text)

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

    def _json(self, text: str) -> int:
        for i in range(self.at, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        self.at = len(text)
        return _WAIT

    def _braces(self, text: str) -> int:
        for i in range(self.at, len(text)):
            self.depth += {"{": 1, "}": -1}.get(text[i], 0)
            if self.depth == 0:
                return i + 1
        self.at = len(text)
        return _WAIT


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

    held: str = ""
    scan: _Scan | None = None  # how the held span is being read

    def feed(self, text: str) -> list[Release | Span]:
        out: list[Release | Span] = []
        buf, self.held = self.held + text, ""
        start = at = 0  # released up to start; looking at at
        while at < len(buf):
            scan, self.scan = self.scan, None
            if scan is None or scan.kind == "partial":
                scan = _scan(buf, at) if buf[at] in "{[<c" else None
                if scan is None:
                    at += 1
                    continue
            end = _WAIT if scan.kind == "partial" else scan.end(buf[at:] if at else buf)
            if end == _NO:
                at += 1
                continue
            if at > start:
                out.append(Release(buf[start:at]))
            if end == _WAIT:
                self.held, self.scan = buf[at:], scan
                return out
            out.append(Span(buf[at : at + end]))
            start = at = at + end
        if start < len(buf):
            out.append(Release(buf[start:]))
        return out

    def finish(self) -> str:
        """What is still held at the end of the turn (an unfinished span), given up."""
        held, self.held, self.scan = self.held, "", None
        return held
