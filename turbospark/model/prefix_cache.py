"""The MLX backend's prefix cache: KV caches of recent sequences, reused by later prompts.

A finished or cancelled sequence hands its KV back (``put``); a new one starts from the longest
cached prefix of its prompt (``take``) and prefills only the rest.  Bounded in entries and bytes,
most recent last.  Lives on the model thread, like every KV cache.  With ``files``
(``--prompt-cache-dir``), an entry that leaves the cache is written to disk, so are all of them at
``persist`` (unload, shutdown), and ``restore`` reads the newest back when the model loads.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import attrs
from mlx_lm.models.cache import trim_prompt_cache

from .backend import common_prefix
from .prompt_files import PromptFiles

__all__ = ["PrefixCache", "trimmable"]

log = logging.getLogger("turbospark.model")


@attrs.define
class _Entry:
    tokens: list[int]
    cache: list[Any]
    path: Path | None = None  # its file on disk, when it has one

    @property
    def nbytes(self) -> int:
        return sum(getattr(c, "nbytes", 0) for c in self.cache)


def trimmable(cache: list[Any]) -> bool:
    """Whether every layer's cache can drop its last tokens (not a rotating window past its
    size, nor a hybrid model's array state)."""
    return all(getattr(c, "is_trimmable", lambda: False)() for c in cache)


@attrs.define
class PrefixCache:
    """KV caches of recent sequences, most recent last, bounded in entries and bytes.

    An entry's ``tokens`` are exactly what its cache holds.  Caches that cannot be trimmed (a
    rotating window, the array state of hybrid and state-space models, anything without an
    ``offset``) are reused only where no trim is needed: when the whole entry is a prefix of the
    new prompt.
    """

    max_entries: int = 4
    max_bytes: int = 1 << 30
    entries: list[_Entry] = attrs.field(factory=list)
    files: PromptFiles | None = None

    def take(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        """A KV cache holding the longest cached prefix of ``prompt`` (at most all but its last
        token, which must be fed to get the first logits), and that prefix's length;
        ``(None, 0)`` when nothing useful is cached.

        An entry that is wholly a prefix of the prompt (the same conversation, one turn on) is
        handed over and comes back, grown, through ``put``; an entry that only shares a prefix
        (another conversation with the same system prompt) is copied, so it stays whole for its
        own next turn.
        """
        best, best_len = self._longest(prompt)
        reuse = min(best_len, len(prompt) - 1)
        if best is None or reuse <= 0:
            return None, 0
        trim = len(best.tokens) - reuse
        if trim and not trimmable(best.cache):
            return None, 0
        if best_len == len(best.tokens):
            self.entries.remove(best)
            cache = best.cache
        else:
            cache = copy.deepcopy(best.cache)
        if trim and trim_prompt_cache(cache, trim) != trim:
            return None, 0
        return cache, reuse

    def peek(self, prompt: list[int]) -> int:
        """What ``take`` would reuse, without taking it."""
        best, best_len = self._longest(prompt)
        reuse = min(best_len, len(prompt) - 1)
        if best is None or reuse <= 0 or (len(best.tokens) > reuse and not trimmable(best.cache)):
            return 0
        return reuse

    def put(self, tokens: list[int], cache: list[Any]) -> None:
        if not tokens or not cache:
            return
        # An entry this one extends (or repeats) says nothing more: drop it, so a repeated prompt
        # does not fill the cache with copies and push other conversations out.
        self.entries = [e for e in self.entries if e.tokens != tokens[: len(e.tokens)]]
        self.entries.append(_Entry(list(tokens), cache))
        while self.entries and (
            len(self.entries) > self.max_entries
            or sum(e.nbytes for e in self.entries) > self.max_bytes
        ):
            self._write(self.entries.pop(0))

    def place(self, index: int, tokens: list[int], cache: list[Any]) -> None:
        """Put an entry at ``index`` (a slot restored), replacing the one there."""
        entry = _Entry(list(tokens), cache)
        if index < len(self.entries):
            self.entries[index] = entry
        else:
            self.entries.append(entry)

    def restore(self) -> int:
        """Read the newest entries on disk back in (at load); how many."""
        if self.files is None:
            return 0
        for tokens, cache, path in self.files.restore(self.max_entries, self.max_bytes):
            self.entries.append(_Entry(tokens, cache, path))
        return len(self.entries)

    def persist(self) -> None:
        """Write every entry not on disk yet (at unload and shutdown)."""
        for entry in self.entries:
            self._write(entry)

    def _write(self, entry: _Entry) -> None:
        if self.files is None or entry.path is not None:
            return
        try:
            self.files.save(entry.tokens, entry.cache)
            entry.path = self.files.path(entry.tokens)
        except Exception as exc:  # a full disk or an unwritable folder costs the entry only
            log.warning("prompt cache: cannot write %d tokens to %s: %s", len(entry.tokens), self.files.folder, exc)

    def _longest(self, prompt: list[int]) -> tuple[_Entry | None, int]:
        best, best_len = None, 0
        for entry in self.entries:
            n = common_prefix(entry.tokens, prompt)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len
