"""Build a Hugging Face ``tokenizer.json`` from the vocabulary stored in a GGUF file.

llama.cpp keeps the whole tokenizer in GGUF metadata (``tokenizer.ggml.*``). This module turns it back
into the two files that MLX / Hugging Face tooling reads, using the ``tokenizers`` library only (no
transformers, no torch). Two vocabulary kinds are supported, the ones the models in the catalogue use:

* ``gpt2``: byte-level BPE with the merges stored in the file (SmolLM2). The pre-tokenizer depends on
  ``tokenizer.ggml.pre``; only the kinds whose llama.cpp splitting we reproduce exactly are accepted.
* ``llama``: SentencePiece BPE (Gemma). SentencePiece files carry piece scores instead of merges, so
  merges are derived from the scores the way llama.cpp applies them (highest-scoring pair first),
  with byte fallback for characters outside the vocabulary.

Token types follow llama.cpp: CONTROL tokens become special added tokens, USER_DEFINED tokens
(Gemma's ``"\\n\\n"``, runs of spaces, HTML tags) become non-special added tokens, matched in the raw
text before the model runs. Both are the behaviour of ``llama_tokenize(..., parse_special=true)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

__all__ = [
    "UnsupportedTokenizerError",
    "build_tokenizer",
    "save_tokenizer",
    "tokenizer_config",
]

# llama.cpp's llama_token_type values (gguf.TokenType).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space


class UnsupportedTokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing or of a kind this module cannot rebuild exactly."""


def _byte_level_pre_tokenizer(*, split_digits: bool) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if not split_digits:
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


# tokenizer.ggml.pre -> the pre-tokenizer that splits text as llama.cpp does for that value: the
# GPT-2 regex, after isolating every digit for "smollm" (checked against llama.cpp's token ids).
# A missing value means llama.cpp's "default" splitting, which is different and not supported.
_GPT2_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt2": lambda: _byte_level_pre_tokenizer(split_digits=False),
    "smollm": lambda: _byte_level_pre_tokenizer(split_digits=True),
}


def _require(metadata: Mapping[str, Any], key: str) -> Any:
    try:
        return metadata[key]
    except KeyError:
        raise UnsupportedTokenizerError(f"the GGUF has no tokenizer: metadata key {key!r} is missing") from None


@attrs.frozen
class _Vocab:
    """The ``tokenizer.ggml.*`` metadata both output files are built from."""

    kind: str  #: "gpt2" or "llama"
    tokens: list[str]
    types: list[int]
    add_bos: bool
    add_eos: bool
    ids: dict[str, int | None]  #: "bos", "eos", "unk", "pad" -> token id

    @classmethod
    def read(cls, metadata: Mapping[str, Any]) -> _Vocab:
        kind = _require(metadata, "tokenizer.ggml.model")
        tokens = list(_require(metadata, "tokenizer.ggml.tokens"))
        return cls(
            kind=kind,
            tokens=tokens,
            types=list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)),
            # llama.cpp's defaults when the flags are absent: SentencePiece vocabularies add BOS.
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            ids={
                role: metadata.get(f"tokenizer.ggml.{key}_token_id")
                for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
            },
        )

    def token(self, role: str) -> str | None:
        token_id = self.ids[role]
        return self.tokens[token_id] if token_id is not None else None

    def of_type(self, token_type: int) -> list[tuple[int, str]]:
        return [(i, tok) for i, (tok, ty) in enumerate(zip(self.tokens, self.types, strict=True)) if ty == token_type]


def _spm_merges(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Derive BPE merges from SentencePiece piece scores.

    llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is the
    highest-scoring piece. Listing every split of every piece into two in-vocabulary halves, ordered
    by the piece's score, gives a BPE merge table with the same preference (this is also how Hugging
    Face converts SentencePiece models).
    """
    candidates: list[tuple[float, int, int, str, str]] = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append((scores[piece_id], vocab[left], vocab[right], left, right))
    # Highest score first; among the splits of one piece, the one with the lower-id halves first.
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(left, right) for _, _, _, left, right in candidates]


def _post_processor(vocab: _Vocab) -> processors.PostProcessor | None:
    """Add BOS/EOS around each sequence when the GGUF asks for it (``add_special_tokens=True``)."""
    wanted = (("bos", vocab.add_bos), ("eos", vocab.add_eos))
    used = {role: token_id for role, on in wanted if on and (token_id := vocab.ids[role]) is not None}
    if not used:
        return processors.ByteLevel(trim_offsets=False) if vocab.kind == "gpt2" else None
    prefix = f"{vocab.token('bos')} " if "bos" in used else ""
    suffix = f" {vocab.token('eos')}" if "eos" in used else ""
    return processors.TemplateProcessing(
        single=f"{prefix}$A:0{suffix}",
        pair=f"{prefix}$A:0{suffix} {prefix}$B:1{suffix}",
        special_tokens=sorted({(vocab.tokens[i], i) for i in used.values()}),
    )


def build_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    """Build the ``tokenizers.Tokenizer`` described by GGUF metadata.

    Args:
        metadata: GGUF key/value metadata, values already decoded (``ReaderField.contents()``). Only
            the ``tokenizer.ggml.*`` keys are read.

    Returns:
        A tokenizer whose ``encode(text).ids`` equal llama.cpp's ``llama_tokenize(text, add_special=true,
        parse_special=true)``.

    Raises:
        UnsupportedTokenizerError: the metadata has no tokenizer, or one of an unsupported kind.
    """
    vocab = _Vocab.read(metadata)
    ids = {token: token_id for token_id, token in enumerate(vocab.tokens)}
    if len(ids) != len(vocab.tokens):
        raise UnsupportedTokenizerError("the GGUF vocabulary has duplicate tokens")

    if vocab.kind == "gpt2":
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in _GPT2_PRE_TOKENIZERS:
            raise UnsupportedTokenizerError(
                f"unsupported pre-tokenizer {pre!r} for a gpt2 vocabulary "
                f"(supported: {', '.join(sorted(_GPT2_PRE_TOKENIZERS))})"
            )
        merges = [tuple(m.split(" ", 1)) for m in _require(metadata, "tokenizer.ggml.merges")]
        tokenizer = Tokenizer(models.BPE(ids, merges, fuse_unk=False, byte_fallback=False))
        tokenizer.pre_tokenizer = _GPT2_PRE_TOKENIZERS[pre]()
        tokenizer.decoder = decoders.ByteLevel()
    elif vocab.kind == "llama":
        merges = _spm_merges(ids, _require(metadata, "tokenizer.ggml.scores"))
        tokenizer = Tokenizer(models.BPE(ids, merges, unk_token=vocab.token("unk"), fuse_unk=True, byte_fallback=True))
        space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        steps = [normalizers.Prepend(_SPM_SPACE)] if space_prefix else []
        tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
        decode_steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if space_prefix:
            decode_steps.append(decoders.Strip(" ", 1, 0))
        tokenizer.decoder = decoders.Sequence(decode_steps)
    else:
        raise UnsupportedTokenizerError(
            f"unsupported tokenizer model {vocab.kind!r} (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )

    tokenizer.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for _, tok in vocab.of_type(_CONTROL)]
    )
    tokenizer.add_tokens([AddedToken(tok, special=False, normalized=False) for _, tok in vocab.of_type(_USER_DEFINED)])
    tokenizer.post_processor = _post_processor(vocab)
    return tokenizer


def tokenizer_config(metadata: Mapping[str, Any], *, context_length: int | None = None) -> dict[str, Any]:
    """The ``tokenizer_config.json`` content matching :func:`build_tokenizer`.

    Holds the special-token strings, ``add_bos_token``/``add_eos_token``, ``added_tokens_decoder`` as
    Hugging Face writes it, and ``chat_template`` when the GGUF has one (base models have none and
    are meant for plain completion).
    """
    vocab = _Vocab.read(metadata)
    added = sorted(vocab.of_type(_CONTROL) + vocab.of_type(_USER_DEFINED))
    config: dict[str, Any] = {
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": vocab.types[token_id] == _CONTROL,
            }
            for token_id, token in added
        },
        "bos_token": vocab.token("bos"),
        "clean_up_tokenization_spaces": False,
        "eos_token": vocab.token("eos"),
        "pad_token": vocab.token("pad"),
        "unk_token": vocab.token("unk"),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if context_length is not None:
        config["model_max_length"] = context_length
    if template := metadata.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config


def save_tokenizer(metadata: Mapping[str, Any], directory: Path, *, context_length: int | None = None) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the GGUF metadata into ``directory``.

    Raises:
        UnsupportedTokenizerError: see :func:`build_tokenizer`.
    """
    tokenizer = build_tokenizer(metadata)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=False)
    config = tokenizer_config(metadata, context_length=context_length)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
