"""Hugging Face and ``mlx-community`` directories into the store, as they are or converted.

The directories are built in-process with mlx-lm itself: a tiny model of each supported
architecture with random weights, saved as a Hugging Face checkpoint (bfloat16 safetensors) or as
mlx-lm saves a quantized ``mlx-community`` model (``quantization`` in ``config.json``, packed
weights with scales and biases).  The tokenizer is the one the store builds for the tiny GGUF.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes, load_model, quantize_model, save_config, save_model

import turbospark.store.store as store_module
from tests.model.tiny import write_tiny_gguf
from turbospark.store.store import ModelStore

_BASE = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "rope_theta": 10000.0,
}  # fmt: skip
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False},
    "mistral": {"architectures": ["MistralForCausalLM"], "tie_word_embeddings": False},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 16, "tie_word_embeddings": True},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "head_dim": 16, "query_pre_attn_scalar": 16,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"architectures": ["Gemma3ForCausalLM"], "head_dim": 16, "query_pre_attn_scalar": 16,
                    "sliding_window": 128, "sliding_window_pattern": 2},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "tie_word_embeddings": False},
}  # fmt: skip
PROMPT = mx.array([[5, 60, 7, 200, 9]])


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tokenizer.json`` and ``tokenizer_config.json`` (with a chat template) of the tiny GGUF."""
    work = tmp_path_factory.mktemp("tokenizer")
    write_tiny_gguf(work / "tiny.gguf")
    model = ModelStore(work / "models").import_source(work / "tiny.gguf", dtype="float32", progress=False)
    out = work / "tokenizer"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(model.path / name, out / name)
    return out


def _vocab_size(tokenizer: Path) -> int:
    return len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])


def _model(model_type: str, vocab_size: int) -> tuple[Any, dict[str, Any]]:
    config = {**_BASE, "model_type": model_type, "vocab_size": vocab_size, **ARCHITECTURES[model_type]}
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config)), config


def hf_directory(path: Path, model_type: str, tokenizer: Path) -> Path:
    """A Hugging Face checkpoint: bfloat16 safetensors (with a RoPE buffer HF writes and mlx-lm
    drops), ``config.json``, ``generation_config.json``, the tokenizer."""
    model, config = _model(model_type, _vocab_size(tokenizer))
    path.mkdir(parents=True)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    if model_type == "llama":
        weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((8,))
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8}))
    for f in tokenizer.iterdir():
        shutil.copy2(f, path / f.name)
    return path


def mlx_community_directory(path: Path, tokenizer: Path, *, bits: int = 4) -> Path:
    """What ``mlx_lm.convert -q`` writes: quantized weights, ``quantization`` in ``config.json``."""
    model, config = _model("llama", _vocab_size(tokenizer))
    model, config = quantize_model(model, config, group_size=64, bits=bits)
    save_model(path, model)
    save_config(config, path / "config.json")
    for f in tokenizer.iterdir():
        shutil.copy2(f, path / f.name)
    return path


def _logits(directory: Path, dtype: mx.Dtype | None = None) -> np.ndarray:
    """The model's logits for ``PROMPT``, its float parameters cast to ``dtype`` first if given."""
    model, _ = load_model(directory)
    if dtype is not None:
        model.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
                              model.parameters()))  # fmt: skip
    return np.array(model(PROMPT).astype(mx.float32))


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "models")


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "default_dtype", lambda: "float32")


@pytest.fixture
def on_metal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "default_dtype", lambda: "native")


# -- Hugging Face checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_a_hugging_face_checkpoint_of_each_supported_architecture(
    model_type: str, store: ModelStore, tmp_path: Path, tokenizer_files: Path, on_cpu: None
) -> None:
    src = hf_directory(tmp_path / f"Tiny-{model_type}", model_type, tokenizer_files)
    model = store.import_source(src, progress=False)  # CPU: float32, BLAS's type
    assert (model.manifest["architecture"], model.manifest["dtype"]) == (model_type, "float32")
    source = mx.load(str(src / "model.safetensors"))
    stored = mx.load(str(model.path / "model.safetensors"))
    assert stored.keys() == source.keys()
    for name, array in stored.items():
        assert array.dtype == mx.float32 and mx.array_equal(array, source[name].astype(mx.float32)), name
    assert json.loads((model.path / "generation_config.json").read_text()) == {"temperature": 0.7, "top_p": 0.8}
    np.testing.assert_allclose(_logits(model.path), _logits(src, mx.float32), rtol=1e-5, atol=1e-5)

    native = store.import_source(src, name=f"{model_type}-native", dtype="native", progress=False)
    assert (native.path / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_a_checkpoint_on_metal_is_kept_as_it_is(store: ModelStore, tmp_path: Path, tokenizer_files: Path,
                                                on_metal: None) -> None:  # fmt: skip
    src = hf_directory(tmp_path / "Tiny-HF", "qwen3", tokenizer_files)
    model = store.import_source(src, progress=False)
    assert model.manifest["dtype"] == "native" and "quantization" not in model.manifest
    assert (model.path / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


# -- mlx-community directories --------------------------------------------------------------------------


def test_an_mlx_community_directory_keeps_its_quantization_where_it_runs_fast(
    store: ModelStore, tmp_path: Path, tokenizer_files: Path, on_metal: None
) -> None:
    src = mlx_community_directory(tmp_path / "Tiny-4bit", tokenizer_files)
    model = store.import_source(src, progress=False)
    assert (model.name, model.manifest["dtype"]) == ("tiny-4bit", "native")
    assert model.manifest["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert json.loads((model.path / "config.json").read_text())["quantization"]["bits"] == 4
    assert (model.path / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    np.testing.assert_array_equal(_logits(model.path), _logits(src))


def test_an_mlx_community_directory_on_cpu_is_dequantized(
    store: ModelStore, tmp_path: Path, tokenizer_files: Path, on_cpu: None
) -> None:
    src = mlx_community_directory(tmp_path / "Tiny-4bit", tokenizer_files)
    model = store.import_source(src, progress=False)
    assert model.manifest["dtype"] == "float32" and "quantization" not in model.manifest
    config = json.loads((model.path / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    source = mx.load(str(src / "model.safetensors"))
    stored = mx.load(str(model.path / "model.safetensors"))
    assert not any(name.endswith((".scales", ".biases")) for name in stored)
    assert {a.dtype for a in stored.values()} == {mx.float32}
    q = "model.layers.0.self_attn.q_proj"
    expected = mx.dequantize(source[f"{q}.weight"], source[f"{q}.scales"], source[f"{q}.biases"], 64, 4)
    assert mx.array_equal(stored[f"{q}.weight"], expected.astype(mx.float32))
    np.testing.assert_allclose(_logits(model.path), _logits(src), atol=1e-2)
    # the index names the files written, not the source's
    index = json.loads((model.path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(stored)

    # --dtype converts: keep it as it is, or quantize again
    assert store.import_source(src, name="kept", dtype="native", progress=False).manifest["dtype"] == "native"
    q8 = store.import_source(src, name="q8", dtype="q8", progress=False)
    assert json.loads((q8.path / "config.json").read_text())["quantization"] == {
        "group_size": 64, "bits": 8, "mode": "affine"
    }  # fmt: skip
    np.testing.assert_allclose(_logits(q8.path), _logits(src), atol=0.05)
    bf16 = store.import_source(src, name="bf16", dtype="bfloat16", progress=False)
    weights = mx.load(str(bf16.path / "model.safetensors"))
    assert {a.dtype for a in weights.values()} == {mx.bfloat16}


def test_an_unquantized_mlx_community_directory(
    store: ModelStore, tmp_path: Path, tokenizer_files: Path, on_cpu: None
) -> None:
    model, config = _model("qwen3", _vocab_size(tokenizer_files))
    model.update(tree_map(lambda a: a.astype(mx.bfloat16), model.parameters()))
    src = tmp_path / "Tiny-bf16"
    save_model(src, model)
    save_config(config, src / "config.json")
    for f in tokenizer_files.iterdir():
        shutil.copy2(f, src / f.name)
    stored = store.import_source(src, progress=False)
    assert stored.manifest["dtype"] == "float32"
    assert {a.dtype for a in mx.load(str(stored.path / "model.safetensors")).values()} == {mx.float32}
    np.testing.assert_allclose(_logits(stored.path), _logits(src, mx.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kept_as", ["chat_template.jinja", "chat_template.json"])
def test_a_chat_template_kept_in_a_file_of_its_own_is_folded_into_the_tokenizers_config(
    kept_as: str, store: ModelStore, tmp_path: Path, tokenizer_files: Path, on_cpu: None
) -> None:
    """transformers 4.51 on writes ``chat_template.jinja``; older vision repositories (SmolVLM2's)
    keep the processor's template in ``chat_template.json``: either way the stored tokenizer has it."""
    src = hf_directory(tmp_path / "Tiny", "llama", tokenizer_files)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (src / kept_as).write_text(template if kept_as.endswith(".jinja") else json.dumps({"chat_template": template}))
    model = store.import_source(src, progress=False)
    assert json.loads((model.path / "tokenizer_config.json").read_text())["chat_template"] == template
