"""Embeddings on a real Hypercorn socket with the scripted encoder: the OpenAI and Ollama wire
shapes, every validation error, resolution among embedding models, batching across requests and
a disconnect dropped before its batch runs."""

from __future__ import annotations

import base64
import json
import threading

import httpx
import numpy as np
import pytest
import trio

from turbospark.messages import Embedded, EmbeddingBatch, RequestFinished
from turbospark.model.encoder import ScriptedEncoder
from turbospark.model.scripted import shipped_tokenizer

from ._support import raw_post, wait_for

TOK = shipped_tokenizer()
PATH = "/v1/embeddings"


def scripted_vector(text: str) -> np.ndarray:
    """The original server's scripted vector, computed here independently."""
    v = np.array([1.0, 0.1 * len(text.encode()), 0.5, -0.2])
    return v / np.linalg.norm(v)


class GatedEncoder(ScriptedEncoder):
    """Blocks in every forward pass until the test opens the gate."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.entered = 0

    def embed(self, batch):
        self.entered += 1
        self.gate.wait(30)
        return super().embed(batch)


async def embeddings_server(start_server, *encoders, **settings):
    return await start_server(encoders=encoders or [ScriptedEncoder()], **settings)


async def test_single_input_is_a_unit_vector_with_exact_usage(start_server, client) -> None:
    server = await embeddings_server(start_server)
    text = "The cat sits on the mat."
    r = await client.post(f"{server.url}{PATH}", json={"input": text, "model": "scripted-embedding"})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "list" and data["model"] == "scripted-embedding"
    [item] = data["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    assert np.allclose(item["embedding"], scripted_vector(text), atol=1e-7)
    assert abs(np.linalg.norm(item["embedding"]) - 1) < 1e-6
    tokens = len(TOK.encode(text))
    assert data["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


async def test_batch_with_dimensions_is_cut_and_renormalised(start_server, client) -> None:
    server = await embeddings_server(start_server)
    texts = ["short", "a much longer sentence than the first"]
    r = await client.post(f"{server.url}{PATH}", json={"input": texts, "dimensions": 2})
    data = r.json()
    assert [d["index"] for d in data["data"]] == [0, 1]
    for text, item in zip(texts, data["data"], strict=True):
        cut = scripted_vector(text)[:2]
        assert np.allclose(item["embedding"], cut / np.linalg.norm(cut), atol=1e-7)
    assert data["usage"]["prompt_tokens"] == sum(len(TOK.encode(t)) for t in texts)
    full = await client.post(f"{server.url}{PATH}", json={"input": texts, "dimensions": 4})
    assert np.allclose(full.json()["data"][1]["embedding"], scripted_vector(texts[1]), atol=1e-7)


async def test_base64_is_the_same_float32_values(start_server, client) -> None:
    server = await embeddings_server(start_server)
    body = {"input": ["one", "two words"]}
    floats = (await client.post(f"{server.url}{PATH}", json=body)).json()["data"]
    packed = (await client.post(f"{server.url}{PATH}", json=body | {"encoding_format": "base64"})).json()["data"]
    for f, b in zip(floats, packed, strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.array(f["embedding"], dtype=np.float32).tolist()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": "x", "encoding_format": "int8"}, 'encoding_format must be float or base64, not "int8"'),
        ({"input": [], "encoding_format": "int8"}, 'encoding_format must be float or base64, not "int8"'),
        ({"input": []}, "input must not be empty"),
        ({"input": ["x"] * 2049}, "too many inputs: 2049 exceeds the 2048-item limit"),
        ({"input": ["x" * 750_000, "y" * 750_000]}, "input too large: 1500000 bytes exceeds the 1048576-byte limit"),
        ({"input": "x", "dimensions": 0}, "dimensions must be greater than 0, got 0"),
        ({"input": "x", "dimensions": -3}, "dimensions must be greater than 0, got -3"),
        ({"input": "x", "dimensions": 5}, "dimensions 5 exceeds this model's own width of 4"),
        ({"input": 5}, "input must be a string, an array of strings, an array of token ids"),
        ({"input": ["a", 1]}, "input must be a string, an array of strings, an array of token ids"),
        ({"input": [[1, "a"]]}, "input must be a string, an array of strings, an array of token ids"),
        ({"input": [101, 2023, 10**9]}, "input 0 holds token id 1000000000, outside this model's vocabulary"),
        ({"input": ["a", [101, -1]]}, "input 1 holds token id -1, outside this model's vocabulary"),
        ({"input": ["a", []]}, "input 1 is an empty list of token ids"),
        ({"input": "\ud800"}, "lone UTF-16 surrogate"),
        ({}, "input"),
        ({"input": "x", "dimensions": "2"}, "expected an integer, got a string"),
        ({"input": "x", "encoding_format": 1}, "expected a string"),
        ({"input": "x", "extra": True}, "unknown field(s) extra"),
    ],
)
async def test_every_validation_error_is_a_400_before_any_work(start_server, client, body, message) -> None:
    encoder = ScriptedEncoder()
    server = await embeddings_server(start_server, encoder)
    r = await client.post(f"{server.url}{PATH}", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert encoder.batches == []


async def test_malformed_json_is_a_json_400(start_server, client) -> None:
    server = await embeddings_server(start_server)
    r = await client.post(f"{server.url}{PATH}", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("name", [None, "text-embedding-3-small", "scripted-embedding", "scripted"])
async def test_any_name_reaches_the_single_embedding_model(start_server, client, name) -> None:
    server = await embeddings_server(start_server)
    body = {"input": "hi"} | ({"model": name} if name else {})
    r = await client.post(f"{server.url}{PATH}", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "scripted-embedding"


async def test_several_embedding_models_resolve_by_name_and_404_otherwise(start_server, client) -> None:
    small = ScriptedEncoder(model_id="small")
    large = ScriptedEncoder(model_id="large")
    server = await embeddings_server(start_server, small, large)
    for name in ("small", "large"):
        r = await client.post(f"{server.url}{PATH}", json={"input": "hi", "model": name})
        assert r.json()["model"] == name
    assert len(small.batches) == len(large.batches) == 1
    r = await client.post(f"{server.url}{PATH}", json={"input": "hi", "model": "text-embedding-3-small"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["available"] == ["small", "large"]
    r = await client.post(f"{server.url}/api/embed", json={"input": "hi", "model": "nomic-embed-text"})
    assert r.status_code == 404
    assert "nomic-embed-text" in r.json()["error"]
    # a chat request never lands on an embedding model, and the reverse
    chat = await client.post(f"{server.url}/v1/chat/completions", json={"model": "small", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["model"] == "small"  # the name asked for; the chat model answered
    assert len(small.batches) == 1


async def test_no_embedding_model_is_a_503(start_server, client) -> None:
    server = await start_server()
    r = await client.post(f"{server.url}{PATH}", json={"input": "hi"})
    assert r.status_code == 503
    assert "no model capable" in r.json()["error"]["message"]
    r = await client.post(f"{server.url}/api/embed", json={"model": "m", "input": "hi"})
    assert r.status_code == 503
    assert set(r.json()) == {"error"}


async def test_models_lists_the_embedding_model_without_an_alias(start_server, client) -> None:
    server = await embeddings_server(start_server)
    ids = [m["id"] for m in (await client.get(f"{server.url}/v1/models")).json()["data"]]
    assert ids == ["scripted", "claude-turbospark-scripted", "scripted-embedding"]
    row = (await client.get(f"{server.url}/v1/models/scripted-embedding")).json()
    assert row["context_window"] == 8192


# --- Ollama ---------------------------------------------------------------------------------


async def test_ollama_embed_and_embeddings_shapes(start_server, client) -> None:
    server = await embeddings_server(start_server)
    texts = ["why is the sky blue?", "why is grass green?"]
    r = await client.post(f"{server.url}/api/embed", json={"model": "all-minilm", "input": texts})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["model"] == "scripted-embedding"
    assert len(data["embeddings"]) == 2
    for text, vector in zip(texts, data["embeddings"], strict=True):
        assert np.allclose(vector, scripted_vector(text), atol=1e-7)
    assert data["prompt_eval_count"] == sum(len(TOK.encode(t)) for t in texts)
    assert data["load_duration"] == 0 and data["total_duration"] > 0
    one = (await client.post(f"{server.url}/api/embed", json={"model": "x", "input": "sky", "dimensions": 3})).json()
    cut = scripted_vector("sky")[:3]
    assert np.allclose(one["embeddings"], [cut / np.linalg.norm(cut)], atol=1e-7)
    r = await client.post(f"{server.url}/api/embeddings", json={"model": "x", "prompt": "sky", "keep_alive": "5m"})
    assert r.json() == {"embedding": pytest.approx(list(scripted_vector("sky")), abs=1e-7)}
    assert "x-anyllm-degradation" not in r.headers
    r = await client.post(f"{server.url}/api/embeddings", json={"model": "x", "prompt": "sky", "options": {"num_ctx": 64}})
    assert r.status_code == 200 and r.headers["x-anyllm-degradation"] == "options.num_ctx"


async def test_ollama_empty_inputs_give_no_vectors_and_run_nothing(start_server, client) -> None:
    encoder = ScriptedEncoder()
    server = await embeddings_server(start_server, encoder)
    for value in ([], "", None):
        body = {"model": "m"} | ({"input": value} if value is not None else {})
        data = (await client.post(f"{server.url}/api/embed", json=body)).json()
        assert data["embeddings"] == [] and data["prompt_eval_count"] == 0
    assert (await client.post(f"{server.url}/api/embeddings", json={"model": "m", "prompt": ""})).json() == {"embedding": []}
    assert encoder.batches == []


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/api/embed", {"model": "m", "input": 5}, "input must be a string or an array of strings"),
        ("/api/embed", {"model": "m", "input": ["x"] * 2049}, "too many inputs: 2049 exceeds the 2048-item limit"),
        ("/api/embed", {"model": "m", "input": "x" * 1_100_000}, "input too large: 1100000 bytes"),
        ("/api/embed", {"model": "m", "input": "x", "dimensions": 0}, "dimensions must be greater than 0"),
        ("/api/embed", {"model": "m", "input": "x", "dimensions": 9}, "dimensions 9 exceeds this model's own width of 4"),
        ("/api/embed", {"model": "m", "input": "x", "truncate": "no"}, "expected a boolean"),
        ("/api/embed", {"model": "m", "input": "x", "format": "json"}, "unknown field(s) format"),
        ("/api/embed", {"model": "m", "input": "x", "keep_alive": True}, "keep_alive must be"),
        ("/api/embeddings", {"model": "m", "prompt": ["x"]}, "expected a string"),
        ("/api/embeddings", {"model": "m", "prompt": "x" * 1_100_000}, "input too large"),
        ("/api/embeddings", {"model": "m", "input": "x"}, "unknown field(s) input"),
    ],
)
async def test_ollama_bad_input_is_a_400_in_ollamas_shape(start_server, client, path, body, message) -> None:
    encoder = ScriptedEncoder()
    server = await embeddings_server(start_server, encoder)
    r = await client.post(f"{server.url}{path}", json=body)
    assert r.status_code == 400, r.text
    assert list(r.json()) == ["error"] and message in r.json()["error"]
    assert encoder.batches == []


async def test_ollama_truncate_false_refuses_what_truncate_true_cuts(start_server, client) -> None:
    encoder = ScriptedEncoder(max_tokens=8)
    server = await embeddings_server(start_server, encoder)
    text = "one two three four five six seven eight nine ten eleven twelve"
    assert len(TOK.encode(text)) > 8
    r = await client.post(f"{server.url}/api/embed", json={"model": "m", "input": ["ok", text], "truncate": False})
    assert r.status_code == 400
    assert r.json() == {"error": f"input 1 is {len(TOK.encode(text))} tokens long, more than this model's limit of 8; shorten it or let it be truncated"}
    assert encoder.batches == []
    r = await client.post(f"{server.url}/api/embed", json={"model": "m", "input": ["ok", text]})
    assert r.json()["prompt_eval_count"] == len(TOK.encode("ok")) + 8
    assert encoder.batches[-1][1] == TOK.encode(text)[:8]
    r = await client.post(f"{server.url}{PATH}", json={"input": text})  # OpenAI: truncated too
    assert r.json()["usage"]["prompt_tokens"] == 8


# --- batching and cancellation ----------------------------------------------------------------


async def test_requests_that_wait_share_one_forward_pass(start_server, client) -> None:
    encoder = GatedEncoder()
    server = await embeddings_server(start_server, encoder)
    events = server.system.subscribe(buffer=1000)
    inbox = server.system.registry.lookup("scripted-embedding").inbox
    bodies = {
        "a": ["a0"],
        "b": ["b0", "b1"],
        "c": ["c0"],
        "d": ["d0", "d1", "d2"],
    }
    answers: dict[str, list] = {}

    async def ask(name: str) -> None:
        r = await client.post(f"{server.url}{PATH}", json={"input": bodies[name]})
        answers[name] = [d["embedding"] for d in r.json()["data"]]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "a")
        await wait_for(lambda: encoder.entered == 1)  # a's pass is running (held at the gate)
        for name in "bcd":
            nursery.start_soon(ask, name)
            await wait_for(lambda: inbox.statistics().current_buffer_used == "bcd".index(name) + 1)
        encoder.gate.set()
    decoded = [[TOK.decode(ids) for ids in batch] for batch in encoder.batches]
    # one pass for a, then one for the three that waited: round-robin over them, oldest first
    assert decoded == [["a0"], ["b0", "c0", "d0", "b1", "d1", "d2"]]
    for name, texts in bodies.items():
        assert np.allclose(answers[name], [scripted_vector(t) for t in texts], atol=1e-7)
    batches = []
    with trio.move_on_after(1):
        async for event in events:
            if isinstance(event, EmbeddingBatch):
                batches.append((event.inputs, event.jobs))
            if len(batches) == 2:
                break
    assert batches == [(1, 1), (6, 3)]
    metrics = (await client.get(f"{server.url}/metrics")).text
    assert "turbospark_embedding_inputs_total 7.0" in metrics
    assert 'turbospark_embedding_requests_total{outcome="Done"} 4.0' in metrics


async def test_a_big_request_is_split_into_batches_by_length_bucket(start_server, client) -> None:
    encoder = ScriptedEncoder()
    server = await embeddings_server(start_server, encoder, embedding_batch=4)
    short = [f"s{i}" for i in range(6)]
    long = [" ".join(["word"] * 20) + f" {i}" for i in range(3)]
    texts = [short[0], long[0], *short[1:4], long[1], *short[4:], long[2]]
    r = await client.post(f"{server.url}{PATH}", json={"input": texts})
    got = [d["embedding"] for d in r.json()["data"]]
    assert np.allclose(got, [scripted_vector(t) for t in texts], atol=1e-7)
    sizes = [[len(ids) for ids in batch] for batch in encoder.batches]
    # at most 4 a pass, in input order within a length bucket: the first pending input picks it
    assert [len(b) for b in sizes] == [4, 3, 2]
    assert max(sizes[0] + sizes[2]) <= 16 and min(sizes[1]) > 16


async def test_a_request_that_disconnects_is_dropped_before_its_batch_runs(start_server, client) -> None:
    encoder = GatedEncoder()
    server = await embeddings_server(start_server, encoder)
    events = server.system.subscribe(buffer=1000)
    inbox = server.system.registry.lookup("scripted-embedding").inbox
    answer: list[httpx.Response] = []

    async def first() -> None:
        answer.append(await client.post(f"{server.url}{PATH}", json={"input": "kept"}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await wait_for(lambda: encoder.entered == 1)
        sock = await raw_post(server.url, PATH, {"input": ["gone one", "gone two"]})
        await wait_for(lambda: inbox.statistics().current_buffer_used == 1)
        await sock.aclose()
        seen: list[object] = []
        with trio.fail_after(10):
            async for event in events:
                seen.append(event)
                if isinstance(event, RequestFinished) and event.status == 499:
                    break  # its route has closed its reply channel
        encoder.gate.set()
        with trio.fail_after(10):
            async for event in events:
                if isinstance(event, Embedded) and event.outcome == "Cancelled":
                    gone = event
                    break
    assert answer[0].status_code == 200
    assert [[TOK.decode(ids) for ids in batch] for batch in encoder.batches] == [["kept"]]
    assert (gone.inputs, gone.computed) == (2, 0)
    metrics = (await client.get(f"{server.url}/metrics")).text
    assert 'turbospark_embedding_requests_total{outcome="Cancelled"} 1.0' in metrics


async def test_a_full_inbox_is_a_503_queue_full(start_server, client) -> None:
    encoder = GatedEncoder()
    server = await embeddings_server(start_server, encoder, max_queue=1, embedding_batch=1)
    inbox = server.system.registry.lookup("scripted-embedding").inbox
    statuses: list[int] = []

    async def ask() -> None:
        statuses.append((await client.post(f"{server.url}{PATH}", json={"input": "x"})).status_code)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await wait_for(lambda: encoder.entered == 1)
        nursery.start_soon(ask)
        await wait_for(lambda: inbox.statistics().current_buffer_used == 1)
        r = await client.post(f"{server.url}{PATH}", json={"input": "x"})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
        encoder.gate.set()
    assert statuses == [200, 200]


async def test_shutdown_answers_waiting_jobs_shutting_down(start_server, client) -> None:
    encoder = GatedEncoder()
    server = await embeddings_server(start_server, encoder)
    inbox = server.system.registry.lookup("scripted-embedding").inbox
    statuses: dict[str, int] = {}

    async def ask(name: str) -> None:
        statuses[name] = (await client.post(f"{server.url}{PATH}", json={"input": name})).status_code

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "running")
        await wait_for(lambda: encoder.entered == 1)
        nursery.start_soon(ask, "waiting")
        await wait_for(lambda: inbox.statistics().current_buffer_used == 1)
        server.stop.set()
        scope = server.system.models_scope
        await wait_for(lambda: scope.cancel_called)
        encoder.gate.set()
    assert statuses == {"running": 200, "waiting": 503}
