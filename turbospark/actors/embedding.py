"""The embedding actor: owns one encoder's inbox and its pinned OS thread, from load to shutdown.

Inbox: ``EmbeddingJob`` (a route's request for vectors), sent with ``send_nowait`` by
``System.embed``: the inbox holds ``max_queue`` jobs, and a full one is a 503 ``queue_full`` at
once.  The actor starts the thread (``trio.to_thread.run_sync`` once, never abandoned), waits until
it has loaded the encoder, and only then reports ready with ``task_status.started(EncoderInfo)``.
The thread takes jobs from the inbox through ``take``: waiting for the first when it has nothing
to do, and without waiting, all that wait (up to what it may hold), before every forward pass.

At shutdown or unload (its cancel scope cancelled) the thread answers what it holds
``ShuttingDown``, and the actor answers the jobs still in the inbox the same way, then closes it:
a later job finds it closed and its route answers ``ShuttingDown`` too.  (The resolver unloads an
embedding model only when no request holds a lease on it, so in practice only shutdown does.)

``embedding_model`` is how the resolver runs one (``Lifecycle.start_model``, by way of
``_system``): it makes the inbox and hands its send end on, in the ``EncoderInfo`` it reports
ready with, to the model's registry entry.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import attrs
import trio

from ..errors import ShuttingDown
from ..messages import EmbeddingJob, Failed
from ..threads.encoder_thread import EmbeddingLimits, serve_encoder
from ..threads.pinned import start_pinned
from ..model.encoder import Encoder
from ._mailbox import answer

__all__ = ["EncoderInfo", "embedding_actor", "embedding_model"]


@attrs.frozen
class EncoderInfo:
    """What the rest of the system may know about a loaded encoder."""

    id: str
    dimensions: int
    max_tokens: int
    fingerprint: str
    #: whether ``dimensions`` may cut its vectors short (``Encoder.matryoshka``)
    matryoshka: bool | tuple[int, ...] = False
    #: the actor's inbox (``embedding_model`` fills it in)
    inbox: trio.MemorySendChannel[EmbeddingJob] | None = attrs.field(default=None, eq=False, repr=False)


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

    with inbox:
        try:
            async with trio.open_nursery() as nursery:
                encoder: Encoder = await start_pinned(
                    nursery, f"encoder:{model_id}", serve_encoder, make_encoder, take, emit, limits=limits
                )
                task_status.started(
                    EncoderInfo(
                        id=model_id,
                        dimensions=encoder.dimensions,
                        max_tokens=encoder.max_tokens,
                        fingerprint=encoder.fingerprint,
                        matryoshka=getattr(encoder, "matryoshka", False),
                    )
                )
        finally:
            while True:  # nobody will run these any more
                try:
                    job = inbox.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                answer(job.reply, Failed(ShuttingDown()))


async def embedding_model(
    model_id: str,
    make_encoder: Callable[[], Encoder],
    emit: Callable[[object], None],
    limits: EmbeddingLimits,
    *,
    task_status: trio.TaskStatus[EncoderInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One embedding model from load to unload: its inbox (``limits.max_jobs`` jobs wait; a full
    one is a 503 at once) and its actor; ready with the ``EncoderInfo`` that carries the inbox."""
    send, recv = trio.open_memory_channel[EmbeddingJob](limits.max_jobs)
    with send:
        async with trio.open_nursery() as nursery:
            info = await nursery.start(partial(embedding_actor, model_id, make_encoder, recv, emit, limits))
            task_status.started(attrs.evolve(info, inbox=send))
