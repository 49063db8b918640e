"""A layer's KV cache while newcomers join the decode batch: merged a few layers a step.

mlx-lm's batch cache (``BatchKVCache``) is one rectangle a layer: every row right-aligned at the
same column.  A sequence that joins the batch is merged in by building a larger rectangle, which
copies every row's KV of every layer in one step (at 8 SmolLM2 streams and a 351-token newcomer,
~200 MB and 3-5x the streams' usual gap between tokens).  ``JoiningKVCache`` holds one layer's
parts side by side instead (the batch's rectangle, then each newcomer's), and ``merge_some``
merges a few layers a step (``MERGE_BYTES`` of KV at least one layer), so the copy is spread
over the steps that follow the join.  Only ``mlx_fused.forward`` reads a joining layer: it runs
attention part by part.

The parts' geometry (columns, left padding) is what masks are made from.  Merging takes all of a
layer's parts at once, and a merged rectangle's geometry does not depend on the step it was
merged at, so every layer with the same number of parts has the same geometry part by part:
masks are made once per step and part count.  Filtering (a sequence leaving) merges the layer
first; extracting one row (the prefix cache's copy) reads its part alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

__all__ = ["MERGE_BYTES", "JoiningKVCache", "join", "joining", "merge", "merge_some", "settle"]

#: KV bytes merged a step, at least one layer: two or three SmolLM2 layers at 8 streams, ~10 ms
#: of copying on a 2-core CPU (decision 0025), against ~1 ms a step for each layer left apart.
MERGE_BYTES = 8 << 20


def _rows(cache: BatchKVCache) -> int:
    return int(cache.offset.shape[0])


def merge(parts: list[BatchKVCache]) -> BatchKVCache:
    """One rectangle holding ``parts``' rows in order, right-aligned at the longest's column."""
    if len(parts) == 1:
        return parts[0]
    top = max(p._idx for p in parts)
    filled = [p for p in parts if p.keys is not None]
    out = BatchKVCache([0] * sum(_rows(p) for p in parts))
    lefts = [p.left_padding + (top - p._idx) for p in parts]
    out.left_padding = mx.concatenate(lefts)
    out.offset = mx.concatenate([p.offset for p in parts])
    out._idx = top
    if filled:
        _, heads, _, k_dim = filled[0].keys.shape
        v_dim = filled[0].values.shape[3]
        width = (top // BatchKVCache.step + 1) * BatchKVCache.step  # room for the next steps
        keys = mx.zeros((_rows(out), heads, width, k_dim), filled[0].keys.dtype)
        values = mx.zeros((_rows(out), heads, width, v_dim), filled[0].values.dtype)
        row = 0
        for p in parts:
            if p.keys is not None and p._idx:
                shift = top - p._idx
                keys[row: row + _rows(p), :, shift:top] = p.keys[..., : p._idx, :]
                values[row: row + _rows(p), :, shift:top] = p.values[..., : p._idx, :]
            row += _rows(p)
        out.keys, out.values = keys, values
    return out


class JoiningKVCache:
    """One layer's rows as parts not yet merged; it stands where the layer's cache stood in the
    generation batch's list, and does what mlx-lm's generation batch asks of a cache."""

    def __init__(self, parts: list[BatchKVCache]) -> None:
        self.parts = parts

    def rows(self) -> list[int]:
        return [_rows(p) for p in self.parts]

    def merged(self) -> BatchKVCache:
        self.parts = [merge(self.parts)]
        return self.parts[0]

    def extend(self, other: Any) -> None:
        self.parts.extend(other.parts if isinstance(other, JoiningKVCache) else [other])

    def filter(self, keep: list[int]) -> None:
        self.merged().filter(keep)

    def extract(self, idx: int) -> Any:
        for part in self.parts:
            if idx < _rows(part):
                return part.extract(idx)
            idx -= _rows(part)
        raise IndexError(idx)

    def size(self) -> int:
        return max(p._idx for p in self.parts)

    def empty(self) -> bool:
        return all(p.keys is None for p in self.parts)

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def state(self) -> list[Any]:
        return [p.state for p in self.parts]


def joining(batch: Any) -> bool:
    """Whether some layer of mlx-lm's generation batch still holds parts."""
    return any(isinstance(c, JoiningKVCache) for c in batch.prompt_cache)


def join(batch: Any, newcomer: Any) -> None:
    """``batch.extend(newcomer)`` (both mlx-lm ``GenerationBatch``) without copying the batch's
    KV: each layer holds the two as parts until ``merge_some`` merges it."""
    if len(batch):
        batch.prompt_cache[:] = [c if isinstance(c, JoiningKVCache) else JoiningKVCache([c])
                                 for c in batch.prompt_cache]
    batch.extend(newcomer)


def merge_some(batch: Any, budget: int | None = None) -> None:
    """Merge the joining layers' parts, in layer order, until ``budget`` bytes (``MERGE_BYTES``
    by default), one layer at least."""
    caches = batch.prompt_cache
    budget = MERGE_BYTES if budget is None else budget
    for i, c in enumerate(caches):
        if isinstance(c, JoiningKVCache):
            if budget <= 0:
                return
            budget -= c.nbytes
            caches[i] = c.merged()


def settle(batch: Any) -> None:
    """Merge every joining layer now (before mlx-lm's own step, which knows only rectangles)."""
    merge_some(batch, budget=1 << 62)
