"""How many prompt tokens a step may prefill while other sequences decode (sans-io).

Theory of operation: a step that prefills a newcomer's chunk also makes every running stream
wait for that chunk, so the chunk decides the running streams' longest gap between tokens.  The
pacer keeps the median of recent decode-only steps (the streams' usual gap) and steers the chunk
by what the last mixed step took: above 1.5x the median, the chunk shrinks by 30 %; below 1.2x it
grows by 25 %, between ``least`` and the backend's chunk, starting from ``least``.  So the longest
gap stays under twice the usual one (the band leaves room for a step's noise) whatever the model,
the machine or its load, and a newcomer is prefilled as fast as that allows.  With nothing
decoding nobody waits: the whole chunk runs.  How much a chunk costs the streams depends on the
step: in one forward pass with them (``mlx_fused``) a chunk of 8 costs ~0.3x a decode step; in a
pass of its own, the whole pass again (the backend then sets ``least`` higher).
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["GROW_BELOW", "JoinPacer", "SHRINK_ABOVE"]

#: A mixed step over this many times the usual gap shrinks the chunk by 30 %; one under
#: ``GROW_BELOW`` grows it by 25 %.  The band sits under 2x so that a step's noise stays within it.
SHRINK_ABOVE, GROW_BELOW = 1.5, 1.2


class JoinPacer:
    def __init__(self, most: int, least: int = 8) -> None:
        self.most, self.least = most, min(least, most)
        self.chunk = self.least  # the first mixed steps grow it if they may
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
        if seconds > SHRINK_ABOVE * gap:
            self.chunk = max(self.least, int(self.chunk * 0.7))
        elif seconds < GROW_BELOW * gap:
            self.chunk = min(self.most, max(self.chunk + 1, int(self.chunk * 1.25)))
