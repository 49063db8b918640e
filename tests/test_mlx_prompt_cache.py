"""SmolLM2's prefix cache survives a restart with --prompt-cache-dir, and reusing it does not
change the greedy answer."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from turbospark.config import Settings
from turbospark.model.backend import BackendSpec
from turbospark.server import serve

from .realmodels import smollm2_store

pytestmark = pytest.mark.mlx

SYSTEM = "You are a helpful assistant for a small shop. Be brief and polite. " * 12
QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]


async def one_turn(cache_dir: Path) -> dict:
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()

    def make() -> MlxBackend:
        return MlxBackend(stored.path, model_id=stored.name, prefill_chunk=64, prompt_cache_dir=cache_dir)

    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve, settings, [BackendSpec(stored.name, make)]))
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"messages": QUESTION, "max_tokens": 10, "temperature": 0}
            r = await client.post(f"{server.url}/v1/chat/completions", json=body)
        server.stop.set()
    assert r.status_code == 200, r.text
    return r.json()


async def test_the_first_turn_after_a_restart_reads_its_prefix_from_disk(tmp_path: Path) -> None:
    before = await one_turn(tmp_path)
    assert before["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(list(tmp_path.glob("*/*.safetensors"))) == 1

    after = await one_turn(tmp_path)
    usage = after["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]


def _kv(tokens: int) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    layer = KVCache()
    layer.update_and_fetch(mx.ones((1, 2, tokens, 4)), mx.ones((1, 2, tokens, 4)))
    return [layer]


def test_an_evicted_entry_is_written_and_read_back_on_load(tmp_path: Path) -> None:
    from turbospark.model.prefix_cache import PrefixCache
    from turbospark.model.prompt_files import PromptFiles

    files = PromptFiles.for_model(tmp_path, "fp_model", "tok", 1 << 30)
    cache = PrefixCache(max_entries=2, files=files)
    for n in range(3):
        cache.put([n] * 5, _kv(5))
    assert len(list(files.folder.glob("*.safetensors"))) == 1  # the first, pushed out
    cache.persist()
    assert len(list(files.folder.glob("*.safetensors"))) == 3

    again = PrefixCache(max_entries=2, files=files)
    again.restore()
    assert [e.tokens for e in again.entries] == [[1] * 5, [2] * 5]  # the newest it holds, oldest first
    kv, reused = again.take([2] * 5 + [7])
    assert reused == 5 and kv[0].offset == 5
