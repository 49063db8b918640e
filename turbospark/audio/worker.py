"""An audio model's worker thread: one pinned OS thread per model, one job at a time.

    engine = make()                 # on this thread (MLX streams are thread-local)
    ready(engine)
    while True:
        check_cancelled()           # shutdown
        work = take()               # ONE crossing: waits for the model's next work item
        if its route has gone:      # dropped before it starts
            continue
        run it, calling check() before every step (a crossing: has the route gone? shutdown?)

- Speech-to-text answers one ``WorkDone(transcript)``; text-to-speech sends a ``Chunk`` per
  sentence (a blocking send: a slow reader holds the voice back, never memory) then ``WorkDone``.
- A failure is the work's own (``WorkFailed``; an unexpected one is a 500 and the traceback goes
  to the log) and the thread keeps serving.
- At shutdown the work under way is answered ``ShuttingDown``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import trio

from ..errors import GenerationFailed, ShuttingDown, TurboSparkError, inject
from ..messages import JobFault
from .engines import Engine, Stop
from .messages import AudioWork, AudioWorkBegan, AudioWorkEnded, Chunk, Synthesize, WorkDone, WorkFailed

__all__ = ["serve_audio"]

log = logging.getLogger("turbospark.audio")


def _gone(work: AudioWork) -> bool:
    return work.reply.statistics().open_receive_channels == 0


def serve_audio(
    make: Callable[[], Engine],
    take: Callable[[], Awaitable[AudioWork | None]],
    emit: Callable[[object], None],
    ready: Callable[[Engine], None],
) -> None:
    engine = make()
    trio.from_thread.run_sync(ready, engine)
    while True:
        trio.from_thread.check_cancelled()
        work = trio.from_thread.run(take)
        if work is None:
            return
        _run(engine, work, emit)


def _run(engine: Engine, work: AudioWork, emit: Callable[[object], None]) -> None:
    began = time.monotonic()

    def end(outcome: str, phase: str, audio_seconds: float = 0.0) -> None:
        event = AudioWorkEnded(engine.model_id, work.endpoint, outcome, phase, time.monotonic() - began, audio_seconds)  # type: ignore[arg-type]
        trio.from_thread.run_sync(emit, event)

    def deliver(message: object) -> None:
        try:
            work.reply.send_nowait(message)  # type: ignore[arg-type]
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            pass
        if isinstance(message, (WorkDone, WorkFailed)):
            work.reply.close()

    def alive() -> None:
        if _gone(work):
            raise Stop()

    def check() -> None:
        trio.from_thread.check_cancelled()
        trio.from_thread.run_sync(alive)

    if trio.from_thread.run_sync(_gone, work):
        trio.from_thread.run_sync(work.reply.close)
        end("cancelled", "queued")
        return
    trio.from_thread.run_sync(emit, AudioWorkBegan(engine.model_id, work.endpoint))
    try:
        inject("audio job")
        if isinstance(work.args, Synthesize):
            samples = 0
            for pcm in engine.synthesize(work.args.text, work.args.voice, work.args.speed, check):  # type: ignore[union-attr]
                samples += len(pcm) // 2
                try:
                    trio.from_thread.run(work.reply.send, Chunk(pcm))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    raise Stop() from None
            trio.from_thread.run_sync(deliver, WorkDone())
            end("done", "running", samples / engine.sample_rate)  # type: ignore[union-attr]
        else:
            args = work.args
            transcript = engine.transcribe(args.audio, args.language, check, prefix=args.prefix)  # type: ignore[union-attr]
            trio.from_thread.run_sync(deliver, WorkDone(transcript))
            end("done", "running", transcript.duration)
    except Stop:
        trio.from_thread.run_sync(work.reply.close)
        end("cancelled", "running")
    except trio.Cancelled:
        try:
            trio.from_thread.run_sync(deliver, WorkFailed(ShuttingDown()))
            end("shutdown", "running")
        except BaseException:
            pass
        raise
    except TurboSparkError as exc:
        trio.from_thread.run_sync(deliver, WorkFailed(exc))
        end("failed", "running")
    except Exception:
        error = GenerationFailed.new(f"{engine.task.replace('_', '-')} failed")
        log.exception("audio model %s: %s work failed (error id %s)", engine.model_id, work.endpoint, error.error_id)
        trio.from_thread.run_sync(emit, JobFault(engine.model_id, error.error_id, "audio"))
        trio.from_thread.run_sync(deliver, WorkFailed(error))
        end("failed", "running")
