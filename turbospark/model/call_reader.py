"""A tool call read as the model writes it, so its arguments can be streamed (sans-io).

Theory of operation: the output parser holds a tool-call block until it closes, and only then
knows whether it is a call.  For the JSON form every model may write
(``{"name": N, "arguments": {...}}``, Hermes' and the forced-call grammar's), ``JsonCallReader``
reads the block as it grows: once the head (``{"name": "N", "arguments": ``, ``parameters``
read alike) is written and names an offered tool, the call is decided and each piece of the
arguments object goes out as it is written, up to the brace that closes it.  A block of any
other form (a list of calls, ``arguments`` before ``name``, arguments as a JSON string, XML) is
not read here and the parser decides it whole, as before.  ``CallPiece`` is what a decided call
gives out: its first piece carries its name; the pieces' texts join to the arguments as written,
which is what the finished call carries.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Literal

import attrs

__all__ = ["CallPiece", "JsonCallReader", "JsonEnd", "read_head"]

_WS = " \t\r\n"
_MAX_NAME = 256  # a head whose name runs longer is not a call of an offered tool


@attrs.frozen
class CallPiece:
    """Part of a call still being written: ``index`` is its place among the sequence's calls
    and ``id`` its id (the finished call keeps both); ``text`` continues its arguments."""

    index: int
    id: str
    name: str
    text: str


_HEAD: tuple[tuple[str, ...] | None, ...] = (
    ("{",), ('"name"',), (":",), None, (",",), ('"arguments"', '"parameters"'), (":",), ("{",),
)


def read_head(text: str) -> tuple[str, int] | None | Literal[False]:
    """``(name, where the arguments object begins)`` once the head is written; None while
    ``text`` may still grow into one; False when it cannot."""
    i, n, name = 0, len(text), None
    for step in _HEAD:
        while i < n and text[i] in _WS:
            i += 1
        if i == n:
            return None
        if step is None:  # the name: a JSON string
            if text[i] != '"':
                return False
            end, escaped = i + 1, False
            while end < n and (escaped or text[end] != '"'):
                escaped = not escaped and text[end] == "\\"
                end += 1
            if end == n:
                return None if n - i <= _MAX_NAME else False
            try:
                name = json.loads(text[i : end + 1])
            except json.JSONDecodeError:
                return False
            i = end + 1
            continue
        rest = text[i:]
        match = next((lit for lit in step if rest.startswith(lit)), None)
        if match is None:
            return None if any(lit.startswith(rest) for lit in step) else False
        i += len(match)
    assert isinstance(name, str)
    return name, i - 1


class JsonEnd:
    """Where a JSON value written piece by piece closes (brackets counted outside strings)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False

    def feed(self, piece: str) -> int:
        """Just past the bracket in ``piece`` that closes the value, or -1: not yet."""
        for i, ch in enumerate(piece):
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
        return -1


class JsonCallReader:
    """One block's JSON call, fed as it arrives.  ``feed`` returns the arguments text that
    became known (``""`` when none); ``name`` is set once the call is decided; ``closed`` once
    its arguments object is complete (what follows is the block's tail, not arguments)."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self.name: str | None = None
        self.arguments = ""
        self.closed = False
        self._head = ""
        self._off = False
        self._end = JsonEnd()

    def feed(self, text: str) -> str:
        if self._off or self.closed:
            return ""
        if self.name is None:
            self._head += text
            head = read_head(self._head)
            if head is None:
                return ""
            if head is False or head[0] not in self.names:
                self._off = True
                return ""
            self.name, at = head
            text, self._head = self._head[at:], ""
        end = self._end.feed(text)  # up to the arguments' closing brace
        if end != -1:
            self.closed, text = True, text[:end]
        self.arguments += text
        return text
