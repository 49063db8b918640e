"""The audio jobs actor: owns the audio models, their worker threads and queues, and the jobs.

Inbox: ``ResolveAudio``, ``SubmitAudio``, ``ListAudio``, ``StartJob``, ``GetJob``, ``DeleteJob``
(``turbospark/audio/messages.py``); ``AttachModel``, ``DetachModel`` and ``HeldJob`` (here).

    audio_actor (its own nursery)
    ├── worker × models   each starts one pinned thread (trio.to_thread.run_sync, never
    │                     abandoned) that loads the engine, then takes work from the model's
    │                     bounded queue (``queue_size``; full: 429 with Retry-After at once)
    └── job × running     an async job: submits its work like a route would, keeps the result

A route's work goes straight on to the model's queue; the worker answers the route on the work's
reply channel.  An async job's reply channel belongs to its job task: ``DELETE`` cancels that
task, which closes the channel, so the worker drops the work before it starts or stops it at its
next step (the original server let running work finish and threw the result away).
Which audio models are attached is the resolver's to decide (decision 0016): it attaches a model
when a request needs it (``AttachModel``: a new worker, started without blocking the inbox,
answered once the engine is loaded) and detaches it when idle (``DetachModel``: answered once its
thread has ended).  An async job holds a lease on its model for as long as it runs (``HeldJob``:
the actor lets the lease go when the job ends), so a model is never detached under a job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import trio

from ..errors import ModelNotFound, NotFound, RequestInvalid, ShuttingDown, TurboSparkError
from ..audio.engines import AudioSpec, Engine, Task
from ..audio.jobs import JobStore
from ..audio.messages import (
    AudioBusyEvent,
    AudioInfo,
    AudioModelsChanged,
    AudioWork,
    DeleteJob,
    GetJob,
    JobsChanged,
    ListAudio,
    ResolveAudio,
    StartJob,
    SubmitAudio,
    WorkDone,
    WorkFailed,
    WorkReply,
)
from ..audio.wire import OPENAI_STT_NAMES, OPENAI_TTS_NAMES
from ..messages import JobFault
from ..audio.worker import serve_audio
from ._mailbox import answer
from ._threaded import ThreadedModels

__all__ = ["AttachModel", "AudioBusy", "AudioMessage", "Conflict", "DetachModel", "Gone", "HeldJob", "audio_actor"]

log = logging.getLogger("turbospark.audio")



@attrs.frozen
class AttachModel:
    """Load ``spec`` on a worker of its own; answered with its ``AudioInfo`` or the error."""

    spec: AudioSpec
    reply: trio.MemorySendChannel[AudioInfo | TurboSparkError]


@attrs.frozen
class DetachModel:
    """Stop ``model``'s worker; answered (None) once its thread has ended."""

    model: str
    reply: trio.MemorySendChannel[None]


@attrs.frozen
class HeldJob:
    """``start``, whose sender holds a lease on the job's model: ``release`` lets it go, called
    once when the job ends (or is refused)."""

    start: StartJob
    release: Callable[[], None]


AudioMessage = (
    ResolveAudio | SubmitAudio | ListAudio | AttachModel | DetachModel | StartJob | HeldJob | GetJob | DeleteJob
)

_TASK_WORDS = {"speech_to_text": "speech-to-text", "text_to_speech": "text-to-speech", "music_generation": "music"}


class AudioBusy(TurboSparkError):
    status = 429
    type = "invalid_request_error"
    retry_after = 2

    def __init__(self) -> None:
        super().__init__("the audio queue is full; retry shortly")


class Conflict(TurboSparkError):
    status = 409
    type = "invalid_request_error"


class Gone(TurboSparkError):
    status = 410
    type = "invalid_request_error"


def _not_found(name: str) -> ModelNotFound:
    return ModelNotFound(name, [])


@contextmanager
def _refusing_at_exit(inbox: trio.MemoryReceiveChannel[Any]) -> Iterator[None]:
    """What still waits in the inbox when the actor ends is answered: the server is stopping."""
    try:
        yield
    finally:
        while True:
            try:
                msg = inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if isinstance(msg, HeldJob):
                msg.release()
                msg = msg.start
            if isinstance(msg, SubmitAudio):
                answer(msg.work.reply, WorkFailed(ShuttingDown()))
            elif isinstance(msg, DetachModel):
                answer(msg.reply, None)
            elif isinstance(msg, ListAudio):
                answer(msg.reply, [])
            else:
                answer(msg.reply, ShuttingDown())


async def audio_actor(
    specs: Sequence[AudioSpec],
    inbox: trio.MemoryReceiveChannel[Any],
    emit: Callable[[object], None],
    *,
    queue_size: int = 4,
    jobs: JobStore | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve audio until cancelled, with ``specs`` attached from the start (tests; ``serve``
    attaches its models through the resolver)."""
    store = jobs or JobStore()
    job_scopes: dict[str, trio.CancelScope] = {}

    def changed() -> None:
        emit(AudioModelsChanged(len(models)))

    def describe(model_id: str, engine: Engine) -> AudioInfo:
        return AudioInfo(
            id=model_id, task=engine.task, created=int(time.time()),
            voices=tuple(getattr(engine, "voices", ())), sample_rate=int(getattr(engine, "sample_rate", 0)),
        )  # fmt: skip

    threads = ThreadedModels[AudioInfo, AudioWork](
        "audio", serve_audio, describe, lambda work: answer(work.reply, WorkFailed(ShuttingDown())), emit, changed,
        queue_size,
    )  # fmt: skip
    models = threads.models

    def jobs_changed() -> None:
        emit(JobsChanged(store.counts()))

    def resolve(name: str, task: Task) -> AudioInfo:
        entry = models.get(name)
        if entry is None:
            defaults = OPENAI_STT_NAMES if task == "speech_to_text" else OPENAI_TTS_NAMES if task == "text_to_speech" else ()
            if name in defaults:
                entry = next((m for m in models.values() if m.info.task == task), None)
        if entry is None:
            raise _not_found(name)
        if entry.info.task != task:
            raise RequestInvalid(
                f"model '{entry.info.id}' is a {_TASK_WORDS[entry.info.task]} model, not a {_TASK_WORDS[task]} one",
                param="model",
            )
        return entry.info

    def submit(work: AudioWork) -> None:
        entry = models.get(work.model)
        try:
            if entry is None:
                raise _not_found(work.model)
            entry.queue.send_nowait(work)
        except trio.WouldBlock:
            emit(AudioBusyEvent(work.model))
            answer(work.reply, WorkFailed(AudioBusy()))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            answer(work.reply, WorkFailed(ShuttingDown()))
        except TurboSparkError as exc:
            answer(work.reply, WorkFailed(exc))

    async def run_job(msg: StartJob, job: Any, recv: trio.MemoryReceiveChannel[WorkReply],
                      release: Callable[[], None], *, task_status: trio.TaskStatus[None]) -> None:  # fmt: skip
        scope = job_scopes[job.id] = trio.CancelScope()
        pcm: list[bytes] = []
        try:
            with scope, recv:
                task_status.started()
                # A job waits for room in its model's queue (the job store bounds how many wait)
                entry = models.get(msg.work.model)
                try:
                    if entry is None:
                        raise _not_found(msg.work.model)
                    await entry.queue.send(msg.work)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    answer(msg.work.reply, WorkFailed(ShuttingDown()))
                except TurboSparkError as exc:
                    answer(msg.work.reply, WorkFailed(exc))
                try:
                    async for reply in recv:
                        if isinstance(reply, WorkFailed):
                            store.fail(job, reply.error.status, reply.error.message, trio.current_time())
                            break
                        if isinstance(reply, WorkDone):
                            body, content_type = msg.render(reply.transcript if reply.transcript else b"".join(pcm))
                            store.succeed(job, body, content_type, trio.current_time())
                            break
                        pcm.append(reply.pcm)
                    else:
                        store.fail(job, 503, ShuttingDown().message, trio.current_time())
                except Exception as exc:  # a result that cannot be rendered fails its job alone
                    log.exception("audio job %s failed", job.id)
                    emit(JobFault(msg.work.model, job.id, "audio"))
                    store.fail(job, 500, f"internal error: {type(exc).__name__}", trio.current_time())
            job_scopes.pop(job.id, None)
            jobs_changed()
        finally:
            release()

    async def start_job(msg: StartJob, release: Callable[[], None], now: float, nursery: trio.Nursery) -> None:
        if msg.work.model not in models:
            release()
            answer(msg.reply, _not_found(msg.work.model))
        elif not store.has_room():
            release()
            emit(AudioBusyEvent(msg.work.model))
            answer(msg.reply, AudioBusy())
        else:
            job = store.add(msg.kind, msg.work.model, created=int(time.time()), now=now)
            send, recv = trio.open_memory_channel[WorkReply](64)
            work = attrs.evolve(msg.work, reply=send)
            await nursery.start(run_job, attrs.evolve(msg, work=work), job, recv, release)
            jobs_changed()
            answer(msg.reply, job.describe())

    async with trio.open_nursery() as nursery:
        for spec in specs:
            await nursery.start(threads.run, spec.id, spec.make)
        changed()
        jobs_changed()
        task_status.started()
        with inbox, _refusing_at_exit(inbox):
            async for msg in inbox:
                now = trio.current_time()
                if isinstance(msg, SubmitAudio):
                    submit(msg.work)
                elif isinstance(msg, ResolveAudio):
                    try:
                        answer(msg.reply, resolve(msg.name, msg.task))
                    except TurboSparkError as exc:
                        answer(msg.reply, exc)
                elif isinstance(msg, ListAudio):
                    answer(msg.reply, [m.info for m in models.values()])
                elif isinstance(msg, AttachModel):
                    nursery.start_soon(threads.attach, msg.spec.id, msg.spec.make, msg.reply, nursery)
                elif isinstance(msg, DetachModel):
                    nursery.start_soon(threads.detach, msg.model, msg.reply)
                elif isinstance(msg, StartJob):
                    await start_job(msg, lambda: None, now, nursery)
                elif isinstance(msg, HeldJob):
                    await start_job(msg.start, msg.release, now, nursery)
                elif isinstance(msg, GetJob):
                    found = store.get(msg.job_id, now)
                    if found is None:
                        answer(msg.reply, NotFound("no such job", param="id"))
                    elif msg.want == "describe":
                        answer(msg.reply, found.describe())
                    elif found.status == "running":
                        answer(msg.reply, Conflict(f"job is still running; poll /v1/audio/jobs/{found.id}"))
                    elif found.status == "cancelled":
                        answer(msg.reply, Gone("job was cancelled"))
                    elif found.status == "failed":
                        error = TurboSparkError(found.error_message)
                        error.status = found.error_status
                        answer(msg.reply, error)
                    else:
                        answer(msg.reply, (found.result, found.content_type))
                elif isinstance(msg, DeleteJob):
                    found = store.get(msg.job_id, now)
                    if found is None:
                        answer(msg.reply, NotFound("no such job", param="id"))
                    elif found.status == "running":
                        store.cancel(found, now)
                        if (scope := job_scopes.get(found.id)) is not None:
                            scope.cancel()
                        jobs_changed()
                        answer(msg.reply, {"id": found.id, "status": "cancelled"})
                    else:
                        store.remove(found)
                        jobs_changed()
                        answer(msg.reply, {"id": found.id, "deleted": True})
        nursery.cancel_scope.cancel()
