"""Actors in isolation, pure Trio (no threads, no sockets), on the autojump clock."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

from turbospark.actors.generation import generation_queue
from turbospark.actors.models import JobIntake
from turbospark.actors.resolution import Grant, Lifecycle, Published, Resolve
from turbospark.actors.resolver import resolver
from turbospark.errors import QueueFull, ResolutionBusy, ShuttingDown
from turbospark.messages import (
    ChatPrompt,
    Failed,
    Generated,
    GenerationJob,
    QueueDepth,
    QueueRejected,
    Retire,
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


async def start_queue(nursery: trio.Nursery, max_queue: int, events: list[object] | None = None):
    queue, inbox = trio.open_memory_channel(16)
    emit = events.append if events is not None else lambda e: None
    await nursery.start(partial(generation_queue, inbox, emit, max_queue=max_queue))
    return queue


def ids(jobs) -> list[int]:
    return [j.request_id for j in jobs]


async def test_queue_is_fifo_bounded_and_frees_withdrawn_slots_at_once(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    events: list[object] = []
    queue = await start_queue(nursery, 2, events)

    jobs = [make_job(i) for i in range(4)]
    for job, _ in jobs[:3]:
        await queue.send(Submit(job))
    await trio.testing.wait_all_tasks_blocked()
    for _, replies in jobs[:2]:  # admitted: nothing is said until the model starts it
        with pytest.raises(trio.WouldBlock):
            replies.receive_nowait()
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
    assert events[-1] == QueueDepth("m", 2)

    send, channel = trio.open_memory_channel(4)
    await queue.send(Take("m", send, 2))
    await trio.testing.wait_all_tasks_blocked()
    got = [channel.receive_nowait() for _ in range(2)]
    assert ids(got) == [1, 3]  # in arrival order
    await queue.send(Withdraw(got[0]))  # received by the model: the queue leaves it alone
    await trio.testing.wait_all_tasks_blocked()
    assert len([e for e in events if isinstance(e, Generated)]) == 1


async def test_a_model_is_sent_what_it_asked_for_and_no_more(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    events: list[object] = []
    queue = await start_queue(nursery, 1, events)
    send, channel = trio.open_memory_channel(4)
    await queue.send(Take("m", send, 3))
    jobs = [make_job(i) for i in range(6)]
    for job, _ in jobs[:4]:  # three will not wait, so a fourth fits in a queue of one
        await queue.send(Submit(job))
    await trio.testing.wait_all_tasks_blocked()
    assert send.statistics().current_buffer_used == 3  # pushed at once, no more than asked
    assert events[-1] == QueueDepth("m", 1)
    await queue.send(Submit(jobs[4][0]))
    await trio.testing.wait_all_tasks_blocked()
    assert isinstance(jobs[4][1].receive_nowait(), Failed)  # the queue of one is full
    assert ids(channel.receive_nowait() for _ in range(3)) == [0, 1, 2]
    await queue.send(Take("m", send, -1))  # fewer than asked: it was sent them already
    await queue.send(Take("m", send, 2))
    await trio.testing.wait_all_tasks_blocked()
    assert ids([channel.receive_nowait()]) == [3]
    with pytest.raises(trio.WouldBlock):
        channel.receive_nowait()
    await queue.send(Submit(jobs[5][0]))
    await trio.testing.wait_all_tasks_blocked()
    assert events[-1] == QueueDepth("m", 1)  # credit 3 - 3 - 1 + 2 - 1: none left, it waits


async def test_a_job_withdrawn_in_its_model_channel_is_dropped_and_never_taken(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    events: list[object] = []
    queue = await start_queue(nursery, 4, events)
    intake = JobIntake("m", queue, 4)
    assert intake.exchange(4, take=True) == []  # nothing yet; asks for four
    jobs = [make_job(i) for i in range(3)]
    for job, _ in jobs:
        await queue.send(Submit(job))
    await trio.testing.wait_all_tasks_blocked()
    assert intake.recv.statistics().current_buffer_used == 3
    await queue.send(Withdraw(jobs[1][0]))  # its client leaves while it sits in the channel
    await trio.testing.wait_all_tasks_blocked()
    assert [(e.id, e.phase) for e in events if isinstance(e, Generated)] == [(1, "queued")]
    with pytest.raises(trio.EndOfChannel):
        await jobs[1][1].receive()  # answered by the queue
    assert ids(intake.exchange(4, take=True)) == [0, 2]  # the thread skips it
    await queue.send(Withdraw(jobs[2][0]))  # taken: left to the model thread
    await trio.testing.wait_all_tasks_blocked()
    assert len([e for e in events if isinstance(e, Generated)]) == 1


async def test_room_that_frees_takes_a_waiting_job_in_the_same_crossing(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    queue = await start_queue(nursery, 4)
    intake = JobIntake("m", queue, 4)
    assert intake.exchange(0, take=True) == []  # a full batch asks for nothing
    job, _ = make_job(0)
    await queue.send(Submit(job))
    await trio.testing.wait_all_tasks_blocked()
    assert intake.exchange(0, take=True) == []  # it waits in the queue
    assert ids(await intake.settle(2)) == [job.request_id]  # two slots free: taken at once
    assert intake.asked == 0  # the room it leaves is said once the job is admitted


async def test_an_idle_model_waits_for_its_first_job(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    queue = await start_queue(nursery, 4)
    intake = JobIntake("m", queue, 4)
    got: list[object] = []

    async def idle() -> None:
        got.append(await intake.wait(4))

    nursery.start_soon(idle)
    await trio.testing.wait_all_tasks_blocked()
    assert got == []
    job, _ = make_job(0)
    await queue.send(Submit(job))
    await trio.testing.wait_all_tasks_blocked()
    assert got == [[job]]
    assert intake.asked == 0  # what room is left is said once the job is admitted


async def test_a_stopped_model_loses_no_job(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    queue = await start_queue(nursery, 4)
    intake = JobIntake("m", queue, 4)
    intake.exchange(3, take=False)
    jobs = [make_job(i) for i in range(3)]
    for job, _ in jobs[:2]:
        await queue.send(Submit(job))
    await trio.testing.wait_all_tasks_blocked()
    assert ids(intake.close()) == [0, 1]  # the model actor answers these ShuttingDown
    await queue.send(Submit(jobs[2][0]))  # pushed to a closed channel: back in the queue
    await queue.send(Retire("m"))
    await trio.testing.wait_all_tasks_blocked()
    answer = jobs[2][1].receive_nowait()
    assert isinstance(answer, Failed) and isinstance(answer.error, ShuttingDown)


async def test_queue_shutdown_releases_idle_models_and_waiting_jobs(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    queue = await start_queue(nursery, 4)
    intake = JobIntake("other", queue.clone(), 4)
    got: list[object] = []

    async def idle() -> None:
        got.append(await intake.wait(4))

    nursery.start_soon(idle)
    job, replies = make_job(0)
    await queue.send(Submit(job))
    await trio.testing.wait_all_tasks_blocked()
    queue.close()
    intake.queue.close()
    await trio.testing.wait_all_tasks_blocked()
    assert got == [None]
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
