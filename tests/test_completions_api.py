"""``/v1/completions`` with the scripted backend: plain text, no chat template."""

from __future__ import annotations

import json

import httpx
import pytest

from turbospark.model.scripted import ENDLESS_TEXT, shipped_tokenizer

from ._support import sse_events

TOK = shipped_tokenizer()
PATH = "/v1/completions"


async def test_non_streaming_text_completion(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server()
    prompt = "Once upon a time"
    r = await client.post(f"{server.url}{PATH}", json={"model": "scripted", "prompt": prompt, "max_tokens": 3})
    data = r.json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    choice = data["choices"][0]
    assert choice["text"] == TOK.decode(TOK.encode(ENDLESS_TEXT)[:3])
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    # no template: the prompt is exactly its own tokens (SmolLM2 adds no BOS)
    assert data["usage"]["prompt_tokens"] == len(TOK.encode(prompt))
    assert data["usage"]["completion_tokens"] == 3
    r = await client.post(f"{server.url}{PATH}", json={"prompt": ["hi"]})
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default budget here


async def test_streaming_text_completion(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server()
    body = {"prompt": "Hi", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post(f"{server.url}{PATH}", json=body)
    frames = sse_events(r.text)
    assert frames[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in frames[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks[:-2]]
    assert all(texts) and "".join(texts) == TOK.decode(TOK.encode(ENDLESS_TEXT)[:4])
    assert chunks[-2]["choices"][0] == {"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": ["a", "b"]}, "exactly one prompt per request, got 2"),
        ({"prompt": []}, "exactly one prompt per request, got 0"),
        ({"prompt": "a", "suffix": "b"}, "suffix (fill-in-the-middle) is not supported"),
        ({"prompt": "a", "n": 0}, "n must be between 1 and 128, got 0"),
        ({"prompt": "a", "n": 129}, "n must be between 1 and 128, got 129"),
        ({"prompt": "a", "n": 17}, "n is 17, but this model runs at most 16 sequences at once"),
        ({"prompt": 5}, "prompt must be a string or an array of strings"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens must be greater than 0"),
        ({}, "required field missing @ body.prompt"),
    ],
)
async def test_bad_completion_requests(start_server, client, body, needle) -> None:
    server = await start_server()
    r = await client.post(f"{server.url}{PATH}", json=body)
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]


async def test_echo_and_logprobs(start_server, client) -> None:
    server = await start_server()
    r = await client.post(f"{server.url}{PATH}", json={"prompt": "Once", "echo": True, "max_tokens": 3})
    assert "x-anyllm-degradation" not in r.headers
    plain = await client.post(f"{server.url}{PATH}", json={"prompt": "Once", "max_tokens": 3})
    assert r.json()["choices"][0]["text"] == "Once" + plain.json()["choices"][0]["text"]
    r = await client.post(f"{server.url}{PATH}", json={"prompt": "Once", "echo": True, "max_tokens": 3, "stream": True})
    texts = [json.loads(d)["choices"][0]["text"] for _, d in sse_events(r.text)[:-1]]
    assert texts[0] == "Once" and "".join(texts) == "Once" + plain.json()["choices"][0]["text"]
    r = await client.post(f"{server.url}{PATH}", json={"prompt": "a", "echo": True, "logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = await client.post(f"{server.url}{PATH}", json={"prompt": "a", "logprobs": 2, "max_tokens": 3})
    choice = r.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"] and len(logprobs["tokens"]) == 3
    assert logprobs["token_logprobs"] == [0.0, 0.0, 0.0]  # the scripted backend is certain
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"] == [0, len(logprobs["tokens"][0]), len("".join(logprobs["tokens"][:2]))]
    r = await client.post(f"{server.url}{PATH}", json={"prompt": "a", "max_tokens": 1})
    assert "x-anyllm-degradation" not in r.headers


async def test_tools_and_json_on_completions(start_server, client) -> None:
    from turbospark.model.scripted import ScriptedBackend

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    server = await start_server([ScriptedBackend(script='<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')])
    r = await client.post(f"{server.url}{PATH}", json={"prompt": "Call a tool.", "tools": [tool], "max_tokens": 40})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["text"] == ""
    assert choice["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    r = await client.post(f"{server.url}{PATH}", json={"prompt": "x", "tools": [tool], "max_tokens": 40, "stream": True})
    chunks = [json.loads(d) for _, d in sse_events(r.text)[:-1]]
    assert any("tool_calls" in c["choices"][0] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    r = await client.post(f"{server.url}{PATH}", json={"prompt": "x", "tools": [tool], "tool_choice": "none", "max_tokens": 40})
    assert r.json()["choices"][0]["text"].startswith("<tool_call>")  # none: not even parsed
    plain = await start_server([ScriptedBackend(script="no json")])
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    r = await client.post(f"{plain.url}{PATH}", json={"prompt": "x", "response_format": fmt, "max_tokens": 30})
    assert json.loads(r.json()["choices"][0]["text"]).keys() == {"a"}
