"""Tiny GGUF files and wheels, written in-process so that store and converter tests need no download.

The GGUFs are laid out the way llama.cpp's converter lays out real models: llama Q/K rows permuted
for interleaved RoPE, Gemma norm weights stored as ``1 + w``. Each builder also returns the weights in
Hugging Face layout, which is what a correct conversion must give back.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

HIDDEN, FFN, HEADS, KV_HEADS = 64, 128, 4, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's ``convert_hf_to_gguf.py`` does to llama Q/K weights (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gpt2_vocab(writer: gguf.GGUFWriter, pre: str) -> int:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merged = ["Ġt", "he", "Ġthe"]
    tokens = specials + bytes_to_unicode() + merged
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def _spm_vocab(writer: gguf.GGUFWriter) -> int:
    controls = ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "a", "b", "▁a", "ab", "▁ab"]
    tokens = controls + byte_tokens + pieces
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * len(controls) + [0.0] * 256 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([3] * len(controls) + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    return len(tokens)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    linear_type: Q = Q.F32,
    embed_type: Q = Q.F32,
    pre: str = "smollm",
    extra_tensors: dict[str, tuple[np.ndarray, Q]] | None = None,
    layers: int | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny model of architecture ``arch`` (``llama`` or ``gemma3``) to ``path``, with
    ``layers`` layers (default 1, and 6 for Gemma 3).

    Linear weights are stored as ``linear_type`` and the embedding as ``embed_type``; ``pre`` is the
    gpt2 pre-tokenizer name, ``extra_tensors`` raw tensors (GGUF name -> data, type) added as is. Returns the
    weights in Hugging Face layout as float32 (after their quantization round trip), which a correct
    conversion to float32 reproduces exactly.
    """
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    # mlx-lm's Gemma 3 needs a full sliding-window pattern (5 local layers, then a global one).
    n_layers = layers or (6 if arch == "gemma3" else 1)
    writer.add_block_count(n_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    head_dim = HIDDEN // HEADS
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(128)
        vocab = _spm_vocab(writer)
    else:
        vocab = _gpt2_vocab(writer, pre)

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, value: np.ndarray, qtype: Q, stored: np.ndarray | None = None) -> None:
        """Store ``stored`` (default: ``value``) as ``qtype``; a conversion must give back ``value``.

        Blocks quantize along rows, and the storage transforms only reorder rows or shift values
        exactly, so the expected result is ``value``'s own quantization round trip.
        """
        stored = value if stored is None else stored
        writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        expected[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype).reshape(value.shape)

    def linear(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0, 0.05, (rows, cols)).astype(np.float32)

    def norm(gguf_name: str, hf_name: str, size: int) -> None:
        w = (rng.integers(-100, 100, size) / 1024).astype(np.float32)  # 1 + w - 1 == w exactly
        # llama.cpp stores Gemma's RMSNorm weight as 1 + w.
        add(gguf_name, hf_name, w, Q.F32, w + np.float32(1.0) if arch == "gemma3" else w)

    add("token_embd.weight", "model.embed_tokens.weight", linear(vocab, HIDDEN), embed_type)
    for i in range(n_layers):
        blk, layer = f"blk.{i}", f"model.layers.{i}"
        q, k = linear(HEADS * head_dim, HIDDEN), linear(KV_HEADS * head_dim, HIDDEN)
        permuted = arch == "llama"  # llama.cpp permutes llama's Q/K rows, not Gemma's
        add(
            f"{blk}.attn_q.weight",
            f"{layer}.self_attn.q_proj.weight",
            q,
            linear_type,
            llamacpp_permute(q, HEADS) if permuted else q,
        )
        add(
            f"{blk}.attn_k.weight",
            f"{layer}.self_attn.k_proj.weight",
            k,
            linear_type,
            llamacpp_permute(k, KV_HEADS) if permuted else k,
        )
        add(
            f"{blk}.attn_v.weight", f"{layer}.self_attn.v_proj.weight", linear(KV_HEADS * head_dim, HIDDEN), linear_type
        )
        add(
            f"{blk}.attn_output.weight",
            f"{layer}.self_attn.o_proj.weight",
            linear(HIDDEN, HEADS * head_dim),
            linear_type,
        )
        add(f"{blk}.ffn_gate.weight", f"{layer}.mlp.gate_proj.weight", linear(FFN, HIDDEN), linear_type)
        add(f"{blk}.ffn_up.weight", f"{layer}.mlp.up_proj.weight", linear(FFN, HIDDEN), linear_type)
        add(f"{blk}.ffn_down.weight", f"{layer}.mlp.down_proj.weight", linear(HIDDEN, FFN), linear_type)
        norm(f"{blk}.attn_norm.weight", f"{layer}.input_layernorm.weight", HIDDEN)
        if arch == "gemma3":
            norm(f"{blk}.post_attention_norm.weight", f"{layer}.post_attention_layernorm.weight", HIDDEN)
            norm(f"{blk}.ffn_norm.weight", f"{layer}.pre_feedforward_layernorm.weight", HIDDEN)
            norm(f"{blk}.post_ffw_norm.weight", f"{layer}.post_feedforward_layernorm.weight", HIDDEN)
            norm(f"{blk}.attn_q_norm.weight", f"{layer}.self_attn.q_norm.weight", head_dim)
            norm(f"{blk}.attn_k_norm.weight", f"{layer}.self_attn.k_norm.weight", head_dim)
        else:
            norm(f"{blk}.ffn_norm.weight", f"{layer}.post_attention_layernorm.weight", HIDDEN)
    norm("output_norm.weight", "model.norm.weight", HIDDEN)
    for name, (data, qtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def write_wheel(directory: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel carrying ``files`` (for ``pip download --find-links``)."""
    dist = f"{project.replace('-', '_')}-{version}"
    path = directory / f"{dist}-py3-none-any.whl"
    contents = {
        **files,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in contents.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
    return path
