"""llama.cpp's ``timings`` on chat and completion answers and final chunks, and the prompt's
progress while it is read (``return_progress`` chunks, SSE comments, Anthropic's pings), on the
scripted backend and sans-io."""

from __future__ import annotations

import json
import math

import pytest

from turbospark.model.scripted import ScriptedBackend
from turbospark.routes.openai_chat_events import ChatStream, Envelope, prompt_progress, timings
from turbospark.turns.turn_events import Finish, Prefill, Text, Usage

from ._support import chat_body, sse_events

TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
           "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
LONG = "Tell me about the history of the printing press and its effect on Europe. " * 12


def test_timings_are_llama_cpps() -> None:
    t = timings(Usage(100, 10, 40, prompt_seconds=0.5, decode_seconds=2.0))
    assert set(t) == TIMINGS
    assert (t["cache_n"], t["prompt_n"], t["predicted_n"]) == (40, 60, 10)
    assert (t["prompt_ms"], t["predicted_ms"]) == (500.0, 2000.0)
    assert t["prompt_per_second"] == 120.0 and t["prompt_per_token_ms"] == 500 / 60
    assert t["predicted_per_second"] == 5.0 and t["predicted_per_token_ms"] == 200.0
    empty = timings(Usage(5, 0, 5))  # everything cached, nothing generated: no division by zero
    assert empty["prompt_n"] == 0 and empty["prompt_per_second"] == 0.0 and empty["predicted_per_token_ms"] == 0.0


def _frames(stream: ChatStream, events: list) -> list[dict | str]:
    out = []
    for event in events:
        frames = stream.progress(event) if isinstance(event, Prefill) else stream.feed(event)
        for frame in frames:
            text = frame.decode()
            out.append(text.strip() if text.startswith(":") or "[DONE]" in text else json.loads(text[6:]))
    return out


def test_the_last_chunk_carries_the_timings() -> None:
    env = Envelope("c", 0, "m", "fp")
    turn = [Text("Hi"), Finish("stop", "EndOfTurn", None, False, 2), Usage(10, 2, 0, 0, 0.1, 0.2)]
    plain = _frames(ChatStream(env), turn)
    assert plain[-1] == "data: [DONE]"
    assert plain[-2]["choices"][0]["finish_reason"] == "stop" and plain[-2]["timings"]["predicted_n"] == 2
    assert "timings" not in plain[0]
    usage = _frames(ChatStream(env, include_usage=True), turn)
    assert usage[-2]["choices"] == [] and usage[-2]["timings"]["prompt_n"] == 10 and "usage" in usage[-2]
    assert "timings" not in usage[-3]  # the finish chunk is not the last


def test_progress_frames() -> None:
    env = Envelope("c", 0, "m", "fp")
    event = Prefill(200, 16, 64, 0.25)
    assert prompt_progress(event) == {"total": 200, "cache": 16, "processed": 64, "time_ms": 250}
    (chunk,) = _frames(ChatStream(env, return_progress=True), [event])
    assert chunk["object"] == "chat.completion.chunk" and chunk["prompt_progress"] == prompt_progress(event)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert _frames(ChatStream(env), [event]) == [": prompt_progress 64/200"]


async def test_whole_answers_carry_timings(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="one two three four", token_delay=0.005)])
    for path, body in (("/v1/chat/completions", chat_body()), ("/v1/completions", {"prompt": "Hello", "max_tokens": 8})):
        r = (await client.post(f"{server.url}{path}", json=body)).json()
        t, u = r["timings"], r["usage"]
        assert set(t) == TIMINGS, path
        assert t["predicted_n"] == u["completion_tokens"]
        assert t["prompt_n"] + t["cache_n"] == u["prompt_tokens"]
        assert t["cache_n"] == u["prompt_tokens_details"]["cached_tokens"]
        assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0  # the model thread's clock, paced steps


async def test_stream_final_chunk_has_timings(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="one two three")])
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(stream=True))
    chunks = [json.loads(d) for _, d in sse_events(r.text) if d != "[DONE]"]
    assert [("timings" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    r = await client.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "stream": True,
                                                                "stream_options": {"include_usage": True}})
    chunks = [json.loads(d) for _, d in sse_events(r.text) if d != "[DONE]"]
    assert "usage" in chunks[-1] and chunks[-1]["timings"]["predicted_n"] == chunks[-1]["usage"]["completion_tokens"]


async def test_return_progress_reports_the_prefill(start_server, client) -> None:
    """A long prompt (16-token prefill chunks) reports its progress before its first token."""
    server = await start_server([ScriptedBackend(script="Sure.", token_delay=0.01)], keepalive_interval=60)
    body = chat_body(LONG, stream=True, return_progress=True, stream_options={"include_usage": True})
    r = await client.post(f"{server.url}/v1/chat/completions", json=body)
    chunks = [json.loads(d) for _, d in sse_events(r.text) if d != "[DONE]"]
    total = chunks[-1]["usage"]["prompt_tokens"]
    first_content = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert len(progress) >= 2 and total > 100
    assert all("prompt_progress" not in c for c in chunks[first_content:])
    assert all(set(p) == {"total", "cache", "processed", "time_ms"} and p["total"] == total for p in progress)
    assert [p["processed"] for p in progress] == sorted(p["processed"] for p in progress)
    assert progress[0]["processed"] == progress[0]["cache"]  # the first report: before any chunk is read
    # without return_progress: SSE comments, the chunks as before
    plain = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(LONG + " again", stream=True))
    assert plain.text.count(": prompt_progress ") >= 2
    assert all("prompt_progress" not in json.loads(d) for _, d in sse_events(plain.text) if d != "[DONE]")


async def test_anthropic_pings_while_the_prompt_is_read(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="Sure.", token_delay=0.01)], keepalive_interval=60)
    body = {"model": "claude-x", "max_tokens": 10, "stream": True, "messages": [{"role": "user", "content": LONG}]}
    r = await client.post(f"{server.url}/v1/messages", json=body)
    names = [name for name, _ in sse_events(r.text)]
    assert names.index("content_block_start") > 2 and names[:names.index("content_block_start")].count("ping") >= 2
    assert names[-1] == "message_stop"


# --- llama.cpp's test_chat_completion.py::test_return_progress, ported -------------------------


@pytest.mark.parametrize("reuse_cache", [False, True])
async def test_llama_cpp_return_progress(start_server, client, reuse_cache) -> None:
    """Their n_batch 64 is the scripted backend's 16-token chunk; paced steps, so the reader is
    never behind (a report finds the reply buffer empty) and every chunk's report arrives."""
    server = await start_server([ScriptedBackend(script="Sure, here it is.", token_delay=0.03)], keepalive_interval=60)
    body = {"max_tokens": 10, "messages": [{"role": "user", "content": "This is a test" * 10}],
            "stream": True, "return_progress": True}
    if reuse_cache:  # a first request to populate the cache
        await client.post(f"{server.url}/v1/chat/completions", json=body)
    r = await client.post(f"{server.url}/v1/chat/completions", json=body)
    last, count = None, 0
    for _, data in sse_events(r.text):
        if data == "[DONE]" or (cur := json.loads(data).get("prompt_progress")) is None:
            continue
        if count == 0:  # the first report: cache == processed
            assert cur["total"] > 0 and cur["cache"] == cur["processed"]
            if reuse_cache:
                assert cur["cache"] > 0
        if last is not None:
            assert cur["total"] == last["total"] and cur["cache"] == last["cache"]
            assert cur["processed"] > last["processed"]
        count += 1
        last = cur
    assert last is not None and last["processed"] == last["total"]
    assert count == 1 + math.ceil((last["total"] - last["cache"]) / 16)
