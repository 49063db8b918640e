"""Tiny random-weight GGUFs, one per architecture, laid out as llama.cpp's converter lays out real ones.

Each :class:`TinyModel` is data: architecture, dimensions, the llama.cpp vocabulary fixture whose
tokenizer it carries (:mod:`tests.model.gguf_fixtures`), the storage type of each tensor and the
architecture's own metadata (RoPE scaling, sliding windows, soft-capping...). :func:`write_tiny`
writes it with ``gguf``'s writer under the real tensor names and keys, so llama.cpp loads it as it
would a converted model and the import reads it as it would a downloaded one.

Quantized tensors: the types ``gguf`` can quantize are quantized from random floats; the others
(K-quants, IQ types) are random blocks whose float16 scale fields are set to small values, which
both llama.cpp and ``gguf.quants.dequantize`` read the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

from turbospark.store.gguf_reader import read_gguf

from .tiny import bytes_to_unicode

__all__ = ["CASES", "Q", "TinyModel", "random_tensor", "write_tiny"]

Q = gguf.GGMLQuantizationType
_V = gguf.GGUFValueType

# Byte offsets of the float16 scale fields in one block, for the types gguf cannot quantize.
_SCALE_FIELDS = {
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,), Q.IQ1_S: (0,),
}  # fmt: skip


@attrs.frozen
class TinyModel:
    """One tiny model: ``general.architecture``, shapes, vocabulary fixture and tensor types."""

    name: str
    arch: str
    vocab: str  #: llama.cpp fixture (``models/ggml-vocab-{vocab}.gguf``), or "bytes" (259 tokens, built in)
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    context: int = 512
    tied: bool = True
    types: Mapping[str, Q] = attrs.field(factory=dict)  #: GGUF tensor stem ("attn_q", "token_embd"...) -> type
    keys: Mapping[str, Any] = attrs.field(factory=dict)  #: extra "{arch}.*" metadata (suffix -> value)
    n_ctx: int = 256  #: llama.cpp context for the comparison
    pre: str | None = None  #: replaces the vocabulary's tokenizer.ggml.pre
    #: How far logits may differ from llama.cpp's, as a fraction of their largest magnitude (see
    #: test_gguf_llama_cpp.py): float32 arithmetic; llama.cpp's float16 GELU table; 8-bit activations.
    tolerance: float = 1e-5
    std: float = 0.1  #: weight scale

    def type_of(self, stem: str) -> Q:
        return self.types.get(stem, self.types.get("*", Q.F32))


def random_tensor(qtype: Q, rows: int, cols: int, rng: np.random.Generator, std: float = 0.1) -> np.ndarray:
    """Data for a ``rows x cols`` tensor stored as ``qtype``: floats, or packed uint8 blocks.

    Types ``gguf`` cannot quantize get random blocks; for those in :data:`_SCALE_FIELDS` the float16
    scales are then set so that the values have about ``std`` (the rest may hold any float).
    """
    values = rng.normal(0, std, (rows, cols)).astype(np.float32)
    if qtype == Q.F32:
        return values
    try:
        return gguf.quants.quantize(values, qtype)
    except (NotImplementedError, gguf.quants.QuantError):
        pass
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype in _SCALE_FIELDS:
        spread = rng.uniform(0.5, 1.0, blocks.shape[:2])

        def set_scales(c: float) -> None:
            for offset in _SCALE_FIELDS[qtype]:
                blocks[..., offset : offset + 2] = (c * spread).astype(np.float16)[..., None].view(np.uint8)

        set_scales(1.0)
        unit = float(np.std(gguf.quants.dequantize(blocks.reshape(rows, -1), qtype)))
        set_scales(std / unit)  # the values are linear in the scales
    elif qtype == Q.IQ1_M:  # the float16 scale is spread over the top nibbles of four uint16: keep it small
        blocks[..., 55] = (blocks[..., 55] & 0x0F) | 0x10
    return blocks.reshape(rows, -1)


def _byte_vocab() -> dict[str, Any]:
    """A 259-token byte-level BPE vocabulary (GPT-2's byte alphabet, three merges): fast to build."""
    tokens = ["<|endoftext|>", *bytes_to_unicode(), "\u0120t", "he"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": ["\u0120 t", "h e"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }


def _tokenizer_keys(writer: gguf.GGUFWriter, vocab_gguf: Path, pre: str | None) -> int:
    md = dict(_byte_vocab() if vocab_gguf.name == "ggml-vocab-bytes.gguf" else read_gguf(vocab_gguf).metadata)
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    for key, value in md.items():
        if not key.startswith("tokenizer."):
            continue
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.precompiled_charsmap"):
            writer.add_key_value(key, value, _V.ARRAY, sub_type=_V.STRING if key != "tokenizer.ggml.precompiled_charsmap" else _V.UINT8)
        elif key == "tokenizer.ggml.token_type":
            writer.add_key_value(key, value, _V.ARRAY, sub_type=_V.INT32)
        elif key == "tokenizer.ggml.scores":
            writer.add_key_value(key, value, _V.ARRAY, sub_type=_V.FLOAT32)
        elif isinstance(value, bool):
            writer.add_key_value(key, value, _V.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, _V.UINT32)
        elif isinstance(value, str):
            writer.add_key_value(key, value, _V.STRING)
    return len(md["tokenizer.ggml.tokens"])


def _llama3_factors(head_dim: int, base: float, factor: float = 8.0, old: int = 8192) -> np.ndarray:
    """What llama.cpp's converter stores in rope_freqs.weight for Llama 3.1's RoPE scaling."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / 4.0, 1.0, np.where(wavelen > old, factor, blended)).astype(np.float32)


def write_tiny(model: TinyModel, path: Path, vocab_dir: Path, seed: int = 0) -> None:
    """Write ``model`` as a GGUF at ``path``, its vocabulary from ``vocab_dir/ggml-vocab-{vocab}.gguf``."""
    rng = np.random.default_rng(seed)
    arch, hd = model.arch, model.head_dim
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {model.name}")
    n_vocab = _tokenizer_keys(writer, vocab_dir / f"ggml-vocab-{model.vocab}.gguf", model.pre)
    writer.add_context_length(model.context)
    writer.add_embedding_length(model.hidden)
    writer.add_block_count(model.layers)
    writer.add_feed_forward_length(model.ffn)
    writer.add_head_count(model.heads)
    writer.add_head_count_kv(model.kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    if hd != model.hidden // model.heads or arch.startswith("gemma"):
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    writer.add_rope_dimension_count(int(hd * model.keys.get("_partial_rotary", 1.0)))
    if arch == "llama":
        writer.add_vocab_size(n_vocab)
    for suffix, value in model.keys.items():
        if suffix.startswith("_"):
            continue
        key = f"{arch}.{suffix}"
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    gemma = arch.startswith("gemma")

    def matrix(name: str, stem: str, rows: int, cols: int, std: float | None = None) -> None:
        qtype = model.type_of(stem)
        writer.add_tensor(name, random_tensor(qtype, rows, cols, rng, std or model.std), raw_dtype=qtype)

    def vector(name: str, size: int, around: float = 0.0, std: float = 0.1) -> None:
        writer.add_tensor(name, (around + rng.normal(0, std, size)).astype(np.float32))

    matrix("token_embd.weight", "token_embd", n_vocab, model.hidden, std=0.5)
    vector("output_norm.weight", model.hidden, 1.0)
    if not model.tied:
        matrix("output.weight", "output", n_vocab, model.hidden, std=0.5)
    if rope := model.keys.get("_llama3_rope"):
        writer.add_tensor("rope_freqs.weight", _llama3_factors(hd, float(model.keys["rope.freq_base"]), *rope))
    if model.keys.get("rope.scaling.type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", rng.uniform(1.0, 8.0, hd // 2).astype(np.float32))
        writer.add_tensor("rope_factors_short.weight", rng.uniform(1.0, 1.5, hd // 2).astype(np.float32))
    q_rows, kv_rows = model.heads * hd, model.kv_heads * hd
    for i in range(model.layers):
        blk = f"blk.{i}"
        vector(f"{blk}.attn_norm.weight", model.hidden, 1.0)
        if arch == "phi3":
            matrix(f"{blk}.attn_qkv.weight", "attn_qkv", q_rows + 2 * kv_rows, model.hidden)
        else:
            matrix(f"{blk}.attn_q.weight", "attn_q", q_rows, model.hidden)
            matrix(f"{blk}.attn_k.weight", "attn_k", kv_rows, model.hidden)
            matrix(f"{blk}.attn_v.weight", "attn_v", kv_rows, model.hidden)
        if arch == "qwen2":
            for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                vector(f"{blk}.attn_{part}.bias", rows, 0.0, 0.2)
        if arch in ("qwen3", "gemma3"):
            vector(f"{blk}.attn_q_norm.weight", hd, 1.0)
            vector(f"{blk}.attn_k_norm.weight", hd, 1.0)
        matrix(f"{blk}.attn_output.weight", "attn_output", model.hidden, q_rows)
        vector(f"{blk}.ffn_norm.weight", model.hidden, 1.0)
        if gemma:
            vector(f"{blk}.post_attention_norm.weight", model.hidden, 1.0)
            vector(f"{blk}.post_ffw_norm.weight", model.hidden, 1.0)
        if arch == "phi3":
            matrix(f"{blk}.ffn_up.weight", "ffn_up", 2 * model.ffn, model.hidden)
        else:
            matrix(f"{blk}.ffn_gate.weight", "ffn_gate", model.ffn, model.hidden)
            matrix(f"{blk}.ffn_up.weight", "ffn_up", model.ffn, model.hidden)
        matrix(f"{blk}.ffn_down.weight", "ffn_down", model.hidden, model.ffn)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_K_QUANTS = {
    "token_embd": Q.Q4_0, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K,
    "attn_output": Q.Q8_0, "ffn_gate": Q.Q3_K, "ffn_up": Q.Q2_K, "ffn_down": Q.IQ4_XS,
}  # fmt: skip
_LEGACY_QUANTS = {
    "token_embd": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q5_0, "attn_v": Q.Q5_1, "attn_output": Q.F16,
    "ffn_gate": Q.BF16, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_0,
}  # fmt: skip

#: The architectures the import supports, each as llama.cpp's converter writes a real model of it.
CASES = {
    case.name: case
    for case in (
        # Llama 3.x: byte-level BPE (llama-bpe), GQA, RoPE scaling stored as rope_freqs.weight.
        TinyModel(
            "llama3", "llama", "llama-bpe", hidden=128, heads=2, kv_heads=1, head_dim=64, ffn=256,
            keys={"rope.freq_base": 500000.0, "_llama3_rope": (8.0, 8192)},
        ),
        # Mistral 7B v0.x as GGUF writes it: arch llama, SentencePiece vocabulary, separate output.
        TinyModel("mistral", "llama", "llama-spm", tied=False, keys={"rope.freq_base": 1000000.0}),
        TinyModel("qwen2", "qwen2", "qwen2", keys={"rope.freq_base": 1000000.0}),
        # Qwen 2.5 with YaRN, as its GGUFs for long contexts carry it.
        TinyModel(
            "qwen2-yarn", "qwen2", "qwen2",
            keys={"rope.freq_base": 1000000.0, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                  "rope.scaling.original_context_length": 128},
        ),
        # Qwen 3: q/k norms, a head size other than hidden / heads.
        TinyModel("qwen3", "qwen3", "qwen2", head_dim=32, tied=False, keys={"rope.freq_base": 1000000.0}),
        TinyModel(
            "gemma2", "gemma2", "llama-spm", std=0.2, tolerance=1e-3,
            keys={"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
        ),
        # Gemma 3: six layers (five sliding, one global), a window shorter than the prompts,
        # linear RoPE scaling on the global layers, a separate base for the local ones.
        TinyModel(
            "gemma3", "gemma3", "llama-spm", layers=6, std=0.2, tolerance=1e-3,
            keys={"attention.sliding_window": 8, "rope.freq_base": 1000000.0, "rope.freq_base_swa": 10000.0,
                  "rope.scaling.type": "linear", "rope.scaling.factor": 8.0},
        ),
        TinyModel("phi3", "phi3", "phi-3", heads=4, kv_heads=4, tied=False, keys={"rope.freq_base": 10000.0}),
        # Phi-3 128k: long RoPE, factors as tensors; llama.cpp uses the long ones past the original
        # context (n_ctx 256 > 64), which is what mlx-lm always uses.
        TinyModel(
            "phi3-longrope", "phi3", "phi-3", heads=4, kv_heads=4, tied=False,
            keys={"rope.freq_base": 10000.0, "rope.scaling.type": "longrope", "rope.scaling.original_context_length": 64,
                  "rope.scaling.attn_factor": float(np.sqrt(1 + np.log(512 / 64) / np.log(64)))},
        ),
        # K-quants and IQ4_XS in every matrix (llama.cpp multiplies them with activations rounded to
        # 8 bits: a looser tolerance; DEQUANT_CASES check the dequantized values themselves).
        TinyModel(
            "llama-kquants", "llama", "llama-spm", hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512,
            tied=False, types=_K_QUANTS, std=0.05, tolerance=0.1,
        ),
        TinyModel(
            "gemma3-legacy-quants", "gemma3", "llama-spm", hidden=256, heads=4, kv_heads=1, head_dim=64, ffn=512,
            layers=6, types=_LEGACY_QUANTS, std=0.05, keys={"attention.sliding_window": 512}, tolerance=0.1,
        ),
    )
}  # fmt: skip

#: Types llama.cpp and ``gguf`` both read; each stored in the embedding only (llama.cpp looks rows up
#: dequantized, exactly), so logits show whether the import dequantizes as llama.cpp does.
DEQUANT_TYPES = (
    Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS,
    Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, Q.MXFP4,
)  # fmt: skip
DEQUANT_CASES = {
    f"embedding-{qtype.name}": TinyModel(
        f"embedding-{qtype.name}", "llama", "bytes", hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
        tied=False, types={"token_embd": qtype}, std=0.05,
    )
    for qtype in DEQUANT_TYPES
}
