"""The real MLX backend behind the server: SmolLM2-135M-Instruct for a few tokens at a time."""

from __future__ import annotations

import json
from functools import partial

import httpx
import pytest
import trio

from turbospark.config import Settings
from turbospark.messages import Generated
from turbospark.model.backend import BackendSpec
from turbospark.server import serve

from ._support import chat_body, raw_post, read_until, sse_events
from .realmodels import smollm2_store

pytestmark = pytest.mark.mlx
PATH = "/v1/chat/completions"
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture
async def mlx_server(nursery: trio.Nursery):
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()
    make = partial(MlxBackend, stored.path, model_id=stored.name, prefill_chunk=64)
    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0)
    server = await nursery.start(serve, settings, [BackendSpec(stored.name, make)])
    yield server
    server.stop.set()


async def test_answers_sensibly_and_counts_exactly(mlx_server, client: httpx.AsyncClient) -> None:
    r = await client.post(
        f"{mlx_server.url}{PATH}", json={"model": "any", "messages": FRANCE, "temperature": 0}
    )
    data = r.json()
    assert data["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert data["choices"][0]["finish_reason"] == "stop"
    usage = data["usage"]
    assert usage["completion_tokens"] == 8  # 7 tokens of text and <|im_end|>
    from turbospark.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_store().path)
    assert usage["prompt_tokens"] == len(tok.encode_chat(FRANCE))


async def test_seed_repeats_and_second_turn_reuses_the_prefix(mlx_server, client) -> None:
    body = {"messages": FRANCE, "temperature": 1.0, "seed": 1234, "max_tokens": 12}
    first, second = [
        (await client.post(f"{mlx_server.url}{PATH}", json=body)).json() for _ in range(2)
    ]
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]

    answer = first["choices"][0]["message"]["content"]
    follow_up = FRANCE + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Germany?"},
    ]
    r = await client.post(f"{mlx_server.url}{PATH}", json={"messages": follow_up, "max_tokens": 8, "temperature": 0})
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 20
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


async def test_stop_strings_and_streaming(mlx_server, client) -> None:
    body = {"messages": FRANCE, "temperature": 0, "stop": ["Paris"], "stream": True}
    r = await client.post(f"{mlx_server.url}{PATH}", json=body)
    chunks = [json.loads(d) for _, d in sse_events(r.text)[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "The capital of France is "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_prompt_over_the_context_window_is_a_400(mlx_server, client) -> None:
    r = await client.post(f"{mlx_server.url}{PATH}", json={"messages": FRANCE, "max_tokens": 8190})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


async def test_disconnect_mid_decode_stops_the_mlx_loop(mlx_server, client) -> None:
    events = mlx_server.system.subscribe()
    story = chat_body("Tell me a very long story about the sea.", max_tokens=2000, stream=True)
    sock = await raw_post(mlx_server.url, PATH, story | {"temperature": 0})
    received = await read_until(sock, b'"content"', timeout=60)
    for _ in range(3):
        received += await read_until(sock, b"\n\n")
    shown = received.count(b'"content"')
    await sock.aclose()
    with trio.fail_after(10):
        async for event in events:
            if isinstance(event, Generated):
                break
    assert event.stop_reason == "Cancelled" and event.phase == "decode"
    # tokens the client had seen, the one step in progress, one pipelined ahead, and SSE lag
    assert event.new_tokens <= shown + 6
    r = await client.post(f"{mlx_server.url}{PATH}", json={"messages": FRANCE, "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


async def test_disconnect_during_prefill_stops_between_chunks(mlx_server, client) -> None:
    events = mlx_server.system.subscribe()
    long_prompt = "The sea is calm and the sky is blue. " * 120  # ~1300 tokens, 64 per chunk
    sock = await raw_post(mlx_server.url, PATH, chat_body(long_prompt, max_tokens=4))
    await trio.sleep(1.0)
    await sock.aclose()
    closed_at = trio.current_time()
    with trio.fail_after(30):
        async for event in events:
            if isinstance(event, Generated):
                break
    assert event.stop_reason == "Cancelled" and event.phase == "prefill"
    assert event.new_tokens == 0
    assert 0 < event.prefilled_tokens < event.prompt_tokens - 64
    # it stopped at the next chunk boundary: one chunk's worth of prefill time at most
    seconds_per_chunk = event.prefill_seconds / (event.prefilled_tokens / 64)
    assert trio.current_time() - closed_at < 2 * seconds_per_chunk + 0.5
