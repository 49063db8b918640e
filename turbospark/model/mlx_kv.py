"""The fused layers' KV caches (``mlx_blocks``): written by the kernels in one call, in float16
(decision 0035) or in llama.cpp's blocks of 32 (``serve --kv-cache q8_0|q4_0``, decision 0047).

A cache in blocks is mlx-lm's own ``KVCache`` or ``BatchKVCache`` whose arrays hold, for each
head's row, its blocks one after the other (q8_0: a float16 scale and 32 int8, 34 bytes; q4_0:
a float16 scale and 16 bytes of nibbles, 18 bytes) as an int8 (q8_0) or uint8 (q4_0) array of
shape (batch, heads, tokens, head size / 32 * block bytes).  Everything mlx-lm does to a cache
along its batch and token axes (growing, trimming, filtering rows, merging, extracting, padding a
prompt) is the same on these bytes; ``kernels.kv_write`` quantizes the new rows as it writes them
(as llama.cpp's reference ``quantize_row_q8_0_ref`` and ``quantize_row_q4_0_ref``), and the
kernels' attention reads the blocks as they are.  A sliding window's rotating cache and a head size that is not a
multiple of 32 stay in float16, and so does a layer whose attention is not the kernels' (Gemma 2's
soft-capped attention, ``blocks`` false).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from ..kernels import ops as kernels

__all__ = ["kv_update", "kv_type"]

#: bytes of one block of 32 values, by the array type that holds blocks
_BLOCK_BYTES = {mx.int8: 34, mx.uint8: 18}


def kv_type(k: mx.array, blocks: bool = True) -> Any:
    """The type a new full-attention cache holds rows like ``k`` in (not in blocks for a layer
    whose attention is not the kernels': ``blocks`` false)."""
    if k.dtype != mx.float32 or not kernels.kv_half():
        return k.dtype
    kind = kernels.kv_blocks() if blocks else None
    return kind if kind is not None and k.shape[-1] % 32 == 0 and k.shape[-1] <= 512 else mx.float16


def kv_update(cache: Any, k: mx.array, v: mx.array, *, blocks: bool = True) -> tuple[mx.array, mx.array]:
    """``cache.update_and_fetch(k, v)`` for a fused layer: in one call to the kernels (a write
    and a slice each for keys and values, without Python's indexing) where the cache is mlx-lm's
    plain or batch KV cache and the new rows fit in its buffers, the same state after as its own
    method leaves.  A new cache is made in float16 where ``kernels.kv_half()`` (decision 0035),
    in blocks where ``kernels.kv_blocks()`` (decision 0047), and a cache keeps its type: rows are
    rounded (or quantized) to it as they are written."""
    kind, n = type(cache), k.shape[2]
    if kind in (RotatingKVCache, BatchRotatingKVCache):  # a sliding window's: its own method, in its type
        kv = cache.keys.dtype if cache.keys is not None else mx.float16 if k.dtype == mx.float32 and kernels.kv_half() \
            else k.dtype
        return cache.update_and_fetch(k.astype(kv), v.astype(kv))
    if kind not in (KVCache, BatchKVCache):
        return cache.update_and_fetch(k, v)
    kv = cache.keys.dtype if cache.keys is not None else kv_type(k, blocks)
    at = cache._idx if kind is BatchKVCache else cache.offset
    blocks = kv in _BLOCK_BYTES
    writable = k.dtype == kv or (k.dtype == mx.float32 and (kv == mx.float16 or blocks))
    if cache.keys is None or at + n > cache.keys.shape[2] or not writable:
        if not blocks or not writable:  # mlx-lm's own, in the cache's type
            return cache.update_and_fetch(k.astype(kv), v.astype(kv))
        # mlx-lm's own growth, its new rows then written over by the kernels below
        width = lambda x: x.shape[-1] // 32 * _BLOCK_BYTES[kv]  # noqa: E731
        cache.update_and_fetch(mx.zeros((*k.shape[:3], width(k)), kv), mx.zeros((*v.shape[:3], width(v)), kv))
        cache.offset -= n
        if kind is BatchKVCache:
            cache._idx -= n
    if kind is BatchKVCache:
        cache.offset = cache.offset + n
        cache._idx += n
    else:
        cache.offset += n
    cache.keys, cache.values, k, v = kernels.kv_write(cache.keys, cache.values, k, v, at)
    return k, v
