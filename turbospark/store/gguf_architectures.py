"""GGUF architectures: how each one's metadata becomes an mlx-lm ``config.json``.

One :class:`Architecture` per ``general.architecture`` value, all data: the mlx-lm model it runs
as, the Hugging Face names of its per-layer tensors, the two llama.cpp storage conventions to undo
(permuted Q/K rows, Gemma's ``1 + w`` norms) and the metadata keys it understands. Every config
value comes from the GGUF (or from llama.cpp's default for an absent key), never from a model name.

What mlx-lm cannot represent is refused rather than approximated: an unknown ``{arch}.*`` key (it
would change what llama.cpp computes), per-layer head counts, a RoPE that rotates part of a head
(outside Phi-3), a RoPE scaling the model class lacks, mixture-of-experts. The one documented
approximation: mlx-lm's Gemma 2 has no sliding window, so its context is capped at the window,
within which sliding and full attention are the same computation.

Mistral models are written by llama.cpp's converters as ``llama`` (Q/K in Meta's interleaved
layout either way), so they need no entry of their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from .gguf_errors import ModelImportError
from .gguf_tokenizer import end_of_generation_ids

__all__ = ["ARCHITECTURES", "Architecture", "build_config"]

Metadata = Mapping[str, Any]

_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
_ATTENTION |= {"attn_output": "self_attn.o_proj"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA_LAYER = {**_ATTENTION, **_MLP, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_LAYER = {
    **_ATTENTION,
    **_MLP,
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Keys every architecture reads (after the "{arch}." prefix).
_COMMON_KEYS = frozenset(
    (
        "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
        "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
        "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
        "rope.scaling.factor", "rope.scale_linear", "rope.scaling.original_context_length",
        "rope.scaling.finetuned", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
        "expert_count", "expert_used_count",
    )
)  # fmt: skip


@attrs.frozen
class Architecture:
    """How one GGUF architecture maps onto an mlx-lm model."""

    model_type: str  #: mlx-lm's ``model_type``
    hf_class: str  #: ``architectures[0]`` in config.json
    layer_names: Mapping[str, str]  #: GGUF per-block tensor name -> Hugging Face name within the layer
    config: Callable[[Metadata, str, Mapping[str, tuple[int, ...]]], dict[str, Any]]  #: arch-specific keys
    keys: frozenset[str] = frozenset()  #: ``{arch}.*`` keys understood beyond the common ones
    global_names: Mapping[str, str] = attrs.field(
        factory=lambda: {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    )
    unpermute_qk: bool = False  #: llama.cpp permuted the Q/K rows for its interleaved RoPE (NORM rope type)
    norm_offset: float = 0.0  #: subtracted from every norm weight (llama.cpp stores Gemma's ``1 + w``)
    zero_biases: tuple[str, ...] = ()  #: layer biases mlx-lm always has; zeros when the GGUF has none
    scalings: frozenset[str] = frozenset({"none"})  #: RoPE scaling types the mlx-lm model implements
    tied_only: bool = False  #: the mlx-lm model has no separate output matrix


def _get(md: Metadata, key: str, default: Any = attrs.NOTHING) -> Any:
    if key in md:
        return md[key]
    if default is attrs.NOTHING:
        raise ModelImportError(f"GGUF metadata {key!r} is missing")
    return default


def _f32(value: float) -> float:
    """A GGUF float32 as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _uniform(md: Metadata, key: str, default: Any = attrs.NOTHING) -> int:
    value = _get(md, key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelImportError(f"per-layer values of {key!r} ({sorted(set(value))}) are not supported")
        value = value[0]
    return int(value)


def _rope_scaling(md: Metadata, arch: str, arch_spec: Architecture, tensors: Mapping[str, tuple[int, ...]]) -> dict | None:
    """``rope_scaling`` for config.json, or None; refuses what the mlx-lm model does not implement."""
    kind = str(md.get(f"{arch}.rope.scaling.type", "none"))
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind == "none" and f"{arch}.rope.scale_linear" in md:
        kind, factor = "linear", md[f"{arch}.rope.scale_linear"]
    if kind == "none" and "rope_freqs.weight" in tensors:
        kind = "llama3"  # Llama 3.x: per-frequency factors stored as a tensor, no metadata
    if kind not in arch_spec.scalings:
        raise ModelImportError(f"RoPE scaling {kind!r} is not supported for architecture {arch!r}")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        scaling = {"type": "yarn", "factor": _f32(factor)}
        scaling["original_max_position_embeddings"] = int(_get(md, f"{arch}.rope.scaling.original_context_length"))
        scaling["beta_fast"] = _f32(md.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0))
        scaling["beta_slow"] = _f32(md.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0))
        return scaling
    if kind == "longrope":  # factors come from rope_factors_{long,short} (see gguf_tensors)
        return {"type": "longrope", "original_max_position_embeddings": int(_get(md, f"{arch}.rope.scaling.original_context_length"))}
    return {"type": "llama3"}  # factors fitted from rope_freqs.weight (see llama3_rope_scaling)


def llama3_rope_scaling(factors: np.ndarray, *, base: float, dims: int, context: int | None) -> dict[str, Any]:
    """Recover Llama 3's RoPE scaling parameters from the factors llama.cpp stores per frequency.

    The converter computes, per frequency ``f``: 1 where the wavelength ``2*pi/f`` is shorter than
    ``old_context / high_freq_factor``, ``factor`` where it is longer than ``old_context /
    low_freq_factor``, and a smooth blend in between, linear in ``old_context * f``. Only the
    products matter, so ``low_freq_factor`` is taken as 1 (Meta's value) and the rest solved from
    the blended factors; the result is checked by recomputing every factor.
    """
    factors = np.asarray(factors, dtype=np.float64)
    freqs = 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    factor = float(factors.max())
    params = {"factor": _f32(factor), "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    params["original_max_position_embeddings"] = int(context or 8192)
    middle = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6 * factor)
    if middle.sum() >= 2:
        smooth = (1.0 / factors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)  # = a * f - b
        a, b = np.polyfit(freqs[middle], smooth, 1)
        b = -b
        if a > 0 and b > 0:
            params["high_freq_factor"] = round(1.0 + 1.0 / b, 4)  # fitted in float32: 3.9999993 is 4
            params["original_max_position_embeddings"] = int(round(a * 2 * math.pi / b))
    expected = _llama3_factors(params, freqs)
    if not np.allclose(expected, factors, rtol=1e-4):
        raise ModelImportError("rope_freqs.weight does not follow Llama 3's RoPE scaling; it cannot be represented")
    return {"rope_type": "llama3", **params}


def _llama3_factors(params: Mapping[str, Any], freqs: np.ndarray) -> np.ndarray:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))


def _swa_pattern(md: Metadata, arch: str, n_layers: int, default: int) -> int:
    """The period p of llama.cpp's sliding-window layout (layer i slides unless i % p == p - 1)."""
    value = md.get(f"{arch}.attention.sliding_window_pattern", default)
    if not isinstance(value, list):
        return int(value)
    for period in range(1, n_layers + 1):
        if [bool(v) for v in value] == [i % period < period - 1 for i in range(len(value))]:
            return period
    raise ModelImportError(f"the sliding-window layout {value} is not a repeating pattern mlx-lm supports")


def _attention_scalar(hidden: int, heads: int, head_dim: int, n_layers: int, wide_at: int) -> int:
    # llama.cpp (gemma2.cpp / gemma3.cpp) scales queries by 1/sqrt(hidden / heads) for its 27B
    # layer count and by 1/sqrt(head_dim) otherwise; mlx-lm reads the same as query_pre_attn_scalar.
    return hidden // heads if n_layers == wide_at else head_dim


def _llama(md: Metadata, arch: str, tensors: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    return {
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }


def _qwen2(md: Metadata, arch: str, tensors: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    return {}


def _gemma2(md: Metadata, arch: str, tensors: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    hidden, heads = md[f"{arch}.embedding_length"], _uniform(md, f"{arch}.attention.head_count")
    head_dim, n_layers = int(md.get(f"{arch}.attention.key_length", hidden // heads)), md[f"{arch}.block_count"]
    window = int(md.get(f"{arch}.attention.sliding_window", 4096))
    if _swa_pattern(md, arch, n_layers, 2) != 2:
        raise ModelImportError("a Gemma 2 sliding-window layout other than every other layer is not supported")
    return {
        "query_pre_attn_scalar": _attention_scalar(hidden, heads, head_dim, n_layers, 46),
        "attn_logit_softcapping": _f32(md.get(f"{arch}.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": _f32(md.get(f"{arch}.final_logit_softcapping", 30.0)),
        "sliding_window": window,
        # mlx-lm's Gemma 2 attends to everything: within the window that is the same computation.
        "max_position_embeddings": min(int(md[f"{arch}.context_length"]), window),
    }


def _gemma3(md: Metadata, arch: str, tensors: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    hidden, heads = md[f"{arch}.embedding_length"], _uniform(md, f"{arch}.attention.head_count")
    head_dim, n_layers = int(md.get(f"{arch}.attention.key_length", hidden // heads)), md[f"{arch}.block_count"]
    if md.get(f"{arch}.final_logit_softcapping"):
        raise ModelImportError("final logit soft-capping is not supported for gemma3 (mlx-lm's model has none)")
    window = int(md.get(f"{arch}.attention.sliding_window", 0))
    context = int(md[f"{arch}.context_length"])
    return {
        "query_pre_attn_scalar": _attention_scalar(hidden, heads, head_dim, n_layers, 62),
        "sliding_window": window or context,
        "sliding_window_pattern": _swa_pattern(md, arch, n_layers, 6) if window else 1,
        "rope_local_base_freq": _f32(md.get(f"{arch}.rope.freq_base_swa", 10000.0)),
    }


def _phi3(md: Metadata, arch: str, tensors: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    hidden, heads = md[f"{arch}.embedding_length"], _uniform(md, f"{arch}.attention.head_count")
    rope_dims = int(md.get(f"{arch}.rope.dimension_count", hidden // heads))
    config: dict[str, Any] = {"partial_rotary_factor": rope_dims / (hidden // heads)}
    if orig := md.get(f"{arch}.rope.scaling.original_context_length"):
        config["original_max_position_embeddings"] = int(orig)
    return config


_GEMMA = {"global_names": {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}, "norm_offset": 1.0}

#: ``general.architecture`` -> how to import it.
ARCHITECTURES: Mapping[str, Architecture] = {
    "llama": Architecture(
        "llama",
        "LlamaForCausalLM",
        _LLAMA_LAYER,
        _llama,
        unpermute_qk=True,
        scalings=frozenset({"none", "linear", "llama3", "yarn"}),
    ),
    "qwen2": Architecture(
        "qwen2",
        "Qwen2ForCausalLM",
        _LLAMA_LAYER,
        _qwen2,
        zero_biases=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        scalings=frozenset({"none", "linear", "yarn"}),
    ),
    "qwen3": Architecture(
        "qwen3",
        "Qwen3ForCausalLM",
        {**_LLAMA_LAYER, **_QK_NORMS},
        _qwen2,
        scalings=frozenset({"none", "linear", "yarn"}),
    ),
    "gemma2": Architecture(
        "gemma2",
        "Gemma2ForCausalLM",
        _GEMMA_LAYER,
        _gemma2,
        keys=frozenset({"attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"}),
        tied_only=True,
        **_GEMMA,
    ),
    "gemma3": Architecture(
        "gemma3_text",
        "Gemma3ForCausalLM",
        {**_GEMMA_LAYER, **_QK_NORMS},
        _gemma3,
        keys=frozenset(
            {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa", "final_logit_softcapping"}
        ),
        scalings=frozenset({"none", "linear"}),
        global_names={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
        norm_offset=1.0,
    ),
    "phi3": Architecture(
        "phi3",
        "Phi3ForCausalLM",
        _PHI3_LAYER,
        _phi3,
        keys=frozenset({"attention.sliding_window", "rope.scaling.attn_factor"}),
        scalings=frozenset({"none", "linear", "longrope"}),
    ),
}


def build_config(md: Metadata, tensors: Mapping[str, tuple[int, ...]]) -> tuple[str, Architecture, dict[str, Any]]:
    """``(general.architecture, its Architecture, config.json)`` for a GGUF's metadata and tensor shapes.

    Args:
        md: the GGUF metadata.
        tensors: GGUF tensor name -> shape (GGUF order).

    Raises:
        ModelImportError: an unsupported architecture, a missing key, or a feature mlx-lm cannot run.
    """
    arch = str(md.get("general.architecture", "(none)"))
    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise ModelImportError(f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    known = _COMMON_KEYS | spec.keys
    if unknown := sorted(k for k in md if k.startswith(f"{arch}.") and k.removeprefix(f"{arch}.") not in known):
        raise ModelImportError(f"GGUF metadata {', '.join(unknown)} is not supported for architecture {arch!r}")
    if _uniform(md, f"{arch}.expert_count", 0):
        raise ModelImportError(f"mixture-of-experts models ({arch}.expert_count) are not supported")

    hidden = int(_get(md, f"{arch}.embedding_length"))
    heads = _uniform(md, f"{arch}.attention.head_count")
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // heads))
    if int(md.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ModelImportError("attention heads with different key and value lengths are not supported")
    rope_dims = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim and spec.model_type != "phi3":
        raise ModelImportError(f"a RoPE over {rope_dims} of {head_dim} head dimensions is not supported for {arch!r}")
    if spec.model_type in ("qwen2", "phi3") and head_dim != hidden // heads:
        raise ModelImportError(f"{arch!r} with a head size other than hidden size / heads is not supported")

    eos = end_of_generation_ids(md)
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "architectures": [spec.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": int(_get(md, f"{arch}.block_count")),
        "intermediate_size": _uniform(md, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _uniform(md, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(_get(md, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_get(md, f"{arch}.context_length")),
        "vocab_size": len(_get(md, "tokenizer.ggml.tokens")),
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "rope_theta": _f32(md.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": spec.tied_only or "output.weight" not in tensors,
    }
    if (scaling := _rope_scaling(md, arch, spec, tensors)) is not None:
        config["rope_scaling"] = scaling
    config |= spec.config(md, arch, tensors)
    return arch, spec, config
