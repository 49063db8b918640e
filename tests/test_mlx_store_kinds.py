"""The real store, as a new user meets it: all-MiniLM-L6-v2 stored but not named at start-up is
listed by ``/api/tags`` and ``/v1/models`` with what its files say, and ``/api/embed`` loads it
(the MLX BERT) and answers; SmolLM2's card says what its files say, without loading it; the
Piper voice stored but not named loads on the first ``/v1/audio/speech`` and unloads by
``keep_alive``."""

from __future__ import annotations

from functools import partial

import httpx
import numpy as np
import ollama
import pytest
import trio

from turbospark.cli.attach import load_mlx, store_loaders
from turbospark.config import Settings
from turbospark.server import serve
from turbospark.store.shelf import StoreShelf

from .realmodels import cached_store, minilm_store, piper_store, smollm2_store

pytestmark = pytest.mark.mlx


async def test_a_stored_embedding_model_loads_on_first_use(nursery: trio.Nursery) -> None:
    minilm_store()
    smollm2_store()
    shelf = StoreShelf(cached_store(), load_mlx, store_loaders())
    server = await nursery.start(partial(
        serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0), [], library=shelf.loadables, shelf=shelf,
    ))
    try:
        client = ollama.AsyncClient(host=server.url, timeout=120)
        listed = {m.model: m for m in (await client.list()).models}
        minilm = listed["all-minilm-l6-v2"].details
        assert (minilm.family, minilm.parameter_size, minilm.quantization_level) == ("bert", "23M", "F32")
        shown = await client.show("all-minilm-l6-v2")
        assert shown.capabilities == ["embedding"]
        assert shown.modelinfo["general.parameter_count"] == 22_565_376  # without the pooler the store drops
        assert shown.modelinfo["bert.embedding_length"] == 384 and shown.modelinfo["bert.context_length"] == 256
        smol = await client.show("smollm2-135m-instruct")
        assert smol.capabilities == ["completion"] and smol.details.quantization_level == "F32"
        assert smol.modelinfo["general.parameter_count"] == 134_515_008 and smol.details.parameter_size == "135M"
        async with httpx.AsyncClient(timeout=30) as h:  # OpenAI's model object, with the card's fields
            row = (await h.get(f"{server.url}/v1/models/smollm2-135m-instruct")).json()
        assert (row["id"], row["object"], row["architecture"], row["parameters"], row["quantization"]) == (
            "smollm2-135m-instruct", "model", "llama", 134_515_008, "F32")
        assert row["capabilities"] == ["completion"] and row["context_window"] == 8192
        assert (await client.ps()).models == []

        r = await client.embed(model="all-minilm-l6-v2", input=["The cat sits on the mat."])
        assert np.asarray(r.embeddings).shape == (1, 384) and r.load_duration > 0
        assert np.allclose(r.embeddings[0][:3], [0.13418, -0.0329, -0.0248], atol=1e-4)
        assert [m.model for m in (await client.ps()).models] == ["all-minilm-l6-v2"]
        await client.embed(model="all-minilm-l6-v2", input="x", keep_alive=0)
        with trio.fail_after(10):
            while (await client.ps()).models:
                await trio.sleep(0.05)
    finally:
        server.stop.set()


async def test_a_stored_voice_loads_on_the_first_speech_request(nursery: trio.Nursery) -> None:
    piper = piper_store()
    shelf = StoreShelf(cached_store(), load_mlx, store_loaders())
    server = await nursery.start(partial(
        serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0), [], library=shelf.loadables, shelf=shelf,
    ))
    try:
        async with httpx.AsyncClient(timeout=120) as h:
            row = (await h.get(f"{server.url}/v1/models/{piper.name}")).json()
            assert row["task"] == "text_to_speech" and row["capabilities"] == ["text_to_speech"]
            assert (await h.get(f"{server.url}/api/ps")).json()["models"] == []
            r = await h.post(f"{server.url}/v1/audio/speech",
                             json={"model": piper.name, "input": "Hello there.", "response_format": "wav"})
            assert r.status_code == 200 and r.content[:4] == b"RIFF" and len(r.content) > 10_000
            loaded = (await h.get(f"{server.url}/api/ps")).json()["models"]
            assert [m["model"] for m in loaded] == [piper.name]
            await h.post(f"{server.url}/api/generate", json={"model": piper.name, "keep_alive": 0})
            with trio.fail_after(10):
                while (await h.get(f"{server.url}/api/ps")).json()["models"]:
                    await trio.sleep(0.05)
    finally:
        server.stop.set()
