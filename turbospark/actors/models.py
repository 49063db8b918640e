"""The model actor: owns one model's pinned OS thread, from load to shutdown.

``model_actor`` starts the thread (``trio.to_thread.run_sync`` once, never abandoned: an
abandoned MLX thread would keep computing and holding memory), waits until the thread has loaded
the backend, and only then reports ready through ``task_status.started(ModelInfo)``.  The thread
pulls jobs from the generation queue with ``Take``: waiting for the first when its batch is empty,
and without waiting, for as many as it has room for, while a batch runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import attrs
import trio

from ..errors import ShuttingDown
from ..messages import Failed, GenerationJob, Retire, Take
from ..model.tokenizer import Tokenizer
from ..model._worker import Limits, serve_model
from ..model.backend import Backend
from ._mailbox import answer
from .generation import QueueMessage

__all__ = ["ModelInfo", "model_actor"]


@attrs.frozen
class ModelInfo:
    """What the rest of the system may know about a loaded model."""

    id: str
    context_window: int
    has_chat_template: bool
    sampling_defaults: dict[str, float]
    fingerprint: str
    tokenizer: Tokenizer


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

    async def take(count: int, wait: bool) -> list[GenerationJob] | None:
        job_send, job_recv = trio.open_memory_channel[list[GenerationJob]](1)
        with job_recv:
            try:
                await queue.send(Take(model_id, job_send, count, wait))
                return await job_recv.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
                return None
            finally:
                # Cancelled (shutdown) just as the queue handed jobs over: answer them.
                try:
                    orphans = job_recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    orphans = []
                for orphan in orphans:
                    answer(orphan.reply, Failed(ShuttingDown()))

    ready_send, ready_recv = trio.open_memory_channel[Backend](1)
    with queue, ready_recv:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(
                        trio.to_thread.run_sync,
                        serve_model,
                        make_backend,
                        take,
                        emit,
                        ready_send.send_nowait,
                        limits,
                        thread_name=f"model:{model_id}",
                        abandon_on_cancel=False,
                    )
                )
                backend = await ready_recv.receive()
                task_status.started(
                    ModelInfo(
                        id=model_id,
                        context_window=backend.context_window,
                        has_chat_template=backend.tokenizer.has_chat_template,
                        sampling_defaults=dict(backend.sampling_defaults),
                        fingerprint=backend.fingerprint,
                        tokenizer=backend.tokenizer,
                    )
                )
        finally:
            try:
                queue.send_nowait(Retire(model_id))  # nobody takes this model's jobs any more
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass
