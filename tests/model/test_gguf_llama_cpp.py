"""Imported GGUFs compute what llama.cpp computes on the same file.

Needs llama-cpp-python, which PyPI has only as an sdist (a C++ build of 6 minutes on 2 idle cores,
hours on busy ones), and takes about 10 minutes itself, so it is not part of the default run: the
tests skip unless ``$TURBOSPARK_LLAMA_CPP_PYTHON`` names an interpreter that imports ``llama_cpp``.
``scripts/check-against-llama-cpp`` builds one into ``tests/.cache/llama-cpp/venv`` from the pinned
sdist when missing, sets the variable and runs this file. llama.cpp runs in its own process
(``scripts/llama_cpp_reference.py``); nothing here imports it.

* Weights: for each tiny model of :data:`tests.model.gguf_tiny_models.CASES` and a few prompts,
  llama.cpp tokenizes (BOS, special tokens parsed) and decodes greedily, keeping the logits of
  every position. The import must tokenize the prompts to the same ids, and MLX, fed the same
  tokens through its KV cache (rotating for sliding windows), must give the same logits within the
  tolerance below and the same greedy token wherever llama.cpp's choice is not a near tie.
* Tokenizers: llama.cpp's ids for every vocabulary fixture on every fixture text and on texts with
  the vocabulary's own special tokens, as a prompt is encoded (``add_special``, ``parse_special``);
  and every pre-tokenizer name the import accepts, swapped into a vocabulary, on all fixture texts.

Tolerance (``TinyModel.tolerance``, a fraction of the largest logit's magnitude): llama.cpp runs
with a float32 KV cache and without flash attention, so on float32 weights both sides compute in
float32 and differ only in summation order: 1e-5 (measured: about 1e-6). Gemma's GELU is the
exception: llama.cpp's CPU GELU reads its input rounded to float16 from a float16 table
(``GGML_GELU_FP16``), so Gemma 2 and 3 get 1e-3 (measured: 1.6e-4; 1e-6 to 2e-5 with that table
emulated in MLX). Quantized matrices are multiplied in llama.cpp with the activations rounded to 8
bits (Q8_0 / Q8_K blocks) but in MLX with float32 activations, so those cases get 0.1 (measured: up
to 5e-2) and rely on the greedy tokens; the dequantized values themselves are checked exactly by
the ``embedding-*`` cases, whose only quantized tensor is the embedding, which llama.cpp reads
dequantized. Greedy tokens must be llama.cpp's wherever its top two logits are further apart than
twice the logits' difference at that position.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tokenizers import Tokenizer

from tests.model.gguf_fixtures import fixture_cases, llama_cpp_sources
from tests.model.gguf_tiny_models import CASES, DEQUANT_CASES, TinyModel, write_tiny
from turbospark.model.mlx_ggml import load_model
from turbospark.store.gguf_import import convert_gguf
from turbospark.store.gguf_pretokenizers import PRE_TOKENIZERS
from turbospark.store.gguf_reader import read_gguf
from turbospark.store.gguf_tokenizer import build_tokenizer

REPO = Path(__file__).parents[2]
PROMPTS = (
    "The quick brown fox jumps over the lazy dog because it wanted to see what lay beyond",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(10))",
    "Été 2024 : 3 chats, 12 chiens — et un lama 🦙 !  Ça   marche ?",
)
N_PREDICT = 12


@functools.cache
def _llama_cpp_python() -> str | None:
    candidate = os.environ.get("TURBOSPARK_LLAMA_CPP_PYTHON")
    if candidate and Path(candidate).exists():
        result = subprocess.run([candidate, "-c", "import llama_cpp"], capture_output=True, check=False)
        if result.returncode == 0:
            return candidate
    return None


pytestmark = pytest.mark.skipif(
    _llama_cpp_python() is None,
    reason="needs llama-cpp-python ($TURBOSPARK_LLAMA_CPP_PYTHON unset or without llama_cpp): "
    "run scripts/check-against-llama-cpp, which builds it from the PyPI sdist once and runs these tests",
)


def _reference(request: dict, work: Path) -> dict[str, np.ndarray]:
    """Run ``scripts/llama_cpp_reference.py`` in the llama-cpp-python interpreter."""
    (work / "request.json").write_text(json.dumps(request))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    command = [_llama_cpp_python(), str(REPO / "scripts" / "llama_cpp_reference.py"), str(work / "request.json")]
    result = subprocess.run(
        [*command, "--out", str(work / "answer.npz")], capture_output=True, text=True, env=env, timeout=900, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(work / "answer.npz") as answer:
        return dict(answer)


def _vocabs() -> Path:
    return llama_cpp_sources() / "models"


# -- weights ---------------------------------------------------------------------------------------------


def _mlx_logits(model, tokens: list[int], n_prompt: int) -> np.ndarray:
    """Logits of every position: the prompt in one pass, then one token at a time through the cache."""
    cache = make_prompt_cache(model)
    rows = [model(mx.array([tokens[:n_prompt]]), cache=cache)[0]]
    for token in tokens[n_prompt:]:
        rows.append(model(mx.array([[token]]), cache=cache)[0])
    return np.array(mx.concatenate(rows).astype(mx.float32))


def _compare(tmp_path: Path, tiny: TinyModel) -> str:
    """Import ``tiny``, run it in llama.cpp and MLX, check prompt ids, logits and greedy tokens."""
    path = tmp_path / f"{tiny.name}.gguf"
    write_tiny(tiny, path, _vocabs())
    (tmp_path / "model").mkdir()
    convert_gguf(path, tmp_path / "model", dtype="float32", progress=False)
    reference = _reference(
        {"kind": "generate", "model": str(path), "prompts": list(PROMPTS), "n_predict": N_PREDICT, "n_ctx": tiny.n_ctx},
        tmp_path,
    )
    model, _ = load_model(tmp_path / "model")
    tokenizer = Tokenizer.from_file(str(tmp_path / "model" / "tokenizer.json"))
    report = []
    for i, prompt in enumerate(PROMPTS):
        tokens = [int(t) for t in reference[f"tokens_{i}"]]
        n_prompt = len(tokens) - N_PREDICT
        assert tokenizer.encode(prompt).ids == tokens[:n_prompt], f"prompt {i} tokenized differently"
        theirs = reference[f"logits_{i}"]
        ours = _mlx_logits(model, tokens, n_prompt)
        assert ours.shape == theirs.shape
        scale = float(np.abs(theirs).max())
        error = float(np.abs(ours - theirs).max()) / scale
        near_ties = 0
        for j in range(n_prompt - 1, len(tokens) - 1):
            row_error = float(np.abs(ours[j] - theirs[j]).max())
            ranked = np.sort(theirs[j])
            assert int(np.argmax(theirs[j])) == tokens[j + 1]
            if int(np.argmax(ours[j])) != tokens[j + 1]:
                # Only a near tie may flip: a gap the logits' own difference at that position covers.
                assert ranked[-1] - ranked[-2] <= 2 * row_error, f"prompt {i}, position {j}: greedy token differs"
                near_ties += 1
            if ranked[-6] < ranked[-5] - 2 * row_error:
                assert set(np.argsort(ours[j])[-5:]) == set(np.argsort(theirs[j])[-5:]), f"prompt {i}, {j}: top 5 differ"
        report.append(f"{n_prompt}+{N_PREDICT} tokens, {error:.1e} of {scale:.0f}, {near_ties} near ties")
        assert error <= tiny.tolerance, f"prompt {i}: logits differ by {error:.2e} of their scale (> {tiny.tolerance})"
    return f"{tiny.name}: " + "; ".join(report)


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_match_llama_cpp(tmp_path: Path, case: str) -> None:
    print("\n" + _compare(tmp_path, CASES[case]))


@pytest.mark.parametrize("case", sorted(DEQUANT_CASES))
def test_dequantization_matches_llama_cpp(tmp_path: Path, case: str) -> None:
    print("\n" + _compare(tmp_path, DEQUANT_CASES[case]))


# -- tokenizers -------------------------------------------------------------------------------------------


def _all_fixture_texts() -> list[str]:
    texts = []
    for inp in sorted(_vocabs().glob("*.gguf.inp")):
        texts += [text for text, _ in fixture_cases(inp.with_suffix(""))]
    return list(dict.fromkeys(texts))


def _special_texts(md: dict) -> list[str]:
    """Prompts made of the vocabulary's own control and user-defined tokens, as chat templates write them."""
    tokens, types = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.token_type") or []
    control = [t for t, ty in zip(tokens, types) if ty == 3][:6]
    user = [t for t, ty in zip(tokens, types) if ty == 4][:6]
    texts = [f"{c}user\nHello there{c} x" for c in control] + [f"a{u}b {u} c" for u in user]
    texts.append("".join(control[:3]) + " Hi  " + "".join(user[:3]) + "\n\n end")
    return texts


# Every vocabulary fixture of a supported kind, with or without .inp/.out files.
VOCABULARIES = (
    "aquila", "baichuan", "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "gpt-neox",
    "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
)  # fmt: skip


@pytest.mark.parametrize("vocab", VOCABULARIES)
def test_vocabulary_ids_match_llama_cpp(tmp_path: Path, vocab: str) -> None:
    """Every fixture vocabulary (with or without .out files), both ways a text is encoded."""
    path = _vocabs() / f"ggml-vocab-{vocab}.gguf"
    md = dict(read_gguf(path).metadata)
    texts = _all_fixture_texts() + _special_texts(md)
    reference = _reference({"kind": "tokenize", "model": str(path), "texts": texts}, tmp_path)
    tokenizer = build_tokenizer(md)
    specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
    wrong = []
    for i, text in enumerate(texts):
        plain = tokenizer.encode(text, add_special_tokens=False).ids
        prompt = tokenizer.encode(text).ids
        # Without parse_special llama.cpp reads special tokens' text as plain text: only comparable without them.
        parses_specials = any(special in text for special in specials)
        if not parses_specials and plain != list(reference[f"ids_{i}_0_0"]):
            wrong.append(("plain", text, plain, list(reference[f"ids_{i}_0_0"])))
        if prompt != list(reference[f"ids_{i}_1_1"]):
            wrong.append(("prompt", text, prompt, list(reference[f"ids_{i}_1_1"])))
    assert not wrong, f"{len(wrong)} of {2 * len(texts)} encodings differ; first: {wrong[0]}"


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_name_matches_llama_cpp(tmp_path: Path, pre: str) -> None:
    """Each accepted ``tokenizer.ggml.pre``, swapped into a byte-level vocabulary, splits as llama.cpp does."""
    vocab = "llama-bpe" if PRE_TOKENIZERS[pre].ignore_merges else "gpt-2"
    path = tmp_path / "vocab.gguf"
    write_tiny(TinyModel("pre", "llama", vocab, layers=1, pre=pre), path, _vocabs())
    texts = _all_fixture_texts()
    reference = _reference({"kind": "tokenize", "model": str(path), "texts": texts}, tmp_path)
    tokenizer = build_tokenizer(dict(read_gguf(path).metadata))
    wrong = [
        (text, ours, list(reference[f"ids_{i}_1_1"]))
        for i, text in enumerate(texts)
        if (ours := tokenizer.encode(text).ids) != list(reference[f"ids_{i}_1_1"])
    ]
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ; first: {wrong[0]}"
