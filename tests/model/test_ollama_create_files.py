"""``ollama create`` from files, as Ollama's client does it: each file uploaded to
``/api/blobs/sha256:<hex>``, then ``/api/create`` naming them in ``files`` (a Modelfile's
``FROM ./model.gguf``, or a safetensors directory); and ``from: "ollama:NAME"`` importing a model
from Ollama's store on this machine.  The models are the tiny GGUFs of ``tests/model/tiny.py``,
served for real on MLX."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest

from tests.model.test_hf_import import hf_directory, tokenizer_files  # noqa: F401 (a fixture)
from tests.model.test_ollama_import import GO_CHATML, lay_out, tiny_gguf  # noqa: F401 (a fixture)
from turbospark.store.store import ModelStore


@pytest.fixture
async def served(start_server, tmp_path: Path):
    from turbospark.cli.attach import load_mlx
    from turbospark.store.shelf import StoreShelf

    store = ModelStore(tmp_path / "models")
    shelf = StoreShelf(store, load_mlx)
    server = await start_server(library=shelf.loadables, shelf=shelf)
    return server, store


def _digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _models(store: ModelStore) -> list[str]:
    return sorted(m.name for m in store.list())


async def test_the_ollama_client_creates_a_model_from_a_gguf_and_chats_with_it(served, tiny_gguf: Path) -> None:
    import ollama

    server, store = served
    c = ollama.AsyncClient(host=server.url)
    digest = await c.create_blob(tiny_gguf)
    assert digest == _digest(tiny_gguf.read_bytes())
    async with httpx.AsyncClient() as h:  # Ollama's client asks HEAD first when it re-uploads
        assert (await h.head(f"{server.url}/api/blobs/{digest}")).status_code == 200
        assert (await h.head(f"{server.url}/api/blobs/sha256:{'0' * 64}")).status_code == 404

    steps = [p async for p in await c.create(model="mine", files={"tiny.gguf": digest}, system="You are tiny.",
                                             parameters={"temperature": 0.25}, stream=True)]  # fmt: skip
    statuses = [s.status for s in steps]
    assert statuses[-1] == "success" and len(statuses) > 2, statuses
    assert _models(store) == ["mine"]
    async with httpx.AsyncClient() as h:  # converted into the store, the upload is not kept twice
        assert (await h.head(f"{server.url}/api/blobs/{digest}")).status_code == 404
    # a GGUF is known by its bytes, whatever it is called (Ollama's FROM ./model.bin)
    digest = await c.create_blob(tiny_gguf)
    await c.create(model="from-bin", files={"model.bin": digest}, stream=False)
    assert _models(store) == ["from-bin", "mine"]
    shown = await c.show("mine")
    assert "You are tiny." in (shown.modelfile or "") and "temperature 0.25" in (shown.parameters or "")
    r = await c.chat(model="mine", messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 3})
    assert r.done and r.eval_count == 3
    # the tiny GGUF's own template now opens a chat without a system message with this one
    stored = store.get("mine")
    assert stored.manifest["ollama"]["system"] == "You are tiny." and "parent_model" not in stored.manifest
    template = json.loads((stored.path / "tokenizer_config.json").read_text())["chat_template"]
    assert "default system prompt" in template


async def test_a_safetensors_directory_sent_as_files(served, tmp_path: Path, tokenizer_files: Path) -> None:  # noqa: F811
    server, store = served
    src = hf_directory(tmp_path / "Tiny-qwen2", "qwen2", tokenizer_files)
    files = {}
    async with httpx.AsyncClient(timeout=60) as h:
        for f in sorted(src.iterdir()):
            data = f.read_bytes()
            r = await h.post(f"{server.url}/api/blobs/{_digest(data)}", content=data)
            assert r.status_code == 201, r.text
            files[f.name] = _digest(data)
        r = await h.post(f"{server.url}/api/create", json={"model": "tiny-qwen", "files": files, "stream": False})
        assert r.json() == {"status": "success"}, r.text
        stored = store.get("tiny-qwen")
        assert stored is not None and stored.manifest["architecture"] == "qwen2"
        r = await h.post(f"{server.url}/api/generate", json={"model": "tiny-qwen", "prompt": "Hi", "stream": False,
                                                             "options": {"num_predict": 2}})  # fmt: skip
        assert r.json()["eval_count"] == 2


async def test_bad_uploads_and_creates_are_a_400_and_keep_nothing(served, tiny_gguf: Path) -> None:
    server, store = served
    data = tiny_gguf.read_bytes()
    async with httpx.AsyncClient(timeout=60) as h:
        wrong = await h.post(f"{server.url}/api/blobs/sha256:{'1' * 64}", content=data)
        assert wrong.status_code == 400 and "digest mismatch" in wrong.json()["error"]
        assert (await h.head(f"{server.url}/api/blobs/sha256:{'1' * 64}")).status_code == 404
        malformed = await h.post(f"{server.url}/api/blobs/md5:abc", content=b"x")
        assert malformed.status_code == 400 and "invalid digest" in malformed.json()["error"]
        never = await h.post(f"{server.url}/api/create", json={"model": "m", "files": {"m.gguf": _digest(b"no")}})
        assert never.status_code == 400 and "never uploaded" in never.json()["error"]
        digest = _digest(data)
        assert (await h.post(f"{server.url}/api/blobs/{digest}", content=data)).status_code == 201
        outside = await h.post(f"{server.url}/api/create", json={"model": "m", "files": {"../m.gguf": digest}})
        assert outside.status_code == 400 and "not a relative file name" in outside.json()["error"]  # before any stream
        junk = _digest(b"not a model")
        assert (await h.post(f"{server.url}/api/blobs/{junk}", content=b"not a model")).status_code == 201
        streamed = await h.post(f"{server.url}/api/create", json={"model": "m", "files": {"m.gguf": junk}})
        lines = [json.loads(line) for line in streamed.text.splitlines()]
        assert streamed.status_code == 200 and "error" in lines[-1] and "create failed" in lines[-1]["error"]
        bad_name = await h.post(f"{server.url}/api/create", json={"model": "Not/A Name", "files": {"m.gguf": digest},
                                                                  "stream": False})  # fmt: skip
        assert bad_name.status_code == 400 and "invalid model name 'Not/A Name'" in bad_name.json()["error"]
    assert _models(store) == []
    assert not [p for p in store.root.iterdir() if p.name.startswith(".tmp")]
    assert not [p for p in (store.root / ".blobs").iterdir() if p.name.startswith(".upload")]


async def test_a_model_from_ollamas_store_is_listed_and_imported(
    served, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, store = served
    root = tmp_path / "ollama"
    lay_out(root, "registry.ollama.ai/library/tiny/1b", tiny_gguf, template=GO_CHATML, params={"temperature": 0.3})
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    async with httpx.AsyncClient(timeout=60) as h:
        listed = (await h.get(f"{server.url}/api/ollama/models")).json()["models"]
        assert [(m["name"], m["store_name"], m["problem"]) for m in listed] == [("ollama:tiny:1b", "tiny:1b", "")]
        r = await h.post(f"{server.url}/api/create", json={"model": "tiny:1b", "from": "ollama:tiny:1b"})
        lines = [json.loads(line) for line in r.text.splitlines()]
        assert lines[-1] == {"status": "success"}, lines
        assert any("total" in line for line in lines)  # byte progress while it hashes and converts
        missing = await h.post(f"{server.url}/api/create", json={"model": "x", "from": "ollama:nothing:here",
                                                                 "stream": False})  # fmt: skip
        assert missing.status_code == 400 and "nothing:here" in missing.json()["error"], missing.text
    assert _models(store) == ["tiny:1b"]
