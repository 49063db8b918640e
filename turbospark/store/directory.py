"""The store's root directory: one directory per model, looked up, listed, copied and removed by
name, and a finished model moved into place atomically.

Models are built in a ``.tmp-<pid>-*`` scratch directory under the root (so on the same
filesystem) and renamed into place at the end: an interrupted import never leaves a half-made
model, and the scratch directories of dead processes are swept by the next import.  Replacing a
model renames the old one aside before the new one takes its name, so a reader sees one or the
other, whole.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from .gguf_import import ModelImportError
from .manifest import read_manifest, write_manifest

__all__ = ["StoreDirectory", "StoredModel", "check_name"]

#: A name, and optionally Ollama's ``:tag`` (``qwen3:0.6b``); ``name:latest`` is stored as ``name``.
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}(?::[a-z0-9_][a-z0-9._-]{0,127})?")
_TMP_PREFIX = ".tmp-"


@attrs.frozen
class StoredModel:
    """A model in the store. ``path`` is the directory to hand to ``model.mlx_ggml.load_model``."""

    name: str
    path: Path
    manifest: dict[str, Any] = attrs.field(hash=False)

    @property
    def kind(self) -> str:
        """``generation`` (chat and completion), ``embedding``, ``speech-to-text`` or ``text-to-speech``."""
        return str(self.manifest.get("kind", "generation"))

    def disk_size(self) -> int:
        """Bytes used by the model's files (an image pipeline's component folders included)."""
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())


def check_name(name: str) -> str:
    """``name``, if it may name a stored model; else :class:`ModelImportError` says why not."""
    if not _NAME_RE.fullmatch(name):
        raise ModelImportError(
            f"invalid model name {name!r}: use 1-128 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, optionally followed by ':' and a tag"
        )
    if name.endswith(":latest"):
        raise ModelImportError(f"invalid model name {name!r}: name it {name.removesuffix(':latest')!r} (':latest' is implied)")
    if name.startswith("claude-turbospark-"):
        raise ModelImportError(f"invalid model name {name!r}: claude-turbospark-<id> names are the models' aliases")
    return name


class StoreDirectory:
    """The models under one root directory, by name."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    # -- reading ----------------------------------------------------------------------------------------

    def get(self, name: str) -> StoredModel | None:
        """The model called ``name``, or None if there is none (or the name is not a valid one)."""
        if not _NAME_RE.fullmatch(name):
            return None
        path = self.root / name
        manifest = read_manifest(path)
        if manifest is None:
            return None
        return StoredModel(name=name, path=path, manifest=manifest)

    def list(self) -> list[StoredModel]:
        """All stored models, sorted by name."""
        if not self.root.is_dir():
            return []
        models = (self.get(entry.name) for entry in sorted(self.root.iterdir()) if entry.is_dir())
        return [m for m in models if m is not None]

    def matching(self, name: str, *, sha256: str, dtype: str) -> StoredModel | None:
        """The model ``name`` if it was imported from bytes with this ``sha256`` in this ``dtype``."""
        existing = self.get(name)
        if existing and existing.manifest.get("source_sha256") == sha256 and existing.manifest.get("dtype") == dtype:
            return existing
        return None

    # -- changing ---------------------------------------------------------------------------------------

    def remove(self, name: str) -> bool:
        """Delete the model called ``name``; False if there was none."""
        model = self.get(name)
        if model is None:
            return False
        doomed = self._temp_path()
        model.path.rename(doomed)  # atomic: the name is gone before the files are
        shutil.rmtree(doomed)
        return True

    def copy(self, source: str, destination: str) -> StoredModel | None:
        """Copy the model ``source`` under the name ``destination`` (replacing a model of that
        name); None if there is no ``source``."""
        model = self.get(source)
        if model is None:
            return None
        check_name(destination)
        temp = self._temp_path()
        shutil.copytree(model.path, temp)
        manifest = dict(model.manifest, name=destination)
        write_manifest(temp, manifest)
        target = self.root / destination
        if target.exists():
            doomed = self._temp_path()
            target.rename(doomed)
            shutil.rmtree(doomed)
        temp.rename(target)
        return StoredModel(destination, target, manifest)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Path]:
        """A temporary directory under the root, removed on exit.

        It is on the store's filesystem, so a model built in it can be renamed into place atomically.
        If the process dies first, the next import removes it.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_stale()
        path = self._temp_path()
        path.mkdir()
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def install(
        self,
        model_dir: Path,
        manifest: dict[str, Any],
        *,
        extra_files: Sequence[Path] = (),
        check: Callable[[Path], None] | None = None,
    ) -> StoredModel:
        """Move the model built in ``model_dir`` (under :meth:`scratch`) into place under its name.

        ``extra_files`` (licence texts, a source's own sampling defaults) are copied in first, then
        ``check(model_dir)`` runs (it raises if the model is unusable, and may add what the runtime
        reads), then the manifest is written and the directory renamed into place, replacing any
        previous model of that name.
        """
        for extra in extra_files:
            shutil.copy2(extra, model_dir / extra.name)
        if check is not None:
            check(model_dir)
        write_manifest(model_dir, manifest)
        target = self.root / manifest["name"]
        if target.exists():
            previous = self._temp_path()
            target.rename(previous)
            model_dir.rename(target)
            shutil.rmtree(previous)
        else:
            model_dir.rename(target)
        return StoredModel(name=manifest["name"], path=target, manifest=manifest)

    # -- internals --------------------------------------------------------------------------------------

    def _temp_path(self) -> Path:
        return self.root / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def _sweep_stale(self) -> None:
        """Remove temporary directories left by imports whose process died."""
        for entry in self.root.glob(f"{_TMP_PREFIX}*"):
            pid = entry.name.removeprefix(_TMP_PREFIX).split("-", 1)[0]
            if pid.isdigit() and not process_alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a scratch directory's or an upload's owner)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
