"""Actors in isolation, pure Trio (no threads, no sockets), on the autojump clock."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

from turbospark.actors.generation import generation_queue
from turbospark.actors.resolution import Grant, Lifecycle, Published, Resolve
from turbospark.actors.resolver import resolver
from turbospark.errors import QueueFull, ResolutionBusy
from turbospark.messages import (
    ChatPrompt,
    Failed,
    Generated,
    GenerationJob,
    Queued,
    QueueDepth,
    QueueRejected,
    Submit,
    Take,
    Withdraw,
)
from turbospark.model.backend import SamplingParams
from turbospark.actors.registry import ModelEntry


def make_job(i: int, model: str = "m"):
    send, recv = trio.open_memory_channel(8)
    job = GenerationJob(i, model, ChatPrompt(()), SamplingParams(), send, 0.0)
    return job, recv


async def take(queue, model: str = "m", count: int = 1, wait: bool = True):
    send, recv = trio.open_memory_channel(1)
    await queue.send(Take(model, send, count, wait))
    return recv


async def test_queue_is_fifo_bounded_and_frees_withdrawn_slots_at_once(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    events: list[object] = []
    queue, inbox = trio.open_memory_channel(16)
    await nursery.start(partial(generation_queue, inbox, events.append, max_queue=2))

    jobs = [make_job(i) for i in range(4)]
    for job, _ in jobs[:3]:
        await queue.send(Submit(job))
    await trio.testing.wait_all_tasks_blocked()
    assert jobs[0][1].receive_nowait() == Queued(0)
    assert jobs[1][1].receive_nowait() == Queued(1)
    refused = jobs[2][1].receive_nowait()
    assert isinstance(refused, Failed) and isinstance(refused.error, QueueFull)
    assert QueueRejected(2, "m") in events
    with pytest.raises(trio.EndOfChannel):
        await jobs[2][1].receive()

    await queue.send(Withdraw(jobs[0][0]))  # the first client leaves while waiting
    await trio.testing.wait_all_tasks_blocked()
    cancelled = [e for e in events if isinstance(e, Generated)]
    assert [(e.id, e.phase, e.began) for e in cancelled] == [(0, "queued", False)]
    assert events[-1] == QueueDepth("m", 1)
    with pytest.raises(trio.EndOfChannel):
        await jobs[0][1].receive()

    await queue.send(Submit(jobs[3][0]))  # the freed slot is usable at once
    await trio.testing.wait_all_tasks_blocked()
    assert jobs[3][1].receive_nowait() == Queued(1)

    got = [job for _ in range(2) for job in await (await take(queue)).receive()]
    assert [j.request_id for j in got] == [1, 3]
    await queue.send(Withdraw(got[0]))  # already handed out: the queue leaves it alone
    await trio.testing.wait_all_tasks_blocked()
    assert len([e for e in events if isinstance(e, Generated)]) == 1


async def test_a_running_batch_takes_what_waits_without_waiting(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    events: list[object] = []
    queue, inbox = trio.open_memory_channel(16)
    await nursery.start(partial(generation_queue, inbox, events.append, max_queue=8))
    before = trio.current_time()
    assert await (await take(queue, count=4, wait=False)).receive() == []  # nothing waits: at once
    jobs = [make_job(i) for i in range(3)]
    for job, _ in jobs:
        await queue.send(Submit(job))
    got = await (await take(queue, count=2, wait=False)).receive()
    assert [j.request_id for j in got] == [0, 1]  # oldest first, no more than asked
    assert trio.current_time() == before
    # an idle thread waits, and gets everything there is up to its count in one answer
    assert [j.request_id for j in await (await take(queue, count=4)).receive()] == [2]
    idle = await take(queue, count=4)
    await trio.testing.wait_all_tasks_blocked()
    late = [make_job(i) for i in (3, 4)]
    for job, _ in late:
        await queue.send(Submit(job))
    assert [j.request_id for j in await idle.receive()] == [3]
    assert [e.depth for e in events if isinstance(e, QueueDepth)][-1] == 1


async def test_queue_shutdown_releases_takers_and_waiting_jobs(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    queue, inbox = trio.open_memory_channel(16)
    await nursery.start(partial(generation_queue, inbox, lambda e: None, max_queue=4))
    idle = await take(queue, "other")
    job, replies = make_job(0)
    await queue.send(Submit(job))
    await trio.testing.wait_all_tasks_blocked()
    queue.close()
    await trio.testing.wait_all_tasks_blocked()
    with pytest.raises(trio.EndOfChannel):
        await idle.receive()
    assert replies.receive_nowait() == Queued(0)
    with pytest.raises(trio.EndOfChannel):
        await replies.receive()


async def test_resolver_refuses_at_once_when_every_slot_is_held(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    entry = ModelEntry("m", 10, frozenset({"chat"}))
    gate = trio.Event()

    async def slow(registry, name, want):
        await gate.wait()
        return registry.resolve(name, want)

    ask, inbox = trio.open_memory_channel(8)
    life = Lifecycle(start_model=None, queue=None, emit=lambda e: None)  # nothing to load here
    await nursery.start(partial(
        resolver, inbox, ask.clone(), lifecycle=life, published=Published(),
        models_scope=trio.CancelScope(), fixed=[entry], slots=1, resolve=slow,
    ))

    first_send, first = trio.open_memory_channel(1)
    await ask.send(Resolve("m", "chat", first_send))
    await trio.testing.wait_all_tasks_blocked()
    busy_send, busy = trio.open_memory_channel(1)
    before = trio.current_time()
    await ask.send(Resolve("m", "chat", busy_send))
    assert isinstance(await busy.receive(), ResolutionBusy)
    assert trio.current_time() == before  # refused, never queued
    gate.set()
    assert await first.receive() == Grant(entry, None)

    again_send, again = trio.open_memory_channel(1)
    await ask.send(Resolve("x", "chat", again_send))
    assert await again.receive() == Grant(entry, None)  # the slot came back
