"""``/v1/rerank``, ``/rerank`` and ``/v1/score`` on scripted encoders: llama.cpp's own server
tests for rerank (tools/server/tests/unit/test_rerank.py, the cases that test the API rather
than its model), the Jina/Cohere and vLLM shapes, bad input, the cosine fallback and its
header, and batching across requests on the encoder thread."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from turbospark.model.encoder import ScriptedEncoder

from ._support import wait_for
from .test_embeddings import GatedEncoder, scripted_vector

# llama.cpp's TEST_DOCUMENTS
DOCS = [
    "A machine is a physical system that uses power to apply forces and control movement to perform an action. The term is commonly applied to artificial devices, such as those employing engines or motors, but also to natural biological macromolecules, such as molecular machines.",
    "Learning is the process of acquiring new understanding, knowledge, behaviors, skills, values, attitudes, and preferences. The ability to learn is possessed by humans, non-human animals, and some machines; there is also evidence for some kind of learning in certain plants.",
    "Machine learning is a field of study in artificial intelligence concerned with the development and study of statistical algorithms that can learn from data and generalize to unseen data, and thus perform tasks without explicit instructions.",
    "Paris, capitale de la France, est une grande ville européenne et un centre mondial de l'art, de la mode, de la gastronomie et de la culture. Son paysage urbain du XIXe siècle est traversé par de larges boulevards et la Seine.",
]
QUERY = "Machine learning is"
SEP = " ||| "


def overlap(query: str, doc: str) -> float:
    """The scripted relevance: how many of the query's words the document has (any case)."""
    return float(len(set(query.lower().split()) & set(doc.lower().replace(",", " ").split())))


class ScriptedCrossEncoder(GatedEncoder):
    """Scores a pair by ``overlap``; every forward pass is recorded (and may be gated)."""

    cross = True
    dimensions = 1

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gate.set()

    def tokenize_pairs(self, query, documents, *, truncate):
        return self.tokenize([query + SEP + d for d in documents], truncate=truncate)

    def embed(self, batch):
        self.entered += 1
        self.gate.wait(30)
        self.batches.append([list(ids) for ids in batch])
        pairs = [self.tokenizer.decode(ids).split(SEP) for ids in batch]
        return np.array([[overlap(q, d)] for q, d in pairs], dtype=np.float32)


async def cross_server(start_server, encoder=None):
    return await start_server(encoders=[encoder or ScriptedCrossEncoder(model_id="scripted-reranker")])


async def test_llama_cpp_rerank(start_server, client) -> None:
    server = await cross_server(start_server)
    r = await client.post(f"{server.url}/rerank", json={"query": QUERY, "documents": DOCS})
    body = r.json()
    assert r.status_code == 200 and len(body["results"]) == 4
    scores = [res["relevance_score"] for res in body["results"]]
    assert scores == sorted(scores, reverse=True)  # best first
    assert body["results"][0]["index"] == 2 and body["results"][-1]["index"] == 3
    assert [res["relevance_score"] for res in sorted(body["results"], key=lambda x: x["index"])] == [
        overlap(QUERY, d) for d in DOCS
    ]
    assert r.headers.get("x-anyllm-degradation") is None  # a cross-encoder scored it
    assert body["model"] == "scripted-reranker" and body["object"] == "list"


async def test_llama_cpp_rerank_tei_format(start_server, client) -> None:
    server = await cross_server(start_server)
    r = await client.post(f"{server.url}/rerank", json={"query": QUERY, "texts": DOCS})
    body = r.json()
    assert r.status_code == 200 and len(body) == 4
    assert body[0]["index"] == 2 and body[-1]["index"] == 3 and body[0]["score"] > body[-1]["score"]
    r = await client.post(f"{server.url}/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True, "top_n": 1})
    assert r.json() == [{"index": 2, "score": 3.0, "text": DOCS[2]}]


@pytest.mark.parametrize("documents", [[], None, 123, [1, 2, 3]])
async def test_llama_cpp_invalid_rerank_req(start_server, client, documents) -> None:
    server = await cross_server(start_server)
    r = await client.post(f"{server.url}/rerank", json={"query": QUERY, "documents": documents})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    assert "documents" in r.json()["error"]["message"]


@pytest.mark.parametrize(("query", "doc1", "doc2"), [
    ("Machine learning is", "A machine", "Learning is"),
    ("Which city?", "Machine learning is ", "Paris, capitale de la"),
])
async def test_llama_cpp_rerank_usage(start_server, client, query, doc1, doc2) -> None:
    encoder = ScriptedCrossEncoder(model_id="scripted-reranker")
    server = await cross_server(start_server, encoder)
    r = await client.post(f"{server.url}/rerank", json={"query": query, "documents": [doc1, doc2]})
    usage = r.json()["usage"]
    # every token the model read: each pair, as one input
    read = sum(len(ids) for batch in encoder.batches for ids in batch)
    assert usage["prompt_tokens"] == usage["total_tokens"] == read > 0


@pytest.mark.parametrize(("top_n", "expected"), [(None, 4), (2, 2), (4, 4), (99, 4)])
@pytest.mark.parametrize("field", ["documents", "texts"])
async def test_llama_cpp_rerank_top_n(start_server, client, top_n, expected, field) -> None:
    server = await cross_server(start_server)
    data = {"query": QUERY, field: DOCS, **({"top_n": top_n} if top_n is not None else {})}
    r = await client.post(f"{server.url}/v1/rerank", json=data)
    results = r.json()["results"] if field == "documents" else r.json()
    assert r.status_code == 200 and len(results) == expected


async def test_documents_as_objects_come_back_as_sent(start_server, client) -> None:
    server = await cross_server(start_server)
    docs = [{"text": DOCS[3], "id": "fr"}, "Machine learning is fun", {"text": "nothing here"}]
    r = await client.post(f"{server.url}/v1/rerank", json={
        "model": "scripted-reranker", "query": QUERY, "documents": docs, "top_n": 2, "return_documents": True,
    })
    assert r.json()["results"] == [
        {"index": 1, "relevance_score": 3.0, "document": {"text": "Machine learning is fun"}},
        {"index": 0, "relevance_score": 0.0, "document": {"text": DOCS[3], "id": "fr"}},  # ties: in order
    ]


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n", "top_n must be an integer of at least 1, got 0"),
    ({"query": QUERY, "documents": DOCS, "top_n": -3}, "top_n", "at least 1"),
    ({"query": "", "documents": DOCS}, "query", "query must be a non-empty string"),
    ({"documents": DOCS}, "query", "query must be a non-empty string"),
    ({"query": QUERY, "documents": [{"title": "x"}]}, "documents", "documents[0] must be a string or an object"),
    ({"query": QUERY, "documents": ["x"] * 2049}, "documents", "more than 2048"),
])
async def test_bad_rerank_input_is_a_400_before_any_work(start_server, client, body, param, needle) -> None:
    encoder = ScriptedCrossEncoder(model_id="scripted-reranker")
    server = await cross_server(start_server, encoder)
    r = await client.post(f"{server.url}/v1/rerank", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and needle in error["message"]
    assert encoder.batches == []


async def test_vllm_score_one_against_many_and_pairwise(start_server, client) -> None:
    server = await cross_server(start_server)
    r = await client.post(f"{server.url}/v1/score", json={"text_1": QUERY, "text_2": DOCS})
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == [overlap(QUERY, d) for d in DOCS]
    firsts = ["Machine learning is", "Which city is it", "Machine"]
    r = await client.post(f"{server.url}/v1/score", json={"text_1": firsts, "text_2": DOCS[1:]})
    assert [d["score"] for d in r.json()["data"]] == [overlap(q, d) for q, d in zip(firsts, DOCS[1:])]
    assert r.json()["usage"]["prompt_tokens"] > 0
    r = await client.post(f"{server.url}/v1/score", json={"text_1": ["a", "b"], "text_2": ["c"]})
    assert r.status_code == 400 and "give one text_1, or as many as text_2" in r.json()["error"]["message"]
    r = await client.post(f"{server.url}/v1/score", json={"text_1": "a", "text_2": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"


async def test_without_a_cross_encoder_the_embedding_model_scores_by_cosine(start_server, client) -> None:
    encoder = ScriptedEncoder()
    server = await start_server(encoders=[encoder])
    docs = ["tiny", "a much longer document here", "mid size"]
    r = await client.post(f"{server.url}/v1/rerank", json={"query": "short q", "documents": docs})
    want = [float(scripted_vector(d) @ scripted_vector("short q")) for d in docs]
    got = {res["index"]: res["relevance_score"] for res in r.json()["results"]}
    assert np.allclose([got[i] for i in range(3)], want, atol=1e-6)
    assert [res["index"] for res in r.json()["results"]] == sorted(range(3), key=lambda i: -want[i])
    assert "cosine similarity" in r.headers["x-anyllm-degradation"]
    assert encoder.batches and [len(b) for b in encoder.batches] == [4]  # the query rode with them
    r = await client.post(f"{server.url}/v1/score", json={"text_1": "short q", "text_2": docs})
    assert np.allclose([d["score"] for d in r.json()["data"]], want, atol=1e-6)
    assert "cosine similarity" in r.headers["x-anyllm-degradation"]


async def test_a_cross_encoder_makes_no_embeddings(start_server, client) -> None:
    server = await cross_server(start_server)
    r = await client.post(f"{server.url}/v1/embeddings", json={"input": "x"})
    assert r.status_code == 400 and "is a cross-encoder" in r.json()["error"]["message"]


async def test_rerank_requests_that_wait_share_one_forward_pass(start_server, client) -> None:
    encoder = ScriptedCrossEncoder(model_id="scripted-reranker")
    encoder.gate.clear()
    server = await cross_server(start_server, encoder)
    inbox = server.system.registry.lookup("scripted-reranker").inbox
    answers: dict[int, list] = {}

    async def ask(i: int, docs: list[str]) -> None:
        r = await client.post(f"{server.url}/v1/rerank", json={"query": f"q{i}", "documents": docs})
        answers[i] = r.json()["results"]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, 0, ["d0"])
        await wait_for(lambda: encoder.entered == 1)
        for i in (1, 2):
            nursery.start_soon(ask, i, [f"d{i}a", f"d{i}b"])
            await wait_for(lambda: inbox.statistics().current_buffer_used == i)
        encoder.gate.set()
    decoded = [[encoder.tokenizer.decode(ids) for ids in batch] for batch in encoder.batches]
    assert decoded == [["q0 ||| d0"], ["q1 ||| d1a", "q2 ||| d2a", "q1 ||| d1b", "q2 ||| d2b"]]
    assert [len(answers[i]) for i in range(3)] == [1, 2, 2]
