"""The batched engine with a real model (SmolLM2-135M-Instruct, a few tokens each): many clients
share one model thread, each gets exactly the text it gets alone, a client that leaves stops
within a step, and a sequence that fails fails alone."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio

from turbospark.config import Settings
from turbospark.messages import BatchState, Generated
from turbospark.model.backend import BackendSpec
from turbospark.server import serve

from ._support import FIRST_TEXT, chat_body, raw_post, read_until
from .realmodels import smollm2_store

pytestmark = pytest.mark.mlx
PATH = "/v1/chat/completions"
TOPICS = ["the sea", "a dragon", "Paris", "the moon", "a robot", "winter", "a garden", "trains"]


@pytest.fixture
async def batch_server(nursery: trio.Nursery):
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()
    make = lambda: MlxBackend(stored.path, model_id=stored.name, prefill_chunk=64)  # noqa: E731
    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0, max_batch=8)
    server = await nursery.start(serve, settings, [BackendSpec(stored.name, make)])
    yield server
    server.stop.set()


def ask(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short story about {topic}."}]


async def test_eight_sdk_clients_share_the_batch_and_get_their_solo_texts(batch_server) -> None:
    events = batch_server.system.subscribe(buffer=100_000)
    sdk = openai.AsyncOpenAI(base_url=f"{batch_server.url}/v1", api_key="unused", max_retries=0)

    async def one(topic: str, **extra) -> str:
        r = await sdk.chat.completions.create(model="any", messages=ask(topic), max_tokens=12, **extra)
        assert r.usage.completion_tokens <= 12
        return r.choices[0].message.content

    solo = {t: await one(t) for t in TOPICS[:4]}
    seeded = {t: await one(t, temperature=1.0, seed=7) for t in TOPICS[:4]}

    together: dict[tuple[str, bool], str] = {}

    async def run(topic: str, sampled: bool) -> None:
        extra = {"temperature": 1.0, "seed": 7} if sampled else {}
        together[topic, sampled] = await one(topic, **extra)

    async with trio.open_nursery() as nursery:
        for topic in TOPICS[:4]:
            nursery.start_soon(run, topic, False)
            nursery.start_soon(run, topic, True)
    # greedy in a batch equals greedy alone, and a seed repeats whoever shares the batch
    assert {t: together[t, False] for t in TOPICS[:4]} == solo
    assert {t: together[t, True] for t in TOPICS[:4]} == seeded
    sizes = []
    with trio.move_on_after(0.5):
        async for event in events:
            if isinstance(event, BatchState):
                sizes.append(event.running)
    assert max(sizes) == 8  # all eight really ran at once


async def test_a_client_dropped_mid_batch_stops_within_a_step(batch_server, client) -> None:
    events = batch_server.system.subscribe(buffer=100_000)
    body = lambda topic: {"messages": ask(topic), "max_tokens": 24, "temperature": 0}  # noqa: E731
    topics = ("winter", "a garden", "trains")
    solo = {
        t: (await client.post(f"{batch_server.url}{PATH}", json=body(t))).json()["choices"][0]["message"]["content"]
        for t in topics
    }
    results: dict[str, httpx.Response] = {}

    async def steady(topic: str) -> None:
        results[topic] = await client.post(f"{batch_server.url}{PATH}", json=body(topic))

    async with trio.open_nursery() as nursery:
        for topic in topics:
            nursery.start_soon(steady, topic)
        leaving = await raw_post(batch_server.url, PATH, chat_body(
            "Tell me a very long story about the sea.", max_tokens=500, stream=True, temperature=0))
        seen = await read_until(leaving, FIRST_TEXT, timeout=60)
        for _ in range(3):
            seen += await read_until(leaving, b"\n\n")
        await leaving.aclose()
        with trio.fail_after(30):
            async for event in events:
                if isinstance(event, Generated) and event.stop_reason == "Cancelled":
                    break
        assert event.phase == "decode"
        # what it had shown, the step in flight and one buffered: nothing more ran for it
        assert event.new_tokens <= seen.count(b'"content"') + 4
    # the batch-mates were undisturbed: each got exactly its solo text
    assert {t: r.json()["choices"][0]["message"]["content"] for t, r in results.items()} == solo


async def test_a_sequence_failing_in_a_real_batch_fails_alone(batch_server, client, monkeypatch, caplog) -> None:
    from turbospark.model import mlx_backend

    real = mlx_backend.make_processors

    def processors(params, prompt_len, *rest):
        out = real(params, prompt_len, *rest)
        if params.presence_penalty == 0.25:  # the marked request's processor blows up

            def broken(tokens, logits):
                raise ValueError("a broken logits processor")

            out.append(broken)
        return out

    monkeypatch.setattr(mlx_backend, "make_processors", processors)
    greedy = {"messages": ask("the moon"), "max_tokens": 10, "temperature": 0}
    alone = (await client.post(f"{batch_server.url}{PATH}", json=greedy)).json()
    results: dict[str, httpx.Response] = {}

    async def post(name: str, body: dict) -> None:
        results[name] = await client.post(f"{batch_server.url}{PATH}", json=body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "healthy", greedy)
        nursery.start_soon(post, "broken", greedy | {"presence_penalty": 0.25})
    assert results["broken"].status_code == 500
    assert results["broken"].json()["error"]["message"].startswith("generation failed (error id ")
    assert "a broken logits processor" in caplog.text
    assert results["healthy"].json()["choices"] == alone["choices"]
    r = await client.post(f"{batch_server.url}{PATH}", json=greedy)
    assert r.json()["choices"] == alone["choices"]  # the thread and its engine keep serving


def test_prefix_cache_reuses_untrimmable_caches_only_whole() -> None:
    """Caches without ``offset`` or trim (rotating windows, hybrid models' array state) are
    reused when the whole entry is a prefix of the prompt, and skipped when a trim is needed."""
    from turbospark.model.prefix_cache import PrefixCache

    class ArrayState:  # no offset, no trim: like mlx-lm's ArraysCache
        nbytes = 100

    cache = PrefixCache()
    state = [ArrayState(), ArrayState()]
    cache.put([1, 2, 3], state)
    assert cache.take([1, 2, 3, 4, 5]) == (state, 3)  # no trim needed: reused whole
    cache.put([1, 2, 3], state)
    assert cache.take([1, 2, 9, 9]) == (None, 0)  # would need a trim: skipped, no crash
    assert cache.take([1, 2, 3]) == (None, 0)  # the last token must be fed: a trim again
    assert [e.tokens for e in cache.entries] == [[1, 2, 3]]  # and the entry stays for later


async def test_rotating_caches_of_a_sliding_window_model_are_reused(nursery, client) -> None:
    """Gemma 3's sliding-window layers keep rotating caches: a repeated prompt reuses them."""
    from turbospark.model.mlx_backend import MlxBackend
    from .realmodels import gemma_store

    stored = gemma_store()
    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0)
    spec = BackendSpec(stored.name, lambda: MlxBackend(stored.path, model_id=stored.name))
    server = await nursery.start(serve, settings, [spec])
    body = {"prompt": "The history of computing is a long story that starts with",
            "max_tokens": 8, "temperature": 0}
    first = (await client.post(f"{server.url}/v1/completions", json=body)).json()
    again = (await client.post(f"{server.url}/v1/completions", json=body)).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    server.stop.set()


async def test_n_seeded_choices_are_each_reproducible(batch_server, client) -> None:
    body = {"messages": ask("a dragon"), "max_tokens": 10, "temperature": 1.0, "seed": 11}
    r = await client.post(f"{batch_server.url}{PATH}", json=body | {"n": 3})
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert len(set(texts)) == 3  # three distinct samples
    assert r.json()["usage"]["completion_tokens"] <= 30
    # choice i draws from seed + i: the same as one request with that seed, prefilled alone
    for i, text in enumerate(texts):
        alone = await client.post(f"{batch_server.url}{PATH}", json=body | {"seed": 11 + i})
        assert alone.json()["choices"][0]["message"]["content"] == text, i
    again = await client.post(f"{batch_server.url}{PATH}", json=body | {"n": 3, "stream": False})
    assert [c["message"]["content"] for c in again.json()["choices"]] == texts


async def test_logit_bias_bans_and_forces_tokens(batch_server, client) -> None:
    from turbospark.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_store().path)
    france = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    body = {"messages": france, "temperature": 0, "max_tokens": 12}
    plain = (await client.post(f"{batch_server.url}{PATH}", json=body)).json()
    assert "Paris" in plain["choices"][0]["message"]["content"]
    (paris,) = tok.encode(" Paris")
    banned = (await client.post(f"{batch_server.url}{PATH}", json=body | {"logit_bias": {str(paris): -100}})).json()
    assert "Paris" not in banned["choices"][0]["message"]["content"]
    (yes,) = tok.encode("Yes")
    forced = (await client.post(f"{batch_server.url}{PATH}", json=body | {"logit_bias": {str(yes): 100}, "max_tokens": 3})).json()
    assert forced["choices"][0]["message"]["content"] == "YesYesYes"


async def test_logprobs_from_the_real_model(batch_server, client) -> None:
    import math

    france = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    body = {"messages": france, "temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 5}
    r = (await client.post(f"{batch_server.url}{PATH}", json=body)).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert r["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert len(content) == 8  # every token, the end of turn included
    for e in content:
        tops = e["top_logprobs"]
        assert len(tops) == 5 and tops[0]["token"] == e["token"]  # greedy: the likeliest
        assert tops[0]["logprob"] == pytest.approx(e["logprob"], abs=1e-5)
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(tops, tops[1:]))
        assert sum(math.exp(t["logprob"]) for t in tops) <= 1 + 1e-4
