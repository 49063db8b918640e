"""The generation queue's scheduling policy (sans-io).

Theory of operation: each model has a FIFO of waiting jobs and a credit: how many jobs its
thread has asked for (``ask``) and not been sent.  ``admit`` appends a job unless the model's
FIFO already holds ``limit`` jobs beyond what its credit will take at once; ``dispatch`` names
the oldest jobs to send to each model, as many as its credit allows; ``withdraw`` removes a job
whose client left: a waiting one at once (its slot frees immediately instead of when the job
reaches the head), and a sent one while it has not been received (``unreceived``: how many of
the jobs sent to that model still sit in its channel, which hands them over in the order they
were sent, so they are the last ones sent).  A credit goes below zero when a thread asks for
fewer after jobs were sent against it.  Jobs are opaque here: the actor that owns this object
does all the channel work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["FifoPolicy"]

J = TypeVar("J", bound=Hashable)


class FifoPolicy(Generic[J]):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiting: dict[str, deque[J]] = {}
        self._credit: dict[str, int] = {}
        self._sent: dict[str, deque[J | None]] = {}  # newest last; None: withdrawn since

    def depth(self, model: str) -> int:
        return len(self._waiting.get(model, ()))

    def credit(self, model: str) -> int:
        return self._credit.get(model, 0)

    def admit(self, model: str, job: J) -> int | None:
        """Queue ``job``; return how many wait ahead of it, or None when the FIFO is full."""
        waiting = self._waiting.setdefault(model, deque())
        if len(waiting) >= self.limit + max(0, self.credit(model)):  # credit: will not wait
            return None
        waiting.append(job)
        return len(waiting) - 1

    def withdraw(self, model: str, job: J, unreceived: int = 0) -> bool:
        """Drop a job whose client left, if it waits or was sent and is among the
        ``unreceived``; False when its model's thread has it already."""
        waiting = self._waiting.get(model)
        if waiting is not None and job in waiting:
            waiting.remove(job)
            return True
        sent = self._received(model, unreceived)
        for i, other in enumerate(sent):
            if other == job:
                sent[i] = None
                return True
        return False

    def ask(self, model: str, count: int, unreceived: int = 0) -> None:
        """``model``'s thread asks for ``count`` more jobs (negative: fewer)."""
        self._credit[model] = self.credit(model) + count
        self._received(model, unreceived)

    def forget(self, model: str) -> None:
        """``model``'s thread (or its channel) is gone: no credit, nothing sent to remember."""
        self._credit.pop(model, None)
        self._sent.pop(model, None)

    def dispatch(self) -> Iterator[tuple[str, list[J]]]:
        """The oldest waiting jobs to send now, per model, within each one's credit."""
        for model, credit in self._credit.items():
            waiting = self._waiting.get(model)
            if credit > 0 and waiting:
                jobs = [waiting.popleft() for _ in range(min(credit, len(waiting)))]
                self._credit[model] = credit - len(jobs)
                self._sent.setdefault(model, deque()).extend(jobs)
                yield model, jobs

    def requeue(self, model: str, jobs: list[J]) -> None:
        """Jobs ``dispatch`` named that could not be sent go back to the head of their FIFO, in
        order, and their credit back to their model."""
        sent = self._sent.get(model)
        for job in reversed(jobs):
            if sent and sent[-1] == job:
                sent.pop()
            self._waiting.setdefault(model, deque()).appendleft(job)
        if model in self._credit:
            self._credit[model] += len(jobs)

    def retire(self, model: str) -> list[J]:
        """``model`` has stopped: forget it, and hand back every job waiting for it."""
        self.forget(model)
        return list(self._waiting.pop(model, ()))

    def drain(self) -> list[J]:
        """Every waiting job, for shutdown."""
        jobs = [j for q in self._waiting.values() for j in q]
        self._waiting.clear()
        self._credit.clear()
        self._sent.clear()
        return jobs

    def _received(self, model: str, unreceived: int) -> deque[J | None]:
        """What was sent to ``model``, trimmed to the ``unreceived`` last: the others were
        received."""
        sent = self._sent.setdefault(model, deque())
        while len(sent) > unreceived:
            sent.popleft()
        return sent
