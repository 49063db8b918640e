"""GGUF tensors -> the Hugging Face / mlx-lm weights of one model: names, checks, values.

* Names: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` through the
  architecture's table (:mod:`.gguf_architectures`); any tensor the table does not know is refused.
* Checks: every expected weight is present with the shape the metadata implies. The expectation is
  the mlx-lm model itself, built lazily from the config (names and shapes, no memory), so a GGUF
  whose tensors contradict its metadata is refused before anything is converted.
* Values: every type ``gguf`` can dequantize is read; the two llama.cpp storage conventions are
  undone, both invisible until the model generates text:

  - llama.cpp permutes the rows of llama's Q and K projections (weights and biases) to suit its
    interleaved RoPE; :func:`unpermute` undoes it. Applying the forward permutation instead gives
    text that looks right for a few tokens and then degenerates.
  - llama.cpp stores Gemma's RMSNorm weights as ``1 + w``; MLX's Gemma adds the 1 itself.

  ``dtype`` then picks the stored form: float32/float16/bfloat16, ``native`` (Q4_0/Q4_1/Q8_0
  blocks re-laid losslessly as MLX affine quantization, the other block types kept as their GGUF
  blocks, which ``model.mlx_ggml`` lays out at load for the kernels or ggml (decision 0041), float
  tensors as they are), or ``q8``/``q4`` (MLX re-quantized).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .gguf_architectures import Architecture
from .gguf_errors import ModelImportError
from .gguf_reader import GGUFFile, TensorInfo

__all__ = [
    "BLOCK_TYPES",
    "CONFIG_TENSORS",
    "NATIVE_TYPES",
    "QUANT_BITS",
    "QUANT_GROUP",
    "check_shapes",
    "convert_tensor",
    "hf_name",
    "hf_names",
    "kept_as_blocks",
    "stored_float",
    "unpermute",
    "zero_biases",
]

_GQT = gguf.GGMLQuantizationType
#: GGUF block types that map losslessly onto MLX affine quantization with group 32 (what mx.load
#: supports): the store keeps them so.
NATIVE_TYPES = frozenset({_GQT.Q4_0, _GQT.Q4_1, _GQT.Q8_0})
_FLOAT_TYPES = {_GQT.F32, _GQT.F16, _GQT.BF16}
#: GGUF block types ``native`` keeps as they are stored, (N, row bytes) uint8, listed in
#: config.json's ``ggml_types``: the kernels read them through ggml, elsewhere they are widened at
#: load (``model.mlx_ggml``).
BLOCK_TYPES = frozenset({
    _GQT.Q4_K, _GQT.Q5_0, _GQT.Q5_1, _GQT.Q2_K, _GQT.Q3_K, _GQT.Q5_K, _GQT.Q6_K, _GQT.IQ4_NL, _GQT.IQ4_XS,
    _GQT.IQ3_XXS, _GQT.IQ3_S, _GQT.IQ2_XXS, _GQT.IQ2_XS, _GQT.IQ2_S, _GQT.IQ1_S, _GQT.IQ1_M,
})
QUANT_BITS = {"q8": 8, "q4": 4}
QUANT_GROUP = 64
# Tensors that are neither kept native nor re-quantized land in this type in the quantized modes.
_QUANTIZED_MODES_FLOAT = mx.bfloat16
#: Tensors read into config.json (RoPE frequency factors) rather than stored as weights.
CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


def hf_name(gguf_name: str, arch: Architecture) -> str | None:
    """``gguf_name``'s Hugging Face name in ``arch`` (None: none it knows)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in arch.global_names:
        return f"{arch.global_names[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in arch.layer_names:
        return f"model.layers.{parts[1]}.{arch.layer_names[parts[2]]}.{suffix}"
    return None


def hf_names(gguf: GGUFFile, arch: Architecture, arch_name: str) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for every weight tensor.

    Raises:
        ModelImportError: a tensor this architecture does not have.
    """
    names = {t.name: hf_name(t.name, arch) for t in gguf if t.name not in CONFIG_TENSORS}
    if unknown := sorted(name for name, hf in names.items() if hf is None):
        raise ModelImportError(f"unsupported tensors for {arch_name}: {', '.join(unknown[:5])}")
    return {name: hf for name, hf in names.items() if hf is not None}


def zero_biases(arch: Architecture, config: Mapping[str, Any], present: set[str]) -> dict[str, np.ndarray]:
    """Zero biases for the layers whose mlx-lm module always has one the GGUF lacks (Qwen 2)."""
    rows = {
        "self_attn.q_proj": config["num_attention_heads"] * config["head_dim"],
        "self_attn.k_proj": config["num_key_value_heads"] * config["head_dim"],
        "self_attn.v_proj": config["num_key_value_heads"] * config["head_dim"],
    }
    zeros = {}
    for i in range(config["num_hidden_layers"]):
        for module in arch.zero_biases:
            name = f"model.layers.{i}.{module}.bias"
            if name not in present:
                zeros[name] = np.zeros(rows[module], np.float32)
    return zeros


def check_shapes(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Check Hugging Face name -> shape against the mlx-lm model ``config`` describes.

    Raises:
        ModelImportError: a missing or unexpected weight, or one whose shape contradicts the metadata.
    """
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    try:
        model = module.Model(module.ModelArgs.from_dict(dict(config)))
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise ModelImportError(f"the GGUF metadata does not describe a valid {config['model_type']} model ({exc})") from None
    expected = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    if config.get("tie_word_embeddings"):
        expected.pop("lm_head.weight", None)
    if missing := sorted(set(expected) - set(shapes)):
        raise ModelImportError(f"the GGUF lacks tensors its metadata implies: {', '.join(missing[:5])}")
    if extra := sorted(set(shapes) - set(expected)):
        raise ModelImportError(f"the GGUF has tensors its metadata does not account for: {', '.join(extra[:5])}")
    for name, shape in shapes.items():
        if tuple(shape) != expected[name]:
            raise ModelImportError(
                f"tensor {name} has shape {list(shape)} but the GGUF metadata implies {list(expected[name])}"
            )


def unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (works on packed quantized rows too: rows are independent).

    llama.cpp's converter does ``w.reshape(n_head, 2, r, ...).swapaxes(1, 2)``; this is the inverse.
    """
    n_rows = rows.shape[0]
    return np.ascontiguousarray(
        rows.reshape(n_head, n_rows // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


def _pack4(values: np.ndarray, rows: int) -> np.ndarray:
    """4-bit values (one row per tensor row, in order) packed as MLX does: two a byte, low first."""
    return np.ascontiguousarray(values[..., 0::2] | (values[..., 1::2] << 4)).reshape(rows, -1).view(np.uint32)


def _repack_native(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> list[np.ndarray]:
    """Re-lay GGUF Q4_0/Q4_1/Q8_0 blocks as MLX affine quantization (group 32), losslessly.

    Returns ``[weight (uint32), scales (float16), biases (float16)]`` with one row per tensor row, the
    layout ``mx.quantize`` produces: value = scale * q + bias, q unsigned, packed little-endian.
    """
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = data.reshape(data.shape[0], -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == _GQT.Q8_0:  # d, then 32 signed bytes: value = d * q
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        weight = np.ascontiguousarray(q).reshape(data.shape[0], -1).view(np.uint32)
        bias = d * np.float16(-128)
    else:  # d (and m for Q4_1), then 16 bytes: low nibbles are values 0-15, high nibbles 16-31
        start = 4 if qtype == _GQT.Q4_1 else 2
        bias = blocks[..., 2:4].copy().view(np.float16)[..., 0] if qtype == _GQT.Q4_1 else d * np.float16(-8)
        nibbles = blocks[..., start:]
        weight = _pack4(np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1), data.shape[0])
    return [weight, np.ascontiguousarray(d), np.ascontiguousarray(bias)]


def _to_mlx_float(values: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(values).astype(dtype)


def stored_float(values: np.ndarray, dtype: str) -> np.ndarray | mx.array:
    """A float tensor (norm, bias) in the form ``dtype`` stores unquantized floats."""
    if dtype in ("float32", "float16"):
        return np.ascontiguousarray(values, dtype=dtype)
    if dtype == "native":
        return np.ascontiguousarray(values, dtype=np.float32)
    return _to_mlx_float(values, mx.bfloat16)


def dequantize(gguf_file: GGUFFile, tensor: TensorInfo) -> np.ndarray:
    """The tensor as float32 in Hugging Face layout (``reversed`` GGUF shape)."""
    try:
        values = gguf.quants.dequantize(gguf_file.data(tensor), tensor.tensor_type)
    except NotImplementedError:
        raise ModelImportError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be converted"
        ) from None
    return np.asarray(values, dtype=np.float32).reshape(tuple(reversed(tensor.shape)))


def kept_as_blocks(tensor: TensorInfo, dtype: str) -> bool:
    """Whether ``dtype`` stores ``tensor`` as its GGUF blocks (``BLOCK_TYPES``, a matrix)."""
    return dtype == "native" and tensor.tensor_type in BLOCK_TYPES and len(tensor.shape) == 2


def convert_tensor(
    gguf_file: GGUFFile, tensor: TensorInfo, hf_name: str, arch: Architecture, config: Mapping[str, Any], dtype: str
) -> dict[str, np.ndarray | mx.array]:
    """Turn one GGUF tensor into the safetensors entries of its Hugging Face name."""
    qtype = tensor.tensor_type
    base = hf_name.removesuffix(".weight").removesuffix(".bias")
    heads = None
    if arch.unpermute_qk and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        heads = config["num_attention_heads"]
    elif arch.unpermute_qk and hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        heads = config["num_key_value_heads"]

    if dtype == "native" and qtype in NATIVE_TYPES and len(tensor.shape) == 2:
        parts = _repack_native(gguf_file.data(tensor), qtype)
        if heads is not None:
            parts = [unpermute(p, heads) for p in parts]
        return dict(zip((hf_name, f"{base}.scales", f"{base}.biases"), parts, strict=True))
    if kept_as_blocks(tensor, dtype):
        rows = np.ascontiguousarray(gguf_file.data(tensor)).reshape(tensor.shape[1], -1)
        return {hf_name: unpermute(rows, heads) if heads is not None else rows}

    values = dequantize(gguf_file, tensor)
    if heads is not None:
        values = unpermute(values, heads)
    if arch.norm_offset and hf_name.endswith("norm.weight"):
        values = values - np.float32(arch.norm_offset)

    if dtype in ("float32", "float16"):
        return {hf_name: np.ascontiguousarray(values, dtype=dtype)}
    if dtype == "bfloat16":
        return {hf_name: _to_mlx_float(values, mx.bfloat16)}
    if dtype == "native" and values.ndim == 2 and qtype in (_GQT.F16, _GQT.BF16):  # matrices keep their bytes
        return {hf_name: np.ascontiguousarray(values, np.float16) if qtype == _GQT.F16 else _to_mlx_float(values, mx.bfloat16)}
    if dtype == "native":  # a type MLX cannot keep quantized: float tensors stay float32, the rest bf16
        return {hf_name: np.ascontiguousarray(values) if qtype in _FLOAT_TYPES else _to_mlx_float(values, mx.bfloat16)}
    floats = _to_mlx_float(values, _QUANTIZED_MODES_FLOAT)
    if values.ndim != 2 or values.shape[-1] % QUANT_GROUP or hf_name.endswith(".bias"):
        return {hf_name: floats}
    weight, scales, biases = mx.quantize(floats, group_size=QUANT_GROUP, bits=QUANT_BITS[dtype])
    return {hf_name: weight, f"{base}.scales": scales, f"{base}.biases": biases}
