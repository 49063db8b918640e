"""The model thread: its loop, and the only code that crosses from it into Trio.

One pinned OS thread per model loads the backend and runs every generation for it (MLX streams
are thread-local, and the KV caches stay with the thread).  It never touches a Trio object
directly; everything goes through ``trio.from_thread``.  Its loop:

    while True:
        start()     # admitted jobs whose routes have had Started enter the engine
        step()      # one engine step: a prefill chunk for newcomers, one decode step for the rest
        admit()     # waiting jobs get slots when the batch has room (slots and KV budget)
        exchange()  # one crossing into Trio: every job's news out, leaving clients and new
                    # jobs in
        if new jobs: accept, admit, and one more crossing: their Started (or refusal) out

The batch itself (jobs, sequences, admission, endings) is ``_batch.Batch``; this module is the
loop and its crossings.

- The crossing is one ``from_thread.run_sync`` per step.  On the Trio side it emits the step's
  observer events, then, for every job, sends its replies with ``send_nowait`` (a ``Delta`` per
  decode step, even an empty one) or, for a job still in prefill or waiting for room, asks
  whether its route still listens (``statistics().open_receive_channels``).  A
  ``BrokenResourceError`` or a closed receive end marks the job as gone: the thread removes it
  from the batch before the next step.  That is the whole cancellation protocol, one step per
  sequence, whoever shares the batch.
- New jobs come through the model's ``Intake`` (its end of its jobs channel, see
  ``actors/models.py``), in the same crossing: the jobs the queue has already pushed, up to the
  batch's free slots, taken with ``receive_nowait``; no round trip to the queue.  Two crossings
  wait (``from_thread.run``): the one after the batch's room grew (jobs ended), until the queue
  has pushed what it could for it, and, with nothing to run, the one that waits for a job.
- ``check_cancelled()`` runs before every step: shutdown stops the loop within one step, and
  every sequence still running or waiting is answered ``Failed(ShuttingDown)``.
- It never waits on a client: the route sizes the reply buffer to hold every message a job can
  send (Started, one ``Delta`` per token of the budget, Finished), so a client that stays
  connected but stops reading cannot stall the batch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import attrs
import trio

from ..errors import GenerationFailed, inject
from ..messages import Failed, GenerationJob, JobFault, Progress
from ._admission import Admission
from ._batch import Batch, News
from ..model.backend import Backend
from ..model.prompt_slots import SlotError

__all__ = ["Intake", "Limits", "deliver", "serve_model"]

log = logging.getLogger("turbospark.model")


class Intake(Protocol):
    """Where a model thread's jobs come from; called on the Trio thread, inside a crossing.

    ``want`` is how many more jobs the batch has room for now (0: none, while a job waits for
    room).  ``exchange`` hands over, when ``take``, up to ``want`` jobs that are there already,
    and tells the queue how many more it may send; ``settle`` (the room grew) first waits until
    the queue has sent what it could; ``wait`` (the batch is empty) returns once at least one
    job is there.  All return None once the queue has closed (shutdown)."""

    def exchange(self, want: int, take: bool) -> list[GenerationJob] | None: ...

    def settle(self, want: int) -> Awaitable[list[GenerationJob] | None]: ...

    def wait(self, want: int) -> Awaitable[list[GenerationJob] | None]: ...


def deliver(
    emit: Callable[[object], None],
    events: Iterable[object],
    news: Iterable[tuple[trio.MemorySendChannel[Any], list[Any], bool]],
) -> list[int]:
    """One crossing's work on the Trio thread (model and encoder threads alike): emit the
    events, send each reply channel its messages (or, with none, ask whether its route still
    listens), close the ended ones; the indices of the channels whose routes are gone."""
    for event in events:
        emit(event)
    gone = []
    for i, (reply, messages, close) in enumerate(news):
        try:
            if not messages and reply.statistics().open_receive_channels == 0:
                gone.append(i)
            for message in messages:
                if isinstance(message, Progress) and reply.statistics().current_buffer_used:
                    continue  # a report goes only into an empty buffer: never in a reply's way
                inject("delivery")
                reply.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            gone.append(i)
        except Exception:  # that job's delivery failed: it ends with a 500, the others go on
            error = GenerationFailed.new()
            log.exception("delivering a reply failed (error id %s)", error.error_id)
            emit(JobFault("", error.error_id))
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                reply.send_nowait(Failed(error))
            reply.close()
            gone.append(i)
            continue
        if close:
            reply.close()
    return gone


def _answer_all(answers: list[tuple[Any, object]]) -> None:
    for reply, message in answers:
        with reply:
            try:
                reply.send_nowait(message)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                pass


@attrs.frozen
class Limits:
    """How much one model thread runs at once (from ``Settings``)."""

    max_batch: int
    kv_budget: int  # bytes of KV cache the running batch may grow to
    special_tokens_in_content: bool = False  # --special-tokens-in-content: trust content's markup


def serve_model(
    make_backend: Callable[[], Backend],
    intake: Intake,
    emit: Callable[[object], None],
    ready: Callable[[Backend], None],
    limits: Limits,
) -> None:
    """Body of a model thread: load, say ready, then run batches until shutdown."""
    backend = make_backend()
    trio.from_thread.run_sync(ready, backend)
    admission = Admission(limits.max_batch, limits.kv_budget, backend.kv_estimate)
    try:
        _Loop(Batch(backend, admission, limits.special_tokens_in_content), intake, emit).run()
    finally:
        _persist(backend)
        if (close := getattr(backend, "close", None)) is not None:
            close()  # a sharded model's other ranks end with it (``model/sharded.py``)


def _persist(backend: Backend) -> None:
    """The prefix cache to disk, where the backend keeps one there (``--prompt-cache-dir``),
    when the model unloads or the server stops."""
    persist = getattr(backend, "persist", None)
    if persist is not None:
        try:
            persist()
        except Exception:
            log.exception("model %s: the prompt cache could not be written", backend.model_id)


class _Loop:
    def __init__(self, batch: Batch, intake: Intake, emit: Callable[[object], None]) -> None:
        self.batch = batch
        self.intake = intake
        self.emit = emit
        self.queue_open = True
        self.told = 0  # the room last told to the intake (none right after taking jobs)

    def run(self) -> None:
        batch = self.batch
        try:
            while True:
                trio.from_thread.check_cancelled()
                batch.start()
                if batch.running:
                    batch.step()
                batch.admit()
                if batch.idle and not self.queue_open:
                    self._exchange(0, take=False)
                    return
                jobs = self._exchange(self._want(), take=True, wait=batch.idle)
                self._run_commands()
                if jobs:
                    for job in jobs:
                        batch.accept(job)
                    batch.admit()
                    self._exchange(self._want(), take=False)  # Started (or a refusal) before any prefill
        except BaseException:
            batch.shut()
            self._last_words()
            raise

    def _want(self) -> int:
        """How many more jobs to let in: the batch's free slots, none while one waits for room."""
        if not self.queue_open or self.batch.waiting:
            return 0
        return self.batch.admission.free_slots()

    def _exchange(self, want: int, *, take: bool, wait: bool = False) -> list[GenerationJob]:
        """One crossing: deliver every job's news, drop the jobs whose routes left, tell the
        intake how much room there is and (``take``) take the jobs that are there, or (``wait``:
        nothing runs) wait for one."""
        jobs, news, events = self.batch.outgoing()
        if wait:
            gone, taken = trio.from_thread.run(self._trio_wait, events, news, want)
        elif take and want > self.told and self.queue_open:
            gone, taken = trio.from_thread.run(self._trio_settle, events, news, want)
        else:
            gone, taken = trio.from_thread.run_sync(self._trio_exchange, events, news, want, take)
        self.told = 0 if taken else want
        self.batch.departed(jobs, gone)
        if taken is None:
            self.queue_open = False  # the queue closed: shutdown is under way
            return []
        return taken

    def _trio_exchange(
        self, events: list[object], news: list[News], want: int, take: bool
    ) -> tuple[list[int], list[GenerationJob] | None]:
        gone = deliver(self.emit, events, news)
        return gone, self.intake.exchange(want, take) if self.queue_open else []

    async def _trio_settle(
        self, events: list[object], news: list[News], want: int
    ) -> tuple[list[int], list[GenerationJob] | None]:
        gone = deliver(self.emit, events, news)
        return gone, await self.intake.settle(want)

    async def _trio_wait(
        self, events: list[object], news: list[News], want: int
    ) -> tuple[list[int], list[GenerationJob] | None]:
        gone = deliver(self.emit, events, news)
        return gone, await self.intake.wait(want)

    def _run_commands(self) -> None:
        """The slot commands the last crossing brought (``SlotCommand``), run here on the model
        thread, which owns the prefix cache; their answers go out in one crossing."""
        commands = getattr(self.intake, "commands", None)
        if not commands:
            return
        todo = list(commands)
        commands.clear()
        run = getattr(self.batch.backend, "slot_command", None)
        answers: list[tuple[Any, object]] = []
        for command in todo:
            try:
                if run is None:
                    raise SlotError(501, "not_supported_error", "This model does not support slots")
                answers.append((command.reply, run(command.action, command.slot, command.filename)))
            except Exception as exc:  # a SlotError says why; anything else fails this command only
                log.warning("model %s: slot %s failed: %s", self.batch.backend.model_id, command.action, exc)
                answers.append((command.reply, exc))
        trio.from_thread.run_sync(_answer_all, answers)

    def _last_words(self) -> None:
        """The final crossing after ``Batch.shut``: every job's ending out."""
        try:
            _, news, events = self.batch.outgoing()
            trio.from_thread.run_sync(deliver, self.emit, events, news)
        except BaseException:  # the Trio side is gone already; nothing more can be said
            log.debug("model %s: final replies could not be delivered", self.batch.backend.model_id)
