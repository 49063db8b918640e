"""Bounded pieces of a vision tower's work, and encoder layers cut into them.

The model thread runs one ``Piece`` between two decode steps (``model/mlx_vision.py``), so a
piece is at most some tens of milliseconds of work: an encoder layer that does more runs in parts
(``encoder_layer``), each the same arithmetic as the whole layer on some of its rows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import mlx.core as mx

__all__ = ["PIECE_MACS", "Piece", "encoder_layer"]


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


def encoder_layer(block: Any, tokens: int, read: Callable[[], mx.array],
                  write: Callable[[mx.array], None]) -> list[Callable[[], Any]]:
    """A pre-norm encoder layer (``layer_norm1``, ``self_attn``, ``layer_norm2``, ``mlp``: SigLIP's
    and CLIP's, as mlx-vlm builds them) over the ``tokens`` rows of the hidden state ``read()``
    gives, in parts of at most ``PIECE_MACS``; the last ``write``s the layer's output."""
    attn = block.self_attn
    ffn, width = block.mlp.fc1.weight.shape[:2]
    group = max(1, int(PIECE_MACS // (2 * width * width + 2 * tokens * width + 2 * width * ffn)))

    def whole() -> mx.array:
        out = block(read(), mask=None)
        write(out)
        return out

    if group >= tokens:
        return [whole]

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

    return [keys_values, *(partial(rows, a, min(a + group, tokens)) for a in range(0, tokens, group))]
