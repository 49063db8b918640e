"""GGUF -> MLX conversion and the GGUF tokenizer.

Tiny GGUFs written in-process check the layout rules (names, the llama Q/K unpermute, Gemma's 1+w
norms, tied embeddings, every dtype) and the refusals. The catalogue's real models check what only
real weights can: token ids and greedy output. The pinned ids and continuations are llama.cpp's
(llama-cpp-python 0.3.36 on the same GGUF files, greedy, ``tokenize(add_bos=True, special=True)``):
the converted models reproduce them exactly.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import gguf
import jinja2
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from tokenizers import Tokenizer

from tests.model.tiny import HEADS, KV_HEADS, Q, llamacpp_permute, write_tiny_gguf
from tests.realmodels import gemma_store, smollm2_store
from turbospark.model.mlx_ggml import load_model
from turbospark.store.gguf_import import ModelImportError, convert_gguf

CHATML_DIR = Path(__file__).parents[2] / "turbospark" / "model" / "data" / "chatml"


def _convert(gguf_path: Path, out: Path, dtype: str) -> dict[str, mx.array]:
    out.mkdir()
    convert_gguf(gguf_path, out, dtype=dtype, progress=False)
    return mx.load(str(out / "model.safetensors"))


def _logits(model_dir: Path) -> np.ndarray:
    model, _ = load_model(model_dir)
    return np.array(model(mx.array([[5, 6, 7, 8]])).astype(mx.float32))


# -- layout ---------------------------------------------------------------------------------------------


def test_llamacpp_permutation_is_not_its_own_inverse() -> None:
    """Applying llama.cpp's permutation again does not undo it, so the direction of the fix matters."""
    w = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    assert not np.array_equal(llamacpp_permute(llamacpp_permute(w, HEADS), HEADS), w)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize(("linear_type", "embed_type"), [(Q.F32, Q.F32), (Q.Q4_0, Q.Q8_0), (Q.Q4_1, Q.F16)])
def test_float32_conversion_gives_back_the_hf_weights(tmp_path: Path, arch: str, linear_type: Q, embed_type: Q) -> None:
    """Names mapped, llama Q/K rows unpermuted, Gemma norms shifted back by 1, no lm_head (tied)."""
    expected = write_tiny_gguf(tmp_path / "m.gguf", arch=arch, linear_type=linear_type, embed_type=embed_type)
    got = _convert(tmp_path / "m.gguf", tmp_path / "out", "float32")
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == mx.float32
        np.testing.assert_array_equal(np.array(got[name]), value, err_msg=name)


def test_config_of_a_llama_gguf(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf")
    _convert(tmp_path / "m.gguf", tmp_path / "out", "float32")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "intermediate_size": 128,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": 16,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 256,
        "vocab_size": 262,
        "bos_token_id": 1,
        "eos_token_id": [2, 0],  # <|im_end|>, then <|endoftext|>: llama.cpp ends generation at both
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
    }


def test_config_of_a_gemma3_gguf(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", arch="gemma3")
    _convert(tmp_path / "m.gguf", tmp_path / "out", "float32")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["eos_token_id"] == [1, 4]  # <eos> and <end_of_turn>
    assert (config["head_dim"], config["sliding_window"], config["max_position_embeddings"]) == (16, 128, 256)
    # llama.cpp scales queries by 1/sqrt(head_dim) (hidden/heads only at the 27B layer count).
    assert (config["query_pre_attn_scalar"], config["rope_local_base_freq"], config["sliding_window_pattern"]) == (
        16,
        10000.0,
        6,
    )


@pytest.mark.parametrize("linear_type", [Q.Q4_0, Q.Q4_1])
def test_native_keeps_gguf_blocks_as_mlx_does(tmp_path: Path, linear_type: Q) -> None:
    """``native`` re-lays Q4_0/Q4_1/Q8_0 blocks bit for bit as ``mx.load``'s own GGUF reader does."""
    write_tiny_gguf(tmp_path / "m.gguf", linear_type=linear_type, embed_type=Q.Q8_0)
    got = _convert(tmp_path / "m.gguf", tmp_path / "out", "native")
    reference = mx.load(str(tmp_path / "m.gguf"))
    pairs = {"token_embd": "model.embed_tokens", "blk.0.ffn_down": "model.layers.0.mlp.down_proj"}
    pairs |= {"blk.0.attn_v": "model.layers.0.self_attn.v_proj", "blk.0.ffn_up": "model.layers.0.mlp.up_proj"}
    for gguf_base, hf_base in pairs.items():
        for part in ("weight", "scales", "biases"):
            assert mx.array_equal(got[f"{hf_base}.{part}"], reference[f"{gguf_base}.{part}"]).item(), (hf_base, part)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    # Q and K are unpermuted on the packed rows: the model computes what the float32 one does.
    (tmp_path / "f32").mkdir()
    convert_gguf(tmp_path / "m.gguf", tmp_path / "f32", dtype="float32", progress=False)
    np.testing.assert_allclose(_logits(tmp_path / "out"), _logits(tmp_path / "f32"), atol=2e-3)


@pytest.mark.parametrize(("dtype", "rtol"), [("float16", 1e-2), ("bfloat16", 5e-2)])
def test_float_dtypes(tmp_path: Path, dtype: str, rtol: float) -> None:
    expected = write_tiny_gguf(tmp_path / "m.gguf", arch="gemma3")
    got = _convert(tmp_path / "m.gguf", tmp_path / "out", dtype)
    for name, value in expected.items():
        assert mx.array_equal(got[name], mx.array(value).astype(getattr(mx, dtype))).item(), name
    (tmp_path / "f32").mkdir()
    convert_gguf(tmp_path / "m.gguf", tmp_path / "f32", dtype="float32", progress=False)
    reference = _logits(tmp_path / "f32")
    np.testing.assert_allclose(_logits(tmp_path / "out"), reference, atol=rtol * np.abs(reference).max())


@pytest.mark.parametrize(("dtype", "bits"), [("q8", 8), ("q4", 4)])
def test_mlx_quantized_dtypes(tmp_path: Path, dtype: str, bits: int) -> None:
    """Every linear layer and the embedding are MLX-quantized (group 64) and dequantize close to the weights."""
    expected = write_tiny_gguf(tmp_path / "m.gguf", arch="gemma3")
    got = _convert(tmp_path / "m.gguf", tmp_path / "out", dtype)
    quantized = [name for name in expected if name.removesuffix(".weight") + ".scales" in got]
    assert len(quantized) == 6 * 7 + 1
    for name in quantized:
        base = name.removesuffix(".weight")
        scales = got[f"{base}.scales"]
        values = mx.dequantize(got[name], scales, got[f"{base}.biases"], group_size=64, bits=bits)
        error = np.abs(np.array(values.astype(mx.float32)) - expected[name])
        # Within a few quantization steps (scales and biases are bfloat16).
        step = np.abs(np.array(scales.astype(mx.float32)))
        assert (error <= 3 * np.repeat(step, 64, axis=1)).all(), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
    assert np.isfinite(_logits(tmp_path / "out")).all()


# -- refusals -------------------------------------------------------------------------------------------


def test_refuses_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 a zip, not a model")
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelImportError, match=r"is not a GGUF file \(it starts with b'PK"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out", dtype="float32", progress=False)


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_refuses_a_truncated_gguf(tmp_path: Path, keep: float) -> None:
    write_tiny_gguf(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[: int(len(data) * keep)])
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelImportError, match=r"damaged GGUF file .* truncated or corrupt"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", progress=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"arch": "falcon"},
            r"unsupported architecture 'falcon' \(supported: llama, qwen2, qwen3, gemma2, gemma3, phi3\)",
        ),
        ({"pre": "no-such-pre"}, "unsupported pre-tokenizer 'no-such-pre' .* for a gpt2 vocabulary"),
        (
            {"extra_tensors": {"blk.0.attn_rot_embd.weight": (np.ones(8, np.float32), Q.F32)}},
            "unsupported tensors for llama: blk.0.attn_rot_embd.weight",
        ),
        (
            {"extra_tensors": {"output.weight": (np.zeros((262, 80), np.uint8), Q.Q8_1)}},
            "tensor 'output.weight' has type Q8_1, which cannot be converted",
        ),
    ],
)
def test_refuses_unsupported_content(tmp_path: Path, kwargs: dict, message: str) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", **kwargs)
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelImportError, match=message):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", progress=False)


def test_refuses_an_unknown_dtype(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(ModelImportError, match="unknown dtype 'int3'"):
        convert_gguf(tmp_path / "m.gguf", tmp_path, dtype="int3", progress=False)


# -- tokenizers (tiny) --------------------------------------------------------------------------------------


def test_tiny_gpt2_tokenizer(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf")
    _convert(tmp_path / "m.gguf", tmp_path / "out", "float32")
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    # 3 control tokens, the 256 byte characters (byte b is 3 + b), then "Ġt", "he", "Ġthe" (259-261).
    # Digits are split one by one; a trailing space stays a word of its own.
    byte = {c: 3 + ord(c) for c in "t 42"}
    assert tok.encode("<|im_start|>the the 42").ids == [1, byte["t"], 260, 261, byte[" "], byte["4"], byte["2"]]
    assert tok.decode([1, 261], skip_special_tokens=False) == "<|im_start|> the"
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert config["added_tokens_decoder"]["2"] == {
        "content": "<|im_end|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    assert config["chat_template"].startswith("{% for m in messages %}")


def test_tiny_spm_tokenizer(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", arch="gemma3")
    _convert(tmp_path / "m.gguf", tmp_path / "out", "float32")
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    # controls 0-4, bytes 5-260, then "▁" 261, "a" 262, "b" 263, "▁a" 264, "ab" 265, "▁ab" 266.
    # "ab ab": pieces merge by score; "c" is not in the vocabulary and falls back to its byte.
    assert tok.encode("ab abc").ids == [2, 265, 266, 5 + ord("c")]
    assert tok.decode([265, 266, 5 + ord("c")]) == "ab abc"
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["add_bos_token"]) == ("<bos>", True)
    assert "chat_template" not in config  # a base model: plain completion only


# -- the real models -----------------------------------------------------------------------------------------

SMOLLM2_IDS = {
    "Hello world, how are you?": [19556, 905, 28, 638, 359, 346, 47],
    "  multiple   spaces\n\nand\ttabs 12345 3.14159 é ü ñ 日本語 🤗🚀": [
        216, 2701, 256, 5600, 198, 198, 397, 197, 100, 7366, 216, 33, 34, 35, 36, 37, 216, 35, 30, 33, 36, 33, 37,
        41, 26411, 5549, 137, 5549, 126, 17097, 241, 115, 40993, 179, 120, 248, 15107, 114, 241, 10813, 244, 218,
    ],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
    "<table><tr><td>cell</td></tr></table>": [
        44, 6413, 21198, 8489, 21198, 11474, 46, 5396, 9617, 11474, 29299, 8489, 29299, 6413, 46,
    ],
}  # fmt: skip

GEMMA_IDS = {
    "Hello world, how are you?": [2, 9259, 1902, 236764, 1217, 659, 611, 236881],
    "  multiple   spaces\n\nand\ttabs 12345 3.14159 é ü ñ 日本語 🤗🚀": [
        2, 138, 43819, 139, 35220, 108, 624, 255968, 39218, 236743, 236770, 236778, 236800, 236812, 236810, 236743,
        236800, 236761, 236770, 236812, 236770, 236810, 236819, 1559, 4741, 131079, 33375, 238582, 223603, 242015,
    ],
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n": [
        2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107,
    ],
    "<table><tr><td>cell</td></tr></table>": [2, 168, 173, 175, 5447, 183, 181, 176],
}  # fmt: skip


@functools.cache
def _tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    model, config = load_model(model_dir)
    eos = config["eos_token_id"]
    stop = set(eos if isinstance(eos, list) else [eos])
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if int(token) in stop:
            break
        out.append(int(token))
    return out


@pytest.mark.mlx
@pytest.mark.parametrize(("text", "ids"), SMOLLM2_IDS.items(), ids=range(len(SMOLLM2_IDS)))
def test_smollm2_token_ids(text: str, ids: list[int]) -> None:
    tok = _tokenizer(smollm2_store().path)
    assert tok.encode(text).ids == ids
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.mlx
@pytest.mark.parametrize(("text", "ids"), GEMMA_IDS.items(), ids=range(len(GEMMA_IDS)))
def test_gemma_token_ids(text: str, ids: list[int]) -> None:
    tok = _tokenizer(gemma_store().path)
    assert tok.encode(text).ids == ids
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text


@pytest.mark.mlx
def test_smollm2_special_tokens() -> None:
    path = smollm2_store().path
    tok, config, tok_config = _tokenizer(path), _json(path / "config.json"), _json(path / "tokenizer_config.json")
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    # <|im_end|>, then <|endoftext|> and <reponame>: the tokens llama.cpp ends generation at.
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (1, [2, 0, 4], 8192)
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["add_bos_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        False,
    )
    assert "<|im_start|>assistant" in tok_config["chat_template"]


@pytest.mark.mlx
def test_gemma_special_tokens() -> None:
    path = gemma_store().path
    tok, config, tok_config = _tokenizer(path), _json(path / "config.json"), _json(path / "tokenizer_config.json")
    assert [tok.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")] == [
        0, 1, 2, 105, 106,
    ]  # fmt: skip
    # <eos>, <end_of_turn> and </s>: the tokens llama.cpp ends generation at.
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (2, [1, 106, 212], 32768)
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["add_bos_token"]) == ("<bos>", "<eos>", True)
    assert "chat_template" not in tok_config


@pytest.mark.mlx
def test_shipped_chatml_tokenizer_is_smollm2s() -> None:
    """``data/chatml`` is exactly what gguf_tokenizer builds from the SmolLM2 GGUF."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (CHATML_DIR / name).read_bytes() == (smollm2_store().path / name).read_bytes(), name


@pytest.mark.mlx
def test_smollm2_greedy_chat_answer() -> None:
    path = smollm2_store().path
    tok = _tokenizer(path)
    template = jinja2.Environment().from_string(_json(path / "tokenizer_config.json")["chat_template"])
    prompt = template.render(
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        add_generation_prompt=True,
    )
    ids = tok.encode(prompt, add_special_tokens=False).ids
    out = _greedy(path, ids, max_tokens=16)
    assert out == [504, 3575, 282, 4649, 314, 7042, 30]  # then <|im_end|>, as with llama.cpp
    assert tok.decode(out) == "The capital of France is Paris."


@pytest.mark.mlx
def test_gemma_greedy_completion() -> None:
    path = gemma_store().path
    tok = _tokenizer(path)
    ids = tok.encode("The history of computing is a long story that starts with").ids
    assert ids[0] == 2  # <bos>
    out = _greedy(path, ids, max_tokens=13)
    assert tok.decode(out) == " the invention of the first computer in 1947."


def test_q4_k_blocks_become_affine_4_bit_group_32_exactly() -> None:
    """Where the kernels do not read Q4_K packed (a GPU, no ggml), a Q4_K super-block's eight
    scales and minimums (6 bits each, packed in twelve bytes) become float32 scales ``d * sc`` and
    biases ``-dmin * m`` per 32 values at load: MLX's dequantization of the re-laid tensor is
    llama.cpp's (gguf's) of the GGUF's bytes, bit for bit."""
    from turbospark.model.mlx_ggml import q4_k_affine

    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(6, 3 * 144), dtype=np.uint8)
    blocks = raw.reshape(6, 3, 144)
    for start in (0, 2):  # d and dmin: ordinary small float16 values
        blocks[..., start:start + 2] = np.float16(rng.uniform(1e-3, 1e-2, (6, 3))).view(np.uint8).reshape(6, 3, 2)
    want = gguf.quants.dequantize(raw, Q.Q4_K).reshape(6, 768)
    weight, scales, biases = q4_k_affine(raw)
    assert weight.dtype == np.uint32 and weight.shape == (6, 96)
    assert scales.dtype == biases.dtype == np.float32 and scales.shape == (6, 24)
    got = mx.dequantize(mx.array(weight), mx.array(scales), mx.array(biases), group_size=32, bits=4)
    np.testing.assert_array_equal(np.array(got), want)
