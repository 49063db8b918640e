"""A model directory's GGUF block tensors (K-quants, Q5, Q6_K, IQ) as the layers that read them
best where the model runs (decision 0041).

The store keeps a GGUF tensor of a type MLX's affine layout cannot hold losslessly as its blocks
(``weight``: (N, row bytes) uint8) and lists it in ``config.json``'s ``ggml_types``
(module path -> GGUF type number).  ``load_model`` is mlx-lm's with one step added to the
model's ``sanitize`` (``_place``); on the CPU (not sharded):

- Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 are packed eight rows together for the kernels' own products
  (``PackedLinear``, a tied Q6_K head's ``K6Embedding``) where their instruction set reads them so;
- any other type ggml multiplies becomes a ``GgmlLinear`` (or ``GgmlEmbedding``): ggml's row
  products in the kernels' op (``kernels.blocks``).

Anywhere else (a GPU, no kernels or ggml, a sharded model) Q4_K becomes MLX's affine 4-bit layout
(float32 scales: lossless) and the rest is widened to bfloat16 by gguf's own dequantization: the
forms the import stored before.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import _get_classes
from mlx_lm.utils import load_model as mlx_lm_load_model

from ..kernels import blocks
from ..kernels import ops as kernels

__all__ = [
    "PACKED", "GgmlEmbedding", "GgmlLinear", "K6Embedding", "PackedLinear", "block_layers", "load_model", "pack_k4",
    "pack_k5", "pack_k5k", "pack_k6", "packed_product", "q4_k_affine", "q4_k_parts", "q6_k_parts", "trim",
]

Q4_K = int(gguf.GGMLQuantizationType.Q4_K)
Q5_1 = int(gguf.GGMLQuantizationType.Q5_1)


class GgmlLinear(nn.Module):
    """``x @ W.T (+ bias)`` with W as GGUF blocks of type ``ggml_type`` (N, row bytes)."""

    def __init__(self, weight: mx.array, ggml_type: int, in_features: int, bias: mx.array | None = None) -> None:
        super().__init__()
        self.weight = weight
        if bias is not None:
            self.bias = bias
        self.ggml_type, self.in_features = int(ggml_type), in_features

    def __call__(self, x: mx.array) -> mx.array:
        return blocks.linear(x, self["weight"], self.ggml_type, self.in_features, self.get("bias"))


class GgmlEmbedding(nn.Module):
    """An embedding table as GGUF blocks: rows looked up as ``dtype``; ``as_linear`` for a tied head."""

    def __init__(self, weight: mx.array, ggml_type: int, dims: int, dtype: mx.Dtype = mx.float32) -> None:
        super().__init__()
        self.weight = weight
        self.ggml_type, self.dims, self.dtype = int(ggml_type), dims, dtype

    def __call__(self, ids: mx.array) -> mx.array:
        return blocks.take_rows(self["weight"], ids, self.ggml_type, self.dims, self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return blocks.linear(x, self["weight"], self.ggml_type, self.dims)


def packed_product(x: mx.array, kind: str, weight: mx.array, highs: mx.array | None, fields: mx.array,
                   bias: mx.array | None = None, **around: Any) -> mx.array:
    """``x @ W.T (+ bias)`` for W packed for the kernels as ``kind`` (``PACKED``); ``around``:
    ``residual``, ``swiglu``, ``geglu``, ``norm``, ``eps`` as ``kernels.ops.linear`` takes them."""
    if kind == "Q4_K":
        return blocks.k4_linear(x, weight, fields, bias, **around)
    product = blocks.k6_linear if kind == "Q6_K" else blocks.k5k_linear if kind == "Q5_K" else blocks.k5_linear
    return product(x, weight, highs, fields, bias, **around)


#: The block types packed for the kernels' own products (``_pack``), in the order the startup line names them.
PACKED = ("Q4_K", "Q5_K", "Q5_0", "Q5_1", "Q6_K")


class PackedLinear(nn.Module):
    """``x @ W.T (+ bias)`` with W packed eight rows together for the kernels' own product:
    Q4_K (``pack_k4``: 4.625 bits a weight, GGUF's 4.5), Q5_K (``pack_k5k``: 5.625, GGUF's 5.5),
    Q5_0 or Q5_1 (``pack_k5``: 6 bits) or Q6_K (``pack_k6``: GGUF's 6.5625); ``highs`` the fifth or
    high bits (none for Q4_K)."""

    def __init__(self, kind: str, weight: mx.array, highs: mx.array | None, fields: mx.array, in_features: int,
                 bias: mx.array | None = None) -> None:
        super().__init__()
        self.weight, self.fields = weight, fields
        if highs is not None:
            self.highs = highs
        if bias is not None:
            self.bias = bias
        self.packed_kind, self.in_features = kind, in_features
        self._turbospark_packed = True

    def __call__(self, x: mx.array) -> mx.array:
        return packed_product(x, self.packed_kind, self["weight"], self.get("highs"), self["fields"], self.get("bias"))


class K6Embedding(nn.Module):
    """An embedding table in Q6_K packed for the kernels (a tied head, as llama-quantize writes
    it): rows looked up as ``dtype``, ``as_linear`` the kernels' packed product."""

    def __init__(self, weight: mx.array, highs: mx.array, fields: mx.array, dims: int,
                 dtype: mx.Dtype = mx.float32) -> None:
        super().__init__()
        self.weight, self.highs, self.fields = weight, highs, fields
        self.dims, self.dtype = dims, dtype
        self._turbospark_packed = True

    def __call__(self, ids: mx.array) -> mx.array:
        return blocks.k6_take_rows(self["weight"], self["highs"], self["fields"], ids, self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return blocks.k6_linear(x, self["weight"], self["highs"], self["fields"])


def pack_k5(data: np.ndarray, ggml_type: int) -> tuple[mx.array, mx.array, mx.array]:
    """Q5_0 or Q5_1 rows packed eight rows together for ``blocks.k5_linear``: the low nibbles as
    ``kernels.pack_quantized`` packs 4-bit weights; each 32's fifth bits one word a row (bit i the
    value i's), eight rows side by side; per chunk and 32 a ``K5Fields`` (the rows' d and m as
    float16, m = -16 d for Q5_0: exact)."""
    q5_1 = ggml_type == Q5_1
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(rows, -1, 24 if q5_1 else 22)
    n32 = b.shape[1]
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    m = b[..., 2:4].copy().view(np.float16)[..., 0] if q5_1 else (d * np.float16(-16)).astype(np.float16)
    at = 4 if q5_1 else 2
    high = b[..., at:at + 4].copy().view(np.uint32)[..., 0]  # (rows, 32s)
    qs = b[..., at + 4:at + 20]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)  # values 0-15, then 16-31
    words = np.ascontiguousarray(low[:, 0::2] | (low[:, 1::2] << 4)).view(np.uint32)
    zeros = mx.zeros((rows, n32), mx.float16)
    packed = kernels.pack_quantized(mx.array(words), zeros, zeros, 32, 4)[0]
    highs = np.ascontiguousarray(high.reshape(rows // 8, 8, n32).transpose(0, 2, 1)).reshape(rows, n32)
    halves = [np.ascontiguousarray(h.view(np.uint16).reshape(rows // 8, 8, n32).transpose(0, 2, 1)).view(np.uint8)
              for h in (d, m)]
    fields = np.concatenate([h.reshape(rows // 8, n32, 16) for h in halves], axis=-1)
    return packed, mx.array(highs), mx.array(fields.reshape(-1))


def q6_k_parts(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K rows ((N, K / 256 * 210) bytes) taken apart as gguf reads them: each value's q in
    0..63 ((N, K) uint8), each 16's scale ((N, K / 16) int8) and ``d`` ((N, K / 256) float16).
    Value = d * sc * (q - 32)."""
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(rows, -1, 210)
    n = b.shape[1]
    ql = b[..., :128].reshape(rows, n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(rows, n, 2, 4, 32)
    qh = b[..., 128:192].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    qh = (qh & 0x03).reshape(rows, n, 2, 4, 32)
    q = (ql | (qh << 4)).reshape(rows, -1)
    sc = b[..., 192:208].copy().view(np.int8).reshape(rows, -1)
    d = b[..., 208:210].copy().view(np.float16)[..., 0]
    return q, sc, d


def pack_k6(data: np.ndarray) -> tuple[mx.array, mx.array, mx.array]:
    """Q6_K rows packed eight rows together for ``blocks.k6_linear``: the low nibbles as
    ``kernels.pack_quantized`` packs 4-bit weights; the high bits two words a 32 per row (for
    dwords 2p and 2p + 1 of a 32, byte j holds the high bits of dword 2p's values 2j and 2j + 1 in
    bits 0-3 and dword 2p + 1's in bits 4-7), eight rows side by side; per chunk and super-block
    a ``K6Fields`` (the rows' d and their 16s' scales, [16][row]: 144 bytes)."""
    q, sc, d = q6_k_parts(data)
    n, k = q.shape
    supers = d.shape[1]
    low = q & 15
    words = np.ascontiguousarray(low[:, 0::2] | (low[:, 1::2] << 4)).view(np.uint32)
    zeros = mx.zeros((n, k // 32), mx.float16)
    packed = kernels.pack_quantized(mx.array(words), zeros, zeros, 32, 4)[0]
    h = (q >> 4).reshape(n, k // 32, 2, 2, 4, 2)  # [32][pair p][dword in pair][byte j][value 2j, 2j + 1]
    byte = h[..., 0, :, 0] | h[..., 0, :, 1] << 2 | h[..., 1, :, 0] << 4 | h[..., 1, :, 1] << 6  # (n, 32s, p, j)
    highs = np.ascontiguousarray(byte.astype(np.uint8)).view(np.uint32)[..., 0]  # (n, K / 32, 2)
    highs = np.ascontiguousarray(highs.reshape(n // 8, 8, k // 32, 2).transpose(0, 2, 3, 1)).reshape(n, k // 16)
    halves = np.ascontiguousarray(d.view(np.uint16).reshape(n // 8, 8, supers).transpose(0, 2, 1)).view(np.uint8)
    scales = np.ascontiguousarray(sc.reshape(n // 8, 8, supers, 16).transpose(0, 2, 3, 1)).view(np.uint8)
    fields = np.concatenate([halves.reshape(n // 8, supers, 16), scales.reshape(n // 8, supers, 128)], axis=-1)
    return packed, mx.array(highs), mx.array(fields.reshape(-1))


def q4_k_parts(data: np.ndarray, size: int = 144) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K rows ((N, K / 256 * 144) bytes) taken apart: the nibbles as MLX packs 4-bit values
    ((N, K / 8) uint32, value i at nibble i % 8 of word i // 8), ``d`` and ``dmin`` ((N, K / 256)
    float16) and each 32's 6-bit scale ``sc`` and minimum ``m`` ((N, K / 32) uint8).

    A super-block holds 256 values: ``d`` and ``dmin``, twelve bytes packing the eight ``sc`` and
    ``m``, and 128 bytes of nibbles (each 32 bytes: a 32 in the low nibbles, the next in the high
    ones).  Value = d * sc * q - dmin * m.  Q5_K's super-blocks (``size`` 176) are the same with
    32 bytes of fifth bits before the nibbles (``pack_k5k``)."""
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(rows, -1, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0]
    s = b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    nibbles = b[..., size - 128:].reshape(rows, -1, 4, 1, 32)
    values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=3).reshape(rows, -1)
    words = np.ascontiguousarray(values[:, 0::2] | (values[:, 1::2] << 4)).view(np.uint32)
    return words, d, dmin, sc.reshape(rows, -1), m.reshape(rows, -1)


def q4_k_affine(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K rows as MLX's affine 4-bit layout with groups of 32, losslessly: the nibbles, scales
    ``d * sc`` and biases ``-dmin * m`` in float32 (as llama.cpp computes them: float16 would
    round them).  6 bits a weight: where the kernels cannot read Q4_K packed (a GPU, no ggml)."""
    words, d, dmin, sc, m = q4_k_parts(data)
    per = sc.shape[1] // d.shape[1]
    scales = np.repeat(d.astype(np.float32), per, axis=1) * sc.astype(np.float32)
    biases = -(np.repeat(dmin.astype(np.float32), per, axis=1) * m.astype(np.float32))
    return words, scales, biases


def pack_k4(data: np.ndarray, size: int = 144) -> tuple[mx.array, mx.array]:
    """Q4_K rows packed eight rows together for ``blocks.k4_linear``: the nibbles as
    ``kernels.pack_quantized`` packs 4-bit weights, and per chunk and super-block a
    ``K4Fields`` (the rows' d, dmin, and their 32s' sc and m as bytes, [32][row]: 160 bytes)."""
    words, d, dmin, sc, m = q4_k_parts(data, size)
    n, supers = d.shape
    zeros = mx.zeros((n, sc.shape[1]), mx.float16)  # the nibbles alone are packed here
    packed = kernels.pack_quantized(mx.array(words), zeros, zeros, 32, 4)[0]

    def lanes(a: np.ndarray) -> np.ndarray:  # (N, S, X) -> (N/8, S, X, 8 rows) as bytes
        return np.ascontiguousarray(a.reshape(n // 8, 8, supers, -1).transpose(0, 2, 3, 1))

    halves = [lanes(h.view(np.uint16)[..., None]).view(np.uint8).reshape(n // 8, supers, 16) for h in (d, dmin)]
    bytes_ = [lanes(a.reshape(n, supers, 8)).reshape(n // 8, supers, 64) for a in (sc, m)]
    fields = np.concatenate([*halves, *bytes_], axis=-1)
    return packed, mx.array(fields.reshape(-1))


def pack_k5k(data: np.ndarray) -> tuple[mx.array, mx.array, mx.array]:
    """Q5_K rows ((N, K / 256 * 176) bytes) packed eight rows together for ``blocks.k5k_linear``:
    the low nibbles and fields as ``pack_k4`` packs Q4_K's, and each 32's fifth bits one word a
    row (bit i the value i's), eight rows side by side, as ``pack_k5`` packs Q5's.  In a
    super-block, 32 bytes ``qh`` hold the fifth bits: bit j of byte l is value l's of its 32 j."""
    n = data.shape[0]
    packed, fields = pack_k4(data, size=176)
    qh = np.ascontiguousarray(data).reshape(n, -1, 176)[..., 16:48]  # (n, supers, 32 values l)
    bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (n, supers, 32 j, value l)
    words = (bits.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    words = words.reshape(n, -1)  # (n, K / 32)
    highs = np.ascontiguousarray(words.reshape(n // 8, 8, -1).transpose(0, 2, 1)).reshape(n, -1)
    return packed, mx.array(highs), fields


def _widened(weight: mx.array, ggml_type: int) -> mx.array:
    values = gguf.quants.dequantize(np.asarray(weight), gguf.GGMLQuantizationType(ggml_type))
    return mx.array(np.asarray(values, np.float32)).astype(mx.bfloat16)


def _module_at(model: nn.Module, path: str) -> tuple[Any, str]:
    parent: Any = model
    *heads, last = path.split(".")
    for part in heads:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    return parent, last


def _stored_blocks(path: Path) -> dict[str, np.ndarray]:
    """The uint8 tensors of the directory's safetensors files as read-only memory maps, by name:
    blocks are packed from the file itself, so the arrays mlx-lm loaded (held by its own dict
    until the model is built) are never read into memory beside what is packed from them."""
    out: dict[str, np.ndarray] = {}
    for file in sorted(Path(path).glob("model*.safetensors")):
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        for name, info in header.items():
            if isinstance(info, dict) and info.get("dtype") == "U8":
                start, end = info["data_offsets"]
                out[name] = np.memmap(file, np.uint8, "r", 8 + length + start, tuple(info["shape"]))
                assert out[name].nbytes == end - start
    return out


def trim() -> None:
    """Give the memory freed while packing back to the system (glibc keeps freed heap pages)."""
    mx.clear_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _pack(kind: str, raw: np.ndarray) -> tuple[mx.array, mx.array | None, mx.array]:
    """``raw`` blocks of ``kind`` packed for the kernels: (nibbles, high bits or None, fields)."""
    if kind == "Q4_K":
        packed, fields = pack_k4(raw)
        return packed, None, fields
    if kind == "Q5_K":
        return pack_k5k(raw)
    return pack_k6(raw) if kind == "Q6_K" else pack_k5(raw, int(gguf.GGMLQuantizationType[kind]))


def _packs(kind: str, linear: bool, k: int) -> bool:
    """Whether a tensor of block type ``kind`` is packed for the kernels here: their instruction
    set reads it so (a Q6_K embedding too: a tied head; Q5's rows in whole 64s)."""
    if kind == "Q4_K":
        return linear and blocks.reads_k4()
    if kind == "Q6_K":
        return blocks.reads_k6()
    if kind == "Q5_K":
        return linear and blocks.reads_k5()
    return kind in ("Q5_0", "Q5_1") and linear and k % 64 == 0 and blocks.reads_k5()


def _place(model: nn.Module, weights: dict[str, mx.array], types: dict[str, int], cpu: bool,
           stored: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """Each module of ``types`` as the layer that reads its blocks best here (``cpu``: the kernels
    may serve it): Q4_K and Q6_K packed for the kernels' own products where their instruction set
    reads them, else ggml's products where ggml is built; else Q4_K in MLX's affine layout and the
    rest widened to bfloat16."""
    for path, ggml_type in types.items():
        name = f"{path}.weight"
        if name not in weights:  # dropped by the model's own sanitize (a tied head)
            continue
        parent, last = _module_at(model, path)
        module = parent[int(last)] if isinstance(parent, list) else parent[last]
        linear = not isinstance(module, nn.Embedding)
        k, n = module.weight.shape[-1], module.weight.shape[0]
        raw = stored.pop(name) if name in stored else np.asarray(weights[name])  # unmapped once packed
        kind = gguf.GGMLQuantizationType(ggml_type).name
        if cpu and n % 8 == 0 and _packs(kind, linear, k):
            packed, highs, fields = _pack(kind, raw)
            weights.update({name: packed, f"{path}.fields": fields, **({f"{path}.highs": highs} if highs is not None else {})})
            new: nn.Module = (PackedLinear(kind, packed, highs, fields, k, weights.get(f"{path}.bias")) if linear
                              else K6Embedding(packed, highs, fields, k))
        elif cpu and blocks.serves(ggml_type, k):
            new = (GgmlLinear(weights[name], ggml_type, k, weights.get(f"{path}.bias")) if linear
                   else GgmlEmbedding(weights[name], ggml_type, k))
        elif ggml_type == Q4_K and linear:  # MLX's affine layout: mlx-lm's quantize step takes it
            words, scales, biases = q4_k_affine(raw)
            weights.update({name: mx.array(words), f"{path}.scales": mx.array(scales), f"{path}.biases": mx.array(biases)})
            continue
        else:
            weights[name] = _widened(weights[name], ggml_type)
            continue
        if isinstance(parent, list):
            parent[int(last)] = new
        else:
            parent[last] = new
    return weights


def load_model(path: Path, *, lazy: bool = False, group: Any = None) -> tuple[nn.Module, dict[str, Any]]:
    """mlx-lm's ``load_model``, with the GGUF block tensors ``config.json`` lists as layers the
    kernels read (or widened where they cannot: ``group``, a sharded model, widens them)."""
    config = json.loads((Path(path) / "config.json").read_text())
    types: dict[str, int] = config.get("ggml_types") or {}
    if not types:
        return mlx_lm_load_model(Path(path), lazy=lazy)
    cpu = group is None and mx.default_device().type == mx.cpu  # a sharded model's layers are MLX's

    def classes(config: dict[str, Any]) -> tuple[type, type]:
        model_class, args_class = _get_classes(config)

        class Model(model_class):  # type: ignore[misc, valid-type]
            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                if hasattr(model_class, "sanitize"):
                    weights = model_class.sanitize(self, weights)
                return _place(self, weights, types, cpu, _stored_blocks(Path(path)))

        Model.__name__ = Model.__qualname__ = model_class.__name__
        Model.__module__ = model_class.__module__
        return Model, args_class

    loaded = mlx_lm_load_model(Path(path), lazy=lazy, get_model_classes=classes)
    trim()
    return loaded


def block_layers(model: nn.Module) -> dict[str, int]:
    """Layers that read GGUF blocks through ggml, by type name, and those that read Q4_K or Q6_K
    packed for the kernels (``"Q4_K packed"``, ``"Q6_K packed"``): how many of each."""
    counts: dict[str, int] = {}
    for _, m in model.named_modules():
        if isinstance(m, (GgmlLinear, GgmlEmbedding, PackedLinear, K6Embedding)):
            name = (f"{m.packed_kind} packed" if isinstance(m, PackedLinear) else "Q6_K packed"
                    if isinstance(m, K6Embedding) else gguf.GGMLQuantizationType(m.ggml_type).name)
            counts[name] = counts.get(name, 0) + 1
    return counts
