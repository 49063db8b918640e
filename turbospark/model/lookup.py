"""Prompt-lookup drafts and how many to try (sans-io).

Theory of operation: text that repeats its context (an answer quoting its prompt, an edit of a
given passage, code copying its surroundings) can be guessed from that context.  ``Lookup``
keeps an index of every n-gram (``min_n`` to ``max_n`` tokens) of one sequence's prompt and
output; the draft is what followed the most recent earlier occurrence of the longest n-gram that
ends the sequence.  The model then checks the draft in one forward pass (``mlx_speculate``) and
keeps it up to the first token it would not have chosen itself, so the output is exactly what
decoding one token at a time gives.

``Pace`` chooses how many tokens to draft from how many were accepted: it grows by one after a
step that accepted the whole draft and halves after one that accepted nothing, between 1 and
``most``, so a sequence whose drafts keep failing pays little for them.

``Backoff`` chooses when to look for drafts at all.  A look costs a step its overlap: the token
each sequence sampled last must be known first, so the next step's graph cannot be built while
that step computes (measured on free prose, one stream: 12-14 % of the decode speed when the
drafts keep nothing).  After a look that kept no token the next one waits 1, 2, 4 then 8 plain
steps; a look that kept one resets the wait.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Backoff", "Lookup", "Pace"]


class Lookup:
    def __init__(self, tokens: Iterable[int] = (), *, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> the index just past its most recent occurrence that is not the sequence's end
        self._index: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            # the n-grams that ended the sequence until now become earlier occurrences
            end = len(self.tokens)
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self._index[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest n-gram ending the sequence, last time it
        occurred; none when no n-gram of ``min_n`` tokens or more occurred before."""
        if k <= 0:
            return []
        toks = self.tokens
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            at = self._index.get(tuple(toks[len(toks) - n:]))
            if at is not None:
                return toks[at:at + k]
        return []


class Pace:
    """How many tokens to draft next, from what the last drafts achieved."""

    def __init__(self, first: int = 4, most: int = 12) -> None:
        self.k, self.most = min(first, most), most
        self.drafted = self.accepted = 0  # totals, for reports

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.k = min(self.most, self.k + 1)
        elif accepted == 0:
            self.k = max(1, self.k // 2)


class Backoff:
    """Whether to look for drafts this step, from what the last looks kept."""

    def __init__(self, most: int = 8) -> None:
        self.most = most
        self.reset()

    def due(self) -> bool:
        """True when this step should look (else one plain step of the wait is taken)."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record(self, kept: bool) -> None:
        """A look ended: it kept a drafted token or it did not (no draft counts as not)."""
        self.gap = 0 if kept else min(self.most, max(1, 2 * self.gap))
        self.wait = self.gap

    def reset(self) -> None:
        """Look at the next step (a new sequence: its prompt may have drafts to give)."""
        self.gap = self.wait = 0  # the wait after the last look; the plain steps still to take
