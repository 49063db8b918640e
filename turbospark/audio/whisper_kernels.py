"""Whisper's encoder and decoder on turbospark's CPU kernels (decision 0045), for
``audio/whisper.py``.

mlx-whisper's layers on MLX's CPU ops spend most of a short clip's time outside the products:
``nn.gelu``'s ``erf`` and the attention's softmax run a value at a time (a tiny.en encoder
block's GELU over 620 positions took 33 ms, its attention 44 ms, its four products 10 ms).  Here
the same model runs through the kernels:

- every linear layer (and the two convolutions, as products over three frames side by side) is
  one kernels product: 8-bit weights (MLX's affine layout, packed) with x rounded to 8 bits per
  32 values where the CPU has integer dot products, the bias, GELU or the residual add in its
  epilogue; the first convolution, which reads the mel itself, keeps float16 weights and float32
  x;
- attention is the kernels' (no mask in the encoder and for the cross-attention, causal for the
  decoder's first tokens), heads side by side as the output product reads them;
- the decoder's self-attention keys and values are kept split into heads; the cross-attention's
  are computed once per window, as mlx-whisper caches them.

The decoder answers mlx-whisper's ``decoder(tokens, audio_features, kv_cache)`` (its cache is
this module's own), so ``mlx_whisper.transcribe`` drives it unchanged; cross-attention weights
(word timestamps) are not computed.  Where the kernels are not built, ``whisper.py`` keeps
mlx-whisper's own layers.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..kernels import ops

__all__ = ["BITS", "KernelWhisper"]

#: bits of the products' weights (8: the transcripts of float32, decision 0045; 16: float16)
BITS = 8
_GROUP = 64


class _Product:
    """``x @ W.T + b`` of one layer (or of layers' rows stacked), through the kernels."""

    def __init__(self, weight: mx.array, bias: mx.array | None, bits: int) -> None:
        self.bias, self.bits = bias, bits
        if bits == 16:
            self.weights: tuple[mx.array, ...] = (weight.astype(mx.float16),)
            self.packed = False
        else:
            w, s, b = mx.quantize(weight, group_size=_GROUP, bits=bits)
            self.packed = ops.packs(weight.shape[0], bits, _GROUP)
            self.weights = ops.pack_quantized(w, s, b, _GROUP, bits) if self.packed else (w, s, b)
        mx.eval(*self.weights, *([bias] if bias is not None else []))

    def __call__(self, x: mx.array, **epilogue: Any) -> mx.array:
        if self.bits == 16:
            return ops.linear(x, self.weights[0], self.bias, **epilogue)
        w, s, b = self.weights
        return ops.quantized_linear(x, w, s, b, self.bias, group_size=_GROUP, bits=self.bits, packed=self.packed,
                                    **epilogue)


def _linear(layer: Any, bits: int) -> _Product:
    return _Product(layer.weight, getattr(layer, "bias", None), bits)


def _stacked(layers: list[Any], bits: int) -> _Product:
    """The layers' rows one after the other (q|k|v), a missing bias as zeros."""
    weight = mx.concatenate([layer.weight for layer in layers], axis=0)
    bias = mx.concatenate([layer.bias if "bias" in layer else mx.zeros((layer.weight.shape[0],), layer.weight.dtype)
                           for layer in layers])
    return _Product(weight, bias, bits)


def _conv(conv: Any, bits: int) -> _Product:
    """A 3-wide ``nn.Conv1d`` as a product over three frames side by side: its weight
    (out, 3, in) read as (out, 3 * in)."""
    weight = conv.weight
    return _Product(weight.reshape(weight.shape[0], -1), conv.bias, bits)


def _frames(x: mx.array, stride: int) -> mx.array:
    """(B, L, C) with one frame of zeros each side: each output position's three frames side by
    side, (B, L / stride, 3 C), as a convolution of width 3, padding 1, reads them."""
    padded = mx.pad(x, [(0, 0), (1, 1), (0, 0)])
    n = (x.shape[1] - 1) // stride + 1
    return mx.concatenate([padded[:, i: i + stride * (n - 1) + 1: stride] for i in range(3)], axis=-1)


class _Block:
    def __init__(self, block: Any, heads: int, bits: int) -> None:
        attn = block.attn
        self.block, self.heads = block, heads
        self.qkv = _stacked([attn.query, attn.key, attn.value], bits)
        self.out = _linear(attn.out, bits)
        if block.cross_attn is not None:
            cross = block.cross_attn
            self.cross_q, self.cross_out = _linear(cross.query, bits), _linear(cross.out, bits)
            self.cross_kv = _stacked([cross.key, cross.value], bits)
        self.mlp1, self.mlp2 = _linear(block.mlp1, bits), _linear(block.mlp2, bits)

    def attend(self, x: mx.array, cache: tuple[mx.array, mx.array] | None, causal: bool) -> tuple[mx.array, Any]:
        q, k, v = ops.split_heads(self.qkv(self.block.attn_ln(x)), self.heads, self.heads)
        if cache is not None:
            k, v = mx.concatenate([cache[0], k], axis=2), mx.concatenate([cache[1], v], axis=2)
        scale = q.shape[-1] ** -0.5
        mask = "causal" if causal and q.shape[2] > 1 else None
        return self.out(ops.merged_attention(q, k, v, scale=scale, mask=mask), residual=x), (k, v)

    def cross_keys(self, xa: mx.array) -> tuple[mx.array, mx.array]:
        b, length, width = xa.shape
        kv = self.cross_kv(xa).reshape(b, length, 2, self.heads, width // self.heads).transpose(2, 0, 3, 1, 4)
        return kv[0], kv[1]

    def cross(self, x: mx.array, keys: tuple[mx.array, mx.array]) -> mx.array:
        b, length, width = x.shape
        q = self.cross_q(self.block.cross_attn_ln(x)).reshape(b, length, self.heads, -1).transpose(0, 2, 1, 3)
        attended = ops.merged_attention(q, *keys, scale=(width // self.heads) ** -0.5)
        return self.cross_out(attended, residual=x)

    def mlp(self, x: mx.array) -> mx.array:
        return self.mlp2(self.mlp1(self.block.mlp_ln(x), gelu=True), residual=x)


class KernelWhisper:
    """A loaded mlx-whisper model's layers through the kernels: ``encode(mel, frames)`` and a
    ``decoder`` that answers mlx-whisper's decoder calls."""

    def __init__(self, model: Any, bits: int = BITS) -> None:
        enc, dec = model.encoder, model.decoder
        self.encoder = enc
        self.conv1 = _conv(enc.conv1, 16)  # it reads the mel itself
        self.conv2 = _conv(enc.conv2, bits)
        heads = model.dims.n_audio_head
        self.enc_blocks = [_Block(b, heads, bits) for b in enc.blocks]
        self.decoder = _Decoder(dec, [_Block(b, model.dims.n_text_head, bits) for b in dec.blocks],
                                _Product(dec.token_embedding.weight, None, bits))

    def encode(self, mel: mx.array) -> mx.array:
        """The encoder on ``mel`` (B, frames, n_mels), frames even: (B, frames / 2, width)."""
        x = self.conv1(_frames(mel, 1), gelu=True)
        x = self.conv2(_frames(x, 2), gelu=True)
        x = x + self.encoder._positional_embedding[: x.shape[1]]
        for block in self.enc_blocks:
            x, _ = block.attend(x, None, causal=False)
            x = block.mlp(x)
        return self.encoder.ln_post(x)


class _Decoder:
    """mlx-whisper's ``TextDecoder.__call__`` (``(logits, kv_cache, cross_qk)``) through the
    kernels; other attributes are the model's decoder's."""

    def __init__(self, decoder: Any, blocks: list[_Block], logits: _Product) -> None:
        self._decoder, self.blocks, self.logits = decoder, blocks, logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self._decoder, name)

    def __call__(self, tokens: mx.array, xa: mx.array, kv_cache: list[Any] | None = None) -> tuple[Any, ...]:
        dec = self._decoder
        offset = kv_cache[0][0][0].shape[2] if kv_cache else 0
        x = dec.token_embedding(tokens) + dec.positional_embedding[offset: offset + tokens.shape[-1]]
        caches: list[Any] = list(kv_cache) if kv_cache else [(None, None)] * len(self.blocks)
        for i, block in enumerate(self.blocks):
            own, keys = caches[i]
            x, own = block.attend(x, own, causal=True)
            keys = keys if keys is not None else block.cross_keys(xa)
            x = block.mlp(block.cross(x, keys))
            caches[i] = (own, keys)
        return self.logits(dec.ln(x)), caches, [None] * len(self.blocks)
