"""SHA-256 of what the store reads: files, streams out of wheels, whole directories.

Every digest is taken while the bytes stream past (copied on the way when asked), with its
:class:`~turbospark.store.progress.Progress` told how far it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO

from .progress import Progress

__all__ = ["copy_and_hash", "files_digest", "hash_files", "opened"]

_CHUNK = 8 << 20


def copy_and_hash(
    sources: Iterable[IO[bytes]], *, total: int | None, out: IO[bytes] | None = None, progress: Progress, desc: str
) -> str:
    """Stream ``sources`` one after the other (into ``out`` if given) and return the sha256 of the bytes.

    ``progress`` hears ``desc`` with the byte counts as they go (``total`` is the expected count).
    """
    digest = hashlib.sha256()
    done = 0
    progress(desc, done, total)
    with progress.bytes_bar(total=total, desc=desc) as bar:
        for source in sources:
            while block := source.read(_CHUNK):
                digest.update(block)
                if out is not None:
                    out.write(block)
                bar.update(len(block))
                done += len(block)
                progress(desc, done, total)
    return digest.hexdigest()


def opened(paths: Sequence[Path]) -> Iterator[IO[bytes]]:
    """Each file open for reading in turn, closed before the next is opened."""
    for path in paths:
        with path.open("rb") as f:
            yield f


def hash_files(paths: Sequence[Path], *, progress: Progress, desc: str = "hashing") -> str:
    """The sha256 of the files' bytes, one after the other (a file split in parts: its whole)."""
    return copy_and_hash(opened(paths), total=sum(p.stat().st_size for p in paths), progress=progress, desc=desc)


def files_digest(files: Iterable[Path], *, progress: Progress) -> str:
    """A directory's digest: the sha256 of each file's name and content digest, one line each.

    The caller chooses the files and their order (both change the digest).
    """
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{hash_files([f], progress=progress, desc=f.name)}\n".encode())
    return digest.hexdigest()
