"""The generation queue's scheduling policy (sans-io).

Theory of operation: each model has a FIFO of waiting jobs and at most a few idle takers (a model
thread that asked for work).  ``admit`` appends a job unless the model's FIFO already holds
``limit`` jobs; ``withdraw`` removes a waiting job at once (its client left), so the slot frees
immediately instead of when the job reaches the head; ``add_taker`` records an idle model thread;
``dispatch`` pairs idle takers with the oldest jobs, in arrival order.  Jobs and takers are opaque
here: the actor that owns this object does all the channel work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["FifoPolicy"]

J = TypeVar("J", bound=Hashable)
T = TypeVar("T")


class FifoPolicy(Generic[J, T]):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiting: dict[str, deque[J]] = {}
        self._takers: dict[str, deque[T]] = {}

    def depth(self, model: str) -> int:
        return len(self._waiting.get(model, ()))

    def admit(self, model: str, job: J) -> int | None:
        """Queue ``job``; return how many wait ahead of it, or None when the FIFO is full."""
        waiting = self._waiting.setdefault(model, deque())
        idle = len(self._takers.get(model, ()))  # jobs that will not wait at all
        if len(waiting) >= self.limit + idle:
            return None
        waiting.append(job)
        return len(waiting) - 1

    def withdraw(self, model: str, job: J) -> bool:
        """Drop a job that is still waiting; False when it was already handed out."""
        waiting = self._waiting.get(model)
        if waiting is None or job not in waiting:
            return False
        waiting.remove(job)
        return True

    def add_taker(self, model: str, taker: T) -> None:
        self._takers.setdefault(model, deque()).append(taker)

    def requeue(self, model: str, job: J) -> None:
        """Put a job that could not be handed out back at the head of its FIFO."""
        self._waiting.setdefault(model, deque()).appendleft(job)

    def dispatch(self) -> Iterator[tuple[str, T, J]]:
        """Pair idle takers with the oldest waiting jobs."""
        for model, takers in self._takers.items():
            waiting = self._waiting.get(model)
            while takers and waiting:
                yield model, takers.popleft(), waiting.popleft()

    def drain(self) -> tuple[list[T], list[J]]:
        """Everything still held, for shutdown."""
        takers = [t for q in self._takers.values() for t in q]
        jobs = [j for q in self._waiting.values() for j in q]
        self._takers.clear()
        self._waiting.clear()
        return takers, jobs
