"""What a stored model's own files say about it: its ``ModelCard`` (``card_for``), read once
when the resolver's library is read, so that the routes only format it.

- **architecture**: the manifest's (``llama``, ``bert``, ``whisper``, ``piper``), else
  ``config.json``'s ``model_type``;
- **parameter count**: exact, from the safetensors headers alone (no weights are read): the sum
  of every tensor's element count, where a quantized weight (packed ``U32`` beside its
  ``.scales``) counts ``32 / bits`` parameters per element and its scales and biases count none;
- **quantization**: ``Q<bits>`` (the ``quantization`` block of ``config.json``; a mode other
  than affine is named, e.g. ``Q4-MXFP4``), else the float type most weights are stored in
  (``F32``, ``F16``, ``BF16``);
- **context length**: the manifest's, else ``max_position_embeddings``;
- **capabilities** (Ollama's words): a generation model ``completion``, ``tools`` when its chat
  template handles tools, ``thinking`` when it has thinking markers (``<think>``,
  ``enable_thinking``, ``reasoning_content``), ``vision`` with a vision tower beside it (``vision/``,
  ``store/vision_import.py``); an embedding model ``embedding``; audio models
  their task (``speech_to_text``, ``text_to_speech``); an image pipeline ``text_to_image`` and
  ``image_to_image`` (its parameters: every component's, from ``*/*.safetensors``);
- Ollama's ``model_info`` keys (``general.architecture``, ``general.parameter_count``,
  ``<arch>.context_length``, ``<arch>.embedding_length``, ...), and ``parameters`` (its
  sampling defaults, as Ollama's ``name value`` lines).

Blocking file work: called on a worker thread.  Imports the lifecycle's ``ModelCard`` only.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import gguf

from ..actors.lifecycle import ModelCard
from .directory import StoredModel

__all__ = ["card_for", "chat_template", "parameter_size", "read_json", "weights_of"]

#: markers of a template that can think (Qwen3, DeepSeek-R1, gpt-oss's "thinking" field)
_THINKING = ("<think>", "thinking", "reasoning_content")
_FLOAT = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64"}
_INFO = (  # config.json -> Ollama's model_info names (after "<arch>.")
    ("max_position_embeddings", "context_length"),
    ("hidden_size", "embedding_length"),
    ("num_hidden_layers", "block_count"),
    ("intermediate_size", "feed_forward_length"),
    ("num_attention_heads", "attention.head_count"),
    ("num_key_value_heads", "attention.head_count_kv"),
    ("vocab_size", "vocab_size"),
    ("rope_theta", "rope.freq_base"),
    ("sliding_window", "attention.sliding_window"),
    ("n_text_ctx", "context_length"),  # Whisper
    ("n_text_state", "embedding_length"),
    ("n_text_layer", "block_count"),
    ("n_audio_ctx", "audio.context_length"),
    ("n_audio_layer", "audio.block_count"),
    ("n_mels", "audio.mel_bins"),
    ("n_vocab", "vocab_size"),
)
_PARAMETERS = (  # generation_config.json -> Ollama's parameter names
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("repetition_penalty", "repeat_penalty"),
)
_AUDIO_CAPABILITY = {"speech-to-text": "speech_to_text", "text-to-speech": "text_to_speech"}


def read_json(path: Path) -> dict[str, Any]:
    """``path`` as a JSON object; ``{}`` when it is missing or not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def weights_of(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def chat_template(path: Path) -> str:
    """The model's default chat template (``tokenizer_config.json``), or ``""``."""
    template = read_json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    return template if isinstance(template, str) else ""


def parameter_size(count: int) -> str:
    """Ollama's ``parameter_size``: ``135M``, ``1.7B``."""
    if count >= 1e9:
        return f"{count / 1e9:.1f}B"
    if count >= 1e6:
        return f"{count / 1e6:.0f}M"
    if count >= 1e3:
        return f"{count / 1e3:.0f}K"
    return str(count) if count else ""


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _bits(quantization: dict[str, Any], module: str) -> int:
    """The bits of ``module``'s weights: its own entry in the block (mixed quantization), else
    the block's."""
    own = quantization.get(module)
    if isinstance(own, dict) and isinstance(own.get("bits"), int):
        return own["bits"]
    bits = quantization.get("bits")
    return bits if isinstance(bits, int) and bits > 0 else 4


def _group(quantization: dict[str, Any], module: str) -> int:
    """The group size of ``module``'s quantization (its own entry, else the block's); 0 if unknown."""
    own = quantization.get(module)
    group = own.get("group_size") if isinstance(own, dict) else quantization.get("group_size")
    return group if isinstance(group, int) and group > 0 else 0


def count_parameters(weights: list[Path], quantization: dict[str, Any] | None,
                     blocks: dict[str, int] | None = None) -> tuple[int, Counter[str]]:
    """The exact parameter count of ``weights`` (from their headers), and how many parameters
    are stored in each dtype (``Q`` for MLX-quantized ones, a GGUF type's name for the GGUF
    blocks ``config.json``'s ``ggml_types`` lists: ``blocks``)."""
    count = 0
    stored: Counter[str] = Counter()
    for path in weights:
        header = _header(path)
        for name, tensor in header.items():
            n = 1
            for dim in tensor["shape"]:
                n *= dim
            base, _, leaf = name.rpartition(".")
            if leaf in ("scales", "biases") and f"{base}.weight" in header and f"{base}.scales" in header:
                continue  # a quantized weight's companions
            if leaf == "weight" and tensor["dtype"] == "U8" and base in (blocks or {}):  # GGUF blocks
                kind = gguf.GGMLQuantizationType(blocks[base])
                values, size = gguf.GGML_QUANT_SIZES[kind]
                n = n // size * values
                stored[kind.name] += n
            elif tensor["dtype"] == "U32" and f"{base}.scales" in header:
                group = _group(quantization or {}, base)
                if group:  # from the scales' shape: a layer's bits may differ from the block's (Q8_0 beside Q4_0)
                    n = n // tensor["shape"][-1] * header[f"{base}.scales"]["shape"][-1] * group
                else:
                    n = n * 32 // _bits(quantization or {}, base)
                stored["Q"] += n
            else:
                stored[tensor["dtype"]] += n
            count += n
    return count, stored


def _quantization_level(config: dict[str, Any], stored: Counter[str], manifest: dict[str, Any]) -> str:
    if isinstance(config.get("gguf_file_type"), str) and (config.get("ggml_types") or config.get("quantization")):
        return config["gguf_file_type"]  # the GGUF's own (Q4_K_M...), its blocks kept
    block = config.get("quantization") or (config.get("text_config") or {}).get("quantization")
    if isinstance(block, dict) and stored.get("Q", 0) >= sum(stored.values()) / 2:
        mode = str(block.get("mode") or "affine")
        return f"Q{_bits(block, '')}" + ("" if mode == "affine" else f"-{mode.upper()}")
    floats = [(n, dtype) for dtype, n in stored.items() if dtype in _FLOAT]
    if floats:
        return _FLOAT[max(floats)[1]]
    dtype = str(manifest.get("dtype") or "")
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, "")


def _capabilities(kind: str, template: str) -> tuple[str, ...]:
    if kind == "embedding":
        return ("embedding",)
    if kind in _AUDIO_CAPABILITY:
        return (_AUDIO_CAPABILITY[kind],)
    if kind == "text-to-image":  # every Z-Image pipeline edits too (its VAE encodes)
        return ("text_to_image", "image_to_image")
    out = ["completion"]
    if "tools" in template:
        out.append("tools")
    if any(marker in template for marker in _THINKING):
        out.append("thinking")
    return tuple(out)


def _sampling_lines(path: Path) -> str:
    generation = read_json(path / "generation_config.json")
    lines = []
    if generation.get("do_sample") is False:
        lines.append("temperature 0")
    for source, name in _PARAMETERS:
        value = generation.get(source)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not (name == "temperature" and lines):
            lines.append(f"{name} {value}")
    return "\n".join(lines)


def card_for(stored: StoredModel) -> ModelCard:
    """``stored``'s card, from its manifest, ``config.json``, chat template, weights' headers and
    (embedding models) ``embedding.json``."""
    path, manifest = stored.path, stored.manifest
    config = read_json(path / "config.json")
    inner = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    settings = {**inner, **config}
    template = chat_template(path) if stored.kind == "generation" else ""
    # an image pipeline's parameters are every component's; a vision model's its tower's too
    weights = (weights_of(path) + sorted(path.glob("vision/*.safetensors"))) if stored.kind != "text-to-image" \
        else sorted(path.glob("*/*.safetensors"))
    params, stored_as = count_parameters(weights, settings.get("quantization"), settings.get("ggml_types"))
    arch = str(manifest.get("architecture") or config.get("model_type") or "")
    context = int(manifest.get("context_length") or settings.get("max_position_embeddings") or 0)
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": params}
    for key, name in _INFO:
        if isinstance(settings.get(key), (int, float)) and not isinstance(settings.get(key), bool):
            info.setdefault(f"{arch}.{name}", settings[key])
    if context:
        info[f"{arch}.context_length"] = context  # what the server reads, not the position table
    if kept := {k: n for k, n in stored_as.items() if k in gguf.GGMLQuantizationType.__members__}:
        info["turbospark.gguf_blocks"] = dict(sorted(kept.items()))  # parameters kept as GGUF blocks, by type
    if stored.kind == "embedding":
        spec = read_json(path / "embedding.json")
        if isinstance(spec.get("dimensions"), int):
            info[f"{arch}.embedding_length"] = spec["dimensions"]
        if spec.get("pooling"):
            info[f"{arch}.pooling_type"] = spec["pooling"]
    manifest_file = path / "manifest.json"
    return ModelCard(
        format=str(manifest.get("format") or "mlx"),
        family=arch,
        parameter_size=parameter_size(params),
        quantization_level=_quantization_level(settings, stored_as, manifest),
        template=template,
        parameters=_sampling_lines(path) if stored.kind == "generation" else "",
        model_info=info,
        digest=str(manifest.get("source_sha256") or ""),
        modified_at=manifest_file.stat().st_mtime if manifest_file.exists() else 0.0,
        architecture=arch,
        parameter_count=params,
        context_length=context,
        capabilities=_capabilities(stored.kind, template) + (("vision",) if (path / "vision").is_dir() else ()),
    )
