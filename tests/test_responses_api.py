"""``/v1/responses`` on the scripted backend: items, the event sequence, stored conversations."""

from __future__ import annotations

import json

import openai
import pytest

from turbospark.turns.guardrails import Guardrails
from turbospark.model.scripted import ScriptedBackend, shipped_tokenizer

from ._support import sse_events

PATH = "/v1/responses"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def names(text: str) -> list[str]:
    return [name for name, _ in sse_events(text)]


async def test_text_output_and_usage(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="Hello there.")])
    r = await client.post(f"{server.url}{PATH}", json={"model": "m", "input": "Hi", "max_output_tokens": 3})
    body = r.json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"][0]["type"] == "output_text"
    assert body["usage"]["output_tokens"] == 3
    tok = shipped_tokenizer()
    assert body["usage"]["input_tokens"] == len(tok.encode_chat([{"role": "user", "content": "Hi"}]))


async def test_the_streaming_event_sequence_is_exact(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="Hello there")])
    r = await client.post(f"{server.url}{PATH}", json={"input": "Hi", "stream": True})
    assert names(r.text) == [
        "response.created", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    events = [json.loads(d) for _, d in sse_events(r.text)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e["type"] == name for e, name in zip(events, names(r.text), strict=True))
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hello there"
    assert "[DONE]" not in r.text


async def test_text_after_a_call_opens_a_new_message_item(start_server, client) -> None:
    script = 'Sure, checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> All set.'
    server = await start_server([ScriptedBackend(script=script)], guardrails=Guardrails.off())
    r = await client.post(f"{server.url}{PATH}", json={"input": "Oslo?", "tools": [TOOL], "stream": True})
    events = [json.loads(d) for _, d in sse_events(r.text)]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"]["type"] for e in added] == ["message", "function_call", "message"]
    assert [e["output_index"] for e in added] == [0, 1, 2]
    texts = [e["text"] for e in events if e["type"] == "response.output_text.done"]
    assert texts == ["Sure, checking. ", " All set."]
    assert added[0]["item"]["id"] != added[2]["item"]["id"]
    output = events[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["message", "function_call", "message"]
    assert output[1]["name"] == "get_weather" and json.loads(output[1]["arguments"]) == {"city": "Oslo"}


async def test_a_rescued_call_streams_after_the_text_before_it(start_server, client) -> None:
    script = 'Checking. {"name": "get_weather", "arguments": {"city": "Oslo"}}'
    server = await start_server([ScriptedBackend(script=script)])
    r = await client.post(f"{server.url}{PATH}", json={"input": "Oslo?", "tools": [TOOL], "stream": True})
    seen = names(r.text)
    assert seen[:4] == [
        "response.created", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
    ]  # the text goes out as written; the bare JSON is held until it is decided
    call = seen.index("response.function_call_arguments.delta") - 1
    assert seen[call] == "response.output_item.added"
    assert seen[call + 1 : call + 4] == ["response.function_call_arguments.delta"] * 3  # in pieces
    assert seen[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]


async def test_two_turns_with_previous_response_id_and_the_sdk(start_server) -> None:
    backend = ScriptedBackend(script="Noted.")
    server = await start_server([backend])
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x")
    first = await sdk.responses.create(model="m", input="My name is Ada.", instructions="Be brief.")
    assert first.output_text == "Noted."
    second = await sdk.responses.create(model="m", input="What is my name?", previous_response_id=first.id)
    tok = shipped_tokenizer()
    expected = tok.encode_chat([
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "What is my name?"},
    ])  # the first turn's instructions do not carry over, its output does
    assert second.usage.input_tokens == len(expected)
    assert (await sdk.responses.retrieve(second.id)).id == second.id
    async with sdk.responses.stream(model="m", input="Again?", previous_response_id=second.id) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == "Noted."
    with pytest.raises(openai.NotFoundError) as err:
        await sdk.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    assert err.value.body["code"] == "previous_response_not_found"
    await sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(first.id)
    await sdk.close()


async def test_items_and_a_forced_call_round_trip(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="It is 12C.")])
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "12C"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]
    r = await client.post(f"{server.url}{PATH}", json={"input": items, "tools": [TOOL]})
    assert r.status_code == 200 and r.json()["output"][-1]["content"][0]["text"] == "It is 12C."
    r = await client.post(f"{server.url}{PATH}", json={"input": "x", "tools": [TOOL], "tool_choice": "required", "max_output_tokens": 60})
    (call,) = r.json()["output"]
    assert call["type"] == "function_call" and json.loads(call["arguments"]).keys() == {"city"}


async def test_text_format_json_schema_is_enforced(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="no json here")])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": True}}
    r = await client.post(f"{server.url}{PATH}", json={"input": "x", "text": fmt, "max_output_tokens": 30})
    text = r.json()["output"][0]["content"][0]["text"]
    assert json.loads(text).keys() == {"ok"}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": [{"type": "image_generation_call"}]}, "not a supported input item"),
        ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "role must be one of"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools only"),
        ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "function_call item needs"),
        ({"input": 5}, "input"),
        ({"input": "x", "max_tokens": 5}, "unknown field"),
    ],
)
async def test_bad_requests_are_400s(start_server, client, body, needle) -> None:
    server = await start_server()
    r = await client.post(f"{server.url}{PATH}", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_a_chain_of_responses_is_stored_once_and_bounded_by_bytes() -> None:
    """A chain of k turns stores each turn once (each response keeps only its own turns and
    points at the one it continues); the store is bounded by bytes, never evicts the newest,
    and an evicted or deleted response lives on only as long as one continuing it needs it."""
    from turbospark.turns.conversations import ResponseStore, StoredResponse

    store = ResponseStore(max_bytes=20_000)
    turn = {"role": "user", "content": "x" * 100}
    parent = None
    for k in range(100):
        entry = StoredResponse({"id": f"r{k}"}, (turn, {"role": "assistant", "content": f"a{k}"}), parent)
        store.put(f"r{k}", entry)
        parent = entry
    assert len(parent.messages) == 200 and parent.messages[-1]["content"] == "a99"
    chain_bytes = sum(len(__import__("json").dumps([{"id": f"r{k}"}, (turn, {"role": "assistant", "content": f"a{k}"})]))
                      for k in range(100))
    assert store.bytes == chain_bytes < 20_000  # each turn once: 100 turns, not 5,050
    # evicting the chain's oldest responses frees nothing while its newest needs their turns
    store.delete("r0")
    assert store.bytes == chain_bytes and store.get("r99").messages[0] is turn
    # another conversation takes the chain past the bound: responses go, oldest first, until the
    # bytes fit, and the chain's turns go with the last response that needed them
    big = StoredResponse({"id": "big"}, ({"role": "user", "content": "y" * 15_000},))
    store.put("big", big)
    assert store.get("big") is big and store.get("r99") is None
    assert store.bytes == big.size and len(store) == 1
    huge = StoredResponse({"id": "huge"}, ({"role": "user", "content": "z" * 50_000},))
    store.put("huge", huge)  # alone over the bound: kept, as the newest
    assert store.get("huge") is huge and store.get("big") is None and store.bytes == huge.size
