"""``ignore_eos`` and ``min_tokens`` on the real MLX backend (SmolLM2-135M-Instruct, greedy, a few
tokens): the end of turn masked in its own sequence's logits only, in plain, speculative and
constrained steps.  The scripted side, the checks and the other families are in
``test_ignore_eos_min_tokens.py``."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import trio

from turbospark.config import Settings
from turbospark.messages import BatchState
from turbospark.model.backend import BackendSpec
from turbospark.server import serve

from .realmodels import smollm2_store

pytestmark = pytest.mark.mlx
PATH = "/v1/chat/completions"
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
ANSWER = "The capital of France is Paris."  # greedy, then <|im_end|>: 8 tokens in all


@pytest.fixture
async def mlx_server(nursery: trio.Nursery):
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()
    built: list[MlxBackend] = []

    def make() -> MlxBackend:
        built.append(MlxBackend(stored.path, model_id=stored.name, prefill_chunk=64))
        return built[0]

    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0, max_batch=4)
    server = await nursery.start(serve, settings, [BackendSpec(stored.name, make)])
    yield _Served(server.url, server.system, built[0])
    server.stop.set()


class _Served:
    """The server's URL and system, and the backend its model thread built."""

    def __init__(self, url: str, system: object, backend: object) -> None:
        self.url, self.system, self.backend = url, system, backend


def _ask(**extra: object) -> dict:
    return {"messages": FRANCE, "temperature": 0, "max_tokens": 24} | extra


async def test_ignore_eos_runs_past_the_greedy_end_to_the_budget(mlx_server, client: httpx.AsyncClient) -> None:
    alone = (await client.post(f"{mlx_server.url}{PATH}", json=_ask())).json()
    assert alone["choices"][0]["message"]["content"] == ANSWER
    assert alone["choices"][0]["finish_reason"] == "stop" and alone["usage"]["completion_tokens"] == 8
    drafted = mlx_server.backend.drafted
    data = (await client.post(f"{mlx_server.url}{PATH}", json=_ask(ignore_eos=True))).json()
    assert mlx_server.backend.drafted > drafted  # it ran speculative steps
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 24
    assert data["choices"][0]["message"]["content"].startswith(ANSWER)  # the same greedy text, then more
    # a speculative step masks each position of its draft as a plain step masks its one token
    plain = (await client.post(f"{mlx_server.url}{PATH}", json=_ask(ignore_eos=True, speculative=False))).json()
    assert plain["choices"][0]["message"]["content"] == data["choices"][0]["message"]["content"]
    held = (await client.post(f"{mlx_server.url}{PATH}", json=_ask(min_tokens=12))).json()
    plain = (await client.post(f"{mlx_server.url}{PATH}", json=_ask(min_tokens=12, speculative=False))).json()
    assert held["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert held["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] >= 12


async def test_min_tokens_runs_past_the_greedy_end_to_at_least_it(mlx_server, client) -> None:
    data = (await client.post(f"{mlx_server.url}{PATH}", json=_ask(min_tokens=14, max_tokens=40))).json()
    assert data["usage"]["completion_tokens"] >= 14
    assert data["choices"][0]["message"]["content"].startswith(ANSWER)
    r = await client.post(f"{mlx_server.url}/v1/completions",
                          json={"prompt": "The capital of France is", "temperature": 0, "max_tokens": 30, "min_tokens": 20})
    assert r.json()["usage"]["completion_tokens"] >= 20


async def test_a_batch_mate_without_ignore_eos_still_ends_at_its_own_end(mlx_server, client) -> None:
    events = mlx_server.system.subscribe(buffer=100_000)
    answers: dict[bool, dict] = {}

    async def ask(ignore: bool) -> None:
        r = await client.post(f"{mlx_server.url}{PATH}", json=_ask(ignore_eos=ignore, max_tokens=32))
        answers[ignore] = r.json()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, True)
        nursery.start_soon(ask, False)
    assert answers[False]["choices"][0]["message"]["content"] == ANSWER
    assert answers[False]["choices"][0]["finish_reason"] == "stop"
    assert answers[False]["usage"]["completion_tokens"] == 8
    assert answers[True]["choices"][0]["finish_reason"] == "length"
    assert answers[True]["usage"]["completion_tokens"] == 32
    sizes = []
    with trio.move_on_after(0.5):
        async for event in events:
            if isinstance(event, BatchState):
                sizes.append(event.running)
    assert max(sizes) == 2  # they really shared the batch


async def test_a_constrained_answer_ends_with_its_grammar_under_ignore_eos(mlx_server, client) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}}, "required": ["capital"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    data = (await client.post(f"{mlx_server.url}{PATH}",
                              json=_ask(ignore_eos=True, max_tokens=60, response_format=fmt))).json()
    assert data["choices"][0]["finish_reason"] == "stop"
    assert set(json.loads(data["choices"][0]["message"]["content"])) == {"capital"}
    assert data["usage"]["completion_tokens"] < 60


async def test_the_openai_sdk_sends_them_in_extra_body(mlx_server) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{mlx_server.url}/v1", api_key="unused", max_retries=0)
    r = await sdk.chat.completions.create(model="any", messages=FRANCE, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True, "min_tokens": 5})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    r = await sdk.chat.completions.create(model="any", messages=FRANCE, max_tokens=16, temperature=0,
                                          extra_body={"min_tokens": 10})
    assert r.usage.completion_tokens >= 10
