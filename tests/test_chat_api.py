"""The OpenAI chat contract on a real Hypercorn socket, with the scripted backend."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from turbospark.web import bodies
from turbospark.model.scripted import ENDLESS_TEXT, ScriptedBackend, shipped_tokenizer

from ._support import chat_body, json_children, sse_events, wait_for

TOK = shipped_tokenizer()


def prompt_tokens(messages: list[dict]) -> int:
    return len(TOK.encode_chat(messages))


async def test_non_streaming_counts_are_exact(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server()
    body = chat_body("What is the capital of France?", max_tokens=5, temperature=0)
    r = await client.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    assert data["model"] == "scripted"
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    expected_text = TOK.decode(TOK.encode(ENDLESS_TEXT)[:5])
    assert choice["message"]["content"] == expected_text
    usage = data["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["prompt_tokens"] == prompt_tokens(body["messages"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert "x-anyllm-degradation" not in r.headers


async def test_streaming_frames_in_order(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server()
    body = chat_body(max_tokens=4, stream=True, stream_options={"include_usage": True})
    r = await client.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = sse_events(r.text)
    assert all(name is None for name, _ in frames)
    assert frames[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert "".join(content) == TOK.decode(TOK.encode(ENDLESS_TEXT)[:4])
    finish = chunks[-2]
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["prompt_tokens"] == prompt_tokens(body["messages"])
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}


async def test_script_ends_the_turn_with_stop(start_server, client: httpx.AsyncClient) -> None:
    script = "Paris is the capital of France. Ünïcödé ✓ 🙂"
    server = await start_server([ScriptedBackend(script=script)])
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=200))
    data = r.json()
    assert data["choices"][0]["message"]["content"] == script
    assert data["choices"][0]["finish_reason"] == "stop"
    # every script token, plus the end-of-turn token the model "sampled"
    assert data["usage"]["completion_tokens"] == len(TOK.encode(script)) + 1


async def test_stop_strings_cut_and_hold_back(start_server, client: httpx.AsyncClient) -> None:
    script = "one two three four five"
    server = await start_server([ScriptedBackend(script=script)])
    for stream in (False, True):
        r = await client.post(
            f"{server.url}/v1/chat/completions",
            json=chat_body(stop=["thr", "five"], stream=stream),
        )
        if stream:
            chunks = [json.loads(d) for _, d in sse_events(r.text)[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text = r.json()["choices"][0]["message"]["content"]
            finish = r.json()["choices"][0]["finish_reason"]
        assert text == "one two "
        assert finish == "stop"


async def test_default_system_prompt_only_when_absent(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server(system_prompt="You are terse.")
    user = {"role": "user", "content": "hi"}
    r = await client.post(f"{server.url}/v1/chat/completions", json={"messages": [user], "max_tokens": 1})
    expected = prompt_tokens([{"role": "system", "content": "You are terse."}, user])
    assert r.json()["usage"]["prompt_tokens"] == expected
    own = {"role": "system", "content": "Be verbose please."}
    r = await client.post(
        f"{server.url}/v1/chat/completions", json={"messages": [own, user], "max_tokens": 1}
    )
    assert r.json()["usage"]["prompt_tokens"] == prompt_tokens([own, user])


async def test_content_parts_and_degradation(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server()
    parts = [
        {"type": "text", "text": "Describe"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    body = {
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 2,
        "n": 2,
        "logprobs": True,
        "response_format": {"type": "json_object"},
    }
    r = await client.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 200
    header = r.headers["x-anyllm-degradation"]
    # n, logprobs and response_format are honoured: only the dropped image is reported
    assert header == (
        "this server's model has no vision tower, so image content parts were ignored; "
        "run it against an install whose checkpoint carries one"
    )
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert r.json()["usage"]["prompt_tokens"] == prompt_tokens([{"role": "user", "content": "Describe"}])
    assert r.json()["usage"]["completion_tokens"] == 4


async def test_models_and_health(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server()
    r = await client.get(f"{server.url}/health")
    assert r.json() == {"status": "ok", "state": "ready"}
    r = await client.get(f"{server.url}/v1/models")
    ids = [m["id"] for m in r.json()["data"]]
    assert ids == ["scripted", "claude-turbospark-scripted"]
    assert r.json()["data"][0]["context_window"] == 8192
    r = await client.get(f"{server.url}/v1/models/claude-turbospark-scripted")
    assert r.status_code == 200 and r.json()["object"] == "model"
    r = await client.get(f"{server.url}/v1/models/gpt-4o")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


async def test_model_routing(start_server, client: httpx.AsyncClient) -> None:
    one = await start_server()
    r = await client.post(
        f"{one.url}/v1/chat/completions", json=chat_body(max_tokens=1) | {"model": "claude-sonnet-4-6"}
    )
    assert r.status_code == 200 and r.json()["model"] == "claude-sonnet-4-6"

    two = await start_server(
        [ScriptedBackend(model_id="alpha", script="A"), ScriptedBackend(model_id="beta", script="B")]
    )
    for name, text in (("alpha", "A"), ("claude-turbospark-beta", "B")):
        r = await client.post(f"{two.url}/v1/chat/completions", json=chat_body() | {"model": name})
        assert r.json()["choices"][0]["message"]["content"] == text
    r = await client.post(f"{two.url}/v1/chat/completions", json=chat_body() | {"model": "gpt-4o"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "alpha" in error["message"] and "beta" in error["message"]
    assert error["available"] == ["alpha", "beta"]


async def test_context_overflow_is_a_400(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server([ScriptedBackend(context_window=64)])
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=60))
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "context window is 64 tokens" in r.json()["error"]["message"]
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=2, stream=True))
    frames = sse_events(r.text)  # a budget that fits streams normally
    assert frames[-1][1] == "[DONE]"
    assert json.loads(frames[-2][1])["choices"][0]["finish_reason"] == "length"


BAD_BODIES = [
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps(chat_body(max_tokens=0)).encode(), "max_tokens must be greater than 0"),
    (json.dumps(chat_body(max_tokn=3)).encode(), "unknown field(s) max_tokn"),
    (json.dumps(chat_body(stream="yes")).encode(), "body.stream"),
    (json.dumps(chat_body(temperature="hot")).encode(), "body.temperature"),
    (json.dumps(chat_body(max_tokens=2.5)).encode(), "body.max_tokens"),
    (json.dumps({"model": "scripted"}).encode(), "required field missing @ body.messages"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "'robot' is not one of"),
    (json.dumps({"messages": [{"role": "user", "content": 7}]}).encode(), "content must be"),
    (json.dumps(chat_body(stop=[1])).encode(), "stop must be"),
    (json.dumps(chat_body(repetition_penalty=0)).encode(), "repetition_penalty must be between"),
    (json.dumps(chat_body(top_p=1.5)).encode(), "top_p must be between 0.0 and 1.0, got 1.5"),
    # enums the API defines are checked, never silently ignored
    (json.dumps(chat_body(response_format={"type": "xml"})).encode(),
     "response_format.type must be one of 'text', 'json_object', 'json_schema', got 'xml'"),
    (json.dumps(chat_body(response_format={"type": "json_schema"})).encode(),
     "response_format.json_schema must be an object"),
    (json.dumps(chat_body(tool_choice="sometimes")).encode(), "tool_choice must be one of"),
    (json.dumps(chat_body(reasoning_effort="extreme")).encode(), "reasoning_effort must be one of"),
    (json.dumps(chat_body(service_tier="gold")).encode(), "service_tier must be one of"),
    (json.dumps(chat_body(modalities=["text", "video"])).encode(), "got 'video'"),
    (json.dumps(chat_body(verbosity="loud")).encode(), "verbosity must be one of"),
    (json.dumps(chat_body(n=0)).encode(), "n must be between 1 and 128, got 0"),
    (json.dumps(chat_body(logit_bias={"the": 5})).encode(), "logit_bias keys must be token ids"),
    (json.dumps(chat_body(logit_bias={"5": 101})).encode(), "between -100 and 100, got 101"),
    (json.dumps(chat_body(logit_bias={"99999999": 1})).encode(), "outside this model's vocabulary"),
]


@pytest.mark.parametrize(("raw", "needle"), BAD_BODIES)
async def test_bad_input_is_a_json_400(start_server, client, raw: bytes, needle: str) -> None:
    server = await start_server()
    r = await client.post(
        f"{server.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert needle in error["message"]
    # and the server keeps serving
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=1))
    assert r.json()["usage"]["completion_tokens"] == 1


async def test_framework_errors_are_json_too(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server()
    r = await client.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = await client.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    big = b'{"messages": "' + b"x" * (25 * 1024 * 1024 + 10) + b'"}'
    r = await client.post(f"{server.url}/v1/chat/completions", content=big)
    assert r.status_code == 413
    assert "25 MiB" in r.json()["error"]["message"]
    r = await client.get(f"{server.url}/health")
    assert r.json() == {"status": "ok", "state": "ready"}


async def test_auth(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server(api_key="s3cret")
    url = f"{server.url}/v1/models"
    for headers in ({}, {"x-api-key": "wrong!"}, {"x-api-key": "s3cre"}, {"authorization": "s3cret"}):
        r = await client.get(url, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    for headers in (
        {"x-api-key": "s3cret"},
        {"authorization": "Bearer s3cret"},
        {"authorization": "BEARER s3cret"},
        {"x-api-key": "", "authorization": "bearer s3cret"},
    ):
        r = await client.get(url, headers=headers)
        assert r.json()["data"][0]["id"] == "scripted"
    assert (await client.get(f"{server.url}/health")).json() == {"status": "ok", "state": "ready"}
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=1))
    assert r.status_code == 401


async def test_queue_full_is_a_503_with_retry_after(start_server, client: httpx.AsyncClient) -> None:
    backend = ScriptedBackend(token_delay=0.02)
    server = await start_server([backend], max_queue=1, max_batch=1)
    url = f"{server.url}/v1/chat/completions"
    results: list[httpx.Response] = []

    async def post(max_tokens: int) -> None:
        results.append(await client.post(url, json=chat_body(max_tokens=max_tokens)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, 40)  # active
        await wait_for(lambda: backend.counters.generations == 1)
        nursery.start_soon(post, 2)  # waits
        await trio.sleep(0.1)
        r = await client.post(url, json=chat_body(max_tokens=2))  # refused
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "queue_full" and error["retryable"] is True
    assert [r.status_code for r in results] == [200, 200]
    assert backend.counters.generations == 2
    metrics = (await client.get(f"{server.url}/metrics")).text
    assert "turbospark_queue_rejections_total 1.0" in metrics


async def test_saturated_resolution_refuses_without_blocking_others(
    start_server, client: httpx.AsyncClient
) -> None:
    gate = trio.Event()
    entered = 0

    async def slow_resolve(registry, name, want):
        nonlocal entered
        entered += 1
        await gate.wait()
        return registry.resolve(name, want)

    server = await start_server(max_resolutions=1, resolve=slow_resolve)
    url = f"{server.url}/v1/chat/completions"
    held: list[httpx.Response] = []
    async with trio.open_nursery() as nursery:

        async def hold() -> None:
            held.append(await client.post(url, json=chat_body(max_tokens=1)))

        nursery.start_soon(hold)
        await wait_for(lambda: entered == 1)
        r = await client.post(url, json=chat_body(max_tokens=1))
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "model_resolution_busy" and error["retryable"] is True
        health = await client.get(f"{server.url}/health")
        assert health.json() == {"status": "ok", "state": "ready"}
        models = await client.get(f"{server.url}/v1/models")
        assert [m["id"] for m in models.json()["data"]] == ["scripted", "claude-turbospark-scripted"]
        gate.set()
    assert held[0].json()["usage"]["completion_tokens"] == 1


async def test_events_file_and_metrics(start_server, client: httpx.AsyncClient, tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    server = await start_server(events_path=path)
    await client.post(
        f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=3) | {"model": "whatever"}
    )
    metrics = (await client.get(f"{server.url}/metrics")).text
    v1 = (await client.get(f"{server.url}/v1/metrics")).text
    assert "turbospark_generated_tokens_total 3.0" in metrics
    assert 'turbospark_requests_total{route="/v1/chat/completions",status="200"} 1.0' in metrics
    assert "turbospark_generations_in_flight 0.0" in metrics
    assert "turbospark_queue_depth 0.0" in metrics
    assert 'turbospark_cancellations_total{phase="decode"} 0.0' in metrics
    assert 'turbospark_time_to_first_token_seconds_count{model="scripted"} 1.0' in metrics
    assert "turbospark_queue_rejections_total 0.0" in metrics
    assert "# TYPE turbospark_generated_tokens_total counter" in v1

    def chat_finished() -> bool:  # the file is written apart from the metrics, a moment later
        if not path.exists():
            return False
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        first = next((e for e in lines if "id" in e), None)
        return first is not None and any(e["kind"] == "requestFinished" and e["id"] == first["id"] for e in lines)

    await wait_for(chat_finished)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert events[0] == {"kind": "modelLoaded", "model": "scripted", "seconds": events[0]["seconds"], "size": 0}
    first = next(e for e in events if "id" in e)
    chat = [e for e in events if e.get("id") == first["id"] and e["kind"] != "queueDepth"]
    assert [e["kind"] for e in chat] == [
        "requestStarted",
        "requestRouted",
        "generationBegan",
        "generated",
        "requestFinished",
    ]
    routed, generated, finished = chat[1], chat[3], chat[4]
    assert routed == {"kind": "requestRouted", "id": routed["id"], "requested": "whatever", "served": "scripted", "stream": False}
    assert generated["newTokens"] == 3 and generated["promptTokens"] > 0
    assert generated["stopReason"] == "MaxTokens"
    assert isinstance(generated["prefillSeconds"], float) and isinstance(generated["decodeSeconds"], float)
    assert finished["status"] == 200 and finished["route"] == "/v1/chat/completions"


async def test_auth_failures_are_observed(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server(api_key="k")
    events = server.system.subscribe()
    await client.get(f"{server.url}/v1/models")
    kinds = []
    with trio.fail_after(5):
        async for event in events:
            kinds.append(event)
            if type(event).__name__ == "RequestFinished":
                break
    assert [type(e).__name__ for e in kinds] == ["RequestStarted", "RequestFinished"]
    assert kinds[1].status == 401 and kinds[1].error == "invalid or missing API key"


class FailingBackend(ScriptedBackend):
    """Every fifth engine step fails as a whole, as a broken model would."""

    steps = 0

    def step(self):
        self.steps += 1
        if self.steps % 5 == 0:
            raise RuntimeError("the accelerator caught fire")
        return super().step()


async def test_a_failure_mid_stream_is_an_error_frame_without_done(start_server, client, caplog) -> None:
    server = await start_server([FailingBackend()])
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(stream=True))
    frames = sse_events(r.text)
    assert [name for name, _ in frames if name] == ["error"]
    assert frames[-1][0] == "error"
    error = json.loads(frames[-1][1])["error"]
    # the client learns it failed, never the internal detail; the log has the traceback
    assert error["type"] == "server_error" and error["message"].startswith("generation failed (error id ")
    assert "caught fire" in caplog.text and "Traceback" in caplog.text
    assert "[DONE]" not in r.text
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body())
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    # the model thread survives its failures
    healthy = await client.get(f"{server.url}/metrics")
    assert "turbospark_generations_in_flight 0.0" in healthy.text


async def test_quiet_streams_carry_keepalive_comments(start_server, client) -> None:
    server = await start_server([ScriptedBackend(token_delay=0.15)], keepalive_interval=0.05)
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=3, stream=True))
    assert r.text.count(": keepalive\n\n") >= 3
    assert sse_events(r.text)[-1][1] == "[DONE]"


async def test_a_client_that_stops_reading_does_not_stall_the_others(start_server, client) -> None:
    """The stalled client keeps its connection open but never reads: the model thread must not
    wait for it, so the next client is served as if it were not there."""
    from ._support import raw_post

    from turbospark.messages import Generated

    backend = ScriptedBackend(context_window=64_000)
    server = await start_server([backend])
    events = server.system.subscribe(buffer=100_000)
    # a stream far larger than the socket buffers (~5 MB of SSE), never read
    stalled = await raw_post(server.url, "/v1/chat/completions", chat_body(max_tokens=30_000, stream=True))
    try:
        await wait_for(lambda: backend.counters.generations == 1)
        # the bounds only catch a hang (a loaded machine is slow, not stuck): what is waited for is
        # the answer, then the two Generated events
        with trio.fail_after(120):
            r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=3))
        assert r.json()["usage"]["completion_tokens"] == 3
        assert backend.counters.generations == 2
        generated = []
        with trio.fail_after(120):
            async for event in events:
                if isinstance(event, Generated):
                    generated.append(event)
                    if len(generated) == 2:
                        break
        # both ran to their budgets: the stalled client's replies were buffered, not waited for
        assert sorted((g.stop_reason, g.new_tokens) for g in generated) == [
            ("MaxTokens", 3), ("MaxTokens", 30_000)
        ]
    finally:
        await stalled.aclose()


async def test_system_fingerprint_is_everywhere_and_stable(start_server, client) -> None:
    first = await start_server([ScriptedBackend()])
    again = await start_server([ScriptedBackend()])  # the same set-up, started anew
    other = await start_server([ScriptedBackend(script="Something else.")])
    prints = set()
    for server in (first, again):
        r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=2))
        prints.add(r.json()["system_fingerprint"])
        r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=2, stream=True))
        prints |= {json.loads(d)["system_fingerprint"] for _, d in sse_events(r.text)[:-1]}
        r = await client.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        prints.add(r.json()["system_fingerprint"])
    (fingerprint,) = prints
    assert fingerprint.startswith("fp_")
    r = await client.post(f"{other.url}/v1/chat/completions", json=chat_body(max_tokens=2))
    assert r.json()["system_fingerprint"] != fingerprint  # what decides the output changed


async def test_a_base_url_without_v1_reaches_the_same_handlers(start_server) -> None:
    import openai

    server = await start_server()
    sdk = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
    chat = await sdk.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert chat.usage.completion_tokens == 3 and chat.choices[0].message.content
    text = await sdk.completions.create(model="scripted", prompt="Hi", max_tokens=2)
    assert text.usage.completion_tokens == 2
    assert "scripted" in [m.id async for m in sdk.models.list()]
    assert (await sdk.models.retrieve("scripted")).id == "scripted"


async def test_logprobs_streaming_and_not(start_server, client, monkeypatch) -> None:
    server = await start_server()
    body = chat_body(max_tokens=4, logprobs=True, top_logprobs=3)
    r = await client.post(f"{server.url}/v1/chat/completions", json=body)
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for e in content:
        assert e["logprob"] <= 0 and e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
    r = await client.post(f"{server.url}/v1/chat/completions", json=body | {"stream": True})
    chunks = [json.loads(d) for _, d in sse_events(r.text)[:-1]]
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content  # every token reported once, in order
    # an answer with many log-probabilities is written by the parser's child: the same answer
    monkeypatch.setattr(bodies, "BIG_ANSWER", 10)
    assert json_children() == []
    written = await client.post(f"{server.url}/v1/chat/completions", json=body | {"seed": 7})
    assert len(json_children()) == 1  # it was written there
    monkeypatch.setattr(bodies, "BIG_ANSWER", 10**9)
    on_the_loop = await client.post(f"{server.url}/v1/chat/completions", json=body | {"seed": 7})
    assert len(content) * (1 + 3) > 10  # over the (lowered) threshold
    assert written.json()["choices"] == on_the_loop.json()["choices"]
    assert written.headers["content-type"] == on_the_loop.headers["content-type"] == "application/json"
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=2, top_logprobs=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=2))
    assert r.json()["choices"][0]["logprobs"] is None  # not asked, not given
