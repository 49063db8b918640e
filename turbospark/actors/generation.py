"""The generation queue actor: a bounded FIFO per model between routes and model threads.

Inbox messages: ``Submit`` (a route's job), ``Withdraw`` (the route left before the job started),
``Take`` (a model thread wants jobs: waiting when its batch is empty, answered at once when it
runs one), ``Retire`` (a model thread has stopped, unloaded or at shutdown: its waiting jobs, and
later ones, are answered ``ShuttingDown``), ``Open`` (the resolver loads that model again).  Admission answers on the job's own reply channel at once:
``Queued(ahead)``, or ``Failed(QueueFull)`` when ``max_queue`` jobs already wait, so a full
queue costs the caller nothing but this message.  A withdrawn job leaves the FIFO immediately.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from ..errors import QueueFull, ShuttingDown
from ..messages import (
    Failed,
    Generated,
    GenerationJob,
    Open,
    Queued,
    QueueDepth,
    QueueRejected,
    Retire,
    Submit,
    Take,
    Withdraw,
)
from ._fifo import FifoPolicy
from ._mailbox import answer

__all__ = ["QueueMessage", "generation_queue"]

QueueMessage = Submit | Withdraw | Take | Retire | Open


def _cancelled_while_queued(job: GenerationJob) -> Generated:
    return Generated(
        id=job.request_id,
        model=job.model,
        prompt_tokens=0,
        new_tokens=0,
        prefill_seconds=0.0,
        decode_seconds=0.0,
        stop_reason="Cancelled",
        reused_prefix_tokens=0,
        phase="queued",
        began=False,
    )


@attrs.define
class _Queue:
    policy: FifoPolicy[GenerationJob, trio.MemorySendChannel[list[GenerationJob]]]
    emit: Callable[[object], None]
    retired: set[str] = attrs.field(factory=set)

    def handle(self, msg: QueueMessage) -> None:
        if isinstance(msg, Submit):
            self._submit(msg.job)
        elif isinstance(msg, Open):
            self.retired.discard(msg.model)
        elif isinstance(msg, Retire):
            self.retired.add(msg.model)
            for taker in self.policy.drop_takers(msg.model):  # that thread is gone
                taker.close()
            for job in self.policy.take_now(msg.model, self.policy.depth(msg.model)):
                answer(job.reply, Failed(ShuttingDown()))
            self._depth(msg.model)
        elif isinstance(msg, Withdraw):
            if self.policy.withdraw(msg.job.model, msg.job):
                self._dropped(msg.job)
        elif msg.wait:
            self.policy.add_taker(msg.model, msg.reply, msg.count)
        else:
            jobs = self.policy.take_now(msg.model, msg.count)
            try:
                msg.reply.send_nowait(jobs)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.policy.requeue(msg.model, jobs)  # that model thread is gone (shutdown)
            msg.reply.close()
            if jobs:
                self._depth(msg.model)
        self._dispatch()

    def _submit(self, job: GenerationJob) -> None:
        if job.model in self.retired:
            answer(job.reply, Failed(ShuttingDown()))
            return
        ahead = self.policy.admit(job.model, job)
        if ahead is None:
            self.emit(QueueRejected(job.request_id, job.model))
            answer(job.reply, Failed(QueueFull(job.model, self.policy.limit)))
            return
        try:
            job.reply.send_nowait(Queued(ahead))
        except trio.BrokenResourceError:  # the route left while its Submit was in flight
            self.policy.withdraw(job.model, job)
            self._dropped(job)
        else:
            self._depth(job.model)

    def _dropped(self, job: GenerationJob) -> None:
        """A waiting job whose client left: it never runs, and its slot is free now."""
        self.emit(_cancelled_while_queued(job))
        job.reply.close()
        self._depth(job.model)

    def _dispatch(self) -> None:
        again = False
        for model, taker, jobs in list(self.policy.dispatch()):
            try:
                taker.send_nowait(jobs)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.policy.requeue(model, jobs)  # that model thread is gone: the next taker
                again = True
            taker.close()
            self._depth(model)
        if again:
            self._dispatch()

    def _depth(self, model: str) -> None:
        self.emit(QueueDepth(model, self.policy.depth(model)))


async def generation_queue(
    inbox: trio.MemoryReceiveChannel[QueueMessage],
    emit: Callable[[object], None],
    *,
    max_queue: int,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the queue until every sender has closed its end of ``inbox``."""
    queue = _Queue(FifoPolicy(max_queue), emit)
    with inbox:
        task_status.started()
        try:
            async for msg in inbox:
                queue.handle(msg)
        finally:
            takers, jobs = queue.policy.drain()
            for channel in (*takers, *(job.reply for job in jobs)):
                channel.close()
