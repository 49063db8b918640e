"""Which jobs a model thread lets into its running batch (sans-io).

Theory of operation: a job runs when the batch has a free slot for each of its sequences
(``max_batch``; a job with ``n`` choices needs ``n``) and the KV memory of the batch it would
make fits the model's KV budget.  Each sequence may grow to its prompt plus its token budget; a
batched KV cache pads every row to the longest sequence, so a batch costs its size times what
its longest sequence may grow to (``size(tokens)`` is one sequence's KV bytes, from the
backend).  A job that would not fit waits, at the head of the line, for running ones to leave:
arrival order is kept, so a long request is never starved by short ones behind it.  One job
alone always runs: the context-window and ``n`` checks have already refused what never can.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["Admission"]


class Admission:
    def __init__(self, max_batch: int, kv_budget: int, size: Callable[[int], int] = lambda n: n) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.max_batch = max_batch
        self.kv_budget = kv_budget
        self.size = size
        self._tokens: dict[int, int] = {}  # what each running sequence may grow to

    @property
    def running(self) -> int:
        return len(self._tokens)

    def cost(self, tokens: Iterable[int]) -> int:
        """KV bytes of a batch of sequences that grow to these lengths (padded to the longest)."""
        lengths = list(tokens)
        return len(lengths) * self.size(max(lengths)) if lengths else 0

    @property
    def reserved(self) -> int:
        return self.cost(self._tokens.values())

    def free_slots(self) -> int:
        return self.max_batch - len(self._tokens)

    def fits(self, tokens: int, slots: int = 1) -> bool:
        if not self._tokens:
            return True
        if self.free_slots() < slots:
            return False
        return self.cost([*self._tokens.values(), *[tokens] * slots]) <= self.kv_budget

    def admit(self, seq: int, tokens: int) -> None:
        assert seq not in self._tokens
        self._tokens[seq] = tokens

    def release(self, seq: int) -> None:
        self._tokens.pop(seq, None)
