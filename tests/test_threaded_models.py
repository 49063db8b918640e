"""``ThreadedModels``, what the audio and images actors share: a model on a thread of its own,
attached (answered with its info once loaded, or with an error that carries no internal text),
its jobs taken in turn, and detached (answered once its thread has ended, what still waited in
its queue refused)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from turbospark.actors._threaded import ThreadedModels
from turbospark.errors import ModelLoadFailed

Job = tuple[str, trio.MemorySendChannel[str]]


def serve(make: Callable[[], Any], take: Callable[[], Awaitable[Job | None]], emit: Any, ready: Any) -> None:
    engine = make()
    trio.from_thread.run_sync(ready, engine)
    while True:
        trio.from_thread.check_cancelled()
        job = trio.from_thread.run(take)
        if job is None:
            return
        text, reply = job
        trio.from_thread.run_sync(reply.send_nowait, f"{engine}:{text}")


def models(refused: list[str], changes: list[int]) -> ThreadedModels[str, Job]:
    threads: ThreadedModels[str, Job] = ThreadedModels(
        "test", serve, lambda model_id, engine: f"{model_id}={engine}", lambda job: refused.append(job[0]),
        lambda event: None, lambda: changes.append(len(threads.models)), 2,
    )  # fmt: skip
    return threads


async def test_attach_serve_and_detach() -> None:
    refused: list[str] = []
    changes: list[int] = []
    threads = models(refused, changes)
    async with trio.open_nursery() as nursery:
        send, recv = trio.open_memory_channel[Any](1)
        await threads.attach("a", lambda: "engine", send, nursery)
        assert recv.receive_nowait() == "a=engine" and changes == [1]
        reply_send, reply_recv = trio.open_memory_channel[str](4)
        threads.models["a"].queue.send_nowait(("hello", reply_send))
        assert await reply_recv.receive() == "engine:hello"

        done_send, done_recv = trio.open_memory_channel[None](1)
        await threads.detach("a", done_send)
        assert done_recv.receive_nowait() is None
        assert threads.models == {} and changes == [1, 0]


async def test_a_load_that_fails_is_model_load_failed_without_its_text() -> None:
    threads = models([], [])

    def broken() -> str:
        raise OSError("/secret/path/weights.safetensors: no such file")

    async with trio.open_nursery() as nursery:
        send, recv = trio.open_memory_channel[Any](1)
        await threads.attach("b", broken, send, nursery)
        error = recv.receive_nowait()
        assert isinstance(error, ModelLoadFailed) and "secret" not in error.message
        assert threads.models == {} and threads.attaching == {}


async def test_a_second_model_of_the_same_name_is_refused_and_the_first_kept() -> None:
    threads = models([], [])
    async with trio.open_nursery() as nursery:
        (one_send, one_recv), (two_send, two_recv) = (trio.open_memory_channel[Any](1) for _ in range(2))
        await threads.attach("c", lambda: "one", one_send, nursery)
        await threads.attach("c", lambda: "two", two_send, nursery)
        assert one_recv.receive_nowait() == "c=one"
        assert isinstance(two_recv.receive_nowait(), ModelLoadFailed)
        assert threads.models["c"].info == "c=one"
        nursery.cancel_scope.cancel()


async def test_jobs_still_queued_when_the_thread_stops_are_refused() -> None:
    refused: list[str] = []
    threads = models(refused, [])
    gate = trio.Event()

    def slow_serve(make: Any, take: Any, emit: Any, ready: Any) -> None:
        trio.from_thread.run_sync(ready, make())
        trio.from_thread.run(gate.wait)  # busy with its first job until the detach

    threads.serve = slow_serve
    async with trio.open_nursery() as nursery:
        send, recv = trio.open_memory_channel[Any](1)
        await threads.attach("d", lambda: "engine", send, nursery)
        reply_send, _ = trio.open_memory_channel[str](4)
        threads.models["d"].queue.send_nowait(("first", reply_send))
        threads.models["d"].queue.send_nowait(("second", reply_send))
        done_send, done_recv = trio.open_memory_channel[None](1)
        nursery.start_soon(threads.detach, "d", done_send)
        await trio.sleep(0.05)
        gate.set()
        await done_recv.receive()
    assert refused == ["first", "second"]
