"""A model directory's GGUF block tensors (K-quants, Q5, Q6_K...) as layers the kernels read as
they are stored, or widened where they cannot (decision 0041).

The store keeps a GGUF tensor of a type MLX's affine layout cannot hold losslessly as its blocks
(``weight``: (N, row bytes) uint8) and lists it in ``config.json``'s ``ggml_types``
(module path -> GGUF type number).  ``load_model`` is mlx-lm's with one step added to the
model's ``sanitize``: each such module becomes a ``GgmlLinear`` (or ``GgmlEmbedding``) whose
products the kernels run through ggml (``kernels.blocks``), on the CPU with ggml built; anywhere
else (a GPU, no ggml, a sharded model) its blocks are widened to bfloat16 by gguf's own
dequantization, the form they had before.
"""

from __future__ import annotations

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

__all__ = ["GgmlEmbedding", "GgmlLinear", "K4Linear", "block_layers", "load_model", "pack_k4", "q4_k_affine", "q4_k_parts"]

Q4_K = int(gguf.GGMLQuantizationType.Q4_K)


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


class K4Linear(nn.Module):
    """``x @ W.T (+ bias)`` with W in Q4_K super-blocks packed eight rows together for the
    kernels' own product (``pack_k4``): 4.625 bits a weight, where GGUF's are 4.5."""

    def __init__(self, weight: mx.array, fields: mx.array, in_features: int, bias: mx.array | None = None) -> None:
        super().__init__()
        self.weight, self.fields = weight, fields
        if bias is not None:
            self.bias = bias
        self.in_features = in_features
        self.k4 = True
        self._turbospark_packed = True

    def __call__(self, x: mx.array) -> mx.array:
        return blocks.k4_linear(x, self["weight"], self["fields"], self.get("bias"))


def q4_k_parts(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K rows ((N, K / 256 * 144) bytes) taken apart: the nibbles as MLX packs 4-bit values
    ((N, K / 8) uint32, value i at nibble i % 8 of word i // 8), ``d`` and ``dmin`` ((N, K / 256)
    float16) and each 32's 6-bit scale ``sc`` and minimum ``m`` ((N, K / 32) uint8).

    A super-block holds 256 values: ``d`` and ``dmin``, twelve bytes packing the eight ``sc`` and
    ``m``, and 128 bytes of nibbles (each 32 bytes: a 32 in the low nibbles, the next in the high
    ones).  Value = d * sc * q - dmin * m."""
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(rows, -1, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0]
    s = b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    nibbles = b[..., 16:].reshape(rows, -1, 4, 1, 32)
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


def pack_k4(data: np.ndarray) -> tuple[mx.array, mx.array]:
    """Q4_K rows packed eight rows together for ``blocks.k4_linear``: the nibbles as
    ``kernels.pack_quantized`` packs 4-bit weights, and per chunk and super-block a
    ``K4Fields`` (the rows' d, dmin, and their 32s' sc and m as bytes, [32][row]: 160 bytes)."""
    words, d, dmin, sc, m = q4_k_parts(data)
    n, supers = d.shape
    zeros = mx.zeros((n, sc.shape[1]), mx.float16)  # the nibbles alone are packed here
    packed = kernels.pack_quantized(mx.array(words), zeros, zeros, 32, 4)[0]

    def lanes(a: np.ndarray) -> np.ndarray:  # (N, S, X) -> (N/8, S, X, 8 rows) as bytes
        return np.ascontiguousarray(a.reshape(n // 8, 8, supers, -1).transpose(0, 2, 3, 1))

    halves = [lanes(h.view(np.uint16)[..., None]).view(np.uint8).reshape(n // 8, supers, 16) for h in (d, dmin)]
    bytes_ = [lanes(a.reshape(n, supers, 8)).reshape(n // 8, supers, 64) for a in (sc, m)]
    fields = np.concatenate([*halves, *bytes_], axis=-1)
    return packed, mx.array(fields.reshape(-1))


def _widened(weight: mx.array, ggml_type: int) -> mx.array:
    values = gguf.quants.dequantize(np.asarray(weight), gguf.GGMLQuantizationType(ggml_type))
    return mx.array(np.asarray(values, np.float32)).astype(mx.bfloat16)


def _module_at(model: nn.Module, path: str) -> tuple[Any, str]:
    parent: Any = model
    *heads, last = path.split(".")
    for part in heads:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    return parent, last


def _place(model: nn.Module, weights: dict[str, mx.array], types: dict[str, int], native: bool) -> dict[str, mx.array]:
    """Each module of ``types`` as a GGUF block layer (``native``) or its weight widened."""
    for path, ggml_type in types.items():
        name = f"{path}.weight"
        if name not in weights:  # dropped by the model's own sanitize (a tied head)
            continue
        parent, last = _module_at(model, path)
        module = parent[int(last)] if isinstance(parent, list) else parent[last]
        linear = not isinstance(module, nn.Embedding)
        k, n = module.weight.shape[-1], module.weight.shape[0]
        if ggml_type == Q4_K and linear and native and blocks.reads_k4() and n % 8 == 0:
            packed, fields = pack_k4(np.asarray(weights[name]))
            weights.update({name: packed, f"{path}.fields": fields})
            new: nn.Module = K4Linear(packed, fields, k, weights.get(f"{path}.bias"))
        elif ggml_type == Q4_K and linear and not native:  # MLX's affine layout: the quantize step takes it
            words, scales, biases = q4_k_affine(np.asarray(weights[name]))
            weights.update({name: mx.array(words), f"{path}.scales": mx.array(scales), f"{path}.biases": mx.array(biases)})
            continue
        elif not native:
            weights[name] = _widened(weights[name], ggml_type)
            continue
        elif linear:
            new = GgmlLinear(weights[name], ggml_type, k, weights.get(f"{path}.bias"))
        else:
            new = GgmlEmbedding(weights[name], ggml_type, k)
        if isinstance(parent, list):
            parent[int(last)] = new
        else:
            parent[last] = new
    return weights


def _natively(types: dict[str, int], config: dict[str, Any], group: Any) -> bool:
    if group is not None or mx.default_device().type != mx.cpu or not blocks.available():
        return False
    return all(blocks.serves(t, 256) for t in types.values())


def load_model(path: Path, *, lazy: bool = False, group: Any = None) -> tuple[nn.Module, dict[str, Any]]:
    """mlx-lm's ``load_model``, with the GGUF block tensors ``config.json`` lists as layers the
    kernels read (or widened where they cannot: ``group``, a sharded model, widens them)."""
    config = json.loads((Path(path) / "config.json").read_text())
    types: dict[str, int] = config.get("ggml_types") or {}
    if not types:
        return mlx_lm_load_model(Path(path), lazy=lazy)
    native = _natively(types, config, group)

    def classes(config: dict[str, Any]) -> tuple[type, type]:
        model_class, args_class = _get_classes(config)

        class Model(model_class):  # type: ignore[misc, valid-type]
            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                if hasattr(model_class, "sanitize"):
                    weights = model_class.sanitize(self, weights)
                return _place(self, weights, types, native)

        Model.__name__ = Model.__qualname__ = model_class.__name__
        Model.__module__ = model_class.__module__
        return Model, args_class

    return mlx_lm_load_model(Path(path), lazy=lazy, get_model_classes=classes)


def block_layers(model: nn.Module) -> dict[str, int]:
    """Layers that read GGUF blocks through ggml, by type name, and those that read Q4_K packed
    for the kernels (``"Q4_K packed"``): how many of each."""
    counts: dict[str, int] = {}
    for _, m in model.named_modules():
        if isinstance(m, (GgmlLinear, GgmlEmbedding, K4Linear)):
            name = "Q4_K packed" if isinstance(m, K4Linear) else gguf.GGMLQuantizationType(m.ggml_type).name
            counts[name] = counts.get(name, 0) + 1
    return counts
