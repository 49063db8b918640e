"""Tool calls, enforced JSON and reasoning on the OpenAI routes, scripted backend, real socket."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from turbospark.model.scripted import ScriptedBackend

from ._support import LANGCHAIN, chat_body, sse_events

PATH = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
BARE_CALL = 'Let me check. {"name": "get_weather", "arguments": {"city": "Oslo"}}'


async def test_a_call_written_as_bare_json_is_rescued(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script=BARE_CALL)])
    r = await client.post(f"{server.url}{PATH}", json=chat_body(tools=[WEATHER]))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check. "  # sent as written; the markup is not content
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert "x-anyllm-degradation" not in r.headers


async def test_with_guardrails_off_the_same_answer_is_prose(start_server, client) -> None:
    from turbospark.turns.guardrails import Guardrails

    server = await start_server([ScriptedBackend(script=BARE_CALL)], guardrails=Guardrails.off())
    r = await client.post(f"{server.url}{PATH}", json=chat_body(tools=[WEATHER]))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == BARE_CALL and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


async def test_an_invalid_call_is_retried_once_then_the_answer_stands(start_server, client) -> None:
    wrong = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>'
    backend = ScriptedBackend(script=wrong)
    server = await start_server([backend])
    r = await client.post(f"{server.url}{PATH}", json=chat_body(tools=[WEATHER]))
    assert r.status_code == 200
    assert backend.counters.generations == 2  # the answer, one corrective retry, no more
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"town": "Oslo"}  # the last answer, as it was


async def test_a_native_call_streams_buffered_and_the_sdk_reassembles_it(start_server) -> None:
    script = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    server = await start_server([ScriptedBackend(script=script)])
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x")
    async with sdk.chat.completions.stream(
        model="scripted", messages=[{"role": "user", "content": "Oslo?"}], tools=[WEATHER]
    ) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content == "Sure. "
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    await sdk.close()


async def test_tool_turn_frames_come_in_order(start_server, client) -> None:
    script = '<think>Hm.</think>Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    server = await start_server([ScriptedBackend(script=script)])
    body = chat_body(tools=[WEATHER], stream=True, stream_options={"include_usage": True})
    frames = sse_events((await client.post(f"{server.url}{PATH}", json=body)).text)
    assert frames[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in frames[:-1]]
    deltas = [c["choices"][0]["delta"] if c["choices"] else "usage" for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    kinds = [next(iter(d)) if isinstance(d, dict) and d else d for d in deltas[1:]]
    # reasoning and content as written, then the call (its start, its argument pieces), the finish
    first_call = kinds.index("tool_calls")
    assert set(kinds[:first_call]) == {"reasoning_content", "content"}
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning_content")
    assert "".join(d.get("reasoning_content", "") for d in deltas[1:-2]) == "Hm."
    assert "".join(d.get("content", "") for d in deltas[1:-2] if isinstance(d, dict)) == "Sure. "
    calls = [d["tool_calls"][0] for d in deltas[1:-2] if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert len(calls) >= 3 and {c["index"] for c in calls} == {0}
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Oslo"}
    assert deltas[-2] == {} and chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert deltas[-1] == "usage"


async def test_tool_choice_none_removes_the_tools(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script=BARE_CALL)])
    with_tools = await client.post(f"{server.url}{PATH}", json=chat_body(tools=[WEATHER], max_tokens=1))
    without = await client.post(f"{server.url}{PATH}", json=chat_body(tools=[WEATHER], tool_choice="none"))
    assert without.json()["choices"][0]["message"]["content"] == BARE_CALL  # no parsing, no rescue
    assert without.json()["usage"]["prompt_tokens"] < with_tools.json()["usage"]["prompt_tokens"]


async def test_required_and_named_tool_choice_force_a_valid_call(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="I would rather chat.")])
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        r = await client.post(f"{server.url}{PATH}", json=chat_body(tools=[WEATHER], tool_choice=choice, max_tokens=60))
        data = r.json()["choices"][0]
        assert data["finish_reason"] == "tool_calls", data
        (call,) = data["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


async def test_history_with_calls_and_reasoning_is_rendered(start_server, client) -> None:
    server = await start_server()
    turns = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12C and cloudy"},
    ]
    short = await client.post(f"{server.url}{PATH}", json=chat_body(tools=[WEATHER], max_tokens=1))
    long = await client.post(f"{server.url}{PATH}", json={"messages": turns, "tools": [WEATHER], "max_tokens": 1})
    assert long.status_code == 200
    assert long.json()["usage"]["prompt_tokens"] > short.json()["usage"]["prompt_tokens"] + 20
    bad = await client.post(f"{server.url}{PATH}", json={"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]})
    assert bad.status_code == 400 and "tool_calls" in bad.json()["error"]["message"]


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    "required": ["name", "tags"],
    "additionalProperties": False,
}


async def test_json_schema_output_always_validates(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="Here you go: not JSON at all")])
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = await client.post(f"{server.url}{PATH}", json=chat_body(response_format=fmt, max_tokens=60))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    r = await client.post(f"{server.url}{PATH}", json=chat_body(response_format={"type": "json_object"}, max_tokens=60))
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
         "response_format", "uniqueItems"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
         "response_format", '"not"'),
        ({"response_format": {"type": "xml"}}, None, "response_format.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "only function tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
         "messages", "does not fetch remote images"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png,AAAA"}}] * 2}]},
         "messages", "not base64-encoded"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 65}]},
         "messages", "too many images: 65"),
        ({"top_logprobs": 21, "logprobs": True}, None, "top_logprobs"),
    ],
)
async def test_refused_with_a_400_naming_the_field(start_server, client, extra, param, needle) -> None:
    server = await start_server()
    r = await client.post(f"{server.url}{PATH}", json=chat_body() | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param


async def test_reasoning_is_split_streaming_or_not(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="<think>First, think.</think>The answer is 4.")])
    message = (await client.post(f"{server.url}{PATH}", json=chat_body())).json()["choices"][0]["message"]
    assert message["content"] == "The answer is 4."
    assert message["reasoning_content"] == message["reasoning"] == "First, think."
    frames = sse_events((await client.post(f"{server.url}{PATH}", json=chat_body(stream=True))).text)
    deltas = [json.loads(d)["choices"][0]["delta"] for _, d in frames[1:-2]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == ("First, think.", "The answer is 4.")
    first_content = next(i for i, d in enumerate(deltas) if "content" in d)
    assert all("content" not in d for d in deltas[:first_content]) and len(deltas) > 3  # live, piece by piece
    assert all("<think>" not in json.dumps(d) and "</think>" not in json.dumps(d) for d in deltas)


async def test_degradation_labels_exactly(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server()
    honoured = chat_body(
        n=2, logprobs=True, top_logprobs=2, seed=1, logit_bias={"5": 1}, reasoning_effort="low",
        response_format={"type": "json_object"}, tools=[WEATHER], tool_choice="auto",
        parallel_tool_calls=False, user="u", metadata={"k": "v"}, max_tokens=2,
    )
    r = await client.post(f"{server.url}{PATH}", json=honoured)
    assert r.status_code == 200 and "x-anyllm-degradation" not in r.headers
    r = await client.post(
        f"{server.url}{PATH}",
        json=chat_body(store=True, verbosity="low", service_tier="flex", modalities=["text", "audio"], max_tokens=1),
    )
    assert r.headers["x-anyllm-degradation"] == "verbosity, store, service_tier, modalities"


# What SmolLM2-135M wrote under the open, whitespace-flexible grammar until the budget ran out.
RAMBLING = '<tool_call>\n{"name": "get_weather", "arguments": {\n  "city": "Oslo",\n  "type": "string",\n  "properties": {\n'


async def test_a_forced_call_with_an_open_schema_finishes_compact_and_closed(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script=RAMBLING)])
    r = await client.post(f"{server.url}{PATH}", json=chat_body(tools=[LANGCHAIN], tool_choice="required", max_tokens=60))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and list(arguments) == ["city"]
    assert isinstance(arguments["city"], str)
    assert " " not in call["function"]["arguments"]  # compact


async def test_a_json_answer_is_compact_and_closed(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script='{ "name": "Ada", "extra": 1 }')])
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    r = await client.post(f"{server.url}{PATH}", json=chat_body(response_format=fmt, max_tokens=40))
    content = r.json()["choices"][0]["message"]["content"]
    assert list(json.loads(content)) == ["name"] and " " not in content.replace("Ada", "")


async def test_a_budget_too_small_for_any_valid_call_is_a_400(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script=RAMBLING)])
    r = await client.post(f"{server.url}{PATH}", json=chat_body(tools=[LANGCHAIN], tool_choice="required", max_tokens=5))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and "too small for the call tool_choice demands" in error["message"]


async def test_a_forced_call_cut_by_the_budget_is_length_with_the_partial_call(start_server, client) -> None:
    long_city = '<tool_call>\n{"name":"get_weather","arguments":{"city":"' + "Oslo " * 40 + '"}}\n</tool_call>'
    server = await start_server([ScriptedBackend(script=long_city)])
    r = await client.post(f"{server.url}{PATH}", json=chat_body(tools=[LANGCHAIN], tool_choice="required", max_tokens=40))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert not choice["message"].get("content")  # never the markup
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"].startswith('{"city":"Oslo Oslo')
    streamed = await client.post(f"{server.url}{PATH}", json=chat_body(
        tools=[LANGCHAIN], tool_choice="required", max_tokens=40, stream=True))
    chunks = [json.loads(d)["choices"] for _, d in sse_events(streamed.text) if d != "[DONE]"]
    deltas = [c[0]["delta"] for c in chunks if c]
    assert not "".join(d.get("content") or "" for d in deltas)
    pieces = [t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls", ())]
    assert "".join(pieces) == call["function"]["arguments"]
    assert [c[0]["finish_reason"] for c in chunks if c and c[0]["finish_reason"]] == ["length"]
