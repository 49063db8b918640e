"""The Anthropic surface on the real default model (SmolLM2-135M-Instruct): the anthropic SDK,
a forced tool round trip, prompt caching across two identical agent turns, and Claude Code."""

from __future__ import annotations

import anthropic
import pytest
import trio

from turbospark.config import Settings
from turbospark.model.backend import BackendSpec
from turbospark.server import serve

from .realmodels import smollm2_store

pytestmark = pytest.mark.mlx

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
SYSTEM = [{"type": "text", "text": "You are a helpful assistant. " * 20, "cache_control": {"type": "ephemeral"}}]


@pytest.fixture
async def server(nursery: trio.Nursery):
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()
    srv = await nursery.start(
        serve,
        Settings(host="127.0.0.1", port=0, graceful_timeout=1.0),
        [BackendSpec(stored.name, lambda: MlxBackend(stored.path, model_id=stored.name, prefill_chunk=64))],
    )
    yield srv
    srv.stop.set()


async def test_sdk_round_trip_count_and_cache(server) -> None:
    sdk = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", timeout=120)
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = await sdk.messages.create(
        model="claude-sonnet-4-6", max_tokens=60, system=SYSTEM, messages=question,
        tools=[WEATHER], tool_choice={"type": "any"}, extra_body={"temperature": 0},
    )
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    follow = [
        *question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12 degrees, cloudy"}]},
    ]
    counted = await sdk.messages.count_tokens(model="claude-sonnet-4-6", system=SYSTEM, messages=follow, tools=[WEATHER])
    async with sdk.messages.stream(
        model="claude-sonnet-4-6", max_tokens=30, system=SYSTEM, messages=follow, tools=[WEATHER], extra_body={"temperature": 0},
    ) as stream:
        async for _ in stream:
            pass
        answer = await stream.get_final_message()
    u = answer.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted.input_tokens
    # the same agent turn again: most of the prompt is read from the prefix cache
    again = await sdk.messages.create(
        model="claude-sonnet-4-6", max_tokens=30, system=SYSTEM, messages=follow, tools=[WEATHER], extra_body={"temperature": 0},
    )
    assert again.usage.cache_read_input_tokens >= 0.9 * counted.input_tokens
    assert again.usage.cache_read_input_tokens + again.usage.cache_creation_input_tokens == counted.input_tokens
    sync = anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=120)
    reply = await trio.to_thread.run_sync(
        lambda: sync.messages.create(model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    )
    assert reply.content[0].text and reply.usage.output_tokens <= 8
    await sdk.close()


async def test_claude_code_on_the_real_model(server) -> None:
    from .claude_code import run_claude

    out = await run_claude(server.url, "Say hi")
    assert out.strip()
