"""The generation queue actor: a bounded FIFO per model between routes and model threads.

Inbox messages: ``Submit`` (a route's job), ``Withdraw`` (the route left before the job
started), ``Take`` (a model thread asks for more jobs, or fewer, pushed into its jobs channel;
its ``pushed`` channel, if any, is closed once they are), ``Retire`` (a model thread has
stopped, unloaded or at shutdown: its waiting jobs, and later ones, are answered
``ShuttingDown``), ``Open`` (the resolver loads that model again).

Admission answers at once, on the job's own reply channel, only when it refuses:
``Failed(QueueFull)`` when ``max_queue`` jobs already wait, so a full queue costs the caller
nothing but this message.  An admitted job is pushed into its model's jobs channel as soon as
the model has asked for more than it was sent (``send_nowait``: the channel holds what the model
asked for), oldest first; until then it waits here.  A withdrawn job that waits here, or that
sits in its model's channel not yet received, is dropped at once and its reply channel closed
(the model thread skips a job so answered); one the thread has received is left to the thread.
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

Jobs = trio.MemorySendChannel[GenerationJob]


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
    policy: FifoPolicy[GenerationJob]
    emit: Callable[[object], None]
    retired: set[str] = attrs.field(factory=set)
    channels: dict[str, Jobs] = attrs.field(factory=dict)  # each model thread's jobs channel

    def handle(self, msg: QueueMessage) -> None:
        if isinstance(msg, Submit):
            self._submit(msg.job)
        elif isinstance(msg, Take):
            self._take(msg)
        elif isinstance(msg, Withdraw):
            if self.policy.withdraw(msg.job.model, msg.job, self._unreceived(msg.job.model)):
                self._dropped(msg.job)
        elif isinstance(msg, Open):
            self.retired.discard(msg.model)
        else:
            self.retired.add(msg.model)
            if (channel := self.channels.pop(msg.model, None)) is not None:
                channel.close()  # that thread is gone
            for job in self.policy.retire(msg.model):
                answer(job.reply, Failed(ShuttingDown()))
            self._depth(msg.model)
        self._dispatch()
        if isinstance(msg, Take) and msg.pushed is not None:
            msg.pushed.close()

    def _submit(self, job: GenerationJob) -> None:
        if job.model in self.retired:
            answer(job.reply, Failed(ShuttingDown()))
            return
        if self.policy.admit(job.model, job) is None:
            self.emit(QueueRejected(job.request_id, job.model))
            answer(job.reply, Failed(QueueFull(job.model, self.policy.limit)))
            return
        if job.reply.statistics().open_receive_channels == 0:  # the route left while its Submit was in flight
            self.policy.withdraw(job.model, job)
            self._dropped(job)
        else:
            self._depth(job.model)

    def _take(self, msg: Take) -> None:
        if msg.jobs is not self.channels.get(msg.model):
            if msg.jobs.statistics().open_receive_channels == 0:
                return  # from a model thread that has stopped since
            self.policy.forget(msg.model)  # a new thread for this model
            self.channels[msg.model] = msg.jobs
        self.policy.ask(msg.model, msg.count, self._unreceived(msg.model))

    def _unreceived(self, model: str) -> int:
        """How many jobs sent to ``model`` still sit in its channel."""
        channel = self.channels.get(model)
        return channel.statistics().current_buffer_used if channel is not None else 0

    def _dropped(self, job: GenerationJob) -> None:
        """A job whose client left before its model thread had it: it never runs, and its
        place is free now."""
        self.emit(_cancelled_while_queued(job))
        job.reply.close()
        self._depth(job.model)

    def _dispatch(self) -> None:
        for model, jobs in list(self.policy.dispatch()):
            channel = self.channels[model]
            for i, job in enumerate(jobs):
                try:
                    channel.send_nowait(job)
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                    # that model thread has stopped (WouldBlock: never, the channel holds
                    # what the thread asked for): the jobs wait for the next one
                    self.policy.requeue(model, jobs[i:])
                    self.policy.forget(model)
                    del self.channels[model]
                    break
            self._depth(model)

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
            for channel in queue.channels.values():
                channel.close()
            for job in queue.policy.drain():
                job.reply.close()
