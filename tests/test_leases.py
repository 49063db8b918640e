"""Lease bookkeeping that cannot be lost (decision 0019): a burst of requests larger than the
resolver's inbox, some abandoned, on two models that cannot be loaded together."""

from __future__ import annotations

import random

import httpx
import trio

from turbospark import _system
from turbospark.messages import ModelLoaded, ModelUnloaded

from .test_lifecycle import HELLO, Shelf, ps


async def test_a_burst_larger_than_the_inbox_loses_no_release(start_server, client, monkeypatch) -> None:
    monkeypatch.setattr(_system, "RESOLVER_INBOX", 4)
    monkeypatch.setattr(_system, "QUEUE_INBOX", 4)
    shelf = Shelf("alpha", "beta", token_delay=0.002, script=None)
    server = await start_server(backends=[], library=shelf.models, max_loaded_models=1, max_resolutions=64,
                                max_queue=64)
    events = server.system.subscribe(buffer=4096)
    rng = random.Random(19)
    answered: list[tuple[str, int]] = []
    abandoned: list[str] = []

    async def one(i: int) -> None:
        model = ("alpha", "beta")[i % 2]
        body = {"model": model, "messages": HELLO, "stream": False, "keep_alive": "1s",
                "options": {"num_predict": 8}}
        if i % 4 == 3:  # this client gives up: while waiting for a load, queued or running
            with trio.move_on_after(rng.uniform(0.0, 0.3)):
                await client.post(f"{server.url}/api/chat", json=body)
            abandoned.append(model)
            return
        r = await client.post(f"{server.url}/api/chat", json=body)
        answered.append((model, r.status_code))
        assert r.status_code == 200, r.text
        assert r.json()["eval_count"] == 8 and r.json()["done"]

    with trio.fail_after(120):  # nothing waits for ever
        async with trio.open_nursery() as nursery:
            for i in range(48):
                nursery.start_soon(one, i)
    assert len(answered) == 36 and len(abandoned) == 12
    assert {m for m, _ in answered} == {"alpha", "beta"}
    # every lease went back: the loaded model holds none, then its keep-alive expires
    with trio.fail_after(10):
        while any(m.requests for m in await server.system.running()):
            await trio.sleep(0.02)
    with trio.fail_after(10):
        while await ps(client, server.url):
            await trio.sleep(0.05)
    # the last unload's event may still be on its way to the observer when ps shows nothing
    seen: list[object] = []
    with trio.move_on_after(5):
        while not (seen and isinstance(seen[-1], ModelUnloaded) and seen[-1].reason == "expired"
                   and not events.statistics().current_buffer_used):
            seen.append(await events.receive())
    lives = [(type(e).__name__, e.model) for e in seen if isinstance(e, (ModelLoaded, ModelUnloaded))]
    loads = [m for kind, m in lives if kind == "ModelLoaded"]
    assert {"alpha", "beta"} <= set(loads)
    # one model at a time: every load follows the unload of the one before
    for before, after in zip(lives, lives[1:]):
        assert before[0] != after[0], lives
    assert lives[-1][0] == "ModelUnloaded"
    assert [e for e in seen if isinstance(e, ModelUnloaded)][-1].reason == "expired"
    # and the server still serves both
    async with httpx.AsyncClient(timeout=30) as again:
        for model in ("alpha", "beta"):
            r = await again.post(f"{server.url}/api/chat", json={"model": model, "messages": HELLO, "stream": False})
            assert r.status_code == 200 and r.json()["done"]
