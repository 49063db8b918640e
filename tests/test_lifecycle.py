"""The model lifecycle on scripted backends that load on demand: loads shared by concurrent
requests, keep-alive, LRU eviction under a model count and a memory budget, never unloading
under a running sequence, and a load whose waiters all left."""

from __future__ import annotations

import json
import math
import threading

import httpx
import ollama
import pytest
import trio

from turbospark.errors import RequestInvalid
from turbospark.actors.lifecycle import Loadable, Resident, evictions, parse_keep_alive, parse_size
from turbospark.actors.resolver import STRANGER_S
from turbospark.messages import Generated, ModelLoaded, ModelUnloaded
from turbospark.model.scripted import ScriptedBackend

from ._support import raw_post, read_until, wait_for

HELLO = [{"role": "user", "content": "Hello there"}]


class Shelf:
    """Scripted models that load on demand; counts loads, and can hold a load at a gate."""

    def __init__(self, *names: str, size: int = 100, token_delay: float = 0.0, gated: bool = False,
                 script: str | None = "Loaded and answering.") -> None:
        self.script = script
        self.loads: dict[str, int] = {}
        self.entered = 0
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.models = [
            Loadable(id=name, make=lambda name=name: self._make(name, token_delay),
                     capabilities=frozenset({"chat", "completion"}), context_window=8192, size=size)
            for name in names
        ]

    def _make(self, name: str, token_delay: float) -> ScriptedBackend:
        self.entered += 1
        assert self.gate.wait(30)
        self.loads[name] = self.loads.get(name, 0) + 1
        return ScriptedBackend(model_id=name, token_delay=token_delay, script=self.script)


def chat(model: str, **extra) -> dict:
    return {"model": model, "messages": HELLO, "stream": False, **extra}


async def ps(client: httpx.AsyncClient, url: str) -> list[str]:
    return sorted(m["model"] for m in (await client.get(f"{url}/api/ps")).json()["models"])


async def until_loaded(client: httpx.AsyncClient, url: str, expected: list[str]) -> None:
    """A request's lease goes when its response has been sent: wait for what follows."""
    with trio.fail_after(10):
        while await ps(client, url) != expected:
            await trio.sleep(0.02)


def test_keep_alive_and_sizes_parse_as_ollama_and_users_write_them() -> None:
    assert parse_keep_alive(None) is None
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive(10) == 10 and parse_keep_alive("10") == 10 and parse_keep_alive("1.5s") == 1.5
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0
    assert parse_keep_alive(-1) == math.inf and parse_keep_alive("-1m") == math.inf
    for bad in ("soon", "5 minutes", True, [1], ""):
        with pytest.raises(RequestInvalid):
            parse_keep_alive(bad)
    assert parse_size("8G") == 8 << 30 and parse_size("512M") == 512 << 20 and parse_size("100") == 100 << 20
    assert parse_size("1.5GiB") == 3 << 29


def test_evictions_take_the_least_recently_used_idle_models_first() -> None:
    r = [Resident("a", 10, False, False, 5.0), Resident("b", 10, False, False, 1.0),
         Resident("p", 10, False, True, 0.0), Resident("busy", 10, True, False, 0.0)]
    assert evictions(r, 10, max_models=5, max_memory=100) == []
    assert evictions(r, 10, max_models=4, max_memory=100) == ["b"]
    assert evictions(r, 10, max_models=2, max_memory=100) == ["b", "a", "p"]
    assert evictions(r, 10, max_models=1, max_memory=100) is None  # a busy model holds the room
    assert evictions(r, 25, max_models=9, max_memory=50) == ["b", "a"]
    assert evictions([], 500, max_models=1, max_memory=50) == []  # too big for the budget: alone


async def test_a_stored_model_loads_when_named_and_v1_models_lists_it_before(start_server, client) -> None:
    shelf = Shelf("alpha")
    server = await start_server(library=shelf.models)
    events = server.system.subscribe()
    ids = [m["id"] for m in (await client.get(f"{server.url}/v1/models")).json()["data"]]
    assert "alpha" in ids and "scripted" in ids
    assert await ps(client, server.url) == ["scripted"] and shelf.loads == {}
    r = await client.post(f"{server.url}/api/chat", json=chat("alpha"))
    assert r.status_code == 200 and r.json()["message"]["content"] == "Loaded and answering."
    assert r.json()["load_duration"] > 0
    assert shelf.loads == {"alpha": 1} and await ps(client, server.url) == ["alpha", "scripted"]
    loaded = next(e for e in [events.receive_nowait() for _ in range(events.statistics().current_buffer_used)]
                  if isinstance(e, ModelLoaded))
    assert loaded.model == "alpha" and loaded.size == 100
    again = await client.post(f"{server.url}/v1/chat/completions", json={"model": "alpha", "messages": HELLO})
    assert again.status_code == 200 and shelf.loads == {"alpha": 1}
    (row,) = [m for m in (await client.get(f"{server.url}/api/ps")).json()["models"] if m["model"] == "alpha"]
    assert row["size"] == 100 and row["expires_at"] < "2300"  # the default keep-alive, 5 minutes
    metrics = (await client.get(f"{server.url}/metrics")).text
    assert "turbospark_loaded_models 2.0" in metrics and 'turbospark_model_loads_total{model="alpha"} 1.0' in metrics


async def test_concurrent_requests_share_one_load(start_server, client) -> None:
    shelf = Shelf("alpha", gated=True)
    server = await start_server(library=shelf.models)
    results: list[httpx.Response] = []
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(lambda: _append(results, client.post(f"{server.url}/api/chat", json=chat("alpha"))))
        await wait_for(lambda: shelf.entered == 1)
        await trio.sleep(0.1)
        shelf.gate.set()
    assert [r.status_code for r in results] == [200, 200, 200]
    assert shelf.entered == 1 and shelf.loads == {"alpha": 1}


async def _append(out: list, coro) -> None:
    out.append(await coro)


async def test_an_idle_model_unloads_after_its_keep_alive(start_server, client) -> None:
    shelf = Shelf("alpha")
    server = await start_server(library=shelf.models)
    events = server.system.subscribe()
    await client.post(f"{server.url}/api/chat", json=chat("alpha", keep_alive="300ms"))
    with trio.fail_after(10):
        async for event in events:
            if isinstance(event, ModelUnloaded):
                break
    assert event == ModelUnloaded("alpha", "expired")
    assert await ps(client, server.url) == ["scripted"]
    c = ollama.AsyncClient(host=server.url)
    await c.chat(model="alpha", messages=HELLO)  # loads again; keep_alive 0 unloads right after
    assert shelf.loads == {"alpha": 2}
    await c.chat(model="alpha", messages=HELLO, keep_alive=0)
    await until_loaded(client, server.url, ["scripted"])  # once its request has ended
    await c.generate(model="alpha", keep_alive=-1)  # an empty request only loads
    assert shelf.loads == {"alpha": 3}
    (row,) = [m for m in (await c.ps()).models if m.model == "alpha"]
    assert row.expires_at.year > 2300
    await c.generate(model="scripted", keep_alive=0)  # a --model model unloads when told to
    await until_loaded(client, server.url, ["alpha"])
    r = await c.chat(model="scripted", messages=HELLO)  # and loads again when asked
    assert r.done and "scripted" in [m.model for m in (await c.ps()).models]


async def test_lru_eviction_under_a_model_count_and_a_memory_budget(start_server, client) -> None:
    shelf = Shelf("alpha", "beta", "gamma")
    server = await start_server(backends=[], library=shelf.models, max_loaded_models=2)
    events = server.system.subscribe()
    for name in ("alpha", "beta", "alpha", "gamma"):
        assert (await client.post(f"{server.url}/api/chat", json=chat(name))).status_code == 200
    await until_loaded(client, server.url, ["alpha", "gamma"])  # beta was the least recently used
    unloaded = [e for e in [events.receive_nowait() for _ in range(events.statistics().current_buffer_used)]
                if isinstance(e, ModelUnloaded)]
    assert unloaded == [ModelUnloaded("beta", "evicted")]

    server = await start_server(backends=[], library=Shelf("one", "two", size=600).models,
                                max_loaded_memory=1000)
    await client.post(f"{server.url}/api/chat", json=chat("one"))
    await client.post(f"{server.url}/api/chat", json=chat("two"))
    await until_loaded(client, server.url, ["two"])


async def test_a_model_is_never_unloaded_under_a_running_sequence(start_server, client) -> None:
    shelf = Shelf("alpha", "beta", token_delay=0.01, script=None)
    server = await start_server(backends=[], library=shelf.models, max_loaded_models=1)
    events = server.system.subscribe()
    stream = await raw_post(server.url, "/api/chat", {"model": "alpha", "messages": HELLO, "options": {"num_predict": 60}})
    await read_until(stream, b'"done":false')
    # keep_alive 0 from another request on the same model: it unloads once both have ended
    short = await client.post(f"{server.url}/api/chat", json=chat("alpha", keep_alive=0, options={"num_predict": 1}))
    await trio.sleep(0.1)
    assert short.status_code == 200 and await ps(client, server.url) == ["alpha"]
    # another model needs the only room: it waits for the stream, which runs to its end
    other = await client.post(f"{server.url}/api/chat", json=chat("beta", options={"num_predict": 2}))
    assert other.status_code == 200 and other.json()["eval_count"] == 2
    body = await read_until(stream, b'"done":true', timeout=20)
    (last,) = [json.loads(line) for line in body.splitlines() if b'"done":true' in line]
    assert last["eval_count"] == 60 and last["done_reason"] == "length"
    await stream.aclose()
    seen = [events.receive_nowait() for _ in range(events.statistics().current_buffer_used)]
    order = [(type(e).__name__, e.model) for e in seen if isinstance(e, (Generated, ModelUnloaded, ModelLoaded))]
    assert order.index(("ModelUnloaded", "alpha")) > max(i for i, e in enumerate(order) if e == ("Generated", "alpha"))
    assert ("ModelLoaded", "beta") in order[order.index(("ModelUnloaded", "alpha")):]
    await until_loaded(client, server.url, ["beta"])


async def test_the_last_waiter_leaving_cancels_the_load(start_server, client) -> None:
    shelf = Shelf("alpha", gated=True)
    server = await start_server(library=shelf.models, max_resolutions=1)
    events = server.system.subscribe()
    with trio.move_on_after(0.5):  # the client gives up while the model loads
        await client.post(f"{server.url}/api/chat", json=chat("alpha"))
    assert shelf.entered == 1
    busy = await client.post(f"{server.url}/api/chat", json=chat("scripted"))
    assert busy.status_code == 503  # the load still holds the only resolution slot
    shelf.gate.set()
    await wait_for(lambda: server.system.resolver.statistics().current_buffer_used == 0)
    r = None
    with trio.fail_after(10):
        while r is None or r.status_code == 503:
            r = await client.post(f"{server.url}/api/chat", json=chat("scripted"))
    assert r.status_code == 200
    seen = [events.receive_nowait() for _ in range(events.statistics().current_buffer_used)]
    assert not any(isinstance(e, ModelLoaded) and e.model == "alpha" for e in seen)
    assert await ps(client, server.url) == ["scripted"]
    again = await client.post(f"{server.url}/api/chat", json=chat("alpha"))
    assert again.status_code == 200 and shelf.entered == 2


async def test_one_waiter_leaving_does_not_cancel_a_load_others_wait_for(start_server, client) -> None:
    shelf = Shelf("alpha", gated=True)
    server = await start_server(library=shelf.models)
    results: list[httpx.Response] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _append(results, client.post(f"{server.url}/api/chat", json=chat("alpha"))))
        with trio.move_on_after(0.3):
            await client.post(f"{server.url}/api/chat", json=chat("alpha"))
        shelf.gate.set()
    assert [r.status_code for r in results] == [200] and shelf.entered == 1


class _Store:
    """The model store's delete, for ``/api/delete``: records whether the model's stream had
    ended when its files went."""

    def __init__(self, stream_over: trio.Event) -> None:
        self.stream_over = stream_over
        self.deleted: list[tuple[str, bool]] = []

    def delete(self, name: str) -> bool:
        self.deleted.append((name, self.stream_over.is_set()))
        return True


async def _delete_during_a_stream(client: httpx.AsyncClient, url: str, store: _Store) -> httpx.Response:
    body = {"model": "slow", "messages": HELLO, "stream": True}
    async with trio.open_nursery() as nursery:
        async with client.stream("POST", f"{url}/api/chat", json=body) as r:
            lines = r.aiter_lines()
            await lines.__anext__()  # the model answers
            answer: list[httpx.Response] = []

            async def delete() -> None:
                answer.append(await client.request("DELETE", f"{url}/api/delete", json={"model": "slow"}))

            nursery.start_soon(delete)
            async for _ in lines:
                pass
        store.stream_over.set()
    return answer[0]


async def test_delete_waits_until_the_model_has_answered_its_requests(start_server, client) -> None:
    shelf = Shelf("slow", token_delay=0.02, script="word " * 60)
    store = _Store(trio.Event())
    server = await start_server(library=shelf.models, shelf=store)
    r = await _delete_during_a_stream(client, server.url, store)
    assert r.status_code == 200
    assert store.deleted == [("slow", True)]  # never under the stream that was reading it
    assert "slow" not in await ps(client, server.url)


async def test_delete_of_a_model_busy_past_the_wait_is_refused(start_server, client, monkeypatch) -> None:
    from turbospark.routes import ollama_models

    monkeypatch.setattr(ollama_models, "DELETE_WAIT", 0.2)
    shelf = Shelf("slow", token_delay=0.02, script="word " * 60)
    store = _Store(trio.Event())
    server = await start_server(library=shelf.models, shelf=store)
    r = await _delete_during_a_stream(client, server.url, store)
    assert r.status_code == 409 and "still answering requests" in r.json()["error"]
    assert store.deleted == []


async def test_a_burst_naming_a_model_no_one_has_takes_one_look_not_a_slot_each(start_server, client) -> None:
    """Eight clients at once name a model the server lacks (an SDK's default, after a quiet
    while): one looks in the library, the others are answered by the fallback at once, so none
    meets the resolution slots' limit (4) with a 503."""
    shelf = Shelf("alpha")
    server = await start_server(backends=[], library=lambda: tuple(shelf.models))
    body = {"model": "gpt-4o", "messages": HELLO, "max_tokens": 4}
    statuses: list[int] = []

    async def one() -> None:
        statuses.append((await client.post(f"{server.url}/v1/chat/completions", json=body)).status_code)

    for _ in range(2):  # the second burst after the name was looked for STRANGER_S ago
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(one)
        await trio.sleep(STRANGER_S)
    assert statuses == [200] * 16 and shelf.loads == {"alpha": 1}


async def test_a_model_stored_while_serving_answers_to_its_name_on_every_route(start_server, client) -> None:
    """A name no known model has is looked for in the library before a fallback answers it:
    ``models import`` beside a running server, then the OpenAI route asks for it by name."""
    shelf = Shelf("alpha")
    server = await start_server(backends=[], library=lambda: tuple(shelf.models))
    body = {"model": "beta", "messages": HELLO, "max_tokens": 4}
    r = await client.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 200 and shelf.loads == {"alpha": 1}  # the only chat model answers any name
    stored = Shelf("beta")
    shelf.models += stored.models  # stored now
    await trio.sleep(STRANGER_S)  # a name no model had is looked for again after a while
    r = await client.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 200 and stored.loads == {"beta": 1} and shelf.loads == {"alpha": 1}


async def test_an_unloaded_model_is_freed_where_start_up_was_frozen(start_server, client) -> None:
    """``serve`` freezes what start-up made (``turbospark._collector``), so that the collector's
    full passes stop walking it; a frozen object is never collected as a cycle, and a model's
    objects hold cycles (a backend and its engine's callbacks): its unload collects them."""
    import gc
    import weakref

    from turbospark._collector import freeze_start_up

    made: list[weakref.ref] = []

    def make() -> ScriptedBackend:
        backend = ScriptedBackend(model_id="alpha", script="Loaded and answering.")
        backend.itself = backend  # a cycle, freed by no reference count
        made.append(weakref.ref(backend))
        return backend

    loadable = Loadable(id="alpha", make=make, capabilities=frozenset({"chat", "completion"}),
                        context_window=8192, size=100)
    server = await start_server(library=[loadable])
    events = server.system.subscribe()
    try:
        r = await client.post(f"{server.url}/api/chat", json=chat("alpha", keep_alive=-1))
        assert r.status_code == 200 and made and made[0]() is not None
        freeze_start_up()  # as serve does once it listens: the loaded model is frozen with the rest
        r = await client.post(f"{server.url}/api/generate", json={"model": "alpha", "keep_alive": 0})
        assert r.status_code == 200
        with trio.fail_after(10):
            async for event in events:
                if isinstance(event, ModelUnloaded):
                    break
            while made[0]() is not None:  # collected once its actor has ended
                await trio.sleep(0.02)
        assert gc.get_freeze_count() > 0  # frozen again after the collection
    finally:
        gc.unfreeze()
