"""The prefix cache on disk (``--prompt-cache-dir``): entries that outlive the process.

One folder per model fingerprint (its weights and engine, see ``backend.fingerprint``, and its
tokenizer's files), one mlx-lm prompt-cache file (``save_prompt_cache``, safetensors) per entry,
named by a digest of the tokens it holds; its metadata records the fingerprint and the tokens.
Written when an entry leaves the prefix cache and at unload or shutdown, bounded in bytes (the
least recently written files go first), read back when the model loads.  A file that cannot be
read, or whose fingerprint or token count disagrees with its cache, is ignored with a log line.
Runs on the model thread, like the cache it serves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from .backend import fingerprint

__all__ = ["PromptFiles", "tokenizer_digest"]

log = logging.getLogger("turbospark.model")

SUFFIX = ".safetensors"


def tokenizer_digest(directory: Path) -> str:
    """A digest of a model directory's tokenizer files (what turns text into the ids a cache
    is keyed by)."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt"):
        file = directory / name
        if file.exists():
            h.update(name.encode() + b"\0" + file.read_bytes())
    return h.hexdigest()[:16]


def _tokens_name(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:24] + SUFFIX


def _held(cache: list[Any]) -> int | None:
    """How many tokens a KV cache holds, where its layers say (``offset``)."""
    offsets = {getattr(c, "offset", None) for c in cache}
    offsets.discard(None)
    return offsets.pop() if len(offsets) == 1 else None


@attrs.define
class PromptFiles:
    """One model's folder of persisted prefix-cache entries."""

    folder: Path
    key: str  # the model's fingerprint and tokenizer digest
    max_bytes: int

    @classmethod
    def for_model(cls, root: Path, model_fingerprint: str, tokenizer: str, max_bytes: int) -> PromptFiles:
        key = fingerprint(model_fingerprint, tokenizer)
        return cls(Path(root) / key, key, max_bytes)

    def path(self, tokens: list[int]) -> Path:
        return self.folder / _tokens_name(tokens)

    def save(self, tokens: list[int], cache: list[Any], *, path: Path | None = None, bound: bool = True) -> int:
        """Write one entry (atomically: a temporary file renamed into place); its bytes.  Then
        (``bound``) the folder is trimmed to ``max_bytes``, least recently written first."""
        from mlx_lm.models.cache import save_prompt_cache

        target = path or self.path(tokens)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}{SUFFIX}")  # mlx adds the suffix else
        metadata = {"fingerprint": self.key, "tokens": json.dumps(tokens)}
        try:
            save_prompt_cache(str(tmp), cache, metadata)
            now = time.time_ns()  # finer than the file system's clock: the order of writes
            os.utime(tmp, ns=(now, now))
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        size = target.stat().st_size
        if bound:
            self._bound(keep=target)
        return size

    def load(self, path: Path) -> tuple[list[int], list[Any]]:
        """One file's tokens and cache; ``ValueError`` when it is not a cache of this model."""
        from mlx_lm.models.cache import load_prompt_cache

        try:
            cache, metadata = load_prompt_cache(str(path), return_metadata=True)
        except Exception as exc:  # safetensors, mlx and mlx-lm each raise their own
            raise ValueError(f"unreadable ({exc})") from exc
        if metadata.get("fingerprint") != self.key:
            raise ValueError("written for another model, tokenizer or engine version")
        try:
            tokens = json.loads(metadata["tokens"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError("its token list is missing or malformed") from exc
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens) or not tokens:
            raise ValueError("its token list is malformed")
        held = _held(cache)
        if cache and held != len(tokens):
            raise ValueError(f"its cache holds {held} tokens, its list {len(tokens)}")
        return tokens, cache

    def restore(self, max_entries: int, max_bytes: int) -> list[tuple[list[int], list[Any], Path]]:
        """The most recently written entries that fit ``max_entries`` and ``max_bytes``, oldest
        first (the order the prefix cache keeps); files that fail are logged and skipped."""
        found: list[tuple[list[int], list[Any], Path]] = []
        total = 0
        for file in self._files(newest_first=True):
            if len(found) >= max_entries:
                break
            try:
                tokens, cache = self.load(file)
            except ValueError as exc:
                log.warning("prompt cache: ignoring %s: %s", file, exc)
                continue
            size = sum(getattr(c, "nbytes", 0) for c in cache)
            if total + size > max_bytes:
                continue
            total += size
            found.append((tokens, cache, file))
        return found[::-1]

    def listing(self) -> Iterable[Path]:
        return self._files(newest_first=True)

    def _files(self, *, newest_first: bool) -> list[Path]:
        if not self.folder.is_dir():
            return []
        files = []
        for f in self.folder.glob(f"*{SUFFIX}"):
            if f.name.startswith(".tmp-"):
                continue
            try:
                files.append((f.stat().st_mtime_ns, f))
            except FileNotFoundError:
                continue
        return [f for _, f in sorted(files, reverse=newest_first)]

    def _bound(self, keep: Path) -> None:
        files = self._files(newest_first=False)
        sizes = {f: f.stat().st_size for f in files}
        total = sum(sizes.values())
        for f in files:
            if total <= self.max_bytes:
                break
            if f == keep:
                continue
            f.unlink(missing_ok=True)
            total -= sizes[f]
        if total > self.max_bytes:  # this entry alone is over the bound
            keep.unlink(missing_ok=True)
