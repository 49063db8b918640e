"""A turn's output as typed events, the same for every API family (sans-io).

Theory of operation: the turn driver (``routes/_turn.py``) reads the model's replies through a
``TurnStream`` and hands out these events, live; each family's framer turns them into its wire
format, and a response sent whole is the same events collected (``Collected``), so a stream and
a whole response cannot tell the turn differently.

For each choice, in the order the model wrote them: ``Text`` and ``Reasoning`` pieces, and tool
calls as ``CallStart`` (index, id, name), ``ArgumentsDelta`` pieces that concatenate to the
arguments' JSON text, and ``CallEnd`` (the whole call); then ``Finish``.  Once every choice has
finished, one ``Usage`` (every attempt's tokens, a corrective retry's included, and how many
retries there were).  ``Retried`` says a corrective turn began; ``Error`` ends a turn that
failed after its first byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

import attrs

from ..errors import TurboSparkError
from ..model.output import ToolCall
from ..model.sequence import StopReason
from ..messages import TokenLogprob

__all__ = [
    "ArgumentsDelta", "CallEnd", "CallStart", "ChoiceResult", "Collected", "Error", "Finish",
    "Prefill", "Reasoning", "Retried", "Text", "TurnEvent", "Usage", "arguments_object", "split_arguments",
]


@attrs.frozen
class Text:
    """Content the model wrote; ``logprobs``: the tokens since the last piece of this choice."""

    text: str
    choice: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class Reasoning:
    text: str
    choice: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class CallStart:
    """A tool call begins: ``index`` is its place among the choice's calls (stable, from 0)."""

    index: int
    id: str
    name: str
    choice: int = 0


@attrs.frozen
class ArgumentsDelta:
    index: int
    text: str
    choice: int = 0


@attrs.frozen
class CallEnd:
    """A tool call is complete: ``call.arguments`` is every delta of it, joined."""

    call: ToolCall
    choice: int = 0


@attrs.frozen
class Finish:
    """A choice ended: ``reason`` is the model's (``length``: the budget ran out), ``called``
    whether it made tool calls; ``logprobs``: its tokens not yet reported."""

    reason: Literal["stop", "length"]
    stop_reason: StopReason
    stop_sequence: str | None
    called: bool
    completion_tokens: int
    choice: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class Usage:
    """The turn's tokens, every attempt added up (the prompt once per attempt)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    retries: int = 0
    prompt_seconds: float = 0.0  # reading the prompts (every attempt's)
    decode_seconds: float = 0.0  # generating, first token to last (choices decode together)


@attrs.frozen
class Retried:
    """A corrective turn began (``attempt`` 1 is the first retry): ``nudge`` is what it said."""

    attempt: int
    nudge: str


@attrs.frozen
class Error:
    error: TurboSparkError


@attrs.frozen
class Prefill:
    """The prompt is being read (llama.cpp's ``prompt_progress``): ``processed`` of ``total``
    tokens, ``cache`` of them reused, ``seconds`` since the model started on it."""

    total: int
    cache: int
    processed: int
    seconds: float


TurnEvent = Text | Reasoning | CallStart | ArgumentsDelta | CallEnd | Finish | Usage | Retried | Error | Prefill


def arguments_object(text: str) -> dict[str, Any]:
    """A call's arguments as an object, for families that carry them parsed (Anthropic's
    ``input``, Ollama's ``arguments``): JSON text that is not an object is ``{"value": ...}``,
    text that does not parse (a call cut short) is ``{}``."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def split_arguments(text: str) -> list[str]:
    """A complete call's arguments as the pieces a stream sends: split at the top level of the
    object, after each key and before each comma and the closing brace
    (``{"a": `` ``1`` ``, "b": `` ``2`` ``}``), so a client's accumulator joins several deltas;
    pieces always concatenate to ``text``."""
    cuts: list[int] = []
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                cuts.append(i)
        elif depth == 1 and ch == ",":
            cuts.append(i)
        elif depth == 1 and ch == ":":
            end = i + 1
            while end < len(text) and text[end] in " \t\r\n":
                end += 1
            cuts.append(end)
    pieces, at = [], 0
    for cut in sorted(set(cuts)):
        if at < cut < len(text):
            pieces.append(text[at:cut])
            at = cut
    pieces.append(text[at:])
    return [p for p in pieces if p]


@attrs.define
class ChoiceResult:
    """One choice's events gathered: its parts in order (adjacent pieces of a kind joined),
    its finish and its log-probabilities."""

    parts: list[tuple[str, Any]] = attrs.field(factory=list)  # ("text"|"reasoning", str) | ("call", ToolCall)
    finish: Finish | None = None
    logprobs: list[TokenLogprob] = attrs.field(factory=list)

    def add(self, kind: str, value: Any) -> None:
        if kind != "call" and self.parts and self.parts[-1][0] == kind:
            self.parts[-1] = (kind, self.parts[-1][1] + value)
        else:
            self.parts.append((kind, value))

    @property
    def text(self) -> str:
        return "".join(v for k, v in self.parts if k == "text")

    @property
    def reasoning(self) -> str:
        return "".join(v for k, v in self.parts if k == "reasoning")

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(v for k, v in self.parts if k == "call")


@attrs.define
class Collected:
    """A turn's events gathered, for a response sent whole."""

    choices: list[ChoiceResult]
    usage: Usage | None = None
    error: TurboSparkError | None = None

    @classmethod
    def of(cls, events: Iterable[TurnEvent], n: int = 1) -> Collected:
        out = cls([ChoiceResult() for _ in range(n)])
        for event in events:
            out.feed(event)
        return out

    @property
    def numbers(self) -> int:
        """How many log-probabilities the answer carries (each token's and its alternatives'):
        what makes a whole answer big to write."""
        return sum(1 + len(t.top) for c in self.choices for t in c.logprobs)

    def feed(self, event: TurnEvent) -> None:
        if isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, Error):
            self.error = event.error
        elif isinstance(event, Retried | Prefill):
            pass
        else:
            choice = self.choices[event.choice]
            if isinstance(event, Text | Reasoning):
                if event.text:
                    choice.add("text" if isinstance(event, Text) else "reasoning", event.text)
                choice.logprobs += event.logprobs
            elif isinstance(event, CallEnd):
                choice.add("call", event.call)
            elif isinstance(event, Finish):
                choice.finish = event
                choice.logprobs += event.logprobs
