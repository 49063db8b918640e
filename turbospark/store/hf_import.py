"""Hugging Face model directories into the store: which of their files it keeps, their digest,
and the weights converted to the dtype asked for (copied as they are for ``native``, cast for a
float dtype, re-quantized by mlx-lm for ``q8``/``q4``).  The result is checked by building the
model with mlx-lm.

An ``mlx-community`` directory is one of them: its weights are already in mlx-lm's names and,
when its ``config.json`` has a ``quantization`` block (or Hugging Face's ``quantization_config``),
quantized.  ``native`` keeps that quantization; a float dtype dequantizes it (mlx-lm builds the
model, ``dequantize_model``, then casts); ``q8``/``q4`` dequantize and quantize again.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from .gguf_import import ModelImportError
from .hashing import copy_and_hash, files_digest
from .progress import Progress, progress_from

__all__ = ["check_architecture", "check_loads", "convert_hf", "directory_sha256", "is_quantized", "kept_files"]

# mlx_lm.utils is imported where it is used: importing it takes ~1-2 s (it pulls in transformers),
# which `turbospark models list` and `rm` need not pay.

# Files of a Hugging Face directory that are copied besides the weights: configs, chat templates,
# texts, and licence files whatever their suffix.
_EXTRA_SUFFIXES = (".json", ".jinja", ".txt", ".md")
_LICENCE_PREFIXES = ("LICENSE", "LICENCE", "NOTICE", "GEMMA_TERMS")


def kept_files(directory: Path) -> list[Path]:
    """The files of a Hugging Face directory that the store keeps (weights, configs, tokenizer, texts)."""
    return sorted(
        f
        for f in directory.iterdir()
        if f.is_file()
        and (
            (f.name.startswith("model") and f.suffix == ".safetensors")
            or f.suffix in _EXTRA_SUFFIXES
            or f.name.upper().startswith(_LICENCE_PREFIXES)
        )
    )


def directory_sha256(directory: Path, *, progress: bool | Progress = False) -> str:
    """The digest the store records for a Hugging Face directory: each kept file's name and content
    digest, in name order (see :func:`~turbospark.store.hashing.files_digest`)."""
    return files_digest(kept_files(directory), progress=progress_from(progress))


def is_quantized(config: dict[str, Any]) -> bool:
    """Whether ``config`` describes quantized weights (mlx-lm's ``quantization``, or Hugging
    Face's ``quantization_config``, at the top or in ``text_config``)."""
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return any("quantization" in c or "quantization_config" in c for c in (config, text_config))


def check_architecture(config: dict[str, Any]) -> str:
    """The ``model_type`` of ``config``, if mlx-lm has a model of that type."""
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = config.get("model_type")
    if (
        not isinstance(model_type, str)
        or importlib.util.find_spec(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}") is None
    ):
        raise ModelImportError(f"unknown architecture {model_type!r}: mlx-lm has no model of that type")
    return model_type


def _template_file(src: Path) -> str | None:
    """A directory's chat template kept beside the tokenizer's config: ``chat_template.jinja``
    (transformers 4.51 on), or the ``chat_template`` of a ``chat_template.json`` (a processor's,
    as older vision repositories such as SmolVLM2's keep it)."""
    if (src / "chat_template.jinja").is_file():
        return (src / "chat_template.jinja").read_text()
    try:
        template = json.loads((src / "chat_template.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) else None


def convert_hf(src: Path, out: Path, *, dtype: str, progress: Progress) -> dict[str, Any]:
    """Copy a Hugging Face directory into ``out``, converting the weights to ``dtype``; returns config."""
    config = json.loads((src / "config.json").read_text())
    for f in kept_files(src):
        if f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    if "chat_template" not in tok_config:  # a template of its own file: the newer .jinja, or the older .json
        template = _template_file(src)
        if template is not None:
            tok_config["chat_template"] = template
            tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")

    weight_files = sorted(src.glob("model*.safetensors"))
    if dtype == "native":
        for f in progress.each(weight_files, desc="copying", unit="file"):
            with f.open("rb") as source, (out / f.name).open("wb") as dest:
                copy_and_hash([source], total=f.stat().st_size, out=dest, progress=progress, desc=f.name)
    elif dtype in ("q8", "q4") or is_quantized(config):
        config = _rebuilt(src, out, dtype=dtype, progress=progress)
    else:
        target = getattr(mx, dtype)
        for f in progress.each(weight_files, desc="converting", unit="file"):
            arrays = {
                key: a.astype(target) if mx.issubdtype(a.dtype, mx.floating) else a
                for key, a in mx.load(str(f)).items()
            }
            mx.save_safetensors(str(out / f.name), arrays, {"format": "mlx"})
    config = legacy_rope(config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def legacy_rope(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with RoPE's settings where mlx-lm reads them: transformers 5 writes them in
    ``rope_parameters`` (``rope_theta``, and the scaling's ``rope_type`` and factors; Gemma 3's by
    layer type, the sliding layers' theta read as ``rope_local_base_freq``), mlx-lm reads
    ``rope_theta`` and ``rope_scaling``."""
    out = dict(config)
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = legacy_rope(out["text_config"])
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):  # by layer type (Gemma 3)
        local = rope.get("sliding_attention")
        if isinstance(local, dict) and "rope_theta" in local:
            out.setdefault("rope_local_base_freq", local["rope_theta"])
        rope = rope["full_attention"]
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            out.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type") not in (None, "default"):
            out.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    return out


def _rebuilt(src: Path, out: Path, *, dtype: str, progress: Progress) -> dict[str, Any]:
    """The model built by mlx-lm from ``src``, dequantized, then quantized (``q8``/``q4``) or cast
    (a float dtype), saved into ``out`` in mlx-lm's names; returns its config."""
    from mlx_lm.utils import dequantize_model, load_model, quantize_model, save_model

    progress("converting")
    model, config = load_model(src, lazy=True)
    model = dequantize_model(model)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
        if isinstance(config.get("text_config"), dict):
            config["text_config"].pop(key, None)
    if dtype in ("q8", "q4"):
        model, config = quantize_model(model, config, group_size=64, bits=8 if dtype == "q8" else 4)
    else:
        target = getattr(mx, dtype)
        model.update(tree_map(lambda a: a.astype(target) if mx.issubdtype(a.dtype, mx.floating) else a,
                              model.parameters()))  # fmt: skip
    for stale in out.glob("model*.safetensors*"):  # the source's index names its own shards
        stale.unlink()
    save_model(out, model)
    return config


def check_loads(directory: Path) -> None:
    """Build the model from ``directory`` with mlx-lm (lazily: shapes and names only), its GGUF
    block tensors as ``model.mlx_ggml`` reads them."""
    from ..model.mlx_ggml import load_model

    try:
        load_model(directory, lazy=True)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelImportError(f"the converted model does not load in mlx-lm: {exc}") from None
