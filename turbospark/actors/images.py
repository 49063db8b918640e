"""The images actor: owns the loaded image models, their threads and their queues.

Inbox: ``AttachImages``, ``DetachImages`` (from a model's life, which the resolver runs) and
``SubmitImage`` (from routes).

    images_actor (its own nursery)
    └── worker × models   each starts one pinned thread (trio.to_thread.run_sync, never
                          abandoned) that loads the pipeline, then runs the model's jobs one at a
                          time from its bounded queue (``queue_size``, the server's --max-queue;
                          full: the retryable 503 chat answers, with Retry-After)

A route's job goes straight on to the model's queue; the thread answers the route on the job's
reply channel, whose receive end the route holds in its request scope: a client that leaves
closes it, and the thread drops the job before it starts or stops it before its next denoising
step.  Which image models are attached is the resolver's to decide (decision 0016): a model's
life attaches it when a request names it and detaches it when idle (answered once its thread has
ended), so every model kind shares one LRU budget and keep-alive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import trio

from ..errors import QueueFull, ShuttingDown, TurboSparkError
from ..images.messages import ImageBusyEvent, ImageFailed, ImageInfo, ImageJob, ImageModelsChanged
from ..images.worker import serve_images
from ._mailbox import answer
from ._threaded import ThreadedModels

__all__ = ["AttachImages", "DetachImages", "ImageMessage", "SubmitImage", "images_actor"]


@attrs.frozen
class AttachImages:
    """Load an image model on a thread of its own (``make`` builds its pipeline there);
    answered with its ``ImageInfo`` or the error."""

    id: str
    make: Callable[[], Any]
    reply: trio.MemorySendChannel[ImageInfo | TurboSparkError]


@attrs.frozen
class DetachImages:
    """Stop ``model``'s thread; answered (None) once it has ended."""

    model: str
    reply: trio.MemorySendChannel[None]


@attrs.frozen
class SubmitImage:
    job: ImageJob


ImageMessage = AttachImages | DetachImages | SubmitImage


def _info_of(model_id: str, pipeline: Any) -> ImageInfo:
    return ImageInfo(
        id=model_id, created=int(time.time()), multiple=pipeline.multiple, patch=pipeline.multiple,
        can_edit=pipeline.can_edit, default_steps=pipeline.default_steps, default_size=pipeline.default_size,
        max_prompt_tokens=pipeline.max_prompt_tokens,
    )  # fmt: skip


async def images_actor(
    inbox: trio.MemoryReceiveChannel[ImageMessage],
    emit: Callable[[object], None],
    *,
    queue_size: int = 8,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve image jobs until cancelled."""

    def changed() -> None:
        emit(ImageModelsChanged(len(models)))

    threads = ThreadedModels[ImageInfo, ImageJob](
        "images", serve_images, _info_of, lambda job: answer(job.reply, ImageFailed(ShuttingDown())), emit, changed,
        queue_size,
    )  # fmt: skip
    models = threads.models

    def submit(job: ImageJob) -> None:
        entry = models.get(job.model)
        try:
            if entry is None:
                raise ShuttingDown()  # its life ended between the route's lease and now
            entry.queue.send_nowait(job)
        except trio.WouldBlock:
            emit(ImageBusyEvent(job.model))
            answer(job.reply, ImageFailed(QueueFull(job.model, queue_size)))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            answer(job.reply, ImageFailed(ShuttingDown()))
        except TurboSparkError as exc:
            answer(job.reply, ImageFailed(exc))

    async with trio.open_nursery() as nursery:
        changed()
        task_status.started()
        with inbox:
            try:
                async for msg in inbox:
                    if isinstance(msg, SubmitImage):
                        submit(msg.job)
                    elif isinstance(msg, AttachImages):
                        nursery.start_soon(threads.attach, msg.id, msg.make, msg.reply, nursery)
                    elif isinstance(msg, DetachImages):
                        nursery.start_soon(threads.detach, msg.model, msg.reply)
            finally:
                while True:  # what still waits is answered: the server is stopping
                    try:
                        msg = inbox.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                        break
                    if isinstance(msg, SubmitImage):
                        answer(msg.job.reply, ImageFailed(ShuttingDown()))
                    elif isinstance(msg, DetachImages):
                        answer(msg.reply, None)
                    else:
                        answer(msg.reply, ShuttingDown())
        nursery.cancel_scope.cancel()
