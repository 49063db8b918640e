"""The pulls actor (``actors/pulls.py``) without a store: one job per model shared by every
requester, at most ``MAX_PULLS`` at once, a pull whose requesters all left stops at its next
report, and a failure reaches every requester."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import trio

from turbospark.actors.pulls import MAX_PULLS, Pull, PullFailed, Pulled, pulls


class FakeStore:
    """A pull that reports ``steps`` byte counts, ``pause`` seconds apart."""

    def __init__(self, steps: int = 20, pause: float = 0.01, fail: str | None = None) -> None:
        self.steps, self.pause, self.fail = steps, pause, fail
        self.calls: list[str] = []
        self.running = self.most = 0
        self.stopped: list[str] = []
        self.lock = threading.Lock()

    def pull(self, name: str, report: Any) -> str:
        self.calls.append(name)
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            for i in range(self.steps + 1):
                report("downloading", i, self.steps)
                time.sleep(self.pause)
            if self.fail:
                raise RuntimeError(self.fail)
            return "digest"
        except BaseException:
            self.stopped.append(name)
            raise
        finally:
            with self.lock:
                self.running -= 1


async def _listen(inbox: trio.MemorySendChannel[Pull], name: str) -> list[Any]:
    send, recv = trio.open_memory_channel[Any](256)
    await inbox.send(Pull(name, "abc", send))
    return [item async for item in recv]


@pytest.fixture
async def actor(nursery: trio.Nursery):
    def start(store: FakeStore) -> trio.MemorySendChannel[Pull]:
        send, recv = trio.open_memory_channel[Pull](16)
        nursery.start_soon(pulls, recv, store.pull)
        return send

    return start


async def test_requesters_of_one_model_share_its_pull(actor) -> None:
    store = FakeStore()
    inbox = actor(store)
    heard: dict[str, list[Any]] = {}

    async def one(who: str, delay: float) -> None:
        await trio.sleep(delay)
        heard[who] = await _listen(inbox, "m")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "first", 0)
        nursery.start_soon(one, "second", 0.05)  # joins while it runs
    assert store.calls == ["m"]
    first, second = heard["first"], heard["second"]
    assert first[0] == {"status": "pulling manifest"} and first[-1] == Pulled()
    assert [f["status"] for f in first[-3:-1]] == ["verifying sha256 digest", "writing manifest"]
    sized = [f for f in first if isinstance(f, dict) and "total" in f]
    assert len(sized) == 21 and all(f["digest"] == "sha256:abc" for f in sized)
    assert second[-1] == Pulled() and second[0] in first and len(second) < len(first)


async def test_at_most_max_pulls_run_at_once(actor) -> None:
    store = FakeStore(steps=5, pause=0.02)
    inbox = actor(store)
    async with trio.open_nursery() as nursery:
        for name in ("a", "b", "c", "d"):
            nursery.start_soon(_listen, inbox, name)
    assert sorted(store.calls) == ["a", "b", "c", "d"] and store.most == MAX_PULLS


async def test_a_pull_whose_requesters_all_left_stops(actor) -> None:
    store = FakeStore(steps=1000, pause=0.005)
    inbox = actor(store)
    send, recv = trio.open_memory_channel[Any](256)
    await inbox.send(Pull("m", "", send))
    await recv.receive()
    await recv.receive()
    recv.close()  # the client left
    with trio.fail_after(5):
        while store.stopped != ["m"]:
            await trio.sleep(0.01)
    heard = await _listen(inbox, "m")  # a later request starts it again, whole
    assert store.calls == ["m", "m"] and heard[-1] == Pulled()


async def test_a_failed_pull_reaches_every_requester(actor) -> None:
    inbox = actor(FakeStore(steps=3, fail="the index cannot be reached"))
    results: list[list[Any]] = []

    async def one() -> None:
        results.append(await _listen(inbox, "m"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
    for heard in results:
        assert isinstance(heard[-1], PullFailed) and "cannot be reached" in str(heard[-1].error)
