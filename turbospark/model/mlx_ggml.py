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

__all__ = ["GgmlEmbedding", "GgmlLinear", "block_layers", "load_model"]


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
        if not native:
            weights[name] = _widened(weights[name], ggml_type)
            continue
        k = module.weight.shape[-1]
        if isinstance(module, nn.Embedding):
            new: nn.Module = GgmlEmbedding(weights[name], ggml_type, k)
        else:
            new = GgmlLinear(weights[name], ggml_type, k, weights.get(f"{path}.bias"))
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
    """Layers that read GGUF blocks through ggml, by type name: how many of each."""
    counts: dict[str, int] = {}
    for _, m in model.named_modules():
        if isinstance(m, (GgmlLinear, GgmlEmbedding)):
            name = gguf.GGMLQuantizationType(m.ggml_type).name
            counts[name] = counts.get(name, 0) + 1
    return counts
