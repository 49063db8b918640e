"""What a model directory records about itself: ``manifest.json``, and the sampling defaults
(``generation_config.json``) the catalogue knows for a GGUF.

The manifest says ``name``, ``kind`` (``generation``, ``embedding``, ``speech-to-text`` or
``text-to-speech``; absent in older manifests: generation), ``source``, ``source_sha256``,
``format``, ``architecture``, ``dtype``, ``context_length``, ``created`` and
``turbospark_version``.  Every importer (GGUF, Hugging Face, encoder, audio) writes it through
:func:`new_manifest`.  Some sources add a key: ``quantization`` (a Hugging Face or
``mlx-community`` directory kept quantized, ``dtype: native``: its ``config.json`` block) and
``ollama`` (a model from Ollama's store: its Ollama ``name``, ``manifest_digest`` (also the
``source_sha256``), ``model_digest``, the ``template``, ``system`` and ``params`` it came with,
and what of them was ``honoured`` and ``not_honoured``, in words).
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from pathlib import Path
from typing import Any

from .. import __version__
from .catalogue import generation_config_for

__all__ = [
    "GENERATION_CONFIG",
    "MANIFEST",
    "add_generation_config",
    "new_manifest",
    "read_manifest",
    "write_manifest",
]

MANIFEST = "manifest.json"
GENERATION_CONFIG = "generation_config.json"


def new_manifest(
    *,
    name: str,
    source: str,
    sha256: str,
    fmt: str,
    architecture: str,
    dtype: str,
    context_length: int | None,
    kind: str = "generation",
) -> dict[str, Any]:
    """The manifest of a model built now from ``source`` (whose bytes have digest ``sha256``)."""
    return {
        "name": name,
        "kind": kind,
        "source": source,
        "source_sha256": sha256,
        "format": fmt,
        "architecture": architecture,
        "dtype": dtype,
        "context_length": context_length,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "turbospark_version": __version__,
    }


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    """The manifest in ``model_dir``, or None when it has none (or an unreadable one)."""
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def write_manifest(model_dir: Path, manifest: dict[str, Any]) -> None:
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def add_generation_config(model_dir: Path, sha256: object) -> bool:
    """Write the catalogue's ``generation_config.json`` into ``model_dir`` unless it has one already.

    ``sha256`` is the digest of the GGUF the model was built from. Returns whether it wrote one.
    The file is written under another name and renamed into place, so a server reading the
    directory meanwhile sees either no file or the whole of it.
    """
    target = model_dir / GENERATION_CONFIG
    if target.exists():
        return False
    config = generation_config_for(sha256) if isinstance(sha256, str) else None
    if config is None:
        return False
    partial = model_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{GENERATION_CONFIG}"
    try:
        partial.write_text(json.dumps(config, indent=2) + "\n")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return True
