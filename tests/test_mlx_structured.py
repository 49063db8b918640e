"""Structured generation on the real default model (SmolLM2-135M-Instruct), through the
official openai SDK: a forced tool round trip (with a strict schema, and with LangChain's open
one), a strict JSON schema at temperature 0.7, logprobs, and a two-turn Responses conversation
that hits the prefix cache."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import trio

from turbospark.config import Settings
from turbospark.model.backend import BackendSpec
from turbospark.server import serve

from ._support import LANGCHAIN, streamed_call

from .realmodels import smollm2_store

pytestmark = pytest.mark.mlx

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
async def sdk(nursery: trio.Nursery):
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()
    server = await nursery.start(
        serve,
        Settings(host="127.0.0.1", port=0, graceful_timeout=1.0),
        [BackendSpec(stored.name, lambda: MlxBackend(stored.path, model_id=stored.name, prefill_chunk=64))],
    )
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)
    yield client
    await client.close()
    server.stop.set()


async def test_a_required_tool_call_round_trip(sdk) -> None:
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = await sdk.chat.completions.create(
        model="any", messages=question, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    answer = await sdk.chat.completions.create(
        model="any",
        messages=[*question, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "12 degrees and cloudy"}],
        tools=[WEATHER], max_tokens=30, temperature=0,
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


# LangChain's bind_tools schema for get_weather(city: str): no additionalProperties.  Left open
# (and with free whitespace), the model wrote `{"city": "Oslo", "type": "string", "properties":
# {...` indented until the budget ran out, at 60 and at 200 tokens alike.


async def test_a_forced_call_with_langchains_open_schema_finishes(sdk) -> None:
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = await sdk.chat.completions.create(
        model="any", messages=question, tools=[LANGCHAIN], tool_choice="required", max_tokens=60, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and list(arguments) == ["city"]
    assert isinstance(arguments["city"], str)
    assert first.usage.completion_tokens <= 60
    answer = await sdk.chat.completions.create(
        model="any",
        messages=[*question, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "12 degrees and cloudy"}],
        tools=[LANGCHAIN], max_tokens=30, temperature=0,
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


async def test_a_forced_call_streams_as_the_model_writes_it(sdk) -> None:
    """Streamed, the same forced call comes as it is written, in more deltas than a finished
    call's split at its top level, joined by the SDK into the call the whole answer has."""
    from turbospark.turns.turn_events import split_arguments

    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    pieces, final = await streamed_call(sdk, model="any", messages=question, tools=[LANGCHAIN],
                                        tool_choice="required", max_tokens=60, temperature=0)
    (call,) = final.choices[0].message.tool_calls
    assert "".join(pieces) == call.function.arguments and isinstance(json.loads(call.function.arguments)["city"], str)
    assert len(pieces) > len(split_arguments(call.function.arguments))
    whole = await sdk.chat.completions.create(
        model="any", messages=question, tools=[LANGCHAIN], tool_choice="required", max_tokens=60, temperature=0
    )
    assert whole.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


async def test_langchain_bind_tools_required_calls_and_round_trips(sdk) -> None:
    """LangChain itself, as a new user writes it: ``bind_tools(..., tool_choice="required")``
    on ``ChatOpenAI`` pointed at the server, then the tool's result sent back."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return f"12 degrees and cloudy in {city}"

    llm = ChatOpenAI(base_url=str(sdk.base_url), api_key="unused", model="any", temperature=0, max_tokens=60)
    forced = llm.bind_tools([get_weather], tool_choice="required")
    history: list = [HumanMessage("What is the weather in Oslo?")]
    reply = await trio.to_thread.run_sync(forced.invoke, history)
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and list(call["args"]) == ["city"]
    assert isinstance(call["args"]["city"], str)
    assert reply.usage_metadata["output_tokens"] <= 60
    history += [reply, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = await trio.to_thread.run_sync(llm.bind_tools([get_weather]).invoke, history)
    assert answer.content and not answer.tool_calls


async def test_a_strict_json_schema_validates_when_sampling(sdk) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for seed in (1, 2):
        r = await sdk.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Invent a person."}],
            response_format=fmt, temperature=0.7, seed=seed, max_tokens=120,
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


async def test_a_regex_a_choice_and_a_gbnf_grammar_hold_when_sampling(sdk) -> None:
    """vLLM's and llama.cpp's grammar fields, as their clients send them (``extra_body``)."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    cases = [
        ({"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}}, lambda t: re.fullmatch("[A-Z][a-z]{2,8}", t)),
        ({"guided_choice": ["Paris", "Lyon", "Nice"]}, lambda t: t in ("Paris", "Lyon", "Nice")),
        ({"grammar": 'root ::= "The capital is " [A-Z] [a-z]+ "."'}, lambda t: re.fullmatch(r"The capital is [A-Z][a-z]+\.", t)),
    ]
    for extra, holds in cases:
        r = await sdk.chat.completions.create(
            model="any", messages=ask, temperature=0.7, seed=3, max_tokens=12, extra_body=extra
        )
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and holds(text), (extra, text)
    done = await sdk.completions.create(
        model="any", prompt="Yes or no: is water wet? Answer:", max_tokens=4, extra_body={"guided_choice": [" yes", " no"]}
    )
    assert done.choices[0].text in (" yes", " no")


async def test_logprobs_with_alternatives(sdk) -> None:
    r = await sdk.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Say hi."}],
        logprobs=True, top_logprobs=3, max_tokens=4, temperature=0,
    )
    entries = r.choices[0].logprobs.content
    assert len(entries) == 4 or r.choices[0].finish_reason == "stop"
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-4)  # greedy takes the top
        assert bytes(e.bytes).decode() == e.token


async def test_responses_two_turns_reuse_the_cache(sdk) -> None:
    first = await sdk.responses.create(
        model="any", input="My name is Ada. Remember it.", instructions="Answer briefly.",
        max_output_tokens=20, temperature=0,
    )
    assert first.output_text
    second = await sdk.responses.create(
        model="any", input="What is my name?", previous_response_id=first.id,
        max_output_tokens=20, temperature=0,
    )
    assert second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the earlier turn was read from cache
