"""``/v1/messages`` and ``count_tokens`` on the scripted backend: the official anthropic SDK,
the raw event stream, normalisation, errors, and Claude Code itself."""

from __future__ import annotations

import json
import re
from functools import partial

import anthropic
import httpx
import pytest
import trio

from turbospark.model.scripted import ScriptedBackend, shipped_tokenizer
from turbospark.routes.anthropic_request import normalise

from ._support import sse_events

PATH = "/v1/messages"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
HI = [{"role": "user", "content": "Hi"}]
TOK = shipped_tokenizer()


def body(**extra: object) -> dict:
    return {"model": "claude-sonnet-4-6", "max_tokens": 20, "messages": HI} | extra


async def test_a_message_and_its_usage(start_server) -> None:
    server = await start_server([ScriptedBackend(script="<think>Plan.</think>Hello!")])
    sdk = anthropic.AsyncAnthropic(base_url=server.url, api_key="x")
    m = await sdk.messages.create(**body())
    assert m.type == "message" and m.role == "assistant" and m.model == "claude-sonnet-4-6"
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Plan." and m.content[1].text == "Hello!"
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt = len(TOK.encode_chat([{"role": "user", "content": "Hi"}]))
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.cache_creation_input_tokens == prompt
    assert m.usage.input_tokens == prompt  # nothing marked with cache_control: no cache writes
    assert m.usage.output_tokens == len(TOK.encode("<think>Plan.</think>Hello!")) + 1  # and the end of turn
    counted = await sdk.messages.count_tokens(model="claude-x", messages=HI)
    assert counted.input_tokens == prompt
    await sdk.close()


async def test_stop_sequences_and_max_tokens(start_server) -> None:
    server = await start_server([ScriptedBackend(script="one two three four")])
    sdk = anthropic.AsyncAnthropic(base_url=server.url, api_key="x")
    m = await sdk.messages.create(**body(stop_sequences=["three"]))
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == ("one two ", "stop_sequence", "three")
    m = await sdk.messages.create(**body(max_tokens=2))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    await sdk.close()


async def test_the_raw_stream_in_anthropic_order(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="<think>Hm.</think>Hi there")])
    r = await client.post(f"{server.url}{PATH}?beta=true", json=body(stream=True),
                          headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x-2025"})
    frames = sse_events(r.text)
    names = [n for n, _ in frames]
    data = [json.loads(d) for _, d in frames]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in zip(names, data, strict=True))
    starts = [d for d in data if d["type"] == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "thinking"), (1, "text")]
    deltas = [d for d in data if d["type"] == "content_block_delta"]
    assert {d["delta"]["type"] for d in deltas if d["index"] == 0} == {"thinking_delta", "signature_delta"}
    assert "".join(d["delta"].get("text", "") for d in deltas if d["index"] == 1) == "Hi there"
    stops = [d["index"] for d in data if d["type"] == "content_block_stop"]
    assert stops == [0, 1]
    final = data[-2]
    assert final["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    prompt = len(TOK.encode_chat([{"role": "user", "content": "Hi"}]))
    assert final["usage"]["input_tokens"] == prompt and final["usage"]["output_tokens"] > 0  # real counts
    assert "[DONE]" not in r.text


async def test_a_tool_use_round_trip_with_the_stream_helper(start_server) -> None:
    script = 'Checking. {"name": "get_weather", "arguments": {"city": "Oslo"}}'
    server = await start_server([ScriptedBackend(script=script)])
    sdk = anthropic.AsyncAnthropic(base_url=server.url, api_key="x")
    async with sdk.messages.stream(**body(tools=[WEATHER], max_tokens=60)) as stream:
        kinds = [event.type async for event in stream]
        m = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather" and use.input == {"city": "Oslo"}
    assert use.id.startswith("toolu_")
    follow = [
        *HI,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12C"}]},
    ]
    again = await sdk.messages.create(**body(messages=follow, tools=[WEATHER]))
    assert again.content  # the history with tool_use and tool_result renders and answers
    await sdk.close()


async def test_tool_choice_any_and_tool_force_a_valid_call(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="Just chatting.")])
    for choice in [{"type": "any"}, {"type": "tool", "name": "get_weather"}]:
        r = await client.post(f"{server.url}{PATH}", json=body(tools=[WEATHER], tool_choice=choice, max_tokens=60))
        content = r.json()["content"]
        assert r.json()["stop_reason"] == "tool_use", content
        assert [b["type"] for b in content] == ["tool_use"] and "city" in content[0]["input"]
    r = await client.post(f"{server.url}{PATH}", json=body(tools=[WEATHER], tool_choice={"type": "none"}))
    assert r.json()["content"][0]["text"] == "Just chatting."


def test_normalisation_rules() -> None:
    promoted = normalise({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]})
    assert promoted == {"system": "S", "messages": [{"role": "user", "content": "U"}]}
    kept = normalise({"system": "top", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]})
    assert kept["system"] == "top" and kept["messages"][0] == {"role": "user", "content": "S"}
    alone = normalise({"messages": [{"role": "system", "content": "S"}]})
    assert alone["messages"] == [{"role": "user", "content": "S"}] and "system" not in alone
    mid = normalise({"messages": [{"role": "user", "content": "a"}, {"role": "Developer", "content": "d"}, {"role": "assistant", "content": "b"}]})
    assert [m["role"] for m in mid["messages"]] == ["user", "user", "assistant"]  # stays where it was


async def test_count_tokens_equals_the_billed_prompt(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="ok")], system_prompt="Default system.")
    request = body(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is the weather?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "12C"}]}]},
        ],
        tools=[WEATHER],
    )
    counted = (await client.post(f"{server.url}{PATH}/count_tokens", json={k: v for k, v in request.items() if k != "max_tokens"})).json()
    usage = (await client.post(f"{server.url}{PATH}", json=request)).json()["usage"]
    assert counted["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    assert usage["cache_creation_input_tokens"] == counted["input_tokens"] and usage["input_tokens"] == 0  # marked


async def test_a_max_tokens_past_the_context_is_clamped(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="short", context_window=256)])
    r = await client.post(f"{server.url}{PATH}", json=body(max_tokens=32000))
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "short"
    assert r.headers["x-anyllm-degradation"] == "max_tokens_clamped"
    r = await client.post(f"{server.url}{PATH}", json={"model": "c", "messages": HI})  # no max_tokens at all
    assert r.status_code == 200 and "x-anyllm-degradation" not in r.headers


async def test_what_agent_clients_send_is_accepted(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="ok")])
    r = await client.post(f"{server.url}{PATH}", json=body(
        system=[{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        metadata={"user_id": "u"}, thinking={"type": "adaptive"}, output_config={"effort": "high"},
        context_management={"edits": []}, tools=[WEATHER | {"cache_control": {"type": "ephemeral"}}],
    ))
    assert r.status_code == 200, r.text
    assert r.headers["x-anyllm-degradation"] == "context_management"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools: web_search (web_search_20250305)"),
        ({"tools": [{"type": "code_execution_20250522", "name": "code_execution"}]}, "code_execution"),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}, "does not fetch remote images"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]}]}, "not supported in a assistant message"),
        ({"frobnicate": True}, "unknown field"),
        ({"messages": []}, "messages"),
    ],
)
async def test_invalid_requests_in_anthropic_shape(start_server, client, extra, needle) -> None:
    server = await start_server()
    r = await client.post(f"{server.url}{PATH}", json=body(**extra))
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]


async def test_error_types(start_server, client) -> None:
    server = await start_server(api_key="secret")
    r = await client.post(f"{server.url}{PATH}", json=body())
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = await client.post(f"{server.url}{PATH}", content=b"{not json", headers={"x-api-key": "secret"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    two = await start_server([ScriptedBackend(model_id="a"), ScriptedBackend(model_id="b")])
    r = await client.post(f"{two.url}{PATH}", json=body(model="nope"))
    assert r.status_code == 404 and r.json() == {"type": "error", "error": {"type": "not_found_error", "message": r.json()["error"]["message"]}}
    full = await start_server([ScriptedBackend(token_delay=0.05)], max_queue=1, max_batch=1)
    async with httpx.AsyncClient(timeout=30) as other:
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(partial(other.post, f"{full.url}{PATH}", json=body(max_tokens=40)))
            await trio.sleep(0.3)
            r = await client.post(f"{full.url}{PATH}", json=body())
            nursery.cancel_scope.cancel()
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"


async def test_claude_code_answers_end_to_end(start_server) -> None:
    from .claude_code import run_claude

    server = await start_server([ScriptedBackend(script="Hi! How can I help?")])
    out = await run_claude(server.url, "Say hi")
    assert out.strip() == "Hi! How can I help?"


CLAUDE_CODE = {"user-agent": "claude-cli/2.1.0 (external, cli)", "x-claude-code-session-id": "0f6c6f3e"}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_too_long_names_its_size_and_claude_codes_flags(start_server, client, stream) -> None:
    server = await start_server([ScriptedBackend(script="ok")])
    long = body(messages=[{"role": "user", "content": "word " * 12000}], stream=stream)
    counted = (await client.post(f"{server.url}{PATH}/count_tokens", json=long)).json()["input_tokens"]
    assert counted > 8192
    for headers, hinted in ((CLAUDE_CODE, True), ({"user-agent": "python-httpx"}, False)):
        r = await client.post(f"{server.url}{PATH}", json=long, headers=headers)
        assert r.status_code == 400, r.text  # refused before the stream's 200
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and len(err) == 2
        message = err["error"]["message"]
        assert message.startswith(f"The prompt is {counted:,} tokens; this model's context window is 8192 tokens.")
        assert ("--tools" in message and "--bare" in message and "Claude Code" in message) == hinted, message
    # either header is enough
    r = await client.post(f"{server.url}{PATH}", json=long, headers={"x-claude-code-session-id": "s"})
    assert "--tools" in r.json()["error"]["message"]


async def test_claude_code_stock_invocation_is_told_what_to_run(start_server) -> None:
    from .claude_code import run_claude_stock

    server = await start_server([ScriptedBackend(script="Hi!")])
    rc, out, err = await run_claude_stock(server.url, "Say hi")  # its own prompt: ~20 K tokens
    said = out + err
    assert rc != 0, said
    assert "context window is 8192 tokens" in said and "--tools" in said, said
    assert re.search(r"The prompt is [\d,]+ tokens", said), said


async def test_repeated_agent_turns_read_the_prompt_from_cache(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="Done.")])
    request = body(
        system=[{"type": "text", "text": "You are a coding agent. " * 10, "cache_control": {"type": "ephemeral"}}],
        stream=True,
    )
    usages = []
    for _ in range(2):
        frames = [json.loads(d) for _, d in sse_events((await client.post(f"{server.url}{PATH}", json=request)).text)]
        start, end = frames[0]["message"]["usage"], frames[-2]["usage"]
        assert {k: start[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")} == {
            k: end[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        }  # message_start already tells the split the end confirms
        usages.append(end)
    first, second = usages
    total = first["cache_creation_input_tokens"] + first["cache_read_input_tokens"] + first["input_tokens"]
    assert first["cache_read_input_tokens"] == 0 and first["cache_creation_input_tokens"] == total
    assert second["cache_read_input_tokens"] == total - 1  # all but the last prompt token
    assert second["cache_creation_input_tokens"] == 1 and second["input_tokens"] == 0


async def test_a_streamed_tool_turn_retries_inside_the_stream(start_server, client) -> None:
    wrong = '<tool_call>{"name": "get_weather", "arguments": {"town": "Oslo"}}</tool_call>'
    backend = ScriptedBackend(script=wrong, context_window=4096)
    server = await start_server([backend])
    r = await client.post(f"{server.url}{PATH}", json=body(tools=[WEATHER], stream=True, max_tokens=32000))
    names = [n for n, _ in sse_events(r.text)]
    assert "error" not in names and names[-1] == "message_stop", r.text
    assert backend.counters.generations == 2  # the answer and one corrective retry, both clamped
    assert r.headers["x-anyllm-degradation"] == "max_tokens_clamped"
