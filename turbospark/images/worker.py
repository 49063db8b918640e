"""An image model's thread: one pinned OS thread per model, one job at a time.

    pipeline = make()               # on this thread (MLX streams are thread-local)
    ready(pipeline)
    while True:
        check_cancelled()           # shutdown
        job = take()                # ONE crossing: waits for the model's next job
        if its route has gone:      # dropped before it starts
            continue
        run it: check() before the text encoder, every denoising step and the decode (a
        crossing: has the route gone? shutdown?); a Step per step, a Preview when asked

Jobs wait in the model's bounded queue, so two requests at once are served in turn.  A failure is
the job's own (``ImageFailed``; an unexpected one is a 500 and the traceback goes to the log) and
the thread keeps serving.  At shutdown the job under way is answered ``ShuttingDown``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..errors import GenerationFailed, RequestInvalid, ShuttingDown, TurboSparkError, inject
from ..messages import JobFault
from .messages import ImageFailed, ImageJob, ImageJobBegan, ImageJobEnded, Images, Preview, Step

__all__ = ["Stop", "serve_images"]

log = logging.getLogger("turbospark.images")


class Stop(Exception):
    """The job's client has left: stop it here."""


def _gone(job: ImageJob) -> bool:
    return job.reply.statistics().open_receive_channels == 0


def serve_images(
    make: Callable[[], Any],
    take: Callable[[], Awaitable[ImageJob | None]],
    emit: Callable[[object], None],
    ready: Callable[[Any], None],
) -> None:
    pipeline = make()
    trio.from_thread.run_sync(ready, pipeline)
    while True:
        trio.from_thread.check_cancelled()
        job = trio.from_thread.run(take)
        if job is None:
            return
        _run(pipeline, job, emit)


def _run(pipeline: Any, job: ImageJob, emit: Callable[[object], None]) -> None:
    began = time.monotonic()
    steps = 0
    args: Any = job.args

    def end(outcome: str, phase: str, images: int = 0) -> None:
        event = ImageJobEnded(pipeline.model_id, job.kind, outcome, phase, time.monotonic() - began, steps, images)
        trio.from_thread.run_sync(emit, event)

    def deliver(message: object, *, last: bool = False) -> None:
        try:
            job.reply.send_nowait(message)  # type: ignore[arg-type]
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            pass
        if last:
            job.reply.close()

    def alive() -> None:
        if _gone(job):
            raise Stop()

    def check() -> None:
        trio.from_thread.check_cancelled()
        trio.from_thread.run_sync(alive)

    def step(done: int, total: int) -> None:
        nonlocal steps
        steps = done
        trio.from_thread.run_sync(deliver, Step(done, total))

    def preview(index: int, images: list[Any]) -> None:
        trio.from_thread.run_sync(deliver, Preview(index, images))

    if trio.from_thread.run_sync(_gone, job):
        trio.from_thread.run_sync(job.reply.close)
        end("cancelled", "queued")
        return
    trio.from_thread.run_sync(emit, ImageJobBegan(pipeline.model_id))
    try:
        inject("image job")
        tokens = pipeline.tokens(args.prompt)
        if tokens > pipeline.max_prompt_tokens:
            raise RequestInvalid(
                f"the prompt is {tokens} tokens; this model reads at most {pipeline.max_prompt_tokens}", param="prompt"
            )
        images = pipeline.generate(args, check, preview if args.partial_images else None, progress=step)
        trio.from_thread.run_sync(lambda: deliver(Images(images, tokens, args.seed), last=True))
        end("done", "running", len(images))
    except Stop:
        trio.from_thread.run_sync(job.reply.close)
        end("cancelled", "running")
    except trio.Cancelled:
        try:
            trio.from_thread.run_sync(lambda: deliver(ImageFailed(ShuttingDown()), last=True))
            end("shutdown", "running")
        except trio.RunFinishedError:  # the run is over: nobody is left to tell
            pass
        raise
    except TurboSparkError as exc:
        trio.from_thread.run_sync(lambda: deliver(ImageFailed(exc), last=True))
        end("failed", "running")
    except Exception:
        error = GenerationFailed.new("image generation failed")
        log.exception("image model %s: %s job failed (error id %s)", pipeline.model_id, job.kind, error.error_id)
        trio.from_thread.run_sync(emit, JobFault(pipeline.model_id, error.error_id, "image"))
        trio.from_thread.run_sync(lambda: deliver(ImageFailed(error), last=True))
        end("failed", "running")
