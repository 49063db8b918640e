"""Uploaded files, kept by digest until a create names them (Ollama's ``/api/blobs`` and
``/api/create`` with ``files``): how ``ollama create`` sends a GGUF or a safetensors directory,
and how the web page imports a file from the user's disk.

Blobs live under the store's root in ``.blobs/sha256-<hex>`` (a name no model can have).  An
upload is written to a temporary file beside them, hashed as it arrives, and renamed into place
only when its bytes hash to the digest it was sent under; a short or wrong upload leaves nothing.
:func:`lay_out` turns a create's ``files`` (file name -> digest) into what ``import_source``
reads: the GGUF itself when one GGUF is named, else a directory of hard links by file name.
Everything here is blocking file work: the routes run it on a worker thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from pathlib import Path, PurePosixPath

from .directory import process_alive
from .gguf_errors import ModelImportError

__all__ = ["BlobError", "BlobStore", "BlobUpload", "check_digest", "check_file_name", "lay_out"]

_DIGEST_RE = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")
_UPLOAD_PREFIX = ".upload-"


class BlobError(ModelImportError, ValueError):
    """A digest that is malformed, unknown or not what the bytes hash to; a file name a create
    cannot lay out."""


def check_digest(digest: str) -> str:
    """The hex of ``sha256:<64 hex>`` (Ollama also writes ``sha256-``); a ``BlobError`` else."""
    match = _DIGEST_RE.fullmatch(digest)
    if match is None:
        raise BlobError(f"invalid digest {digest!r}: expected sha256:<64 hex digits>")
    return match[1].lower()


class BlobUpload:
    """One upload in progress: ``write`` its chunks, then ``finish`` (kept under its digest when
    the bytes match, else a ``BlobError``) or ``discard``."""

    def __init__(self, final: Path, expected: str) -> None:
        self.final, self.expected = final, expected
        self.temp = final.with_name(f"{_UPLOAD_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.file = self.temp.open("wb")
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.hash.update(chunk)
        self.file.write(chunk)
        self.size += len(chunk)

    def finish(self) -> int:
        """Keep the blob; its size in bytes."""
        self.file.close()
        if self.hash.hexdigest() != self.expected:
            self.temp.unlink(missing_ok=True)
            raise BlobError(f"digest mismatch: the {self.size} bytes sent hash to sha256:{self.hash.hexdigest()}")
        os.replace(self.temp, self.final)
        return self.size

    def discard(self) -> None:
        self.file.close()
        self.temp.unlink(missing_ok=True)


class BlobStore:
    """The blobs under one model store's root."""

    def __init__(self, store_root: Path) -> None:
        self.root = store_root / ".blobs"

    def path(self, digest: str) -> Path:
        return self.root / f"sha256-{check_digest(digest)}"

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def upload(self, digest: str) -> BlobUpload:
        final = self.path(digest)
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_stale()
        return BlobUpload(final, check_digest(digest))

    def _sweep_stale(self) -> None:
        """Remove the partial uploads of processes that died mid-upload."""
        for entry in self.root.glob(f"{_UPLOAD_PREFIX}*"):
            pid = entry.name.removeprefix(_UPLOAD_PREFIX).split("-", 1)[0]
            if pid.isdigit() and not process_alive(int(pid)):
                entry.unlink(missing_ok=True)

    def remove(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)

    def resolve(self, files: object) -> dict[PurePosixPath, Path]:
        """A create's ``files`` (file name -> digest) as the blobs they name; a ``BlobError`` for
        a name that could leave its directory, a malformed digest, or a blob never uploaded."""
        if not isinstance(files, dict) or not files:
            raise BlobError("files must be an object of file names to blob digests")
        named: dict[PurePosixPath, Path] = {}
        for name, digest in files.items():
            path = check_file_name(name)
            if not isinstance(digest, str):
                raise BlobError(f"files: the digest of {name!r} must be a string")
            blob = named[path] = self.path(digest)
            if not blob.is_file():
                raise BlobError(f"files: {name} names {digest}, which was never uploaded (POST /api/blobs/<digest> first)")
        return named


def check_file_name(name: object) -> PurePosixPath:
    """A create's file name as a relative path; a ``BlobError`` for anything that could leave
    the directory it is laid out in."""
    if not isinstance(name, str) or not name:
        raise BlobError("files: each key must be a file name")
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name or not path.parts:
        raise BlobError(f"files: {name!r} is not a relative file name")
    return path


def is_gguf(path: Path) -> bool:
    """A GGUF by its magic bytes, whatever its name (``FROM ./model.bin``)."""
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def lay_out(blobs: BlobStore, files: object, work: Path) -> Path:
    """What ``import_source`` reads for a create's ``files``: the blob itself when the file is a
    GGUF (by its name or its magic bytes, as Ollama reads ``FROM ./model.bin``), else a directory
    under ``work`` with each blob hard-linked under its name (a Hugging Face or safetensors
    directory, as ``ollama create`` sends one)."""
    named = blobs.resolve(files)
    ggufs = [n for n, blob in named.items() if n.suffix.lower() == ".gguf" or is_gguf(blob)]
    if ggufs:
        if len(named) > 1:
            raise BlobError("files: a GGUF carries its tokenizer and config; send it alone")
        return named[ggufs[0]]
    directory = work / "files"
    for name, blob in named.items():
        target = directory.joinpath(*name.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(blob, target)
        except OSError:
            shutil.copy2(blob, target)
    return directory
