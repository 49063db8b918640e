"""Convert a GGUF file (llama.cpp's format) into an MLX / Hugging Face model directory.

The steps, each in its own module:

1. read the header and tensor table (:mod:`.gguf_reader`, fast on large vocabularies);
2. map the metadata onto an mlx-lm ``config.json`` (:mod:`.gguf_architectures`: ``llama`` (and
   Mistral, which GGUF writes as llama), ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``, ``phi3``);
3. map tensor names and check every shape against the model the config describes, before
   converting anything (:mod:`.gguf_tensors`);
4. rebuild the tokenizer (:mod:`.gguf_tokenizer`, ids equal to llama.cpp's);
5. convert tensor by tensor into ``model.safetensors`` (:mod:`.gguf_safetensors`), so peak memory
   stays near the size of the largest tensor rather than the whole model. Every quantization type
   ``gguf`` can dequantize is accepted.

Anything that cannot be converted faithfully raises :class:`ModelImportError` naming what: not a
GGUF, truncated, an unsupported architecture, pre-tokenizer or metadata key, tensors that
contradict the metadata. The caller builds into a scratch directory, so the store is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import gguf
import mlx.core as mx
from tqdm import tqdm

from .gguf_architectures import ARCHITECTURES, build_config, llama3_rope_scaling
from .gguf_errors import ModelImportError
from .gguf_reader import GGUFFile, GGUFFormatError, read_gguf
from .gguf_safetensors import SafetensorsWriter
from .gguf_tensors import (
    NATIVE_TYPES,
    QUANT_BITS,
    QUANT_GROUP,
    check_shapes,
    convert_tensor,
    dequantize,
    hf_names,
    kept_as_blocks,
    stored_float,
    zero_biases,
)
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
#: tensors as MLX affine-quantized ones (group 32, lossless) and its other block types as their
#: blocks (``BLOCK_TYPES``); ``q8``/``q4`` re-quantize with MLX (group 64).
DTYPES = ("float32", "float16", "bfloat16", "native", "q8", "q4")
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
Q4_K = gguf.GGMLQuantizationType.Q4_K


def default_dtype() -> str:
    """The dtype that fits this platform: the GGUF's own quantization where MLX keeps it
    (``native``), with Metal, or on the CPU where turbospark's kernels read it (decision 0027:
    the same weights as the float32 import, a fifth of the bytes, faster); ``float32`` on a CPU
    without them, where only float32 products are fast (BLAS).
    """
    from ..kernels import ops as kernels

    return "native" if mx.metal.is_available() or kernels.available() else "float32"


def check_dtype(dtype: str) -> None:
    """Raise :class:`ModelImportError` unless ``dtype`` is one of :data:`DTYPES`."""
    if dtype not in DTYPES:
        raise ModelImportError(f"unknown dtype {dtype!r} (choose one of {', '.join(DTYPES)})")


@attrs.frozen
class ConvertedModel:
    """What :func:`convert_gguf` learned about the model it wrote."""

    architecture: str  #: the ``model_type`` in config.json, e.g. ``llama`` or ``gemma3_text``
    context_length: int


def open_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file, turning the reader's failures into a clear :class:`ModelImportError`."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelImportError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return read_gguf(path)
    except GGUFFormatError as exc:
        raise ModelImportError(
            f"{path} is a damaged GGUF file ({path.stat().st_size:,} bytes): it is truncated or corrupt ({exc})"
        ) from None


def _rope_factors(gguf_file: GGUFFile, config: dict) -> None:
    """Fill in the RoPE scaling parameters stored as tensors (Llama 3.x, Phi-3 long RoPE)."""
    tensors = {t.name: t for t in gguf_file}
    scaling = config.get("rope_scaling") or {}
    if "rope_freqs.weight" in tensors and scaling.get("type") != "llama3":
        raise ModelImportError("rope_freqs.weight together with another RoPE scaling is not supported")
    if scaling.get("type") == "llama3":
        factors = dequantize(gguf_file, tensors["rope_freqs.weight"]).reshape(-1)
        context = gguf_file.metadata.get(f"{gguf_file.metadata['general.architecture']}.rope.scaling.original_context_length")
        config["rope_scaling"] = llama3_rope_scaling(
            factors, base=config["rope_theta"], dims=config["head_dim"], context=context
        )
    elif scaling.get("type") == "longrope":
        for kind in ("long", "short"):
            if (tensor := tensors.get(f"rope_factors_{kind}.weight")) is None:
                raise ModelImportError(f"long RoPE scaling without rope_factors_{kind}.weight")
            scaling[f"{kind}_factor"] = [float(x) for x in dequantize(gguf_file, tensor).reshape(-1)]


def convert_gguf(path: Path, out_dir: Path, *, dtype: str, progress: bool = True) -> ConvertedModel:
    """Convert the GGUF at ``path`` into ``out_dir`` (which must exist).

    Writes ``config.json``, ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.

    Args:
        path: the GGUF file.
        out_dir: an existing, empty directory.
        dtype: one of :data:`DTYPES`.
        progress: show a progress bar over tensors on stderr.

    Raises:
        ModelImportError: not a GGUF, damaged, unsupported architecture, metadata, tensor or
            tokenizer, or tensors whose shapes contradict the metadata.
    """
    check_dtype(dtype)
    gguf_file = open_gguf(path)
    shapes = {t.name: t.shape for t in gguf_file}
    try:
        arch_name, arch, config = build_config(gguf_file.metadata, shapes)
    except ModelImportError as exc:
        raise ModelImportError(f"{path.name}: {exc}") from None
    try:
        _rope_factors(gguf_file, config)
        names = hf_names(gguf_file, arch, arch_name)
        zeros = zero_biases(arch, config, set(names.values()))
        logical = {hf: tuple(reversed(shapes[name])) for name, hf in names.items()}
        check_shapes(config, logical | {name: z.shape for name, z in zeros.items()})
    except ModelImportError as exc:
        raise ModelImportError(f"{path.name}: {exc}") from None

    try:
        save_tokenizer(gguf_file.metadata, out_dir, context_length=config["max_position_embeddings"])
    except UnsupportedTokenizerError as exc:
        raise ModelImportError(f"{path.name}: {exc}") from None

    tensors = [t for t in gguf_file if t.name in names]
    with SafetensorsWriter(out_dir / "model.safetensors") as writer:
        for tensor in tqdm(tensors, desc="converting", unit="tensor", disable=not progress, leave=False):
            for name, array in convert_tensor(gguf_file, tensor, names[tensor.name], arch, config, dtype).items():
                writer.add(name, array)
        for name, array in zeros.items():
            writer.add(name, stored_float(array, dtype))

    file_type = gguf_file.metadata.get("general.file_type")
    if dtype == "native" and isinstance(file_type, int) and file_type in gguf.LlamaFileType._value2member_map_:
        config["gguf_file_type"] = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")  # Q4_K_M...
    if blocks := {names[t.name].removesuffix(".weight"): int(t.tensor_type) for t in tensors if kept_as_blocks(t, dtype)}:
        config["ggml_types"] = blocks  # module -> GGUF type: read through ggml (``model.mlx_ggml``)
    if dtype == "native" and any(t.tensor_type in NATIVE_TYPES | {Q4_K} and len(t.shape) == 2 for t in tensors):
        # Per-layer bits are inferred from the packed shapes; group 32 is the GGUF block size.  (Q4_K
        # blocks become affine 4-bit at load where the kernels do not read them: ``mlx_ggml``.)
        config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    elif dtype in QUANT_BITS:
        config["quantization"] = {"group_size": QUANT_GROUP, "bits": QUANT_BITS[dtype], "mode": "affine"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ConvertedModel(architecture=config["model_type"], context_length=config["max_position_embeddings"])
