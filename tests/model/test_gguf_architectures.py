"""Every supported GGUF architecture imports, loads in mlx-lm and generates; every quantization
``gguf`` can dequantize converts exactly; what cannot be imported faithfully is refused by name,
leaving the store as it was.

The models are the tiny random-weight GGUFs of :mod:`tests.model.gguf_tiny_models`, written as
llama.cpp's converter writes real ones. That their outputs equal llama.cpp's is checked in
``test_gguf_llama_cpp.py`` (which needs a llama-cpp-python build).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from tests.model.gguf_fixtures import llama_cpp_sources
from tests.model.gguf_tiny_models import CASES, Q, TinyModel, random_tensor, write_tiny
from turbospark.model.mlx_ggml import load_model
from turbospark.store.gguf_architectures import llama3_rope_scaling
from turbospark.store.gguf_import import ModelImportError, convert_gguf
from turbospark.store.gguf_reader import read_gguf
from turbospark.store.store import ModelStore

_SMALL = TinyModel("small", "llama", "bytes", tied=False)


@functools.cache
def _vocabs() -> Path:
    return llama_cpp_sources() / "models"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory):
    """case name -> its converted float32 directory (each case written and converted once)."""
    root = tmp_path_factory.mktemp("cases")

    @functools.cache
    def convert(name: str) -> Path:
        _convert(_write(root, CASES[name], f"{name}.gguf"), root / name)
        return root / name

    return convert


def _write(tmp_path: Path, model: TinyModel, name: str = "m.gguf") -> Path:
    """Write ``model``; the built-in "bytes" vocabulary needs no download."""
    path = tmp_path / name
    write_tiny(model, path, _vocabs() if model.vocab != "bytes" else Path("unused"))
    return path


def _convert(path: Path, out: Path, dtype: str = "float32") -> dict:
    out.mkdir()
    convert_gguf(path, out, dtype=dtype, progress=False)
    return json.loads((out / "config.json").read_text())


def _forward(model_dir: Path) -> np.ndarray:
    model, _ = load_model(model_dir)
    return np.array(model(mx.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])).astype(mx.float32))


@pytest.mark.parametrize("case", sorted(CASES))
def test_architecture_imports_and_runs(converted, case: str) -> None:
    config = json.loads((converted(case) / "config.json").read_text())
    logits = _forward(converted(case))
    assert logits.shape[-1] == config["vocab_size"] and np.isfinite(logits).all()


def test_configs_come_from_metadata(converted) -> None:
    configs = {}
    for name in ("llama3", "qwen3", "gemma2", "gemma3", "phi3"):
        configs[name] = json.loads((converted(name) / "config.json").read_text())
    llama3 = configs["llama3"]["rope_scaling"]
    assert llama3 == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert configs["llama3"]["bos_token_id"] == 128000
    assert 128009 in configs["llama3"]["eos_token_id"]  # <|eot_id|> ends a turn
    assert (configs["qwen3"]["head_dim"], configs["qwen3"]["tie_word_embeddings"]) == (32, False)
    gemma2 = configs["gemma2"]
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (50.0, 30.0)
    assert (gemma2["query_pre_attn_scalar"], gemma2["max_position_embeddings"]) == (16, 512)
    gemma3 = configs["gemma3"]
    assert (gemma3["sliding_window"], gemma3["sliding_window_pattern"], gemma3["rope_local_base_freq"]) == (8, 6, 10000.0)
    assert gemma3["rope_scaling"] == {"type": "linear", "factor": 8.0}
    assert gemma3["rope_theta"] == 1000000.0
    assert configs["phi3"]["partial_rotary_factor"] == 1.0
    assert 32007 in configs["phi3"]["eos_token_id"]  # <|end|>


@pytest.mark.parametrize(
    ("factor", "old"), [(8.0, 8192), (32.0, 8192), (16.0, 4096)], ids=["llama3.1", "llama3.2", "other"]
)
def test_llama3_rope_scaling_is_recovered_from_the_factors(factor: float, old: int) -> None:
    from tests.model.gguf_tiny_models import _llama3_factors

    factors = _llama3_factors(128, 500000.0, factor, old)
    got = llama3_rope_scaling(factors, base=500000.0, dims=128, context=None)
    assert got["factor"] == factor and got["original_max_position_embeddings"] == old
    assert got["high_freq_factor"] == pytest.approx(4.0, rel=1e-5)


# -- every quantization type ---------------------------------------------------------------------------

_DEQUANTIZABLE = [
    qtype
    for qtype in Q
    if qtype not in (Q.F64, Q.I8, Q.I16, Q.I32, Q.I64, Q.Q8_1, Q.Q8_K) and qtype.name != "Q1_0"
]


@pytest.mark.parametrize("qtype", _DEQUANTIZABLE, ids=[q.name for q in _DEQUANTIZABLE])
def test_every_dequantizable_type_converts_exactly(tmp_path: Path, qtype: Q) -> None:
    """Float32 import of each type equals ``gguf.quants.dequantize`` of the stored blocks."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    width = max(256, block)
    model = TinyModel("q", "llama", "bytes", hidden=width, heads=4, head_dim=width // 4, ffn=width,
                      layers=1, types={"ffn_down": qtype, "ffn_up": qtype})
    path = _write(tmp_path, model)
    _convert(path, tmp_path / "out")
    got = mx.load(str(tmp_path / "out" / "model.safetensors"))
    stored = {t.name: t for t in read_gguf(path)}
    for gguf_name, hf_name in (("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                               ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight")):
        tensor = stored[gguf_name]
        assert tensor.tensor_type == qtype
        raw = read_gguf(path).data(tensor)
        expected = gguf.quants.dequantize(raw, qtype).reshape(tuple(reversed(tensor.shape)))
        np.testing.assert_array_equal(np.array(got[hf_name]), expected.astype(np.float32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "native", "q8", "q4"])
def test_dtypes_keep_working(tmp_path: Path, dtype: str) -> None:
    import attrs

    path = _write(tmp_path, attrs.evolve(CASES["gemma3-legacy-quants"], vocab="bytes"))
    _convert(path, tmp_path / "f32")
    _convert(path, tmp_path / dtype, dtype)
    reference, got = _forward(tmp_path / "f32"), _forward(tmp_path / dtype)
    tolerance = {"float16": 0.02, "bfloat16": 0.1, "native": 0.05, "q8": 0.1, "q4": 0.5}[dtype]
    assert np.abs(got - reference).max() <= tolerance * np.abs(reference).max()


# -- refusals ------------------------------------------------------------------------------------------


def _refused(tmp_path: Path, path: Path, message: str) -> None:
    """Importing ``path`` raises ModelImportError matching ``message`` and leaves the store as it was."""
    root = tmp_path / "store"
    store = ModelStore(root)
    with pytest.raises(ModelImportError, match=message):
        store.import_source(path, name="bad", dtype="float32", progress=False)
    assert store.list() == []
    assert not root.exists() or not any(root.iterdir())  # no model, no scratch directory left


def test_refuses_unsupported_architecture(tmp_path: Path) -> None:
    import attrs

    path = _write(tmp_path, attrs.evolve(_SMALL, arch="falcon"), "bad.gguf")
    _refused(tmp_path, path, r"unsupported architecture 'falcon' \(supported: llama, qwen2, qwen3, gemma2, gemma3, phi3\)")


def test_refuses_unsupported_pre_tokenizer(tmp_path: Path) -> None:
    path = _write(tmp_path, _SMALL, "good.gguf")
    length = b"\x05\x00\x00\x00\x00\x00\x00\x00"
    (tmp_path / "bad-pre.gguf").write_bytes(path.read_bytes().replace(length + b"gpt-2", length + b"gpt-9"))
    _refused(tmp_path, tmp_path / "bad-pre.gguf", r"unsupported pre-tokenizer 'gpt-9' \(tokenizer.ggml.pre\)")


def test_refuses_a_truncated_gguf(tmp_path: Path) -> None:
    path = _write(tmp_path, _SMALL, "bad.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    _refused(tmp_path, path, r"damaged GGUF file .* truncated")


def test_refuses_a_truncated_header(tmp_path: Path) -> None:
    path = _write(tmp_path, _SMALL, "bad.gguf")
    path.write_bytes(path.read_bytes()[:5000])
    _refused(tmp_path, path, r"damaged GGUF file .*truncated: the header runs past the end")


@pytest.mark.parametrize(
    ("changes", "claims", "message"),
    [
        (
            {"kv_heads": 4},
            {"attention.head_count_kv": 2},
            r"tensor model.layers.0.self_attn.k_proj.weight has shape \[64, 64\] but .* implies \[32, 64\]",
        ),
        (
            {"ffn": 96},
            {"feed_forward_length": 128},
            r"tensor model.layers.0.mlp.gate_proj.weight has shape \[96, 64\] but .* implies \[128, 64\]",
        ),
        ({"layers": 3}, {"block_count": 2}, r"the GGUF has tensors its metadata does not account for: model.layers.2"),
        ({"layers": 2}, {"block_count": 3}, r"the GGUF lacks tensors its metadata implies: model.layers.2"),
    ],
)
def test_refuses_shapes_that_contradict_the_metadata(tmp_path: Path, changes: dict, claims: dict, message: str) -> None:
    """Tensors written for one shape, metadata claiming another."""
    import attrs

    path = _write(tmp_path, attrs.evolve(_SMALL, keys=claims, **changes), "bad.gguf")
    _refused(tmp_path, path, message)


def test_refuses_unknown_metadata(tmp_path: Path) -> None:
    import attrs

    path = _write(tmp_path, attrs.evolve(_SMALL, keys={"attention.scale": 0.5}), "bad.gguf")
    _refused(tmp_path, path, r"GGUF metadata llama.attention.scale is not supported for architecture 'llama'")


def test_refuses_mixture_of_experts(tmp_path: Path) -> None:
    import attrs

    path = _write(tmp_path, attrs.evolve(_SMALL, keys={"expert_count": 8, "expert_used_count": 2}), "bad.gguf")
    _refused(tmp_path, path, r"mixture-of-experts")


def test_random_blocks_have_finite_scales() -> None:
    rng = np.random.default_rng(0)
    for qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ1_M):
        values = gguf.quants.dequantize(random_tensor(qtype, 4, 256, rng), qtype)
        assert np.isfinite(values).all() and 0 < np.abs(values).max() < 10, qtype.name
