"""One sequence's own state in a batch (sans-io).

Theory of operation: the model thread runs many sequences in one batch, and everything that is
one request's alone lives here, fed one engine event at a time: prefill progress, then one token
per decode step.  ``feed`` turns a token into the text that became safe to show (stream decoding,
stop strings held back until they cannot match), decides whether the sequence has ended (a stop
token, a stop string, its budget) and, at the end, adds what the decoder and the stop matcher
still held.  Stop strings count only from the ``min_tokens``-th token on (vLLM's rule); the
backend keeps stop tokens from being sampled before then, or ever with ``ignore_eos``, so one
that comes anyway (the end a grammar forces) ends the sequence.  ``event`` tells the observer
what the sequence did.  Nothing here does I/O, so the loop stays "step, feed, deliver" and this
object is tested without MLX or Trio.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Literal, Protocol

import attrs

from .backend import PrefillProgress, SamplingParams
from .output import OutputParser, Parts
from .stops import StopMatcher

__all__ = ["SequenceState", "StopReason"]

Phase = Literal["queued", "prefill", "decode"]
StopReason = Literal[
    "MaxTokens", "EndOfTurn", "Eos", "StopString", "Cancelled", "Error", "Shutdown"
]


class _Decoder(Protocol):
    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@attrs.define
class SequenceState:
    params: SamplingParams
    decoder: _Decoder
    stop_ids: Collection[int]
    eos_id: int | None
    prompt_tokens: int
    created: float  # when the request was accepted (for time to first token)
    parser: OutputParser
    began: float = attrs.field(factory=time.monotonic)
    phase: Phase = "prefill"
    stop_reason: StopReason | None = None
    new_tokens: int = 0
    cached: int = 0
    prefilled: int = 0
    prefill_end: float | None = None
    last_token: float | None = None
    gaps: list[float] = attrs.field(factory=list)  # seconds between consecutive tokens
    stops: StopMatcher = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.stops = StopMatcher(self.params.stop)

    @property
    def finish_reason(self) -> Literal["stop", "length"]:
        return "length" if self.stop_reason == "MaxTokens" else "stop"

    def progress(self, item: PrefillProgress) -> None:
        self.cached, self.prefilled = item.cached, item.done

    def feed(self, token: int, now: float | None = None) -> Parts:
        """One decoded token: the parts now safe to show (possibly none).  When the sequence
        ends here, ``stop_reason`` is set and the parts include everything still held back."""
        assert self.stop_reason is None, "a finished sequence was fed"
        now = time.monotonic() if now is None else now
        if self.phase == "prefill":
            self.phase = "decode"
            self.prefill_end = now
        elif self.last_token is not None:
            self.gaps.append(now - self.last_token)
        self.last_token = now
        self.new_tokens += 1
        if token in self.stop_ids:
            self.stop_reason = "Eos" if token == self.eos_id else "EndOfTurn"
            return self._last(self._tail())
        text = self.stops.feed(self.decoder.add(token), armed=self._armed)
        if self.stops.matched is not None:
            self.stop_reason = "StopString"
            return self._last(text)
        if self.new_tokens >= self.params.max_tokens:
            self.stop_reason = "MaxTokens"
            return self._last(text + self._tail())
        return self.parser.feed(text)

    def _last(self, text: str) -> Parts:
        return self.parser.feed(text) + self.parser.finish()

    def _tail(self) -> str:
        """What the decoder or the stop matcher still held; a stop string it completes wins."""
        tail = self.stops.feed(self.decoder.flush(), armed=self._armed)
        if self.stops.matched is not None:
            self.stop_reason = "StopString"
            return tail
        return tail + self.stops.flush()

    @property
    def _armed(self) -> bool:
        """Whether a stop string may end it: not before ``min_tokens`` tokens."""
        return self.new_tokens >= self.params.min_tokens

    def end(self, reason: StopReason) -> None:
        """Ended from outside: the client left, the sequence failed, the server stops."""
        if self.stop_reason is None:
            self.stop_reason = reason
