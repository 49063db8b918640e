"""Ollama's API on the real default model (SmolLM2-135M-Instruct), through the official
``ollama`` client: chat and generate, streaming and not, a JSON Schema ``format``, tools, the
store's models listed and shown, and ``keep_alive=0`` unloading it (visible in ``ps``)."""

from __future__ import annotations

import json
from functools import partial

import jsonschema
import ollama
import pytest
import trio

from turbospark.cli.attach import load_mlx
from turbospark.config import Settings
from turbospark.server import serve
from turbospark.store.shelf import StoreShelf, loadable_from

from .realmodels import cached_store, smollm2_store

pytestmark = pytest.mark.mlx

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
NAME = "smollm2-135m-instruct"


@pytest.fixture
async def client(nursery: trio.Nursery):
    stored = smollm2_store()
    shelf = StoreShelf(cached_store(), load_mlx)
    server = await nursery.start(partial(
        serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0),
        [loadable_from(stored, load_mlx, pinned=True)], library=shelf.loadables, shelf=shelf,
    ))
    yield ollama.AsyncClient(host=server.url, timeout=120)
    server.stop.set()


async def test_chat_and_generate_answer_sensibly(client) -> None:
    r = await client.chat(model=NAME, messages=FRANCE)
    assert r.message.content == "The capital of France is Paris."
    assert r.done_reason == "stop" and r.eval_count == 8 and r.prompt_eval_count > 10
    parts = [p async for p in await client.chat(model=NAME, messages=FRANCE, stream=True)]
    assert "".join(p.message.content for p in parts) == r.message.content and parts[-1].done
    g = await client.generate(model=NAME, prompt=FRANCE[0]["content"])
    assert "Paris" in g.response
    pieces = [p async for p in await client.generate(model=NAME, prompt="Count: one, two,", raw=True, stream=True,
                                                     options={"num_predict": 4})]
    assert pieces[-1].eval_count == 4 and pieces[-1].done_reason == "length"


async def test_format_with_a_schema_validates(client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    r = await client.chat(model=NAME, messages=FRANCE, format=schema, options={"num_predict": 60, "temperature": 0.7, "seed": 3})
    jsonschema.validate(json.loads(r.message.content), schema)


async def test_tools_are_offered_and_calls_parse(client) -> None:
    def get_weather(city: str) -> str:
        """Current weather for a city.

        Args:
          city: the city
        """
        return "12C"

    plain = await client.chat(model=NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}], options={"num_predict": 1})
    r = await client.chat(model=NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[get_weather],
                          options={"num_predict": 60})
    assert r.prompt_eval_count > plain.prompt_eval_count + 20  # the tool is in the prompt
    for call in r.message.tool_calls or ():
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)


async def test_list_show_and_keep_alive_zero(client) -> None:
    names = [m.model for m in (await client.list()).models]
    assert NAME in names
    shown = await client.show(NAME)
    assert shown.details.family == "llama" and shown.details.parameter_size == "135M"
    assert shown.modelinfo["llama.context_length"] == 8192 and "completion" in shown.capabilities
    assert "temperature 0" in shown.parameters and "im_start" in shown.template
    assert [m.model for m in (await client.ps()).models] == [NAME]
    await client.chat(model=NAME, messages=FRANCE, keep_alive=0)
    with trio.fail_after(10):
        while (await client.ps()).models:
            await trio.sleep(0.05)
    r = await client.chat(model=NAME, messages=FRANCE)  # loads again
    assert r.message.content == "The capital of France is Paris." and r.load_duration > 0
    assert [m.model for m in (await client.ps()).models] == [NAME]
