"""Tokenizers rebuilt from GGUF vocabularies give llama.cpp's ids, on llama.cpp's own fixtures.

Every ``models/ggml-vocab-*.gguf`` with ``.inp``/``.out`` files in llama.cpp (fetched by
:mod:`tests.model.gguf_fixtures`) is tokenized text by text and compared id for id, as llama.cpp's
``test-tokenizer-0`` does (no BOS/EOS, special tokens not parsed: ``add_special_tokens=False``).
The supported types are exactly those below; a fixture of a type we do not support must be refused
with an error naming it, and a fixture llama.cpp adds later fails :func:`test_every_fixture_is_listed`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.model.gguf_fixtures import fixture_cases, llama_cpp_sources
from turbospark.store.gguf_pretokenizers import PRE_TOKENIZERS
from turbospark.store.gguf_reader import read_gguf
from turbospark.store.gguf_tokenizer import UnsupportedTokenizerError, build_tokenizer

# fixture -> (tokenizer.ggml.model, tokenizer.ggml.pre) it holds
SUPPORTED = {
    "bert-bge": ("bert", "bert-bge"),
    "command-r": ("gpt2", "command-r"),
    "deepseek-coder": ("gpt2", "deepseek-coder"),
    "deepseek-llm": ("gpt2", "deepseek-llm"),
    "falcon": ("gpt2", "falcon"),
    "gpt-2": ("gpt2", "gpt-2"),
    "llama-bpe": ("gpt2", "llama-bpe"),
    "llama-spm": ("llama", "default"),
    "mpt": ("gpt2", "mpt"),
    "phi-3": ("llama", "default"),
    "qwen2": ("gpt2", "qwen2"),
    "qwen35": ("gpt2", "qwen35"),
    "refact": ("gpt2", "refact"),
    "starcoder": ("gpt2", "starcoder"),
}
# fixture with texts -> the unsupported kind the refusal must name
UNSUPPORTED = {"gemma-4": "'gemma4'"}


@functools.cache
def _metadata(name: str) -> dict:
    return dict(read_gguf(llama_cpp_sources() / "models" / f"ggml-vocab-{name}.gguf").metadata)


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    return build_tokenizer(_metadata(name))


def test_every_fixture_is_listed() -> None:
    with_texts = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp") for p in _models().glob("*.gguf.inp")}
    assert with_texts == set(SUPPORTED) | set(UNSUPPORTED)


def _models() -> Path:
    return llama_cpp_sources() / "models"


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_fixture_ids_equal_llama_cpps(name: str) -> None:
    md = _metadata(name)
    assert (md["tokenizer.ggml.model"], md.get("tokenizer.ggml.pre", "default")) == SUPPORTED[name]
    tokenizer = _tokenizer(name)
    cases = fixture_cases(_models() / f"ggml-vocab-{name}.gguf")
    assert len(cases) >= 40
    wrong = [
        (text, ids, got)
        for text, ids in cases
        if (got := tokenizer.encode(text, add_special_tokens=False).ids) != ids
    ]
    assert not wrong, f"{len(wrong)} of {len(cases)} texts differ, first: {wrong[0]}"


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_fixture_is_refused_by_name(name: str) -> None:
    with pytest.raises(UnsupportedTokenizerError, match=UNSUPPORTED[name]):
        build_tokenizer(_metadata(name))


def test_unknown_pre_tokenizer_is_refused_by_name() -> None:
    md = {**_metadata("gpt-2"), "tokenizer.ggml.pre": "made-up-pre"}
    with pytest.raises(UnsupportedTokenizerError, match=r"unsupported pre-tokenizer 'made-up-pre'"):
        build_tokenizer(md)


def test_t5_vocabulary_is_refused_by_name() -> None:
    md = dict(read_gguf(_models() / "ggml-vocab-nomic-bert-moe.gguf").metadata)
    with pytest.raises(UnsupportedTokenizerError, match=r"unsupported tokenizer model 't5'"):
        build_tokenizer(md)


def test_regexes_are_llama_cpps_verbatim() -> None:
    """Every split expression is a string literal of llama.cpp's ``llama-vocab.cpp``."""
    source = (llama_cpp_sources() / "src" / "llama-vocab.cpp").read_text("utf-8")
    literals = {bytes(m, "utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8")
                for m in re.findall(r'^\s*"((?:[^"\\]|\\.)*)",\s*(?://.*)?$', source, re.M)}
    for name, pre in PRE_TOKENIZERS.items():
        for regex in pre.regexes:
            assert regex in literals, (name, regex)


def test_production_tokenizer_adds_bos_and_parses_specials() -> None:
    """With special tokens on (how the runtime encodes prompts), BOS is added as llama.cpp adds it."""
    llama3 = _tokenizer("llama-bpe")
    assert llama3.encode("Hello").ids == [128000, 9906]  # llama-bpe adds BOS by default
    assert llama3.encode("<|begin_of_text|>Hi", add_special_tokens=False).ids == [128000, 13347]
    spm = _tokenizer("llama-spm")
    assert spm.encode("Hello").ids[0] == 1
    assert _tokenizer("gpt-2").encode("Hello").ids == [15496]
    bert = _tokenizer("bert-bge")
    assert bert.encode("Hello").ids == [101, 7592, 102]
