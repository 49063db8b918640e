"""The embedding actor: owns one encoder's inbox and its pinned OS thread, from load to shutdown.

Inbox: ``EmbeddingJob`` (a route's request for vectors), sent with ``send_nowait`` by
``System.embed``: the inbox holds ``max_queue`` jobs, and a full one is a 503 ``queue_full`` at
once.  The actor starts the thread (``trio.to_thread.run_sync`` once, never abandoned), waits until
it has loaded the encoder, and only then reports ready with ``task_status.started(EncoderInfo)``.
The thread takes jobs from the inbox through ``take``: waiting for the first when it has nothing
to do, and without waiting, all that wait (up to what it may hold), before every forward pass.

At shutdown (its cancel scope cancelled) the thread answers what it holds ``ShuttingDown``, and
the actor answers the jobs still in the inbox the same way, then closes it: a later job finds it
closed and its route answers ``ShuttingDown`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import attrs
import trio

from ..errors import ShuttingDown
from ..messages import EmbeddingJob, Failed
from ..threads.encoder_thread import EmbeddingLimits, serve_encoder
from ..model.encoder import Encoder
from ._mailbox import answer

__all__ = ["EncoderInfo", "embedding_actor"]


@attrs.frozen
class EncoderInfo:
    """What the rest of the system may know about a loaded encoder."""

    id: str
    dimensions: int
    max_tokens: int
    fingerprint: str


async def embedding_actor(
    model_id: str,
    make_encoder: Callable[[], Encoder],
    inbox: trio.MemoryReceiveChannel[EmbeddingJob],
    emit: Callable[[object], None],
    limits: EmbeddingLimits,
    *,
    task_status: trio.TaskStatus[EncoderInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``model_id``'s embedding jobs until cancelled."""

    async def take(count: int, wait: bool) -> list[EmbeddingJob] | None:
        jobs: list[EmbeddingJob] = []
        try:
            if wait:
                jobs.append(await inbox.receive())
            while len(jobs) < count:
                jobs.append(inbox.receive_nowait())
        except trio.WouldBlock:
            pass
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return jobs or None
        return jobs

    ready_send, ready_recv = trio.open_memory_channel[Encoder](1)
    with inbox, ready_recv:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(
                        trio.to_thread.run_sync,
                        serve_encoder,
                        make_encoder,
                        take,
                        emit,
                        ready_send.send_nowait,
                        limits,
                        thread_name=f"encoder:{model_id}",
                        abandon_on_cancel=False,
                    )
                )
                encoder = await ready_recv.receive()
                task_status.started(
                    EncoderInfo(
                        id=model_id,
                        dimensions=encoder.dimensions,
                        max_tokens=encoder.max_tokens,
                        fingerprint=encoder.fingerprint,
                    )
                )
        finally:
            while True:  # nobody will run these any more
                try:
                    job = inbox.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                answer(job.reply, Failed(ShuttingDown()))
