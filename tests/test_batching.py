"""The batched engine on the scripted backend: sequences join and leave a running batch in every
phase without disturbing each other, a sequence that fails fails alone, and shutdown gives every
running client its documented ending.  Real sockets, a real Hypercorn, the real model thread."""

from __future__ import annotations

import itertools
import json
from functools import partial

import attrs
import httpx
import trio

from turbospark.messages import BatchState, Generated
from turbospark.model.scripted import ENDLESS_TEXT, ScriptedBackend, shipped_tokenizer

from ._support import chat_body, raw_post, read_until, sse_events, wait_for
from .test_cancellation import metric

PATH = "/v1/chat/completions"
DELAY = 0.03


def solo_text(n: int) -> str:
    """What the scripted endless text is after ``n`` tokens, as one client alone would get it."""
    tok = shipped_tokenizer()
    return tok.decode(list(itertools.islice(itertools.cycle(tok.encode(ENDLESS_TEXT)), n)))


async def next_generated(events: trio.MemoryReceiveChannel, request_id: int | None = None) -> Generated:
    with trio.fail_after(10):
        async for event in events:
            if isinstance(event, Generated) and request_id in (None, event.id):
                return event
    raise AssertionError("no Generated event")


async def test_sequences_join_and_leave_a_running_batch_in_every_phase(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=DELAY, prefill_chunk=8)
    server = await start_server([backend], max_batch=2)
    events = server.system.subscribe(buffer=10_000)
    steady: list[httpx.Response] = []
    async with trio.open_nursery() as nursery:

        async def run_steady() -> None:
            body = chat_body(max_tokens=80, stream=True)
            steady.append(await client.post(f"{server.url}{PATH}", json=body))

        nursery.start_soon(run_steady)
        await wait_for(lambda: backend.counters.decode_steps >= 2)

        # joins in prefill (a long prompt, 8 tokens a step) and leaves there
        chunks = backend.counters.prefill_chunks
        prefilling = await raw_post(server.url, PATH, chat_body("word " * 300, max_tokens=5))
        await wait_for(lambda: backend.counters.prefill_chunks >= chunks + 3)
        # the batch is full (2): the next one waits in the queue, and leaves from there
        queued = await raw_post(server.url, PATH, chat_body(max_tokens=5, stream=True))
        with trio.fail_after(5):
            while await metric(client, server.url, "turbospark_queue_depth") != 1:
                await trio.sleep(0.005)
        assert await metric(client, server.url, 'turbospark_batch_size{model="scripted"}') == 2
        assert await metric(client, server.url, "turbospark_generations_in_flight") == 2
        await queued.aclose()
        left = await next_generated(events)
        assert (left.stop_reason, left.phase, left.began) == ("Cancelled", "queued", False)
        await prefilling.aclose()
        left = await next_generated(events)
        assert (left.stop_reason, left.phase) == ("Cancelled", "prefill")
        assert 0 < left.prefilled_tokens < left.prompt_tokens and left.new_tokens == 0

        # joins, decodes a few tokens, and leaves mid-decode: it stops within a step
        decoding = await raw_post(server.url, PATH, chat_body(max_tokens=500, stream=True))
        seen = await read_until(decoding, b'"content":"The"')
        for _ in range(3):
            seen += await read_until(decoding, b"\n\n")
        await decoding.aclose()
        left = await next_generated(events)
        assert (left.stop_reason, left.phase) == ("Cancelled", "decode")
        shown = seen.count(b'"content"') - 1  # the opening chunk carries an empty content
        assert left.new_tokens <= shown + 3  # what was shown, one step in flight, one buffered

    # the steady stream never noticed: its text is exactly what it is alone
    frames = [json.loads(d) for _, d in sse_events(steady[0].text)[:-1]]
    text = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames)
    assert text == solo_text(80)
    assert frames[-1]["choices"][0]["finish_reason"] == "length"
    assert await metric(client, server.url, "turbospark_generations_in_flight") == 0
    with trio.fail_after(5):
        while await metric(client, server.url, 'turbospark_batch_size{model="scripted"}') != 0:
            await trio.sleep(0.01)
    for phase in ("queued", "prefill", "decode"):
        assert await metric(client, server.url, f'turbospark_cancellations_total{{phase="{phase}"}}') == 1


async def test_batch_state_reports_size_and_kv_memory(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=0.005)
    server = await start_server([backend], max_batch=4)
    events = server.system.subscribe(buffer=10_000)
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(partial(client.post, f"{server.url}{PATH}", json=chat_body(max_tokens=40)))
    states = []
    with trio.move_on_after(1):
        async for event in events:
            if isinstance(event, BatchState):
                states.append(event)
                if event.running == 0:
                    break
    assert max(s.running for s in states) == 3
    assert max(s.kv_bytes for s in states) > 3 * 40 * 46_080  # three prompts and their tokens
    assert states[-1] == BatchState("scripted", 0, 0)


class PoisonedBackend(ScriptedBackend):
    """A sequence whose prompt says "poison" fails on its third decode step (as a broken logits
    processor would) or, with "poison-end", while it is being removed (ending or cleanup)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.poisoned: dict[int, str] = {}

    def insert(self, seq, prompt, params):
        text = self.tokenizer.decode(prompt)
        if "poison-end" in text:
            self.poisoned[seq] = "end"
        elif "poison" in text:
            self.poisoned[seq] = "step"
        return super().insert(seq, prompt, params)

    def step(self):
        out = super().step()
        failed = {}
        for seq, kind in self.poisoned.items():
            if kind == "step" and self._seqs.get(seq) and self._seqs[seq].generated >= 3:
                failed[seq] = RuntimeError("a logits processor blew up")
        for seq in failed:
            del self.poisoned[seq]
            self.remove(seq)
        tokens = {s: t for s, t in out.tokens.items() if s not in failed}
        return attrs.evolve(out, tokens=tokens, failed=failed)

    def remove(self, seq, *, keep_cache=True):
        if keep_cache and self.poisoned.get(seq) == "end":
            raise RuntimeError("the KV cache could not be handed back")
        super().remove(seq, keep_cache=keep_cache)


async def test_a_failing_sequence_fails_alone(start_server, client, caplog) -> None:
    backend = PoisonedBackend(token_delay=0.01)
    server = await start_server([backend], max_batch=4)
    results: dict[str, httpx.Response] = {}

    async def post(name: str, content: str, stream: bool) -> None:
        body = chat_body(content, max_tokens=30, stream=stream)
        results[name] = await client.post(f"{server.url}{PATH}", json=body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "healthy", "Hello there", True)
        await wait_for(lambda: backend.counters.decode_steps >= 1)
        nursery.start_soon(post, "poisoned", "poison", False)
        nursery.start_soon(post, "poisoned stream", "poison", True)
        nursery.start_soon(post, "fails ending", "poison-end", False)
    for name in ("poisoned", "fails ending"):
        assert results[name].status_code == 500, name
        error = results[name].json()["error"]
        assert error["type"] == "server_error" and error["message"].startswith("generation failed (error id ")
    frames = sse_events(results["poisoned stream"].text)
    assert frames[-1][0] == "error" and "[DONE]" not in results["poisoned stream"].text
    assert json.loads(frames[-1][1])["error"]["message"].startswith("generation failed (error id ")
    # no internal detail reaches a client; the log has each traceback
    assert "blew up" not in results["poisoned"].text and "blew up" in caplog.text
    error_id = results["poisoned"].json()["error"]["message"].rsplit(" ", 1)[-1].rstrip(")")
    assert f"(error id {error_id})" in caplog.text  # the log line the client's error points at
    assert "could not be handed back" in caplog.text
    # the batch-mate finished normally, and its text is exactly what it is alone
    healthy = [json.loads(d) for _, d in sse_events(results["healthy"].text)[:-1]]
    assert "".join(f["choices"][0]["delta"].get("content") or "" for f in healthy) == solo_text(30)
    r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=3))
    assert r.json()["usage"]["completion_tokens"] == 3  # and the thread keeps serving
    assert await metric(client, server.url, "turbospark_generations_in_flight") == 0


async def test_shutdown_with_a_running_batch_ends_every_client_properly(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=DELAY)
    server = await start_server([backend], max_batch=2)
    results: dict[str, httpx.Response] = {}

    async def post(name: str, stream: bool) -> None:
        body = chat_body(max_tokens=5000, stream=stream)
        results[name] = await client.post(f"{server.url}{PATH}", json=body)

    async with trio.open_nursery() as nursery:
        for n, (name, stream) in enumerate([("stream", True), ("plain", False)], start=1):
            nursery.start_soon(post, name, stream)
            await wait_for(lambda n=n: backend.counters.generations == n)
        nursery.start_soon(post, "queued", False)
        await wait_for(lambda: backend.counters.decode_steps >= 6)
        server.stop.set()
    # a stream ends with an error frame (no [DONE]), a plain request with a 503, both retryable
    frames = sse_events(results["stream"].text)
    assert frames[-1][0] == "error" and "[DONE]" not in results["stream"].text
    error = json.loads(frames[-1][1])["error"]
    assert "shutting down" in error["message"] and error["retryable"] is True
    for name in ("plain", "queued"):
        assert results[name].status_code == 503, name
        assert "shutting down" in results[name].json()["error"]["message"]


async def test_a_job_that_would_overflow_the_kv_budget_waits_for_room(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=DELAY)
    # room for one request of ~32 prompt tokens and 40 new ones (46 kB a token), not for two
    server = await start_server([backend], max_batch=4, kv_budget=100 * 46_080)
    events = server.system.subscribe(buffer=10_000)
    first: list[httpx.Response] = []
    async with trio.open_nursery() as nursery:

        async def run_first() -> None:
            first.append(await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=40)))

        nursery.start_soon(run_first)
        await wait_for(lambda: backend.counters.decode_steps >= 2)
        # taken by the model thread, but held: the batch has slots, not KV room
        held = await raw_post(server.url, PATH, chat_body(max_tokens=40, stream=True))
        await trio.sleep(DELAY * 4)
        assert backend.counters.generations == 1
        assert await metric(client, server.url, "turbospark_queue_depth") == 0
        # while one is held, the thread takes no more: the next waits in the queue, bounded
        third: list[httpx.Response] = []

        async def run_third() -> None:
            third.append(await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=3)))

        nursery.start_soon(run_third)
        with trio.fail_after(5):
            while await metric(client, server.url, "turbospark_queue_depth") != 1:
                await trio.sleep(0.005)
        await held.aclose()  # its client leaves while it waits for room
        left = await next_generated(events)
        assert (left.stop_reason, left.phase, left.began) == ("Cancelled", "queued", False)
    assert first[0].json()["usage"]["completion_tokens"] == 40
    assert third[0].json()["usage"]["completion_tokens"] == 3
    assert backend.counters.generations == 2  # the held one never ran


async def test_n_choices_share_one_prefill_and_decode_together(start_server, client) -> None:
    backend = ScriptedBackend(prefill_chunk=8)
    server = await start_server([backend])
    long_prompt = "word " * 100
    r = await client.post(f"{server.url}{PATH}", json=chat_body(long_prompt, max_tokens=5, n=3))
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in data["choices"]} == {solo_text(5)}
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    prompt = data["usage"]["prompt_tokens"]
    assert data["usage"]["completion_tokens"] == 15 and data["usage"]["total_tokens"] == prompt + 15
    # the prompt was read once, not three times
    assert backend.counters.generations == 1
    assert backend.counters.prefill_chunks == -(-prompt // 8)
    assert backend.counters.decode_steps == 15


async def test_n_choices_stream_interleaved_then_one_usage(start_server, client) -> None:
    server = await start_server([ScriptedBackend()])
    body = chat_body(max_tokens=4, n=2, stream=True, stream_options={"include_usage": True})
    r = await client.post(f"{server.url}{PATH}", json=body)
    frames = sse_events(r.text)
    assert frames[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in frames[:-1]]
    *choice_chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    indices = [c["choices"][0]["index"] for c in choice_chunks]
    assert indices[:2] == [0, 1]  # each choice opens with its role
    assert indices[2:6] != sorted(indices[2:6])  # and then they take turns, step by step
    for i in (0, 1):
        mine = [c["choices"][0] for c in choice_chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content") or "" for c in mine) == solo_text(4)
        assert [c["finish_reason"] for c in mine][-1] == "length"


async def test_a_disconnect_stops_every_choice(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=DELAY)
    server = await start_server([backend])
    events = server.system.subscribe(buffer=10_000)
    sock = await raw_post(server.url, PATH, chat_body(max_tokens=500, n=3, stream=True))
    await read_until(sock, b'"content":"The"')
    await wait_for(lambda: backend.counters.decode_steps >= 9)
    steps_at_close = backend.counters.decode_steps
    await sock.aclose()
    left = await next_generated(events)
    assert (left.stop_reason, left.phase) == ("Cancelled", "decode")
    assert backend.counters.decode_steps - steps_at_close <= 3  # one step, three choices
    settled = backend.counters.decode_steps
    await trio.sleep(DELAY * 4)
    assert backend.counters.decode_steps == settled


async def test_n_is_bounded_by_the_batch_and_the_kv_budget(start_server, client) -> None:
    server = await start_server([ScriptedBackend()], max_batch=4, kv_budget=1000 * 46_080)
    r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=5, n=5))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "at most 4 sequences" in r.json()["error"]["message"]
    r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=400, n=3))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "KV-cache memory" in r.json()["error"]["message"]
    r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=5, n=4))
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
