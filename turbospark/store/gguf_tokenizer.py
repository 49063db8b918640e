"""Build a Hugging Face ``tokenizer.json`` from the vocabulary stored in a GGUF file.

llama.cpp keeps the whole tokenizer in GGUF metadata (``tokenizer.ggml.*``). This module turns it back
into the two files that MLX / Hugging Face tooling reads, using the ``tokenizers`` library only (no
transformers, no torch), so that the ids are llama.cpp's (``llama_tokenize``) for every text.
Three vocabulary kinds (``tokenizer.ggml.model``) are rebuilt:

* ``gpt2``: byte-level BPE with the merges stored in the file (Llama 3, Qwen, SmolLM2, GPT-2,
  DeepSeek, Command-R, StarCoder, Falcon, MPT...). How text is split into words before the merges
  depends on ``tokenizer.ggml.pre`` (:mod:`.gguf_pretokenizers`); an unknown value is refused.
* ``llama``: SentencePiece BPE (Llama 2, Mistral, Phi-3, Gemma). SentencePiece files carry piece
  scores instead of merges, so merges are derived from the scores the way llama.cpp applies them
  (highest-scoring pair first), with byte fallback for characters outside the vocabulary.
* ``bert``: WordPiece (BERT, BGE). llama.cpp stores word-initial pieces with a leading ``▁`` and
  continuations bare; they are turned back into Hugging Face's bare / ``##`` form.

Token types follow llama.cpp: CONTROL and UNKNOWN tokens become special added tokens (matched in
the text only when special tokens are parsed), USER_DEFINED tokens (Gemma's ``"\\n\\n"``, runs of
spaces, HTML tags) non-special added tokens, matched in the raw text before the model runs. Tokens
llama.cpp treats as end-of-generation or fill-in-the-middle markers by their text are CONTROL
whatever their stored type, as there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .gguf_pretokenizers import PRE_TOKENIZERS

__all__ = [
    "UnsupportedTokenizerError",
    "build_tokenizer",
    "end_of_generation_ids",
    "save_tokenizer",
    "tokenizer_config",
]

# llama.cpp's llama_token_type values (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Texts llama.cpp (llama_vocab::load) treats as end of generation, and marks CONTROL if they are not.
_END_OF_GENERATION = frozenset(
    (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
    )
)  # fmt: skip
# Fill-in-the-middle markers llama.cpp marks CONTROL; the pad/repo/file-separator ones also end generation.
_FIM_ENDING = frozenset(("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>"))
_FIM_ENDING |= {"<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"}
_FIM = _FIM_ENDING | {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
    "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
    "▁<MID>", "<|code_middle|>", "<|middle|>",
}  # fmt: skip


class UnsupportedTokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing or of a kind this module cannot rebuild exactly."""


def _require(metadata: Mapping[str, Any], key: str) -> Any:
    try:
        return metadata[key]
    except KeyError:
        raise UnsupportedTokenizerError(f"the GGUF has no tokenizer: metadata key {key!r} is missing") from None


# Special-token ids llama.cpp assumes when the GGUF does not say (per vocabulary kind).
_DEFAULT_IDS = {
    "llama": {"bos": 1, "eos": 2, "unk": 0},
    "gpt2": {"bos": 11, "eos": 11},  # Falcon's, llama.cpp's default for byte-level BPE
    "bert": {"bos": 101, "unk": 100, "sep": 102, "pad": 0},
}
_ID_KEYS = (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"), ("sep", "seperator"))
_ID_KEYS += (("eot", "eot"), ("eom", "eom"))


@attrs.frozen
class _Vocab:
    """The ``tokenizer.ggml.*`` metadata both output files are built from."""

    kind: str  #: "gpt2", "llama" or "bert"
    pre: str  #: tokenizer.ggml.pre ("default" when absent)
    tokens: list[str]
    types: list[int]  #: llama.cpp's types, CONTROL for the texts it treats as control
    add_bos: bool
    add_eos: bool
    ids: dict[str, int | None]  #: "bos", "eos", "unk", "pad", "sep", "eot", "eom" -> token id
    rstrip_specials: bool  #: llama.cpp strips spaces after special tokens (Phi-3, by model name)

    @classmethod
    def read(cls, metadata: Mapping[str, Any]) -> _Vocab:
        kind = _require(metadata, "tokenizer.ggml.model")
        tokens = list(_require(metadata, "tokenizer.ggml.tokens"))
        pre = str(metadata.get("tokenizer.ggml.pre") or "default")
        types = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise UnsupportedTokenizerError(f"the GGUF has {len(tokens)} tokens but {len(types)} token types")
        types = [_CONTROL if tok in _END_OF_GENERATION or tok in _FIM else ty for tok, ty in zip(tokens, types)]
        ids: dict[str, int | None] = {}
        for role, key in _ID_KEYS:
            value = metadata.get(f"tokenizer.ggml.{key}_token_id", _DEFAULT_IDS.get(kind, {}).get(role))
            ids[role] = value if value is not None and 0 <= value < len(tokens) else None
        # llama.cpp's defaults when the flags are absent: SentencePiece and WordPiece vocabularies add
        # BOS, byte-level BPE only for some pre-tokenizers (Llama 3, Tekken).
        default_bos = kind in ("llama", "bert") or (kind == "gpt2" and pre in PRE_TOKENIZERS and PRE_TOKENIZERS[pre].add_bos)
        name = str(metadata.get("general.name", "")).lower()
        return cls(
            kind=kind,
            pre=pre,
            tokens=tokens,
            types=types,
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos)),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            ids=ids,
            rstrip_specials="phi-3" in name or "phi3" in name,
        )

    def token(self, role: str) -> str | None:
        token_id = self.ids[role]
        return self.tokens[token_id] if token_id is not None else None

    def of_type(self, *token_types: int) -> list[tuple[int, str]]:
        return [(i, tok) for i, (tok, ty) in enumerate(zip(self.tokens, self.types, strict=True)) if ty in token_types]


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


def _bpe_merges(metadata: Mapping[str, Any], ids: Mapping[str, int]) -> list[tuple[str, str]]:
    """The stored merges, split as llama.cpp splits them (at the first space after the first character)."""
    merges = []
    for merge in _require(metadata, "tokenizer.ggml.merges"):
        cut = merge.find(" ", 1)
        left, right = (merge[:cut], merge[cut + 1 :]) if cut > 0 else ("", "")
        # llama.cpp ranks every pair but can only emit pieces in the vocabulary; tokenizers refuses
        # merges whose halves or result are missing, which never fire in llama.cpp either.
        if left in ids and right in ids and left + right in ids:
            merges.append((left, right))
    return merges


def _build_gpt2(metadata: Mapping[str, Any], vocab: _Vocab, ids: dict[str, int]) -> Tokenizer:
    pre = PRE_TOKENIZERS.get(vocab.pre)
    if pre is None:
        raise UnsupportedTokenizerError(
            f"unsupported pre-tokenizer {vocab.pre!r} (tokenizer.ggml.pre) for a gpt2 vocabulary; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    model = models.BPE(ids, _bpe_merges(metadata, ids), fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre.build()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _build_spm(metadata: Mapping[str, Any], vocab: _Vocab, ids: dict[str, int]) -> Tokenizer:
    scores = _require(metadata, "tokenizer.ggml.scores")
    if len(scores) != len(vocab.tokens):
        raise UnsupportedTokenizerError(f"the GGUF has {len(vocab.tokens)} tokens but {len(scores)} scores")
    merges = _spm_merges(ids, scores)
    tokenizer = Tokenizer(models.BPE(ids, merges, unk_token=vocab.token("unk"), fuse_unk=True, byte_fallback=True))
    space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # llama.cpp prefixes a space to every run of text that starts the input or follows a special
    # token; tokenizers normalizes each run between added tokens apart, so Prepend does the same.
    steps = [normalizers.Prepend(_SPM_SPACE)] if space_prefix else []
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces"):
        raise UnsupportedTokenizerError("SentencePiece vocabularies that remove extra whitespace are not supported")
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
    decode_steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode_steps)
    return tokenizer


def _build_wpm(vocab: _Vocab) -> Tokenizer:
    # llama.cpp's WordPiece looks words up with a leading "▁"; continuation pieces are stored bare.
    # Hugging Face's is the other way round: word-initial pieces bare, continuations "##"-prefixed.
    wordpiece: dict[str, int] = {}
    for token_id, token in enumerate(vocab.tokens):
        if token.startswith(_SPM_SPACE):
            key = token[1:]
        elif vocab.types[token_id] in (_CONTROL, _UNKNOWN) or (token.startswith("[") and token.endswith("]")):
            key = token
        else:
            key = "##" + token
        wordpiece.setdefault(key, token_id)
    unk = vocab.token("unk") or "[UNK]"
    tokenizer = Tokenizer(models.WordPiece(wordpiece, unk_token=unk, max_input_chars_per_word=1 << 30))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tokenizer


def _post_processor(vocab: _Vocab) -> processors.PostProcessor | None:
    """Add BOS/EOS (and BERT's SEP) around each sequence as llama.cpp does with ``add_special=true``."""
    wanted = [("bos", vocab.add_bos), ("eos", vocab.add_eos)]
    if vocab.kind == "bert":
        wanted = [("bos", True), ("sep", True)]
    used = {role: token_id for role, on in wanted if on and (token_id := vocab.ids[role]) is not None}
    if not used:
        return processors.ByteLevel(trim_offsets=False) if vocab.kind == "gpt2" else None
    prefix = f"{vocab.token('bos')} " if "bos" in used else ""
    suffix = "".join(f" {vocab.token(role)}" for role in ("eos", "sep") if role in used)
    return processors.TemplateProcessing(
        single=f"{prefix}$A:0{suffix}",
        pair=f"{prefix}$A:0{suffix} {prefix}$B:1{suffix}",
        special_tokens=sorted({(vocab.tokens[i], i) for i in used.values()}),
    )


def build_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    """Build the ``tokenizers.Tokenizer`` described by GGUF metadata.

    Args:
        metadata: GGUF key/value metadata as Python values. Only ``tokenizer.ggml.*`` keys (and
            ``general.name``, which llama.cpp consults for Phi-3's special tokens) are read.

    Returns:
        A tokenizer whose ``encode(text).ids`` equal llama.cpp's ``llama_tokenize(text, add_special=true,
        parse_special=true)``; with ``add_special_tokens=False``, ``add_special=false``.

    Raises:
        UnsupportedTokenizerError: the metadata has no tokenizer, or one of an unsupported kind or
            pre-tokenizer.
    """
    vocab = _Vocab.read(metadata)
    ids = {token: token_id for token_id, token in enumerate(vocab.tokens)}
    if len(ids) != len(vocab.tokens):
        raise UnsupportedTokenizerError("the GGUF vocabulary has duplicate tokens")

    if vocab.kind == "gpt2":
        tokenizer = _build_gpt2(metadata, vocab, ids)
    elif vocab.kind == "llama":
        tokenizer = _build_spm(metadata, vocab, ids)
    elif vocab.kind == "bert":
        tokenizer = _build_wpm(vocab)
    else:
        raise UnsupportedTokenizerError(
            f"unsupported tokenizer model {vocab.kind!r} (tokenizer.ggml.model); supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece, 'bert' WordPiece"
        )

    rstrip = vocab.rstrip_specials
    keep = {"<unk>", "<s>", "<|endoftext|>"}  # llama.cpp's exceptions to Phi-3's right-stripping
    tokenizer.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False, rstrip=rstrip and tok not in keep)
            for _, tok in vocab.of_type(_CONTROL, _UNKNOWN)
        ]
    )
    tokenizer.add_tokens(
        [AddedToken(tok, special=False, normalized=False, rstrip=rstrip) for _, tok in vocab.of_type(_USER_DEFINED)]
    )
    tokenizer.post_processor = _post_processor(vocab)
    return tokenizer


def end_of_generation_ids(metadata: Mapping[str, Any]) -> list[int]:
    """The ids llama.cpp stops generating at: EOS first, then EOT/EOM and the texts it knows as such."""
    vocab = _Vocab.read(metadata)
    found = [vocab.ids[role] for role in ("eos", "eot", "eom")]
    found += [i for i, tok in enumerate(vocab.tokens) if tok in _END_OF_GENERATION or tok in _FIM_ENDING]
    return list(dict.fromkeys(i for i in found if i is not None))


def tokenizer_config(metadata: Mapping[str, Any], *, context_length: int | None = None) -> dict[str, Any]:
    """The ``tokenizer_config.json`` content matching :func:`build_tokenizer`.

    Holds the special-token strings, ``add_bos_token``/``add_eos_token``, ``added_tokens_decoder`` as
    Hugging Face writes it, and ``chat_template`` when the GGUF has one (base models have none and
    are meant for plain completion).
    """
    vocab = _Vocab.read(metadata)
    added = sorted(vocab.of_type(_CONTROL, _UNKNOWN, _USER_DEFINED))
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
                "special": vocab.types[token_id] != _USER_DEFINED,
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
