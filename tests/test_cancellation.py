"""The core promise: a client that disconnects stops its own generation, in every phase, for
streaming and non-streaming requests, and disturbs nobody else.

Each test drives a real Hypercorn on 127.0.0.1:0 with a raw socket that it closes, then checks
the scripted backend's own counters (what really ran), the observer's ``Generated`` event (where
it stopped) and ``/metrics`` (the slot is free).
"""

from __future__ import annotations

import random

import httpx
import pytest
import trio

from turbospark.messages import Generated, QueueDepth
from turbospark.model.scripted import ScriptedBackend

from ._support import chat_body, raw_post, read_until, wait_for

DELAY = 0.05  # seconds per scripted step: long enough to land a disconnect where we want it
PATH = "/v1/chat/completions"


async def generated_event(events: trio.MemoryReceiveChannel, timeout: float = 10) -> Generated:
    with trio.fail_after(timeout):
        async for event in events:
            if isinstance(event, Generated):
                return event
    raise AssertionError("no Generated event")


async def metric(client: httpx.AsyncClient, url: str, name: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_disconnect_during_decode_stops_within_one_step(start_server, client, stream) -> None:
    backend = ScriptedBackend(token_delay=DELAY)
    server = await start_server([backend])
    events = server.system.subscribe()
    sock = await raw_post(server.url, PATH, chat_body(max_tokens=5000, stream=stream))
    if stream:
        await read_until(sock, b'"content":"The"')
    await wait_for(lambda: backend.counters.decode_steps >= 3)
    steps_at_close = backend.counters.decode_steps
    await sock.aclose()
    event = await generated_event(events)
    assert event.stop_reason == "Cancelled" and event.phase == "decode"
    assert backend.counters.decode_steps - steps_at_close <= 1
    settled = backend.counters.decode_steps
    await trio.sleep(DELAY * 4)
    assert backend.counters.decode_steps == settled  # nothing runs on behind our back
    assert await metric(client, server.url, 'turbospark_cancellations_total{phase="decode"}') == 1
    assert await metric(client, server.url, "turbospark_generations_in_flight") == 0
    # the model is free for the next client at once
    r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=2))
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_disconnect_during_prefill_stops_at_the_next_chunk(start_server, client, stream) -> None:
    backend = ScriptedBackend(token_delay=DELAY, prefill_chunk=8)
    server = await start_server([backend])
    events = server.system.subscribe()
    long_prompt = "word " * 400
    sock = await raw_post(server.url, PATH, chat_body(long_prompt, max_tokens=5, stream=stream))
    await wait_for(lambda: backend.counters.prefill_chunks >= 3)
    chunks_at_close = backend.counters.prefill_chunks
    await sock.aclose()
    event = await generated_event(events)
    assert event.stop_reason == "Cancelled" and event.phase == "prefill"
    assert backend.counters.prefill_chunks - chunks_at_close <= 1
    assert backend.counters.decode_steps == 0
    assert event.prompt_tokens > 400 and event.new_tokens == 0
    assert await metric(client, server.url, 'turbospark_cancellations_total{phase="prefill"}') == 1
    assert await metric(client, server.url, "turbospark_generations_in_flight") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_disconnect_while_queued_never_starts_and_spares_the_active_one(
    start_server, client, stream
) -> None:
    backend = ScriptedBackend(token_delay=DELAY / 5)
    server = await start_server([backend], max_batch=1)  # one runs, the next one waits
    events = server.system.subscribe()
    active: list[httpx.Response] = []
    async with trio.open_nursery() as nursery:

        async def run_active() -> None:
            active.append(await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=60)))

        nursery.start_soon(run_active)
        await wait_for(lambda: backend.counters.decode_steps >= 1)
        sock = await raw_post(server.url, PATH, chat_body(max_tokens=5, stream=stream))
        with trio.fail_after(5):
            async for event in events:
                if isinstance(event, QueueDepth) and event.depth == 1:
                    break
        assert await metric(client, server.url, "turbospark_queue_depth") == 1
        await sock.aclose()
        with trio.fail_after(5):
            async for event in events:
                if isinstance(event, Generated):
                    break
        # the queued one was dropped, not the active one, and its slot freed at once
        assert event.stop_reason == "Cancelled" and event.phase == "queued" and not event.began
        assert await metric(client, server.url, "turbospark_queue_depth") == 0
        assert backend.counters.decode_steps < 60
    assert active[0].json()["usage"]["completion_tokens"] == 60
    assert active[0].json()["choices"][0]["finish_reason"] == "length"
    assert backend.counters.generations == 1  # the queued request never ran
    assert await metric(client, server.url, 'turbospark_cancellations_total{phase="queued"}') == 1


async def test_arrival_order_is_kept(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=0.01)
    server = await start_server([backend], max_batch=1)
    done: list[int] = []

    async def one(i: int, max_tokens: int) -> None:
        await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=max_tokens, stream=True))
        done.append(i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, 0, 30)
        await wait_for(lambda: backend.counters.generations == 1)
        for i in range(1, 4):
            nursery.start_soon(one, i, 2)
            with trio.fail_after(5):
                while await metric(client, server.url, "turbospark_queue_depth") != i:
                    await trio.sleep(0.005)
    assert done == [0, 1, 2, 3]


async def test_soak_with_random_disconnects_ends_clean(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=0.002, prefill_chunk=4)
    server = await start_server([backend], max_queue=64)
    rng = random.Random(1234)
    statuses: list[int] = []

    async def one(i: int) -> None:
        stream = rng.random() < 0.5
        body = chat_body("hello " * rng.randint(1, 40), max_tokens=rng.randint(1, 30), stream=stream)
        if rng.random() < 0.5:
            sock = await raw_post(server.url, PATH, body)
            await trio.sleep(rng.random() * 0.05)
            await sock.aclose()
        else:
            r = await client.post(f"{server.url}{PATH}", json=body)
            statuses.append(r.status_code)
            if r.status_code == 200 and not stream:
                assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]

    for batch in range(10):
        async with trio.open_nursery() as nursery:
            for i in range(30):
                nursery.start_soon(one, batch * 30 + i)
    assert statuses and set(statuses) <= {200, 503}
    with trio.fail_after(10):
        while (
            await metric(client, server.url, "turbospark_generations_in_flight") != 0
            or await metric(client, server.url, "turbospark_queue_depth") != 0
        ):
            await trio.sleep(0.05)
    steps = backend.counters.decode_steps
    await trio.sleep(0.05)
    assert backend.counters.decode_steps == steps  # nothing is left running
    r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=3))
    assert r.json()["usage"]["completion_tokens"] == 3
