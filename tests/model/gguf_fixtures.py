"""llama.cpp's own tokenizer fixtures, fetched once from the llama-cpp-python sdist on PyPI.

llama.cpp ships ``models/ggml-vocab-*.gguf`` (vocabulary-only GGUFs of real models) with
``.inp``/``.out`` files: texts and the token ids llama.cpp must produce for them
(``tests/test-tokenizer-0.cpp``: ``add_special=false``, ``parse_special=false``). The sdist of
``llama-cpp-python`` (pinned below, with its sha256) carries them in ``vendor/llama.cpp``. They are
several MB, so they are not committed: :func:`llama_cpp_sources` downloads the sdist with pip into
``tests/.cache`` (gitignored; ``$TURBOSPARK_TEST_HOME`` instead when set) and extracts only the
vocabulary fixtures and ``src/llama-vocab.cpp`` (its chat templates and its converter likewise). A test that needs them skips, saying why, when
they are not cached and PyPI cannot be reached.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

__all__ = [
    "LLAMA_CPP_PYTHON", "SDIST_SHA256", "fixture_cases", "llama_cpp_converter", "llama_cpp_sources",
    "llama_cpp_templates", "sdist_path",
]

LLAMA_CPP_PYTHON = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_SEPARATOR = "\n__ggml_vocab_test__\n"


def _cache() -> Path:
    home = os.environ.get("TURBOSPARK_TEST_HOME")
    return (Path(home) if home else Path(__file__).parents[1] / ".cache") / "llama-cpp"


def sdist_path(*, download: bool = True) -> Path | None:
    """The pinned llama-cpp-python sdist, downloaded with pip when missing (None if it cannot be)."""
    target = _cache() / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not target.exists() and download:
        target.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        command += [f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "--dest", str(target.parent)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        if result.returncode != 0 or not target.exists():
            return None
    if not target.exists():
        return None
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        target.unlink()
        raise AssertionError(f"{target.name} has sha256 {digest}, not the pinned {SDIST_SHA256}")
    return target


def _extracted(root: Path, what: str, wanted: Callable[[str], bool], flat: bool = False) -> Path:
    """``root``, holding the sdist's ``vendor/llama.cpp`` files whose paths ``wanted`` accepts
    (``flat``: by their names alone), extracted once; skips the calling test when the sdist is not
    cached and cannot be downloaded."""
    if root.is_dir():
        return root
    sdist = sdist_path()
    if sdist is None:
        pytest.skip(f"llama.cpp's {what} are not cached and llama-cpp-python {LLAMA_CPP_PYTHON} "
                    "could not be downloaded from PyPI")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    scratch = root.with_name(root.name + f".tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        for member in archive:
            name = member.name.removeprefix(prefix)
            if member.isfile() and member.name.startswith(prefix) and wanted(name):
                target = scratch / (Path(name).name if flat else name)
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.extractfile(member) as src, target.open("wb") as dst:  # type: ignore[union-attr]
                    shutil.copyfileobj(src, dst)
    shutil.rmtree(root, ignore_errors=True)
    scratch.rename(root)
    return root


@functools.cache
def llama_cpp_sources() -> Path:
    """A directory holding llama.cpp's ``models/ggml-vocab-*`` and ``src/llama-vocab.cpp``."""
    return _extracted(_cache() / f"llama.cpp-{LLAMA_CPP_PYTHON}", "tokenizer fixtures",
                      lambda name: name.startswith("models/ggml-vocab-") or name == "src/llama-vocab.cpp")


@functools.cache
def llama_cpp_templates() -> Path:
    """A directory holding llama.cpp's ``models/templates/*.jinja``: the real chat templates of
    many model families, as their tokenizer configs ship them."""
    return _extracted(_cache() / f"templates-{LLAMA_CPP_PYTHON}", "chat templates",
                      lambda name: name.startswith("models/templates/") and name.endswith(".jinja"), flat=True)


@functools.cache
def llama_cpp_converter() -> Path:
    """A directory holding llama.cpp's ``convert_hf_to_gguf.py`` with its ``conversion/`` and
    ``gguf-py/``: what writes the GGUFs and projector files users download."""
    return _extracted(_cache() / f"converter-{LLAMA_CPP_PYTHON}", "converter sources",
                      lambda name: name == "convert_hf_to_gguf.py" or name.startswith(("conversion/", "gguf-py/")))


def fixture_cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs of ``vocab``'s ``.inp``/``.out`` files, read as llama.cpp's test reads them."""
    raw = vocab.with_name(vocab.name + ".inp").read_bytes().decode("utf-8")
    texts, pos = [], 0
    while pos < len(raw):
        end = raw.find(_SEPARATOR, pos)
        if end < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:end])
        pos = end + len(_SEPARATOR)
    lines = vocab.with_name(vocab.name + ".out").read_bytes().decode("utf-8").split("\n")
    if len(lines) < len(texts):
        raise AssertionError(f"{vocab.name}: {len(texts)} texts but {len(lines)} id lines")
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines, strict=False)]
