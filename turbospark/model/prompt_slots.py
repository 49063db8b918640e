"""llama.cpp's slots over the prefix cache: ``GET /slots`` and ``POST /slots/{id}?action=``
``save``, ``restore`` or ``erase`` (decision 0022).

A slot is a place in the model's prefix cache, numbered from 0 (least recently used) to the
cache's size less one; an empty place is an idle slot holding no tokens.  Running sequences are
not slots: their KV joins the cache when they end.  ``save`` writes a slot's entry to
``<--prompt-cache-dir>/slots/<filename>.safetensors`` (an mlx-lm prompt-cache file, with the
model's fingerprint), ``restore`` reads such a file into the slot (replacing what it held; a file of
another model is refused), ``erase`` empties it.  Answers are in llama.cpp's shapes.  Runs on the
model thread (``Slots.run``), which owns the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from .prompt_files import PromptFiles

__all__ = ["SlotError", "Slots", "slots_of", "valid_filename"]


class SlotError(Exception):
    """A slot command that cannot be done: ``status`` and llama.cpp's error ``type``."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def valid_filename(name: str) -> bool:
    """llama.cpp's rule, in short: a plain file name, no folders, no hidden or special names."""
    return (
        0 < len(name.encode()) <= 255 and "/" not in name and "\\" not in name and "\0" not in name
        and not name.startswith(".") and name.strip() == name
    )


@attrs.define
class Slots:
    """The slot view of one model's prefix cache.

    ``entries()`` is the cache's (tokens, KV) from least to most recent; ``place(i, tokens,
    kv)`` puts an entry at ``i`` (replacing one there, or after the last); ``erase(i)`` drops
    one.  ``files`` is the model's prompt files (None without ``--prompt-cache-dir``)."""

    count: int
    n_ctx: int
    model: str
    entries: Callable[[], list[tuple[list[int], list[Any]]]]
    place: Callable[[int, list[int], list[Any]], None]
    erase: Callable[[int], None]
    decode: Callable[[list[int]], str]
    files: PromptFiles | None = None

    def run(self, action: str, slot: int | None, filename: str | None) -> Any:
        if action == "list":
            return self._list()
        if slot is None or not 0 <= slot < self.count:
            raise SlotError(400, "invalid_request_error", "Invalid slot ID")
        if action == "erase":
            held = self.entries()
            n = len(held[slot][0]) if slot < len(held) else 0
            if slot < len(held):
                self.erase(slot)
            return {"id_slot": slot, "n_erased": n}
        if action not in ("save", "restore"):
            raise SlotError(400, "invalid_request_error", "Invalid action")
        if self.files is None:
            raise SlotError(501, "not_supported_error",
                            "This server does not support slots action. Start it with `--prompt-cache-dir`")  # fmt: skip
        if not filename or not valid_filename(filename):
            raise SlotError(400, "invalid_request_error", "Invalid filename")
        # mlx reads safetensors by their suffix: a name without it gets it on disk
        path = self.files.folder.parent / "slots" / (filename if filename.endswith(".safetensors") else f"{filename}.safetensors")
        start = time.perf_counter()
        if action == "save":
            held = self.entries()
            if slot >= len(held):
                raise SlotError(400, "invalid_request_error", f"Unable to save slot: slot {slot} holds no tokens")
            tokens, kv = held[slot]
            size = self.files.save(tokens, kv, path=path, bound=False)
            return {"id_slot": slot, "filename": filename, "n_saved": len(tokens), "n_written": size,
                    "timings": {"save_ms": (time.perf_counter() - start) * 1e3}}  # fmt: skip
        if not path.is_file():
            raise SlotError(400, "invalid_request_error", "Unable to restore slot: no such file")
        try:
            tokens, kv = self.files.load(path)
        except ValueError as exc:
            raise SlotError(400, "invalid_request_error", f"Unable to restore slot: {exc}") from None
        if len(tokens) > self.n_ctx:
            raise SlotError(400, "invalid_request_error", "Unable to restore slot: Restored prompt does not fit in the slot context")
        self.place(slot, tokens, kv)
        return {"id_slot": slot, "filename": filename, "n_restored": len(tokens), "n_read": path.stat().st_size,
                "timings": {"restore_ms": (time.perf_counter() - start) * 1e3}}  # fmt: skip

    def _list(self) -> list[dict[str, Any]]:
        held = self.entries()
        out = []
        for i in range(self.count):
            tokens, kv = held[i] if i < len(held) else ([], [])
            out.append({
                "id": i, "id_task": -1, "n_ctx": self.n_ctx, "speculative": False, "is_processing": False,
                "model": self.model, "n_tokens": len(tokens), "prompt": self.decode(tokens) if tokens else "",
                "kv_bytes": sum(getattr(c, "nbytes", 0) for c in kv),  # as the cache holds them (float16, q8_0 ...)
            })
        return out


def slots_of(cache: Any, n_ctx: int, model: str, decode: Callable[[list[int]], str]) -> Slots:
    """The slot view of a ``PrefixCache``.  An image's tokens (marked by its hash, below 0:
    ``mlx_vision``) are not text: the listing leaves them out."""
    return Slots(
        cache.max_entries, n_ctx, model, entries=lambda: [(e.tokens, e.cache) for e in cache.entries],
        place=cache.place, erase=cache.entries.pop, decode=lambda ids: decode([i for i in ids if i >= 0]),
        files=cache.files,
    )
