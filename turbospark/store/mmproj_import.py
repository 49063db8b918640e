"""llama.cpp's vision projector files (``mmproj-*.gguf``) beside a GGUF language model.

llama.cpp keeps a vision-language model in two GGUFs: the language model, and a projector file
(``general.architecture`` ``clip``) holding the vision tower and the projector into the language
model's embeddings.  Ollama's vision models carry the same file as their ``projector`` layer.  The
import converts the language model as any GGUF, then the projector into what a vision-language
directory's import writes (``store.vision_import``), so ``turbospark.vision`` serves both alike:

- ``vision/config.json``: the family's transformers config (its ``vision_config`` from the
  projector's ``clip.vision.*`` keys, its ``text_config`` the converted language model's);
- ``vision/weights.safetensors``: the tower's and projector's tensors in mlx-vlm's names, in
  transformers' layout;
- ``processor_config.json``: transformers' processor for the family, with the image size, tiles,
  mean and deviation the projector file names.

The projector types read are those whose towers are served: ``idefics3`` (SmolVLM and Idefics3).
Any other is refused by name, as a projector that does not project onto the language model's
width is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np

from .gguf_errors import ModelImportError
from .gguf_reader import GGUFFile, GGUFFormatError, read_gguf
from .gguf_tensors import dequantize

__all__ = ["PROJECTOR_TYPES", "add_projector", "is_projector", "projector_beside"]

#: Projector types read: ``clip.projector_type`` -> the vision family it is served as.
PROJECTOR_TYPES = {"idefics3": "idefics3"}

# llama.cpp's names of a SigLIP/CLIP tower's tensors -> transformers' (inside ``vision_model.``)
_TOWER = {"v.patch_embd": "embeddings.patch_embedding", "v.position_embd": "embeddings.position_embedding",
          "v.post_ln": "post_layernorm"}  # fmt: skip
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2"}  # fmt: skip
_PROJECTOR = {"idefics3": {"mm.model.fc": "connector.modality_projection.proj"}}


def _read(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except (OSError, GGUFFormatError) as exc:
        raise ModelImportError(f"{path.name}: not a readable GGUF file ({exc})") from None


def is_projector(path: Path) -> bool:
    """Whether the GGUF at ``path`` is a projector file (its architecture is ``clip``)."""
    try:
        return read_gguf(path).metadata.get("general.architecture") == "clip"
    except (OSError, GGUFFormatError):
        return False


def projector_beside(model: Path) -> Path | None:
    """The one projector file beside the GGUF ``model`` (a ``*mmproj*.gguf`` in its directory, as
    llama.cpp's and LM Studio's downloads place it), or None when there is none or several."""
    found = [p for p in model.parent.glob("*.gguf") if "mmproj" in p.name.lower() and p != model]
    return found[0] if len(found) == 1 else None


def _vision_config(meta: dict[str, Any]) -> dict[str, Any]:
    def need(key: str) -> Any:
        if f"clip.vision.{key}" not in meta:
            raise ModelImportError(f"it lacks clip.vision.{key}")
        return meta[f"clip.vision.{key}"]

    return {
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": int(need("attention.head_count")),
        "image_size": int(need("image_size")),
        "patch_size": int(need("patch_size")),
        "num_channels": 3,
        "layer_norm_eps": float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        "hidden_act": "gelu_pytorch_tanh",
    }


def _hf_name(name: str, family: str, shape: tuple[int, ...], vision: dict[str, Any]) -> str:
    base, _, suffix = name.rpartition(".")
    if base in _TOWER:
        return f"vision_model.{_TOWER[base]}.{suffix}"
    if base in _PROJECTOR[family]:
        return f"{_PROJECTOR[family][base]}.{suffix}"
    if m := re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", base):
        block, part = m[1], m[2]
        if part in ("ffn_up", "ffn_down"):
            # which one widens is told by its shape: llama.cpp's converters have named them both ways
            widens = shape[0] == vision["intermediate_size"] and (len(shape) == 1 or shape[1] == vision["hidden_size"])
            part = "mlp.fc1" if widens else "mlp.fc2"
        elif part in _BLOCK:
            part = _BLOCK[part]
        else:
            part = ""
        if part:
            return f"vision_model.encoder.layers.{block}.{part}.{suffix}"
    raise ModelImportError(f"its tensor {name!r} belongs to no part of a {family} tower")


def _stored(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> mx.array:
    """Kept in the file's float type; a quantized tensor widened to float32 (the tower runs in
    float32 on the CPU anyway)."""
    array = mx.array(values)
    if kind == gguf.GGMLQuantizationType.F16:
        return array.astype(mx.float16)
    if kind == gguf.GGMLQuantizationType.BF16:
        return array.astype(mx.bfloat16)
    return array


def add_projector(path: Path, model_dir: Path) -> str:
    """Convert the projector file at ``path`` beside the language model converted into
    ``model_dir``; returns the vision family it is served as.  Every refusal names the file."""
    try:
        return _add(path, model_dir)
    except ModelImportError as exc:
        if str(exc).startswith(path.name):
            raise
        raise ModelImportError(f"{path.name}: {exc}") from None


def _add(path: Path, model_dir: Path) -> str:
    source = _read(path)
    meta = dict(source.metadata)
    if meta.get("general.architecture") != "clip":
        raise ModelImportError(f"{path.name} is not a vision projector file (its architecture is "
                               f"{meta.get('general.architecture')!r}, not 'clip')")
    kind = str(meta.get("clip.projector_type", ""))
    if kind not in PROJECTOR_TYPES or not meta.get("clip.has_vision_encoder", True):
        raise ModelImportError(f"the projector type {kind!r} is not supported "
                               f"(supported: {', '.join(sorted(PROJECTOR_TYPES))})")
    family = PROJECTOR_TYPES[kind]
    text = json.loads((model_dir / "config.json").read_text())
    width = int(meta.get("clip.vision.projection_dim", 0))
    if width != text.get("hidden_size"):
        raise ModelImportError(f"it projects onto width {width}, but the language model's is "
                               f"{text.get('hidden_size')}: it is another model's projector")
    vision = _vision_config(meta)
    weights = {}
    for tensor in source.tensors:
        hf_shape = tuple(reversed(tensor.shape))
        weights[_hf_name(tensor.name, family, hf_shape, vision)] = _stored(dequantize(source, tensor), tensor.tensor_type)
    (model_dir / "vision").mkdir()
    mx.save_safetensors(str(model_dir / "vision" / "weights.safetensors"), weights, {"format": "mlx"})
    config, processor = _CONFIGS[family](meta, vision, text, model_dir)
    (model_dir / "vision" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (model_dir / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return family


def _token_id(model_dir: Path, token: str) -> int:
    vocab = json.loads((model_dir / "tokenizer.json").read_text())
    for added in vocab.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    found = vocab.get("model", {}).get("vocab", {}).get(token)
    if found is None:
        raise ModelImportError(f"the language model's vocabulary has no {token} token for its images")
    return int(found)


def _idefics3(meta: dict[str, Any], vision: dict[str, Any], text: dict[str, Any], model_dir: Path) -> tuple[dict, dict]:
    """Idefics3's transformers config and processor (SmolVLM's tiles: each ``image_size`` square
    of the image resized to ``preproc_image_size`` at most, then the whole image)."""
    scale = int(meta.get("clip.vision.projector.scale_factor", 2))
    side = vision["image_size"] // vision["patch_size"]
    config = {
        "model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"],
        "image_token_id": _token_id(model_dir, "<image>"), "scale_factor": scale,
        "vision_config": {**vision, "model_type": "idefics3_vision"}, "text_config": text,
    }  # fmt: skip
    processor = {
        "processor_class": "Idefics3Processor",
        "image_seq_len": side * side // (scale * scale),
        "image_processor": {
            "image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True, "do_image_splitting": True,
            "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True, "resample": 1,
            "rescale_factor": 1 / 255, "image_mean": list(meta.get("clip.vision.image_mean", [0.5] * 3)),
            "image_std": list(meta.get("clip.vision.image_std", [0.5] * 3)),
            "max_image_size": {"longest_edge": vision["image_size"]},
            "size": {"longest_edge": int(meta.get("clip.vision.preproc_image_size", vision["image_size"]))},
        },
    }  # fmt: skip
    return config, processor


#: each family's transformers config and processor, from the projector file's keys
_CONFIGS = {"idefics3": _idefics3}
