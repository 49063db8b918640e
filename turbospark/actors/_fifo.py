"""The generation queue's scheduling policy (sans-io).

Theory of operation: each model has a FIFO of waiting jobs and at most a few idle takers (a model
thread whose batch is empty and that waits for up to ``count`` jobs).  ``admit`` appends a job
unless the model's FIFO already holds ``limit`` jobs; ``withdraw`` removes a waiting job at once
(its client left), so the slot frees immediately instead of when the job reaches the head;
``add_taker`` records an idle model thread; ``dispatch`` hands idle takers the oldest jobs, in
arrival order; ``take_now`` answers a model thread with a running batch at once, with up to
``count`` jobs, possibly none.  Jobs and takers are opaque here: the actor that owns this object
does all the channel work.
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
        self._takers: dict[str, deque[tuple[T, int]]] = {}

    def depth(self, model: str) -> int:
        return len(self._waiting.get(model, ()))

    def admit(self, model: str, job: J) -> int | None:
        """Queue ``job``; return how many wait ahead of it, or None when the FIFO is full."""
        waiting = self._waiting.setdefault(model, deque())
        idle = sum(n for _, n in self._takers.get(model, ()))  # jobs that will not wait at all
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

    def add_taker(self, model: str, taker: T, count: int = 1) -> None:
        self._takers.setdefault(model, deque()).append((taker, count))

    def drop_takers(self, model: str) -> list[T]:
        """Forget ``model``'s idle takers (its thread has stopped); they are handed back."""
        return [taker for taker, _ in self._takers.pop(model, ())]

    def take_now(self, model: str, count: int) -> list[J]:
        """Up to ``count`` of the oldest waiting jobs, at once."""
        waiting = self._waiting.get(model)
        out: list[J] = []
        while waiting and len(out) < count:
            out.append(waiting.popleft())
        return out

    def requeue(self, model: str, jobs: list[J]) -> None:
        """Put jobs that could not be handed out back at the head of their FIFO, in order."""
        self._waiting.setdefault(model, deque()).extendleft(reversed(jobs))

    def dispatch(self) -> Iterator[tuple[str, T, list[J]]]:
        """Hand idle takers the oldest waiting jobs, up to each one's count."""
        for model, takers in self._takers.items():
            while takers and self._waiting.get(model):
                taker, count = takers.popleft()
                yield model, taker, self.take_now(model, count)

    def drain(self) -> tuple[list[T], list[J]]:
        """Everything still held, for shutdown."""
        takers = [t for q in self._takers.values() for t, _ in q]
        jobs = [j for q in self._waiting.values() for j in q]
        self._takers.clear()
        self._waiting.clear()
        return takers, jobs
