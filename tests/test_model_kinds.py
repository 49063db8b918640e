"""Every kind of model loads when asked, as a new user meets it: a store that holds an embedding
model (and a speech-to-text model) never named at start-up lists it on ``/api/tags`` and
``/v1/models`` with what its files say, loads it on first use, unloads it with ``keep_alive`` 0,
and gives its room to a chat model under ``--max-loaded-models 1``.  The store is a real one on
disk (hand-made model directories); the models it loads are the scripted engines."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import numpy as np
import trio

from turbospark.actors.lifecycle import Loadable
from turbospark.audio.engines import ScriptedSpeechToText
from turbospark.messages import ModelLoaded, ModelUnloaded
from turbospark.model.encoder import ScriptedEncoder
from turbospark.model.scripted import ScriptedBackend
from turbospark.store.card import card_for
from turbospark.store.manifest import new_manifest, write_manifest
from turbospark.store.shelf import StoreShelf
from turbospark.store.store import ModelStore

from .test_audio_api import tone
from .test_embeddings import scripted_vector

from .test_lifecycle import ps, until_loaded

HELLO = [{"role": "user", "content": "Hello there"}]
QWEN_LIKE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}{% for m in messages %}<|im_start|>"
    "{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is false %}<think>\n\n</think>\n{% endif %}{% endif %}"
)


def safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with these tensors (dtype, shape), zero-filled."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}
    header, offset = {"__metadata__": {"format": "mlx"}}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype] * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def stored_model(root: Path, name: str, kind: str, *, config: dict, tensors: dict, files: dict | None = None,
                 architecture: str = "", context: int | None = None, dtype: str = "float32") -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    safetensors(path / "model.safetensors", tensors)
    for file, content in (files or {}).items():
        (path / file).write_text(json.dumps(content))
    write_manifest(path, new_manifest(name=name, source="test", sha256="0" * 64, fmt="hf", architecture=architecture,
                                      dtype=dtype, context_length=context, kind=kind))
    return path


def minilm_like(root: Path) -> None:
    stored_model(
        root, "all-minilm-l6-v2", "embedding", architecture="bert", context=256,
        config={"model_type": "bert", "hidden_size": 4, "num_hidden_layers": 1, "max_position_embeddings": 512},
        tensors={"embeddings.word_embeddings.weight": ("F32", [30, 4]), "pooler": ("F32", [4])},
        files={"embedding.json": {"pooling": "mean", "normalize": True, "max_tokens": 256, "dimensions": 4}},
    )


class Loads:
    """The shelf's loaders: scripted engines, counted; the encoder's load can wait at a gate."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.gate = threading.Event()
        self.gate.set()

    def _count(self, name: str) -> None:
        assert self.gate.wait(30)
        self.counts[name] = self.counts.get(name, 0) + 1

    def chat(self, path: Path, name: str) -> ScriptedBackend:
        self._count(name)
        return ScriptedBackend(model_id=name, script="Loaded and answering.")

    def encoder(self, path: Path, name: str) -> ScriptedEncoder:
        self._count(name)
        return ScriptedEncoder(model_id=name)

    def stt(self, path: Path, name: str) -> ScriptedSpeechToText:
        self._count(name)
        return ScriptedSpeechToText(model_id=name)

    def shelf(self, root: Path) -> StoreShelf:
        return StoreShelf(ModelStore(root), self.chat, {"embedding": self.encoder, "speech-to-text": self.stt})



def drained(events: trio.MemoryReceiveChannel) -> list:
    return [events.receive_nowait() for _ in range(events.statistics().current_buffer_used)]


async def seen(events: trio.MemoryReceiveChannel, wanted: object) -> None:
    """Wait until the observer has told of ``wanted`` (an unload is told once the model has ended)."""
    with trio.fail_after(10):
        async for event in events:
            if event == wanted:
                return


def test_the_card_is_read_from_the_files(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    # a 4-bit mlx-community-style chat model: packed weights count 8 parameters per element
    stored_model(
        tmp_path, "qwen-tiny", "generation", architecture="qwen3", context=None, dtype="native",
        config={"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 40960,
                "num_attention_heads": 4, "quantization": {"group_size": 64, "bits": 4}},
        tensors={"model.embed_tokens.weight": ("U32", [100, 8]), "model.embed_tokens.scales": ("F16", [100, 1]),
                 "model.embed_tokens.biases": ("F16", [100, 1]), "model.norm.weight": ("F16", [64])},
        files={"tokenizer_config.json": {"chat_template": QWEN_LIKE}, "generation_config.json": {"temperature": 0.6}},
    )
    minilm_like(tmp_path)
    card = card_for(store.get("qwen-tiny"))
    assert card.architecture == "qwen3" and card.parameter_count == 100 * 64 + 64
    assert card.quantization_level == "Q4" and card.context_length == 40960
    assert card.capabilities == ("completion", "tools", "thinking") and card.parameters == "temperature 0.6"
    assert card.model_info["qwen3.context_length"] == 40960 and card.model_info["qwen3.block_count"] == 2
    assert card.model_info["general.parameter_count"] == 6464
    bert = card_for(store.get("all-minilm-l6-v2"))
    assert (bert.architecture, bert.parameter_count, bert.quantization_level) == ("bert", 124, "F32")
    assert bert.capabilities == ("embedding",) and bert.context_length == 256 and bert.template == ""
    assert bert.model_info["bert.embedding_length"] == 4 and bert.model_info["bert.context_length"] == 256


async def test_a_stored_embedding_model_is_listed_loads_unloads_and_gives_way(start_server, client, tmp_path) -> None:
    minilm_like(tmp_path)
    stored_model(tmp_path, "tiny-chat", "generation", architecture="llama", context=2048,
                 config={"model_type": "llama", "hidden_size": 8}, tensors={"w": ("F16", [8, 8])},
                 files={"tokenizer_config.json": {"chat_template": "{{ messages }}"}})
    loads = Loads()
    shelf = loads.shelf(tmp_path)
    server = await start_server(backends=[], library=shelf.loadables, shelf=shelf, max_loaded_models=1)
    url = server.url
    events = server.system.subscribe()

    tags = {m["name"]: m for m in (await client.get(f"{url}/api/tags")).json()["models"]}
    assert set(tags) == {"all-minilm-l6-v2", "tiny-chat"} and loads.counts == {}
    details = tags["all-minilm-l6-v2"]["details"]
    assert (details["family"], details["parameter_size"], details["quantization_level"]) == ("bert", "124", "F32")
    rows = {m["id"]: m for m in (await client.get(f"{url}/v1/models")).json()["data"]}
    assert rows["all-minilm-l6-v2"]["capabilities"] == ["embedding"] and rows["all-minilm-l6-v2"]["parameters"] == 124
    assert rows["tiny-chat"]["capabilities"] == ["completion"] and rows["tiny-chat"]["quantization"] == "F16"
    assert "claude-turbospark-tiny-chat" in rows and "claude-turbospark-all-minilm-l6-v2" not in rows
    shown = (await client.post(f"{url}/api/show", json={"model": "all-minilm-l6-v2"})).json()
    assert shown["capabilities"] == ["embedding"] and shown["model_info"]["general.architecture"] == "bert"

    # named, it loads, answers, and stays for the default keep_alive
    r = await client.post(f"{url}/api/embed", json={"model": "all-minilm-l6-v2", "input": ["why is the sky blue?"]})
    assert r.status_code == 200, r.text
    assert np.allclose(r.json()["embeddings"], [scripted_vector("why is the sky blue?")], atol=1e-7)
    assert r.json()["load_duration"] > 0 and loads.counts == {"all-minilm-l6-v2": 1}
    assert await ps(client, url) == ["all-minilm-l6-v2"]
    r = await client.post(f"{url}/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "sky"})
    assert r.status_code == 200 and loads.counts == {"all-minilm-l6-v2": 1}
    assert any(isinstance(e, ModelLoaded) and e.model == "all-minilm-l6-v2" for e in drained(events))

    # keep_alive 0 unloads it once the request has ended; the next request loads it again
    r = await client.post(f"{url}/api/embed", json={"model": "all-minilm-l6-v2", "input": "x", "keep_alive": 0})
    assert r.status_code == 200
    await seen(events, ModelUnloaded("all-minilm-l6-v2", "requested"))
    assert await ps(client, url) == []
    r = await client.post(f"{url}/api/embed", json={"model": "all-minilm-l6-v2", "input": "x"})
    assert r.status_code == 200 and loads.counts == {"all-minilm-l6-v2": 2}

    # one model at a time: a chat request evicts the idle embedding model, and the reverse
    r = await client.post(f"{url}/api/chat", json={"model": "tiny-chat", "messages": HELLO, "stream": False})
    assert r.status_code == 200 and r.json()["message"]["content"] == "Loaded and answering."
    await seen(events, ModelUnloaded("all-minilm-l6-v2", "evicted"))
    await until_loaded(client, url, ["tiny-chat"])
    r = await client.post(f"{url}/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "sky"})
    assert r.status_code == 200 and loads.counts == {"all-minilm-l6-v2": 3, "tiny-chat": 1}
    await until_loaded(client, url, ["all-minilm-l6-v2"])
    metrics = (await client.get(f"{url}/metrics")).text
    assert 'turbospark_model_loads_total{model="all-minilm-l6-v2"} 3.0' in metrics


async def test_a_request_that_leaves_while_its_embedding_model_loads_stops_the_load(
    start_server, client, tmp_path
) -> None:
    minilm_like(tmp_path)
    loads = Loads()
    loads.gate.clear()
    shelf = loads.shelf(tmp_path)
    server = await start_server(library=shelf.loadables, shelf=shelf)
    events = server.system.subscribe()
    with trio.move_on_after(0.5):  # the client gives up while the encoder loads
        await client.post(f"{server.url}/api/embed", json={"model": "all-minilm-l6-v2", "input": "x"})
    assert loads.counts == {}  # still loading
    loads.gate.set()
    # a new request waits for the abandoned load to end, then loads anew
    r = await client.post(f"{server.url}/api/embed", json={"model": "all-minilm-l6-v2", "input": "x"})
    assert r.status_code == 200 and loads.counts == {"all-minilm-l6-v2": 2}
    loaded = [e.model for e in drained(events) if isinstance(e, ModelLoaded)]
    assert loaded == ["all-minilm-l6-v2"]  # once: the abandoned load never became ready
    assert await ps(client, server.url) == ["all-minilm-l6-v2", "scripted"]


async def test_a_stored_speech_to_text_model_loads_when_named_and_counts_in_the_budget(
    start_server, client, tmp_path
) -> None:
    stored_model(tmp_path, "whisper-tiny", "speech-to-text", architecture="whisper", context=448,
                 config={"n_text_ctx": 448, "n_text_state": 384, "n_mels": 80}, tensors={"w": ("F32", [10, 10])})
    loads = Loads()
    shelf = loads.shelf(tmp_path)
    server = await start_server(library=shelf.loadables, shelf=shelf, max_loaded_models=1)
    url = server.url
    rows = {m["id"]: m for m in (await client.get(f"{url}/v1/models")).json()["data"]}
    assert rows["whisper-tiny"]["capabilities"] == ["speech_to_text"] and rows["whisper-tiny"]["task"] == "speech_to_text"
    assert (await client.get(f"{url}/v1/audio/models")).json()["data"] == []  # nothing loaded yet
    shown = (await client.post(f"{url}/api/show", json={"model": "whisper-tiny"})).json()
    assert shown["model_info"]["whisper.context_length"] == 448 and shown["details"]["parameter_size"] == "100"
    assert shown["capabilities"] == ["speech_to_text"] and shown["model_info"]["whisper.embedding_length"] == 384

    upload = {"files": {"file": ("a.wav", tone(0.5), "audio/wav")}, "data": {"model": "whisper-1"}}
    r = await client.post(f"{url}/v1/audio/transcriptions", **upload)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "Scripted transcript of 0.50 s of audio." and loads.counts == {"whisper-tiny": 1}
    assert await ps(client, url) == ["whisper-tiny"]  # it evicted the scripted chat model
    assert [m["id"] for m in (await client.get(f"{url}/v1/audio/models")).json()["data"]] == ["whisper-tiny"]
    r = await client.post(f"{url}/v1/chat/completions", json={"model": "scripted", "messages": HELLO})
    assert r.status_code == 200
    await until_loaded(client, url, ["scripted"])
    # asked by its own name, it loads again; a text-to-speech request for it is refused
    r = await client.post(f"{url}/v1/audio/transcriptions",
                          files=upload["files"], data={"model": "whisper-tiny"})
    assert r.status_code == 200 and loads.counts == {"whisper-tiny": 2}
    r = await client.post(f"{url}/v1/audio/speech", json={"model": "whisper-tiny", "input": "Hi."})
    assert r.status_code == 400 and "speech-to-text model" in r.json()["error"]["message"]


async def test_an_audio_load_its_request_left_is_detached_and_loads_again(start_server, client, tmp_path) -> None:
    stored_model(tmp_path, "whisper-tiny", "speech-to-text", architecture="whisper", context=448,
                 config={"n_text_ctx": 448}, tensors={"w": ("F32", [10, 10])})
    loads = Loads()
    loads.gate.clear()
    shelf = loads.shelf(tmp_path)
    server = await start_server(library=shelf.loadables, shelf=shelf)
    upload = {"files": {"file": ("a.wav", tone(0.5), "audio/wav")}, "data": {"model": "whisper-tiny"}}
    with trio.move_on_after(0.5):  # the client gives up while the model loads
        await client.post(f"{server.url}/v1/audio/transcriptions", **upload)
    loads.gate.set()
    r = await client.post(f"{server.url}/v1/audio/transcriptions", **upload)
    assert r.status_code == 200 and loads.counts == {"whisper-tiny": 2}
    assert [m["id"] for m in (await client.get(f"{server.url}/v1/audio/models")).json()["data"]] == ["whisper-tiny"]
    metrics = (await client.get(f"{server.url}/metrics")).text
    assert "turbospark_audio_models_loaded 1.0" in metrics  # the abandoned one was detached


async def test_models_handed_to_serve_are_pinned_whatever_their_kind(start_server, client) -> None:
    library = [Loadable(id="other", make=lambda: ScriptedBackend(model_id="other"),
                        capabilities=frozenset({"chat", "completion"}), context_window=8192, size=1)]
    server = await start_server(encoders=[ScriptedEncoder()], audio=[ScriptedSpeechToText()], library=library,
                                max_loaded_models=2)
    assert await ps(client, server.url) == ["scripted", "scripted-embedding", "scripted-stt"]
    assert (await client.post(f"{server.url}/v1/chat/completions", json={"model": "scripted", "messages": HELLO})).status_code == 200
    r = await client.post(f"{server.url}/api/chat", json={"model": "other", "messages": HELLO, "stream": False})
    assert r.status_code == 200
    # the least recently used pinned models made room (pinned models go last, but they go)
    await until_loaded(client, server.url, ["other", "scripted"])
    r = await client.post(f"{server.url}/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 200 and r.json()["model"] == "scripted-embedding"  # loads again
    await until_loaded(client, server.url, ["scripted", "scripted-embedding"])  # "other" went first
