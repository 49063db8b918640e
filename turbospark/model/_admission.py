"""Which sequences a model thread lets into its running batch (sans-io).

Theory of operation: a sequence runs when the batch has a free slot (``max_batch``) and the KV
memory it may grow to (prompt plus its token budget, as the backend estimates it) fits in the
model's KV budget beside what the running sequences may grow to.  A sequence that would not fit
waits, at the head of the line, for running ones to leave: arrival order is kept, so a long
request is never starved by short ones behind it.  One sequence alone always runs, however large:
the context-window check has already refused what can never run.
"""

from __future__ import annotations

__all__ = ["Admission"]


class Admission:
    def __init__(self, max_batch: int, kv_budget: int) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.max_batch = max_batch
        self.kv_budget = kv_budget
        self._reserved: dict[int, int] = {}

    @property
    def running(self) -> int:
        return len(self._reserved)

    @property
    def reserved(self) -> int:
        return sum(self._reserved.values())

    def free_slots(self) -> int:
        return self.max_batch - len(self._reserved)

    def fits(self, need: int) -> bool:
        if not self._reserved:
            return True
        return self.free_slots() > 0 and self.reserved + need <= self.kv_budget

    def admit(self, seq: int, need: int) -> None:
        assert seq not in self._reserved
        self._reserved[seq] = need

    def release(self, seq: int) -> None:
        self._reserved.pop(seq, None)
