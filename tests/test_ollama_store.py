"""Ollama's model management on a real store: ``pull`` with NDJSON progress (a catalogue entry
whose wheels are written in-process and served by a local folder), ``copy`` and ``delete``, and
a pulled model loading on demand."""

from __future__ import annotations

from pathlib import Path

import ollama
import pytest

from turbospark.cli.attach import load_mlx
from turbospark.store.catalogue import CATALOGUE
from turbospark.store.shelf import StoreShelf
from turbospark.store.store import ModelStore

from .model.test_store import _sha256, _tiny_entry, local_index, tiny_gguf  # noqa: F401 (fixtures)

pytestmark = pytest.mark.mlx  # the tiny model is converted and loaded with MLX


async def test_pull_streams_progress_then_copy_and_delete(
    start_server, client, tmp_path: Path, tiny_gguf: Path, local_index: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(CATALOGUE, "tiny-chat", _tiny_entry(local_index, tiny_gguf))
    shelf = StoreShelf(ModelStore(tmp_path / "models"), load_mlx)
    server = await start_server(library=shelf.loadables, shelf=shelf)
    c = ollama.AsyncClient(host=server.url)
    assert [m.model for m in (await c.list()).models] == ["scripted"]

    progress = [p async for p in await c.pull("tiny-chat", stream=True)]
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert any(s.startswith("downloading tiny-model-part1==1.0") for s in statuses)
    sized = [p for p in progress if p.total]
    assert sized and all(0 <= p.completed <= p.total for p in sized)
    assert all(p.digest == f"sha256:{_sha256(tiny_gguf)}" for p in sized)
    extracting = [p for p in sized if p.status == "extracting"]
    assert extracting[-1].completed == extracting[-1].total == tiny_gguf.stat().st_size
    assert sorted(m.model for m in (await c.list()).models) == ["scripted", "tiny-chat"]
    shown = await c.show("tiny-chat")
    assert shown.details.family == "llama" and shown.details.format == "gguf" and "completion" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama" and shown.template

    r = await client.post(f"{server.url}/api/pull", json={"model": "tiny-chat", "stream": False})
    assert r.json() == {"status": "success"}  # already there: nothing to fetch
    missing = await client.post(f"{server.url}/api/pull", json={"model": "no-such-model"})
    assert missing.status_code == 404 and "tiny-chat" in missing.json()["error"]

    # a pulled model loads when named
    g = await c.generate(model="tiny-chat", prompt="Hi", options={"num_predict": 2}, raw=True)
    assert g.done and g.eval_count == 2 and g.load_duration > 0
    assert "tiny-chat" in [m.model for m in (await c.ps()).models]

    await c.copy("tiny-chat", "tiny-copy")
    assert sorted(m.model for m in (await c.list()).models) == ["scripted", "tiny-chat", "tiny-copy"]
    await c.delete("tiny-chat")
    assert "tiny-chat" not in [m.model for m in (await c.ps()).models]
    assert sorted(m.model for m in (await c.list()).models) == ["scripted", "tiny-copy"]
    gone = await client.request("DELETE", f"{server.url}/api/delete", json={"model": "tiny-chat"})
    assert gone.status_code == 404 and list(gone.json()) == ["error"]
    pinned = await client.request("DELETE", f"{server.url}/api/delete", json={"model": "scripted"})
    assert pinned.status_code == 400 and "--model" in pinned.json()["error"]
    bad = await client.post(f"{server.url}/api/copy", json={"source": "tiny-copy", "destination": "Bad Name!"})
    assert bad.status_code == 400, bad.text
