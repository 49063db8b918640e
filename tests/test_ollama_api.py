"""Ollama's API on the scripted backend: the official ``ollama`` client, NDJSON framing, counters,
option mapping, tools, format, think, images, errors in Ollama's shape, disconnects."""

from __future__ import annotations

import base64
import json

import httpx
import jsonschema
import ollama
import pytest
import trio

from turbospark.errors import RequestInvalid
from turbospark.messages import Generated
from turbospark.model.scripted import ScriptedBackend
from turbospark.wire.ollama import options_params

from ._support import WEATHER, raw_post, read_until

HELLO = [{"role": "user", "content": "Hello there"}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def lines(r: httpx.Response) -> list[dict]:
    assert r.text.endswith("\n")
    return [json.loads(line) for line in r.text.splitlines()]


async def test_the_official_client_chats_and_generates(start_server) -> None:
    server = await start_server([ScriptedBackend(script="Hello from the script.")])
    c = ollama.AsyncClient(host=server.url)
    r = await c.chat(model="scripted", messages=HELLO, stream=False)
    assert r.message.role == "assistant" and r.message.content == "Hello from the script."
    assert r.done and r.done_reason == "stop" and r.eval_count == 6 and r.prompt_eval_count > 0
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration and r.load_duration == 0
    parts = [p async for p in await c.chat(model="scripted", messages=HELLO, stream=True)]
    assert "".join(p.message.content for p in parts) == "Hello from the script."
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == 6 and parts[-1].message.content == ""
    g = await c.generate(model="scripted", prompt="Hi", options={"num_predict": 2})
    assert g.response == "Hello from" and g.eval_count == 2 and g.done_reason == "length"
    pieces = [p async for p in await c.generate(model="scripted:latest", prompt="Hi", stream=True)]
    assert "".join(p.response for p in pieces) == "Hello from the script." and pieces[-1].done


async def test_a_stream_is_ndjson_by_default_ending_in_one_done_object(start_server, client) -> None:
    server = await start_server()
    r = await client.post(f"{server.url}/api/chat", json={"model": "scripted", "messages": HELLO, "options": {"num_predict": 3}})
    assert r.headers["content-type"] == "application/x-ndjson"
    frames = lines(r)
    assert [f["done"] for f in frames] == [False, False, False, True]
    last = frames[-1]
    assert last["done_reason"] == "length" and last["eval_count"] == 3
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[key], int) and last[key] >= 0
    assert all(f["model"] == "scripted" and f["created_at"].endswith("Z") for f in frames)
    whole = await client.post(f"{server.url}/api/generate", json={"model": "scripted", "prompt": "x", "stream": False, "options": {"num_predict": 2}})
    assert whole.headers["content-type"] == "application/json"
    assert whole.json()["response"] and "message" not in whole.json()


async def test_generate_applies_the_template_unless_raw(start_server, client) -> None:
    server = await start_server()
    url = f"{server.url}/api/generate"
    body = {"model": "scripted", "prompt": "Hello", "stream": False, "options": {"num_predict": 1}}
    templated = (await client.post(url, json=body)).json()["prompt_eval_count"]
    with_system = (await client.post(url, json=body | {"system": "Be brief."})).json()["prompt_eval_count"]
    raw = (await client.post(url, json=body | {"raw": True})).json()["prompt_eval_count"]
    assert raw < templated and with_system != templated  # the template's own default system goes
    refused = await client.post(url, json=body | {"suffix": "end"})
    assert refused.status_code == 400 and "suffix" in refused.json()["error"]


def test_options_map_to_sampling_fields() -> None:
    got = options_params({
        "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "seed": 7, "num_predict": 12,
        "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25, "stop": ["\n"],
        "num_ctx": 512, "num_thread": 4,
    })
    assert got.sampling == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "seed": 7, "max_tokens": 12,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25, "stop": ("\n",),
    }
    assert got.num_ctx == 512 and got.ignored == ("num_thread",)
    assert "max_tokens" not in options_params({"num_predict": -1}).sampling
    for bad in ({"temperature": "hot"}, {"top_k": 1.5}, {"top_p": 2}, {"stop": [1]}, {"warp": 9}):
        with pytest.raises(RequestInvalid):
            options_params(bad)


async def test_options_reach_the_model_and_num_ctx_is_checked(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="one two three four five", context_window=512)])
    url = f"{server.url}/api/chat"
    body = {"model": "scripted", "messages": HELLO, "stream": False}
    r = await client.post(url, json=body | {"options": {"stop": [" three"], "num_thread": 2}})
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == "one two" and r.json()["done_reason"] == "stop"
    assert r.headers["x-anyllm-degradation"] == "options.num_thread"
    too_big = await client.post(url, json=body | {"options": {"num_ctx": 4096}})
    assert too_big.status_code == 400 and "512" in too_big.json()["error"]
    too_small = await client.post(url, json=body | {"options": {"num_ctx": 40, "num_predict": 30}})
    assert too_small.status_code == 400 and "num_ctx" in too_small.json()["error"]
    fits = await client.post(url, json=body | {"options": {"num_ctx": 200, "num_predict": 2}})
    assert fits.status_code == 200 and fits.json()["eval_count"] == 2


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/api/chat", {"model": "nope", "messages": HELLO}, 404, "nope"),
        ("/api/generate", {"model": "nope", "prompt": "x"}, 404, "nope"),
        ("/api/chat", {"messages": HELLO}, 400, "model"),
        ("/api/chat", {"model": "scripted", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("/api/chat", {"model": "scripted", "messages": HELLO, "format": "xml"}, 400, "format"),
        ("/api/chat", {"model": "scripted", "messages": HELLO, "keep_alive": "soon"}, 400, "keep_alive"),
        ("/api/chat", {"model": "scripted", "messages": HELLO, "think": "very"}, 400, "think"),
        ("/api/chat", {"model": "scripted", "messages": HELLO, "stream": "yes"}, 400, "stream"),
        ("/api/chat", {"model": "scripted", "messages": HELLO, "temperature": 1}, 400, "temperature"),
        ("/api/chat", {"model": "scripted", "messages": [{"role": "user", "content": "x", "images": ["%%%"]}]}, 400, "base64"),
        ("/api/generate", {"model": "scripted", "prompt": "x", "template": "{{ .Prompt }}"}, 400, "template"),
        ("/api/show", {"model": "nope"}, 404, "nope"),
        ("/api/show", {}, 400, "model"),
        ("/api/pull", {"model": "smollm2-135m-instruct"}, 400, "model store"),
        ("/api/delete", {"model": "scripted"}, 400, "model store"),
    ],
)
async def test_errors_are_in_ollamas_shape(start_server, client, path, body, status, needle) -> None:
    server = await start_server()
    method = "DELETE" if path == "/api/delete" else "POST"
    r = await client.request(method, f"{server.url}{path}", json=body)
    assert r.status_code == status
    assert list(r.json()) == ["error"] and needle in r.json()["error"]
    bad_json = await client.post(f"{server.url}/api/chat", content=b"{nope")
    assert bad_json.status_code == 400 and list(bad_json.json()) == ["error"]


async def test_tools_come_back_as_tool_calls(start_server) -> None:
    script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    server = await start_server([ScriptedBackend(script=script)])
    c = ollama.AsyncClient(host=server.url)
    r = await c.chat(model="scripted", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER])
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Oslo"}
    assert r.done_reason == "stop"
    parts = [p async for p in await c.chat(model="scripted", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], stream=True)]
    assert [tc.function.name for p in parts for tc in (p.message.tool_calls or ())] == ["get_weather"]
    # the call and its result go back as history
    follow = await c.chat(model="scripted", tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12C", "tool_name": "get_weather"},
    ])
    assert follow.prompt_eval_count > r.prompt_eval_count


async def test_format_is_enforced(start_server) -> None:
    server = await start_server([ScriptedBackend(script="Here you go: not JSON at all")])
    c = ollama.AsyncClient(host=server.url)
    r = await c.chat(model="scripted", messages=HELLO, format=SCHEMA, options={"num_predict": 60})
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    g = await c.generate(model="scripted", prompt="x", format="json", options={"num_predict": 60})
    assert isinstance(json.loads(g.response), dict)


async def test_think_gives_the_reasoning_as_thinking(start_server) -> None:
    server = await start_server([ScriptedBackend(script="<think>Plan it.</think>The answer.")])
    c = ollama.AsyncClient(host=server.url)
    r = await c.chat(model="scripted", messages=HELLO, think=True)
    assert r.message.thinking == "Plan it." and r.message.content == "The answer."
    g = await c.generate(model="scripted", prompt="x", think=True)
    assert g.thinking == "Plan it." and g.response == "The answer."


async def test_images_are_checked_then_dropped_with_a_note(start_server, client) -> None:
    server = await start_server()
    image = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()
    r = await client.post(f"{server.url}/api/chat", json={
        "model": "scripted", "stream": False, "options": {"num_predict": 1},
        "messages": [{"role": "user", "content": "What is this?", "images": [image]}],
    })
    assert r.status_code == 200 and "vision" in r.headers["x-anyllm-degradation"]
    r = await client.post(f"{server.url}/api/generate", json={
        "model": "scripted", "prompt": "x", "images": [image] * 65, "stream": False,
    })
    assert r.status_code == 400 and "64" in r.json()["error"]


async def test_a_failure_mid_stream_ends_with_an_error_object(start_server) -> None:
    server = await start_server([ScriptedBackend(token_delay=0.01)])
    stream = await raw_post(server.url, "/api/chat", {"model": "scripted", "messages": HELLO, "options": {"num_predict": 1000}})
    await read_until(stream, b'"done":false')
    server.stop.set()
    body = await read_until(stream, b'"done_reason":"error"', timeout=20)
    (last,) = [json.loads(line) for line in body.splitlines() if b'"done_reason":"error"' in line]
    assert last["done"] is True and last["error"] and "shutting down" in last["error"]
    await stream.aclose()


async def test_a_disconnect_mid_stream_cancels_the_generation(start_server) -> None:
    backend = ScriptedBackend(token_delay=0.01)
    server = await start_server([backend])
    events = server.system.subscribe()
    stream = await raw_post(server.url, "/api/generate", {"model": "scripted", "prompt": "x", "options": {"num_predict": 1000}})
    await read_until(stream, b'"done":false')
    await stream.aclose()
    with trio.fail_after(10):
        async for event in events:
            if isinstance(event, Generated):
                break
    assert event.stop_reason == "Cancelled" and event.phase == "decode" and event.new_tokens < 1000


async def test_management_routes(start_server, client) -> None:
    server = await start_server()
    c = ollama.AsyncClient(host=server.url)
    assert [m.model for m in (await c.list()).models] == ["scripted"]
    shown = await c.show("scripted")
    assert shown.capabilities == ["completion", "tools"] and shown.modelinfo
    assert shown.details.family == "scripted"
    (loaded,) = (await c.ps()).models
    assert loaded.model == "scripted" and loaded.context_length == 8192 and loaded.expires_at.year > 2100
    assert (await client.get(f"{server.url}/api/version")).json() == {"version": __import__("turbospark").__version__}
    head = await client.head(f"{server.url}/")
    assert head.status_code == 200
    assert (await client.get(f"{server.url}/")).text == "Ollama is running"


async def test_truncate_drops_the_oldest_messages_and_shift_cuts_the_budget(start_server, client) -> None:
    """Ollama's ``truncate``: a conversation past the context keeps its system message and its
    newest messages that fit, instead of a 400; ``shift``: a budget past what is left is cut to
    it.  Without them, and on other families without ``serve --context-shift``, the typed 400."""
    backend = ScriptedBackend(context_window=200, script="Fine.")
    server = await start_server(backends=[backend])
    old = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " + "word " * 20} for i in range(12)]
    messages = [{"role": "system", "content": "Be brief."}, *old, {"role": "user", "content": "And now?"}]
    body = {"model": backend.model_id, "messages": messages, "stream": False, "options": {"num_predict": 8}}
    refused = await client.post(server.url + "/api/chat", json=body)
    assert refused.status_code == 400 and "context window is 200 tokens" in refused.json()["error"]
    kept = await client.post(server.url + "/api/chat", json={**body, "truncate": True})
    assert kept.status_code == 200, kept.text
    assert 0 < kept.json()["prompt_eval_count"] <= 200 - 8
    tok = backend.tokenizer
    newest = tok.encode_chat([messages[0], *messages[-3:]])  # the system message and the newest fit
    assert kept.json()["prompt_eval_count"] >= len(newest)
    long = {**body, "messages": [messages[0], messages[-1]], "options": {"num_predict": 500}}
    assert (await client.post(server.url + "/api/chat", json=long)).status_code == 400
    cut = await client.post(server.url + "/api/chat", json={**long, "shift": True})
    assert cut.status_code == 200 and cut.json()["done_reason"] in ("stop", "length")
    openai = {"model": backend.model_id, "messages": messages, "max_tokens": 8}
    assert (await client.post(server.url + "/v1/chat/completions", json=openai)).status_code == 400
    shifted = await start_server(backends=[ScriptedBackend(context_window=200, script="Fine.")], context_shift=True)
    r = await client.post(shifted.url + "/v1/chat/completions", json=openai)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] <= 200 - 8
