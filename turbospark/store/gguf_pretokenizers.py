"""llama.cpp's pre-tokenizers for byte-level BPE vocabularies, as ``tokenizers`` pre-tokenizers.

A GGUF with ``tokenizer.ggml.model = gpt2`` names its pre-tokenizer in ``tokenizer.ggml.pre``.
llama.cpp (``llama-vocab.cpp``, ``llm_tokenizer_bpe``) maps each name onto a list of regular
expressions; each one splits every piece the previous ones left, keeping both the matches and the
text between them (``unicode_regex_split``), and the pieces are then byte-encoded (GPT-2's
byte-to-character table) before the merges run. ``tokenizers`` does the same with a sequence of
``Split(regex, "isolated")`` followed by ``ByteLevel(use_regex=False)``. The expressions below are
llama.cpp's own strings (Oniguruma reads them as llama.cpp's ``std::regex`` does), so the words
are llama.cpp's words; the fixtures in ``tests/model/test_gguf_vocab_fixtures.py`` check it id for id.

Names map onto llama.cpp's pre-tokenizer *types*; names of one type behave identically there. A
name not in :data:`PRE_TOKENIZERS` is refused: splitting text differently than the model was
trained with gives plausible but wrong ids.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from tokenizers import Regex, pre_tokenizers

__all__ = ["PRE_TOKENIZERS", "PreTokenizer"]

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = (
    _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN2 = _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
_QWEN35 = (
    _CONTRACTIONS
    + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
# llama.cpp's letter class for DeepSeek LLM (escaped: several of these code points have NFC look-alikes).
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d"
    "\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_TEKKEN = (
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+"
    "((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_GPT4O = (
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?|[^\\r\\n\\p{L}\\p{N}]?"
    "((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


@attrs.frozen
class PreTokenizer:
    """One llama.cpp pre-tokenizer type."""

    regexes: tuple[str, ...]  #: applied in order, each splitting the pieces the previous left
    ignore_merges: bool = False  #: a word that is itself a token is taken whole (Llama 3, Tekken)
    add_bos: bool = False  #: llama.cpp's default for ``tokenizer.ggml.add_bos_token`` when absent

    def build(self) -> pre_tokenizers.PreTokenizer:
        if self.regexes[-1] == _GPT2 and set(self.regexes[:-1]) <= {"\\p{N}"}:
            # GPT-2's expression is ByteLevel's own (which adds a final "|\\s+": it only names the
            # lone space llama.cpp keeps as an unmatched piece, the same word), and "\\p{N}" is
            # Digits(individual_digits=True). Written the way Hugging Face writes GPT-2, StarCoder
            # and SmolLM2 tokenizers.
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
            if len(self.regexes) == 1:
                return byte_level
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in self.regexes]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        return pre_tokenizers.Sequence([*splits, byte_level])


_TYPES = {
    "default": PreTokenizer(
        ("[\\p{P}\\$\\+<=>\\^~\\|]+", _GPT2, "\\p{N}+", "[0-9][0-9][0-9]"),
    ),
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "dbrx": PreTokenizer((_LLAMA3,)),
    "deepseek-llm": PreTokenizer(
        (
            "[\r\n]",
            f"\\s?[{_DEEPSEEK_LETTERS}]+",
            "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            "\\s+$",
            "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
            "\\p{N}+",
        ),
    ),
    "deepseek-coder": PreTokenizer(("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", "\\p{N}")),
    "falcon": PreTokenizer(("[\\p{P}\\$\\+<=>\\^~\\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "starcoder": PreTokenizer(("\\p{N}", _GPT2)),
    "gpt2": PreTokenizer((_GPT2,)),
    "qwen2": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,)),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "gpt4o": PreTokenizer((_GPT4O,)),
}

#: ``tokenizer.ggml.pre`` -> its llama.cpp type. Names sharing a type share llama.cpp's code path.
_NAMES = {
    "default": "default",
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), "llama3"
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), "dbrx"),
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    "falcon": "falcon",
    # STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA: digits alone, then GPT-2's.
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), "starcoder"),
    # GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING.
    **dict.fromkeys(
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "exaone4",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
        ),
        "gpt2",
    ),
    # STABLELM2, QWEN2, HUNYUAN, SOLAR_OPEN.
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"), "qwen2"
    ),
    "qwen35": "qwen35",
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie"), "gpt4o"),
}

#: ``tokenizer.ggml.pre`` value -> how llama.cpp splits text for it. A missing value is "default".
PRE_TOKENIZERS: Mapping[str, PreTokenizer] = {name: _TYPES[kind] for name, kind in _NAMES.items()}
