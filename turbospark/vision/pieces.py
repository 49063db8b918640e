"""Bounded pieces of a vision tower's work, and encoder layers cut into them.

The model thread runs one ``Piece`` between two decode steps (``model/mlx_vision.py``), so a
piece is at most some tens of milliseconds of work: an encoder layer that does more runs in parts
(``encoder_layer``, ``layer_in_rows``), each the same arithmetic as the whole layer on some of
its rows.  How much a piece may do is ``PIECE_MACS`` multiply-adds, or what the caller plans
with (``budget``: the model thread sizes pieces to the streams' usual gap, as the join pacer
sizes prompt chunks); each part says what it does (``Part.macs``), so the thread can measure
its pace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

__all__ = ["PIECE_MACS", "Part", "Piece", "budget", "encoder_layer", "layer_in_rows"]


@attrs.frozen
class Piece:
    """One bounded piece of an image's encoding: ``run()`` gives what the model thread evaluates
    (a tile's hidden state after one more layer, or a part of one), and for a ``final`` piece the features of some
    of its image's tokens."""

    image: int  # which image of the request
    run: Callable[[], mx.array]
    final: bool = True


#: The most work a piece of an encoder layer does, in multiply-adds (some 30 to 60 ms on two
#: cores): a layer that does more runs as the keys and values of all its tokens, then its tokens
#: in groups (their attention over every key, then the MLP). SigLIP's at 512 pixels (1,024 tokens,
#: width 768) is 7.6 billion: 9 pieces.
PIECE_MACS = 1e9
_planning: list[float] = []  # the budgets of the plans being made (``budget``)


@contextmanager
def budget(macs: float) -> Iterator[None]:
    """Layers cut into parts of at most ``macs`` multiply-adds (``PIECE_MACS`` elsewhere)."""
    _planning.append(macs)
    try:
        yield
    finally:
        _planning.pop()


def _most() -> float:
    return _planning[-1] if _planning else PIECE_MACS


@attrs.frozen
class Part:
    """A part of a layer (or the whole): what it runs, and its multiply-adds."""

    run: Callable[[], Any]
    macs: float

    def __call__(self) -> Any:
        return self.run()


def encoder_layer(block: Any, tokens: int, read: Callable[[], mx.array],
                  write: Callable[[mx.array], None]) -> list[Part]:
    """A pre-norm encoder layer (``layer_norm1``, ``self_attn``, ``layer_norm2``, ``mlp``: SigLIP's
    and CLIP's, as mlx-vlm builds them) over the ``tokens`` rows of the hidden state ``read()``
    gives, in parts of at most ``PIECE_MACS`` (or the ``budget``); the last ``write``s the
    layer's output."""
    attn = block.self_attn
    ffn, width = block.mlp.fc1.weight.shape[:2]
    row = 2 * width * width + 2 * tokens * width + 2 * width * ffn  # a row's, its keys and values apart
    group = max(1, int(_most() // row))

    def whole() -> mx.array:
        out = block(read(), mask=None)
        write(out)
        return out

    if group >= tokens:
        return [Part(whole, tokens * (row + 2 * width * width))]

    def heads(y: mx.array) -> mx.array:
        return y.reshape(*y.shape[:2], attn.num_heads, -1).transpose(0, 2, 1, 3)

    kv: list[mx.array] = []
    done: list[mx.array] = []

    def keys_values() -> list[mx.array]:
        y = block.layer_norm1(read())
        kv[:] = [heads(attn.k_proj(y)), heads(attn.v_proj(y))]
        return kv

    def rows(start: int, end: int) -> mx.array:
        x = read()[:, start:end]
        o = mx.fast.scaled_dot_product_attention(heads(attn.q_proj(block.layer_norm1(x))), kv[0], kv[1],
                                                 scale=attn.scale)  # fmt: skip
        h = x + attn.out_proj(o.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1))
        done.append(h + block.mlp(block.layer_norm2(h)))
        if end < tokens:
            return done[-1]
        out = mx.concatenate(done, axis=1)
        kv.clear()
        done.clear()
        write(out)
        return out

    return [Part(keys_values, tokens * 2 * width * width),
            *(Part(partial(rows, a, min(a + group, tokens)), (min(a + group, tokens) - a) * row)
              for a in range(0, tokens, group))]  # fmt: skip


def layer_in_rows(hidden: dict[str, Any], segments: list[int], *, whole: Callable[[], mx.array],
                  project: Callable[[mx.array, int, int], mx.array], finish: Callable[[mx.array, mx.array], mx.array],
                  scale: float, project_macs: int, row_macs: int) -> list[Part]:
    """A pre-norm encoder layer over ``hidden["x"]`` (rows, width) whose rows attend within
    ``segments`` (their lengths, in order: an image, or its windows): ``whole()`` if it does at
    most ``PIECE_MACS``, else in parts: ``project(x, a, b)`` (rows ``a`` to ``b``'s q, k and v,
    stacked, each (rows, heads, dim), RoPE applied) for groups of rows, then groups of rows'
    attention over their segment's keys, and ``finish(x, o)`` (the rows after the layer, from
    their input and attention's output).  ``project_macs`` and ``row_macs`` are a row's work in
    each; parts of at most ``PIECE_MACS``, or the ``budget``."""
    n = sum(segments)
    if n * (project_macs + row_macs) <= _most():
        return [Part(whole, n * (project_macs + row_macs))]
    bounds = np.cumsum([0, *segments])
    qkv: list[mx.array] = []
    done: list[mx.array] = []

    def projected(a: int, b: int) -> mx.array:
        qkv.append(project(hidden["x"][a:b], a, b))
        return qkv[-1]

    def rows(a: int, b: int) -> mx.array:
        if len(qkv) > 1:
            qkv[:] = [mx.concatenate(qkv, axis=1)]
        q, k, v = (y.transpose(1, 0, 2)[None] for y in qkv[0])  # (1, heads, rows, dim)
        parts = []
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            lo, hi = max(a, s), min(b, e)
            if lo < hi:
                parts.append(mx.fast.scaled_dot_product_attention(q[:, :, lo:hi], k[:, :, s:e], v[:, :, s:e],
                                                                  scale=scale))  # fmt: skip
        done.append(finish(hidden["x"][a:b], mx.concatenate(parts, axis=2)[0].transpose(1, 0, 2).reshape(b - a, -1)))
        if b < n:
            return done[-1]
        hidden["x"] = mx.concatenate(done, axis=0)
        qkv.clear()
        done.clear()
        return hidden["x"]

    first = max(1, int(_most() // project_macs))
    second = max(1, int(_most() // row_macs))
    return [*(Part(partial(projected, a, min(a + first, n)), (min(a + first, n) - a) * project_macs)
              for a in range(0, n, first)),
            *(Part(partial(rows, a, min(a + second, n)), (min(a + second, n) - a) * row_macs)
              for a in range(0, n, second))]  # fmt: skip
