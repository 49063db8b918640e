"""BERT sentence encoders (a Hugging Face directory with sentence-transformers' configs beside it)
into the store: the weights renamed once for the runtime's own BERT
(:func:`turbospark.model.bert.hf_to_mlx`) and cast to the dtype asked for, and ``embedding.json``
(pooling, normalisation, the longest input it reads, its width, and whether its vectors may be
cut short) written from the sentence-transformers files and the model's config.  The result is checked by building the encoder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx

from .gguf_import import ModelImportError
from .hf_import import kept_files
from .progress import Progress

__all__ = ["check_encoder_loads", "convert_encoder", "embedding_spec", "is_cross_encoder"]

# turbospark.model.bert (and the model package it pulls in) is imported where it is used, so that
# `turbospark models list` and `rm` need not pay for it.


def embedding_spec(src: Path, config: dict[str, Any]) -> dict[str, Any]:
    """``embedding.json`` from a sentence-transformers directory's pooling and length settings."""

    def read(name: str) -> Any:
        try:
            return json.loads((src / name).read_text())
        except OSError:
            return None
        except ValueError as exc:
            raise ModelImportError(f"{src / name} is not valid JSON ({exc})") from None

    positions = int(config.get("max_position_embeddings", 512))
    if is_cross_encoder(config):  # sentence-transformers' CrossEncoder: one relevance logit
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1))
        if labels != 1:
            raise ModelImportError(f"{src}: a classifier with {labels} labels; only one (a relevance score) is supported")
        return {"pooling": "classifier", "labels": 1, "activation": "sigmoid", "max_tokens": positions, "dimensions": 1}
    pooling = read("1_Pooling/config.json") or {"pooling_mode_mean_tokens": True}
    others = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k != "pooling_mode_mean_tokens"]
    if not pooling.get("pooling_mode_mean_tokens") or others:
        raise ModelImportError(f"{src}: only mean pooling is supported (its pooling: {', '.join(others) or 'none'})")
    length = (read("sentence_bert_config.json") or {}).get("max_seq_length") or positions
    spec: dict[str, Any] = {
        "pooling": "mean",
        "normalize": True,
        "max_tokens": min(int(length), positions),
        "dimensions": int(config["hidden_size"]),
    }
    # Trained for truncated vectors (Matryoshka representation learning), as the model's config
    # says it the way vLLM reads it: ``matryoshka_dimensions`` (the widths) or ``is_matryoshka``.
    if isinstance(widths := config.get("matryoshka_dimensions"), list) and widths:
        spec["matryoshka"] = sorted({int(w) for w in widths})
    elif config.get("is_matryoshka") is True:
        spec["matryoshka"] = True
    return spec


def is_cross_encoder(config: dict[str, Any]) -> bool:
    """A ``BertForSequenceClassification`` (a cross-encoder) rather than a sentence encoder."""
    return "BertForSequenceClassification" in (config.get("architectures") or ())


def convert_encoder(src: Path, out: Path, *, dtype: str, progress: Progress) -> dict[str, Any]:
    """Copy a BERT sentence-encoder directory into ``out``: weights renamed for the runtime and cast
    to ``dtype``, ``embedding.json`` written; returns that spec."""
    from ..model.bert import BertConfig, hf_to_mlx
    from ..model.encoder import EMBEDDING_CONFIG

    config = json.loads((src / "config.json").read_text())
    try:
        BertConfig(config)
    except (KeyError, ValueError) as exc:
        raise ModelImportError(f"{src}: unsupported BERT ({exc})") from None
    spec = embedding_spec(src, config)
    for f in kept_files(src):
        if f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    weights: dict[str, mx.array] = {}
    for f in progress.each(sorted(src.glob("model*.safetensors")), desc="converting", unit="file"):
        weights.update(mx.load(str(f)))
    target = None if dtype == "native" else getattr(mx, dtype)
    renamed = {
        key: a.astype(target) if target is not None and mx.issubdtype(a.dtype, mx.floating) else a
        for key, a in hf_to_mlx(weights, classifier=is_cross_encoder(config)).items()
    }
    mx.save_safetensors(str(out / "model.safetensors"), renamed, {"format": "mlx"})
    (out / EMBEDDING_CONFIG).write_text(json.dumps(spec, indent=2) + "\n")
    return spec


def check_encoder_loads(directory: Path) -> None:
    """Build the encoder from ``directory`` (strict: every weight present, none left over)."""
    from ..model.bert import BertEncoder

    try:
        BertEncoder(directory, model_id="check")
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelImportError(f"the converted encoder does not load: {exc}") from None
