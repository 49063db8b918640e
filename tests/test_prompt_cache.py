"""The prefix cache on disk (--prompt-cache-dir): a restart keeps an agent's cached prefix.

Scripted here (its cache is token lists, written with mlx-lm's own prompt-cache files); the
real SmolLM2 in test_mlx_prompt_cache.py.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import httpx
import trio

from turbospark.config import Settings
from turbospark.model.backend import BackendSpec
from turbospark.model.prompt_files import PromptFiles
from turbospark.model.scripted import ScriptedBackend
from turbospark.server import serve

SYSTEM = "You are a careful coding agent. " * 40
AGENT = [{"role": "system", "content": SYSTEM}]


async def one_turn(backend: ScriptedBackend, question: str) -> dict:
    """Start a server on ``backend``, ask one question, stop it and wait until it has ended."""
    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve, settings, [BackendSpec(backend.model_id, lambda: backend)]))
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": "scripted", "max_tokens": 4, "messages": [*AGENT, {"role": "user", "content": question}]}
            r = await client.post(f"{server.url}/v1/chat/completions", json=body)
        server.stop.set()
    assert r.status_code == 200, r.text
    return r.json()["usage"]


async def test_a_restart_reads_the_system_prompt_from_disk(tmp_path: Path) -> None:
    first = await one_turn(ScriptedBackend(script="ok", prompt_cache_dir=tmp_path), "List the files.")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    files = list(tmp_path.glob("*/*.safetensors"))
    assert len(files) == 1  # written at shutdown, under the model's fingerprint

    after = await one_turn(ScriptedBackend(script="ok", prompt_cache_dir=tmp_path), "Read main.py.")
    cached = after["prompt_tokens_details"]["cached_tokens"]
    assert 0.8 * after["prompt_tokens"] < cached < after["prompt_tokens"]  # the system prompt

    # without the directory, a restart starts cold
    cold = await one_turn(ScriptedBackend(script="ok"), "Read main.py.")
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0


async def test_another_model_does_not_read_them(tmp_path: Path) -> None:
    await one_turn(ScriptedBackend(script="ok", prompt_cache_dir=tmp_path), "List the files.")
    other = await one_turn(ScriptedBackend(script="another script", prompt_cache_dir=tmp_path), "Read main.py.")
    assert other["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(list(tmp_path.iterdir())) == 2  # one folder per fingerprint


async def test_corrupt_and_stale_files_are_ignored_with_a_log_line(tmp_path: Path, caplog) -> None:
    backend = ScriptedBackend(script="ok", prompt_cache_dir=tmp_path)
    await one_turn(backend, "List the files.")
    (folder,) = tmp_path.iterdir()
    (folder / "0123456789abcdef01234567.safetensors").write_bytes(b"not a safetensors file")
    # a file moved here from another model's folder: its metadata names another fingerprint
    stranger = PromptFiles(folder, "fp_000000000000", 1 << 20)
    stranger.save([1, 2, 3], [], path=folder / "stranger.safetensors")
    with caplog.at_level(logging.WARNING, logger="turbospark.model"):
        after = await one_turn(ScriptedBackend(script="ok", prompt_cache_dir=tmp_path), "Read main.py.")
    assert after["prompt_tokens_details"]["cached_tokens"] > 0  # the good file still counts
    ignored = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(ignored) == 2
    assert any("unreadable" in m for m in ignored) and any("another model" in m for m in ignored)


def test_the_folder_is_bounded_in_bytes_oldest_first(tmp_path: Path) -> None:
    files = PromptFiles.for_model(tmp_path, "fp_x", "tok", max_bytes=1 << 20)
    one = files.save([1] * 10, [])
    files.max_bytes = 2 * one + one // 2  # room for two
    for n in range(2, 6):
        files.save([n] * 10, [])
    kept = [tokens for tokens, _, _ in files.restore(10, 1 << 30)]
    assert kept == [[4] * 10, [5] * 10]  # the two written last, oldest first


async def test_slots_list_save_erase_and_restore(start_server, client, tmp_path: Path) -> None:
    server = await start_server(backends=[ScriptedBackend(script="ok", prompt_cache_dir=tmp_path)])
    body = {"model": "scripted", "max_tokens": 4, "messages": [*AGENT, {"role": "user", "content": "List the files."}]}
    first = (await client.post(f"{server.url}/v1/chat/completions", json=body)).json()["usage"]

    listed = (await client.get(f"{server.url}/slots")).json()
    assert [s["id"] for s in listed] == [0, 1, 2, 3]
    assert listed[0]["n_tokens"] == first["total_tokens"] and "careful coding agent" in listed[0]["prompt"]
    assert all(s["n_tokens"] == 0 and not s["is_processing"] and s["kv_bytes"] == 0 for s in listed[1:])

    saved = (await client.post(f"{server.url}/slots/0?action=save", json={"filename": "agent.bin"})).json()
    assert saved["id_slot"] == 0 and saved["filename"] == "agent.bin" and saved["n_saved"] == first["total_tokens"]
    assert saved["n_written"] == (tmp_path / "slots" / "agent.bin.safetensors").stat().st_size and "save_ms" in saved["timings"]
    erased = (await client.post(f"{server.url}/slots/0?action=erase")).json()
    assert erased == {"id_slot": 0, "n_erased": first["total_tokens"]}
    assert (await client.get(f"{server.url}/slots")).json()[0]["n_tokens"] == 0

    restored = (await client.post(f"{server.url}/slots/0?action=restore", json={"filename": "agent.bin"})).json()
    assert restored["n_restored"] == first["total_tokens"] and restored["n_read"] == saved["n_written"]
    again = (await client.post(f"{server.url}/v1/chat/completions", json=body)).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1


async def test_bad_slot_commands_are_llama_cpp_errors(start_server, client, tmp_path: Path) -> None:
    server = await start_server(backends=[ScriptedBackend(script="ok", prompt_cache_dir=tmp_path)])
    cases = [
        ("/slots/99?action=erase", None, 400, "Invalid slot ID"),
        ("/slots/x?action=erase", None, 400, "Invalid slot ID"),
        ("/slots/0?action=dance", None, 400, "Invalid action"),
        ("/slots/0?action=save", {"filename": "../escape.bin"}, 400, "Invalid filename"),
        ("/slots/0?action=save", {"filename": "empty.bin"}, 400, "holds no tokens"),
        ("/slots/0?action=restore", {"filename": "missing.bin"}, 400, "no such file"),
    ]
    for path, body, status, says in cases:
        r = await client.post(f"{server.url}{path}", json=body)
        assert r.status_code == status, (path, r.text)
        error = r.json()["error"]
        assert error["code"] == status and error["type"] == "invalid_request_error" and says in error["message"]
    assert not (tmp_path / "escape.bin").exists()
    # a file another model wrote is refused, and the slot stays as it was
    (tmp_path / "slots").mkdir()
    PromptFiles(tmp_path / "x", "fp_000000000000", 1 << 20).save([1, 2], [], path=tmp_path / "slots" / "other.bin.safetensors")
    r = await client.post(f"{server.url}/slots/0?action=restore", json={"filename": "other.bin"})
    assert r.status_code == 400 and "another model" in r.json()["error"]["message"]
    assert (await client.get(f"{server.url}/slots")).json()[0]["n_tokens"] == 0


async def test_save_and_restore_need_the_prompt_cache_dir(start_server, client) -> None:
    server = await start_server(backends=[ScriptedBackend(script="ok")])
    r = await client.post(f"{server.url}/slots/0?action=save", json={"filename": "a.bin"})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert "--prompt-cache-dir" in r.json()["error"]["message"]
    erased = await client.post(f"{server.url}/slots/1?action=erase")
    assert erased.json() == {"id_slot": 1, "n_erased": 0}
