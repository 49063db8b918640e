"""The model actor: owns one model's pinned OS thread, from load to shutdown, and its jobs channel.

``model_actor`` starts the thread (``trio.to_thread.run_sync`` once, never abandoned: an
abandoned MLX thread would keep computing and holding memory), waits until the thread has loaded
the backend, and only then reports ready through ``task_status.started(ModelInfo)``.

Jobs reach the thread through the model's own jobs channel (``JobIntake``): the model holds the
receive end, the generation queue the send end, which it gets in the model's ``Take`` messages.
``Take(count)`` asks the queue for ``count`` more jobs (a negative count, for fewer): the queue
pushes a job as soon as it is admitted while the model has asked for more than it was sent, so
the channel never holds more than the model asked for, at most ``max_batch`` jobs.  The thread
takes them in its step's one crossing with ``receive_nowait``, up to its free slots, and asks
again only when its room changes: no round trip per step.  When room grows (jobs ended) that
crossing waits until the queue has pushed what it could (``Take.pushed``), so a job waiting for
a slot joins at once, as it would with a round trip per step; with nothing to run, the thread
waits on the channel.

A job the queue withdrew while it sat in the channel (its client left) has been answered by the
queue, which closed its reply channel: the thread skips it.  When the model stops, the jobs
still in its channel are answered ``ShuttingDown`` here, the channel closes (the queue puts back
what it could not push, and ``Retire`` answers it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import attrs
import trio

from ..errors import ShuttingDown
from ..messages import Failed, GenerationJob, Retire, Take
from ..model.tokenizer import Tokenizer
from ..threads.model_thread import Limits, serve_model
from ..threads.pinned import start_pinned
from ..model.backend import Backend
from ._mailbox import answer
from .generation import QueueMessage

__all__ = ["JobIntake", "ModelInfo", "model_actor"]

log = logging.getLogger("turbospark")

RETIRE_WAIT = 10.0  # seconds a stopping model waits for the queue to take its Retire


@attrs.frozen
class ModelInfo:
    """What the rest of the system may know about a loaded model."""

    id: str
    context_window: int
    has_chat_template: bool
    sampling_defaults: dict[str, float]
    fingerprint: str
    tokenizer: Tokenizer
    inbox: Any = None  # where ``SlotCommand``s for its model thread go
    kernels: str = ""  # what computes its layers (an MLX model's ``kernels`` line), for the startup lines
    adapters: tuple[str, ...] = ()  # the names of the LoRA adapters it was served with (``serve --lora``)


def answered(job: GenerationJob) -> bool:
    """The queue has answered ``job`` already (withdrawn: its reply channel is closed)."""
    return job.reply.statistics().open_send_channels == 0


class JobIntake:
    """A model's end of its jobs channel, used on the Trio thread only (inside the model
    thread's crossings, and by the actor when the model stops).

    ``asked`` is how many jobs the model has asked for and not received; the queue's credit for
    it plus what waits in the channel comes to the same once the queue has read every ``Take``.
    It goes below zero when the model asks for fewer after the queue has already pushed them."""

    def __init__(self, model: str, queue: trio.MemorySendChannel[QueueMessage], room: int) -> None:
        self.model = model
        self.queue = queue
        self.send, self.recv = trio.open_memory_channel[GenerationJob](room)
        self.asked = 0
        self.closed = False  # the queue has gone (shutdown)
        # commands for the model thread (``SlotCommand``), taken in its crossings like jobs
        self.control, self._control = trio.open_memory_channel[Any](16)
        self.commands: list[Any] = []

    def exchange(self, want: int, take: bool) -> list[GenerationJob] | None:
        """Up to ``want`` jobs already in the channel (when ``take``); then ask the queue for
        ``want`` more, or for none when jobs were just taken: the thread does not know yet
        what room they leave, and says so in its next crossing (before any of their prefill)."""
        self._take_commands()
        received, jobs = self._drain(want) if take else (0, [])
        self._ask(0 if received else want)
        return None if self.closed and not jobs else jobs

    async def settle(self, want: int) -> list[GenerationJob] | None:
        """The batch has more room than it last said: ask for it, wait until the queue has
        pushed what it could (the one round trip, when jobs end, not every step), then take as
        ``exchange`` does.  A job waiting for a slot joins the step right after the slot frees."""
        if want > self.asked and not self.closed:
            await self._ask_now(want, settle=True)
        return self.exchange(want, take=True)

    async def wait(self, want: int) -> list[GenerationJob] | None:
        """The batch is empty: ask for ``want`` and wait for the first job, with whatever came
        along with it (up to ``want``)."""
        while not self.closed:
            await self._ask_now(want)
            if self.closed:
                break
            try:
                first = await self._job_or_command()
            except trio.EndOfChannel:
                self.closed = True
                break
            if first is None:  # a command came first: the thread runs it, then waits again
                return []
            self.asked -= 1
            _, jobs = self._drain(want - 1)
            if not answered(first):
                jobs.insert(0, first)
            self._ask(0)
            if jobs:
                return jobs
        return None

    async def _job_or_command(self) -> GenerationJob | None:
        """The next job, or None once a command has come (in ``commands``)."""
        self._take_commands()
        if self.commands:
            return None
        got: list[GenerationJob] = []
        ended: list[bool] = []
        async with trio.open_nursery() as nursery:

            async def job() -> None:
                try:
                    got.append(await self.recv.receive())
                except trio.EndOfChannel:
                    ended.append(True)
                nursery.cancel_scope.cancel()

            async def command() -> None:
                with contextlib.suppress(trio.EndOfChannel):
                    self.commands.append(await self._control.receive())
                nursery.cancel_scope.cancel()

            nursery.start_soon(job)
            nursery.start_soon(command)
        if ended and not got:
            raise trio.EndOfChannel
        return got[0] if got else None

    def _take_commands(self) -> None:
        while True:
            try:
                self.commands.append(self._control.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return

    def close(self) -> list[GenerationJob]:
        """The model has stopped: the jobs left in the channel and not answered yet, which the
        caller must answer; the channel closes, so the queue sends no more."""
        _, jobs = self._drain(self.recv.statistics().current_buffer_used)
        self._take_commands()
        for command in self.commands:  # never run: the model has stopped
            answer(command.reply, Failed(ShuttingDown()))
        self.commands.clear()
        self._control.close()
        self.control.close()
        self.recv.close()
        self.send.close()
        return jobs

    def _drain(self, limit: int) -> tuple[int, list[GenerationJob]]:
        received, jobs = 0, []
        while received < limit:
            try:
                job = self.recv.receive_nowait()
            except trio.WouldBlock:
                break
            except trio.EndOfChannel:
                self.closed = True
                break
            received += 1
            self.asked -= 1
            if not answered(job):
                jobs.append(job)
        return received, jobs

    def _ask(self, target: int) -> None:
        if self.closed or target == self.asked:
            return
        try:
            self.queue.send_nowait(Take(self.model, self.send, target - self.asked))
        except trio.WouldBlock:
            return  # the queue's inbox is full: asked again at the next crossing
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = True
            return
        self.asked = target

    async def _ask_now(self, target: int, *, settle: bool = False) -> None:
        if target == self.asked:
            return
        pushed_send, pushed = trio.open_memory_channel[None](0)
        with pushed:
            try:
                await self.queue.send(
                    Take(self.model, self.send, target - self.asked, pushed_send if settle else None)
                )
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.closed = True
                return
            self.asked = target
            if settle:
                with contextlib.suppress(trio.EndOfChannel):
                    await pushed.receive()


async def model_actor(
    model_id: str,
    make_backend: Callable[[], Backend],
    queue: trio.MemorySendChannel[QueueMessage],
    emit: Callable[[object], None],
    limits: Limits,
    *,
    task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``model_id`` until cancelled.  ``queue`` is this actor's own clone."""
    intake = JobIntake(model_id, queue, limits.max_batch)
    with queue:
        try:
            async with trio.open_nursery() as nursery:
                backend: Backend = await start_pinned(
                    nursery, f"model:{model_id}", serve_model, make_backend, intake, emit, limits=limits
                )
                task_status.started(
                    ModelInfo(
                        id=model_id,
                        context_window=backend.context_window,
                        has_chat_template=backend.tokenizer.has_chat_template,
                        sampling_defaults=dict(backend.sampling_defaults),
                        fingerprint=backend.fingerprint,
                        tokenizer=backend.tokenizer,
                        inbox=intake.control,
                        kernels=getattr(backend, "kernels", ""),
                        adapters=tuple(a.name for a in getattr(backend, "adapters", ()) if a.name),
                    )
                )
        finally:
            for job in intake.close():  # pushed to it, never taken
                answer(job.reply, Failed(ShuttingDown()))
            # nobody takes this model's jobs any more: never dropped (the jobs waiting for it
            # would never be answered), and prompt: the queue handles each message at once, so
            # the bound (shutdown is never held by it) is only ever reached by a stuck queue
            with trio.CancelScope(shield=True), trio.move_on_after(RETIRE_WAIT) as waited:
                with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                    await queue.send(Retire(model_id))
            if waited.cancelled_caught:
                log.error("model %s: the queue took no Retire in %g s; its waiting jobs are not answered",
                          model_id, RETIRE_WAIT)
