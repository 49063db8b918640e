"""Vision-language model directories into the store: the language model apart from the vision tower.

A vision-language directory (transformers' layout, or ``mlx-community``'s as mlx-vlm writes it)
holds one model of three parts: a language model, a vision tower and the projector between
them.  The store keeps them apart, so that the language model is an ordinary chat model
(converted, quantized, fused and batched as any other) and the tower is read beside it:

- the language model's ``config.json`` is the source's ``text_config`` and its weights are the
  ``text_model`` / ``language_model`` tensors renamed as mlx-lm names them (``model.*``,
  ``lm_head.*``); the tokenizer, chat template and processor files are the source's;
- ``vision/config.json`` is the source's whole ``config.json`` and ``vision/weights.safetensors``
  holds the tower's and projector's tensors in mlx-vlm's names, as they were (the tower is built
  by mlx-vlm at load, which lays out what needs it).

The families are those whose tower ``turbospark.vision`` builds; any other is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from .gguf_import import ModelImportError
from .hf_import import kept_files

__all__ = ["VISION_FAMILIES", "is_vision", "language_config", "split_vision", "vision_family"]

#: The vision-language families served: model_type -> the prefixes of their tower's tensors (in
#: mlx-vlm's names).
VISION_FAMILIES: dict[str, tuple[str, ...]] = {
    "idefics3": ("vision_model.", "connector."),
    "smolvlm": ("vision_model.", "connector."),
    "llava": ("vision_tower.", "multi_modal_projector."),
    "gemma3": ("vision_tower.", "multi_modal_projector."),
    "qwen2_vl": ("vision_tower.",),
    "qwen2_5_vl": ("vision_tower.",),
    "mistral3": ("vision_tower.", "multi_modal_projector."),
}
#: The families whose language model is a Qwen2 (its RoPE multimodal only where images are read)
_QWEN = ("qwen2_vl", "qwen2_5_vl")
#: Tensors of a source that no family's tower reads: SigLIP's pooling head, which Gemma 3 does
#: not use (its projector pools the patches itself).
_UNREAD = ("vision_tower.head.", "vision_tower.vision_model.head.")

# Where each layout keeps the language model, and where the tower's tensors sit (the first match).
_RENAMES = (
    ("model.layers.", "text", "model.layers."),  # Qwen2-VL's repositories: the language model at the top
    ("model.embed_tokens.", "text", "model.embed_tokens."),
    ("model.norm.", "text", "model.norm."),
    ("model.visual.", "vision", "vision_tower."),
    ("visual.", "vision", "vision_tower."),
    ("model.text_model.", "text", "model."),
    ("model.language_model.", "text", "model."),
    ("language_model.model.", "text", "model."),
    ("language_model.lm_head.", "text", "lm_head."),
    ("lm_head.", "text", "lm_head."),
    ("model.", "vision", ""),
    ("", "vision", ""),
)


def is_vision(config: dict[str, Any]) -> bool:
    """Whether ``config`` describes a vision-language model (it has a ``vision_config``)."""
    return isinstance(config.get("vision_config"), dict)


def vision_family(config: dict[str, Any]) -> str:
    """The family of a vision-language ``config``, if it is one served here."""
    family = config.get("model_type")
    if family not in VISION_FAMILIES:
        raise ModelImportError(
            f"the vision-language architecture {family!r} is not supported "
            f"(supported: {', '.join(sorted(VISION_FAMILIES))})"
        )
    if not isinstance(config.get("text_config"), dict) and family not in _QWEN:  # Qwen2-VL's may be at the top
        raise ModelImportError(f"{family} config.json has no text_config")
    return str(family)


def language_config(config: dict[str, Any]) -> dict[str, Any]:
    if config["model_type"] in _QWEN:  # a Qwen2 to mlx-lm, its config at the top or in text_config
        top = {k: v for k, v in config.items() if k not in ("vision_config", "text_config")}
        return {**top, **(config.get("text_config") or {}), "model_type": "qwen2"}
    text = dict(config["text_config"])
    for key in ("quantization", "quantization_config"):  # mlx-community: the language model's
        if key in config and key not in text:
            text[key] = config[key]
    text.setdefault("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)))
    return text


def split_vision(src: Path, work: Path) -> Path:
    """Write ``src``'s language model as a directory of its own under ``work`` (returned) and its
    tower under ``work / "vision"``; refuses a tensor that belongs to neither."""
    config = json.loads((src / "config.json").read_text())
    family = vision_family(config)
    text_dir, vision_dir = work / "text", work / "vision"
    text_dir.mkdir()
    vision_dir.mkdir()
    for f in kept_files(src):
        if f.suffix != ".safetensors" and f.name != "config.json" and not f.name.endswith(".index.json"):
            (text_dir / f.name).symlink_to(f.resolve())
    text: dict[str, mx.array] = {}
    vision: dict[str, mx.array] = {}
    tower = VISION_FAMILIES[family]
    for f in sorted(src.glob("model*.safetensors")):
        for key, array in mx.load(str(f)).items():
            for prefix, part, to in _RENAMES:
                if not key.startswith(prefix):
                    continue
                name = to + key[len(prefix):]
                if (family not in _QWEN and name.startswith("vision_tower.")
                        and not name.startswith("vision_tower.vision_model.")):
                    name = "vision_tower.vision_model." + name[len("vision_tower."):]  # transformers 5 drops it
                if name.startswith(_UNREAD):
                    break
                if part == "vision" and not name.startswith(tower):
                    raise ModelImportError(f"{f.name}: tensor {key!r} belongs to no part of a {family} model")
                (text if part == "text" else vision)[name] = array
                break
    if not text or not vision:
        raise ModelImportError(f"{src} holds no {'language model' if not text else 'vision tower'} tensors")
    mx.save_safetensors(str(text_dir / "model.safetensors"), text, {"format": "mlx"})
    mx.save_safetensors(str(vision_dir / "weights.safetensors"), vision, {"format": "mlx"})
    (text_dir / "config.json").write_text(json.dumps(language_config(config), indent=2) + "\n")
    (vision_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return text_dir
