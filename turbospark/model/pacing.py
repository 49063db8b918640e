"""How many prompt tokens a step may prefill while other sequences decode (sans-io).

Theory of operation: a step that prefills a newcomer's chunk also makes every running stream
wait for that chunk, so the chunk decides the running streams' longest gap between tokens.  The
pacer keeps the median of recent decode-only steps (the streams' usual gap) and steers the chunk
by what the last mixed step took: above 1.8x the median, the chunk shrinks by 30 %; below 1.4x it
grows by 25 %, between ``least`` and the backend's chunk.  So the longest gap stays within about
twice the usual one whatever the model, the machine or its load, and a newcomer is prefilled as
fast as that allows.  With nothing decoding nobody waits: the whole chunk runs.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["JoinPacer"]


class JoinPacer:
    def __init__(self, most: int, least: int = 16) -> None:
        self.most, self.least = most, min(least, most)
        self.chunk = max(self.least, most // 4)  # a first guess: the first mixed step corrects it
        self._plain: deque[float] = deque(maxlen=32)

    @property
    def gap(self) -> float | None:
        """The median decode-only step, in seconds (None before any)."""
        return statistics.median(self._plain) if self._plain else None

    def size(self, decoding: int) -> int:
        """Prompt tokens the next step may prefill, in all."""
        if not decoding or self.gap is None:
            return self.most
        return self.chunk

    def record(self, seconds: float, decoding: int, prefilled: int) -> None:
        """A step took ``seconds``, with ``decoding`` sequences decoding and ``prefilled``
        prompt tokens read."""
        if not decoding:
            return
        if not prefilled:
            self._plain.append(seconds)
            return
        gap = self.gap
        if gap is None:
            return
        if seconds > 1.8 * gap:
            self.chunk = max(self.least, int(self.chunk * 0.7))
        elif seconds < 1.4 * gap:
            self.chunk = min(self.most, max(self.chunk + 1, int(self.chunk * 1.25)))
