"""Stop strings over streamed text (sans-io).

Theory of operation: text arrives in pieces.  A stop string may straddle pieces, so the matcher
holds back the longest tail of what it has seen that could still grow into a stop string, and
emits everything before it.  When a stop string completes, the text before it is emitted and the
stop string itself (and anything after it) is dropped.  At the end of a turn that did not stop on
a string, ``flush()`` hands back the held tail.

Before ``min_tokens`` (vLLM's "stop strings are not checked until min_tokens") the matcher is fed
unarmed: it still holds back what could grow into a stop string, but matches nothing, so text
that holds a whole stop string is shown.  Once armed, a stop string counts only if it completes
in text fed since: one that began in the held tail may complete, one that was already whole in
it may not.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str, *, armed: bool = True) -> str:
        """Take the next piece; return the text that is safe to emit now.

        After a stop string completes, ``matched`` names it and further input is ignored.
        Unarmed, no stop string completes (``min_tokens`` not reached yet).
        """
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hit_at, hit = len(buf) + 1, None
        for stop in self._stops if armed else ():
            # only a match that ends in ``text``: one whole in the held tail was fed unarmed
            at = buf.find(stop, max(0, len(self._held) - len(stop) + 1))
            if at != -1 and at < hit_at:
                hit_at, hit = at, stop
        if hit is not None:
            self.matched = hit
            self._held = ""
            return buf[:hit_at]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
