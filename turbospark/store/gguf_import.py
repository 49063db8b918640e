"""Convert a GGUF file (llama.cpp's format) into an MLX / Hugging Face model directory.

Supported architectures are the two the catalogue ships: ``llama`` (SmolLM2) and ``gemma3`` (Gemma 3
270M). Every tensor is read with the ``gguf`` package, so every quantization type it can dequantize is
accepted; the result is written tensor by tensor to ``model.safetensors`` so that peak memory stays
near the size of the largest tensor rather than the whole model.

Two traps, both invisible until the model generates text:

* llama.cpp permutes the rows of the llama Q and K projections to suit its interleaved RoPE.
  :func:`_unpermute` undoes it. Applying the forward permutation instead produces text that looks
  right for a few tokens and then degenerates.
* llama.cpp stores Gemma's RMSNorm weights as ``1 + w``; MLX's Gemma adds the 1 itself, so 1.0 is
  subtracted from every norm weight.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import gguf
import mlx.core as mx
import numpy as np
from tqdm import tqdm

from .gguf_tokenizer import UnsupportedTokenizerError, save_tokenizer

__all__ = [
    "DTYPES",
    "SUPPORTED_ARCHITECTURES",
    "ConvertedModel",
    "ModelImportError",
    "check_dtype",
    "convert_gguf",
    "default_dtype",
    "open_gguf",
]

#: Accepted values of ``dtype``: plain float types; ``native`` keeps the GGUF's Q4_0/Q4_1/Q8_0
#: tensors as MLX affine-quantized ones (group 32, lossless); ``q8``/``q4`` re-quantize with MLX
#: (group 64).
DTYPES = ("float32", "float16", "bfloat16", "native", "q8", "q4")

_GQT = gguf.GGMLQuantizationType
# GGUF block types that map losslessly onto MLX affine quantization (what mx.load supports).
_NATIVE_TYPES = {_GQT.Q4_0, _GQT.Q4_1, _GQT.Q8_0}
_FLOAT_TYPES = {_GQT.F32, _GQT.F16, _GQT.BF16}
_MLX_QUANT_BITS = {"q8": 8, "q4": 4}
_MLX_QUANT_GROUP = 64
# Tensors that are neither kept native nor re-quantized land in this type in the quantized modes.
_QUANTIZED_MODES_FLOAT = mx.bfloat16


class ModelImportError(Exception):
    """A source cannot be imported: missing, corrupt, truncated or of an unsupported kind."""


def default_dtype() -> str:
    """The dtype that fits this platform.

    On the MLX CPU backend only float32 matmuls use BLAS; bf16/fp16 and quantized matmuls are 2-20x
    slower, so CPU gets ``float32``. With Metal, quantized weights are fast and small, so the GGUF's
    own quantization is kept where MLX supports it (``native``).
    """
    return "native" if mx.metal.is_available() else "float32"


def check_dtype(dtype: str) -> None:
    """Raise :class:`ModelImportError` unless ``dtype`` is one of :data:`DTYPES`."""
    if dtype not in DTYPES:
        raise ModelImportError(f"unknown dtype {dtype!r} (choose one of {', '.join(DTYPES)})")


@attrs.frozen
class ConvertedModel:
    """What :func:`convert_gguf` learned about the model it wrote."""

    architecture: str  #: the ``model_type`` in config.json, e.g. ``llama`` or ``gemma3_text``
    context_length: int


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file, turning the reader's low-level failures into a clear :class:`ModelImportError`."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelImportError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, struct.error) as exc:
        raise ModelImportError(
            f"{path} is a damaged GGUF file ({path.stat().st_size:,} bytes): it is truncated or corrupt "
            f"(reader error: {exc})"
        ) from None


# -- architectures ------------------------------------------------------------------------------------

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_COMMON_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}


def _f32(value: float) -> float:
    """A GGUF float32 as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _common_config(md: Mapping[str, Any], arch: str) -> dict[str, Any]:
    heads = md[f"{arch}.attention.head_count"]
    hidden = md[f"{arch}.embedding_length"]
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelImportError(f"unsupported RoPE scaling {scaling!r} for architecture {arch!r}")
    return {
        "hidden_size": hidden,
        "num_hidden_layers": md[f"{arch}.block_count"],
        "intermediate_size": md[f"{arch}.feed_forward_length"],
        "num_attention_heads": heads,
        "num_key_value_heads": md.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": md.get(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": _f32(md[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": md[f"{arch}.context_length"],
        "vocab_size": len(md["tokenizer.ggml.tokens"]),
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
    }


def _llama_config(md: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **_common_config(md, "llama"),
        "eos_token_id": md["tokenizer.ggml.eos_token_id"],
        "rope_theta": _f32(md.get("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }


def _gemma3_config(md: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    # Gemma's chat turns end with <end_of_turn>, so generation stops on it as well as on <eos>.
    eos = [md["tokenizer.ggml.eos_token_id"]]
    tokens = md["tokenizer.ggml.tokens"]
    if "<end_of_turn>" in tokens:
        eos.append(tokens.index("<end_of_turn>"))
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        **_common_config(md, "gemma3"),
        "eos_token_id": eos,
        "rope_theta": _f32(md["gemma3.rope.freq_base"]),
        "sliding_window": md["gemma3.attention.sliding_window"],
        # Not in the GGUF; these are the values of the Hugging Face Gemma 3 (270M..12B) configs.
        "query_pre_attn_scalar": 256,
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
    }


@attrs.frozen
class _Architecture:
    layer_names: Mapping[str, str]  #: GGUF per-block tensor name -> Hugging Face name within the layer
    config: Callable[[Mapping[str, Any], set[str]], dict[str, Any]]
    unpermute_qk: bool  #: llama.cpp permuted the Q/K rows for its interleaved RoPE
    norm_offset: float  #: subtracted from every norm weight (llama.cpp stores Gemma's 1+w)


_ARCHITECTURES = {
    "llama": _Architecture(
        layer_names={**_COMMON_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"},
        config=_llama_config,
        unpermute_qk=True,
        norm_offset=0.0,
    ),
    "gemma3": _Architecture(
        layer_names={
            **_COMMON_LAYER_NAMES,
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        config=_gemma3_config,
        unpermute_qk=False,
        norm_offset=1.0,
    ),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def _hf_name(gguf_name: str, arch: _Architecture) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in arch.layer_names:
        return f"model.layers.{parts[1]}.{arch.layer_names[parts[2]]}.{suffix}"
    return None


# -- tensor transforms ------------------------------------------------------------------------------------


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (works on packed quantized rows too: rows are independent).

    llama.cpp's converter does ``w.reshape(n_head, 2, r, ...).swapaxes(1, 2)``; this is the inverse.
    """
    n_rows = rows.shape[0]
    return np.ascontiguousarray(
        rows.reshape(n_head, n_rows // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


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
        bias = d * np.float16(-128)
    else:  # d (and m for Q4_1), then 16 bytes: low nibbles are values 0-15, high nibbles 16-31
        start = 4 if qtype == _GQT.Q4_1 else 2
        bias = blocks[..., 2:4].copy().view(np.float16)[..., 0] if qtype == _GQT.Q4_1 else d * np.float16(-8)
        nibbles = blocks[..., start:]
        values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
        q = values[..., 0::2] | (values[..., 1::2] << 4)
    weight = np.ascontiguousarray(q).reshape(data.shape[0], -1).view(np.uint32)
    return [weight, np.ascontiguousarray(d), np.ascontiguousarray(bias)]


def _to_mlx_float(values: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(values).astype(dtype)


def _convert_tensor(
    tensor: gguf.ReaderTensor, hf_name: str, arch: _Architecture, config: Mapping[str, Any], dtype: str
) -> dict[str, np.ndarray | mx.array]:
    """Turn one GGUF tensor into the safetensors entries of its Hugging Face name."""
    qtype = tensor.tensor_type
    base = hf_name.removesuffix(".weight")
    heads = None
    if arch.unpermute_qk and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        heads = config["num_attention_heads" if ".q_proj." in hf_name else "num_key_value_heads"]

    if dtype == "native" and qtype in _NATIVE_TYPES:
        parts = _repack_native(tensor.data, qtype)
        if heads is not None:
            parts = [_unpermute(p, heads) for p in parts]
        return dict(zip((hf_name, f"{base}.scales", f"{base}.biases"), parts, strict=True))

    try:
        values = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ModelImportError(f"tensor {tensor.name!r} has type {qtype.name}, which cannot be converted") from None
    values = values.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    if heads is not None:
        values = _unpermute(values, heads)
    if arch.norm_offset and hf_name.endswith("norm.weight"):
        values = values - np.float32(arch.norm_offset)

    if dtype in ("float32", "float16"):
        return {hf_name: np.ascontiguousarray(values, dtype=dtype)}
    if dtype == "bfloat16":
        return {hf_name: _to_mlx_float(values, mx.bfloat16)}
    if dtype == "native":  # a type MLX cannot keep quantized: float tensors stay float32, the rest bf16
        return {hf_name: np.ascontiguousarray(values) if qtype in _FLOAT_TYPES else _to_mlx_float(values, mx.bfloat16)}
    floats = _to_mlx_float(values, _QUANTIZED_MODES_FLOAT)
    if values.ndim != 2 or values.shape[-1] % _MLX_QUANT_GROUP:
        return {hf_name: floats}
    weight, scales, biases = mx.quantize(floats, group_size=_MLX_QUANT_GROUP, bits=_MLX_QUANT_BITS[dtype])
    return {hf_name: weight, f"{base}.scales": scales, f"{base}.biases": biases}


# -- safetensors --------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "uint32": "U32",
}


class _SafetensorsWriter:
    """Write a safetensors file one tensor at a time (a context manager).

    The header (names, dtypes, offsets) must come first but is only known at the end, so tensor bytes
    go to a scratch file next to the target and are appended after the header when the block exits
    without an error.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._scratch_path = path.with_name(path.name + ".data")
        self._scratch: BinaryIO = self._scratch_path.open("wb")
        self._header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
        self._offset = 0

    def add(self, name: str, array: np.ndarray | mx.array) -> None:
        dtype = str(array.dtype).removeprefix("mlx.core.")
        if dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"no safetensors dtype for {dtype}")
        data = memoryview(array)  # both array types export a C-contiguous buffer
        self._scratch.write(data)
        end = self._offset + data.nbytes
        self._header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(array.shape),
            "data_offsets": [self._offset, end],
        }
        self._offset = end

    def __enter__(self) -> _SafetensorsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self._scratch.close()
        if exc_type is None:
            self._finish()
        self._scratch_path.unlink()

    def _finish(self) -> None:
        header = json.dumps(self._header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the format aligns the data section to 8 bytes
        with self._path.open("wb") as out, self._scratch_path.open("rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(data, out, 16 << 20)


# -- conversion ------------------------------------------------------------------------------------------


def convert_gguf(path: Path, out_dir: Path, *, dtype: str, progress: bool = True) -> ConvertedModel:
    """Convert the GGUF at ``path`` into ``out_dir`` (which must exist).

    Writes ``config.json``, ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.

    Args:
        path: the GGUF file.
        out_dir: an existing, empty directory.
        dtype: one of :data:`DTYPES`.
        progress: show a progress bar over tensors on stderr.

    Raises:
        ModelImportError: not a GGUF, damaged, unknown architecture, unsupported tensor or tokenizer.
    """
    check_dtype(dtype)
    reader = open_gguf(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    arch_name = str(metadata.get("general.architecture", "(none)"))
    arch = _ARCHITECTURES.get(arch_name)
    if arch is None:
        raise ModelImportError(
            f"{path.name}: unsupported architecture {arch_name!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    mapped = {t.name: _hf_name(t.name, arch) for t in reader.tensors}
    if unknown := sorted(name for name, hf in mapped.items() if hf is None):
        raise ModelImportError(f"{path.name}: unsupported tensors for {arch_name}: {', '.join(unknown[:5])}")
    names = {name: hf for name, hf in mapped.items() if hf is not None}
    try:
        config = arch.config(metadata, set(names))
    except KeyError as exc:
        raise ModelImportError(f"{path.name}: GGUF metadata {exc} is missing") from None

    try:
        save_tokenizer(metadata, out_dir, context_length=config["max_position_embeddings"])
    except UnsupportedTokenizerError as exc:
        raise ModelImportError(f"{path.name}: {exc}") from None

    with _SafetensorsWriter(out_dir / "model.safetensors") as writer:
        for tensor in tqdm(reader.tensors, desc="converting", unit="tensor", disable=not progress, leave=False):
            for name, array in _convert_tensor(tensor, names[tensor.name], arch, config, dtype).items():
                writer.add(name, array)

    if dtype == "native" and any(t.tensor_type in _NATIVE_TYPES for t in reader.tensors):
        # Per-layer bits are inferred from the packed shapes; group 32 is the GGUF block size.
        config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    elif dtype in _MLX_QUANT_BITS:
        config["quantization"] = {"group_size": _MLX_QUANT_GROUP, "bits": _MLX_QUANT_BITS[dtype], "mode": "affine"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ConvertedModel(architecture=config["model_type"], context_length=config["max_position_embeddings"])
