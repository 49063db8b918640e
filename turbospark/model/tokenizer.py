"""Tokenizer and chat template: the text side of every backend.

A model directory in the store carries ``tokenizer.json`` (read by the ``tokenizers`` library)
and ``tokenizer_config.json`` (its ``chat_template`` is a Jinja template, rendered here the way
Hugging Face renders it).  The scripted backend and the MLX backend share this class, so token
counts are the same whichever backend answers.  No Trio import: this runs on the model thread.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from ..errors import RequestInvalid
from .constraint import Grammars
from .tool_preamble import short_call_ids, tools_in_preamble
from .output import MARKUP, THINK_START, Dialect
from .tool_formats import reads_system_tools

__all__ = ["StreamDecoder", "Tokenizer"]

# Tokens that end an assistant turn in the chat formats we know, when a vocabulary has them.
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<|return|>")


# Characters encoded at a time when a long text is measured against a limit, and the tokens one
# cut can add or remove (merges are local: only tokens overlapping the cut change).
_SLICE = 1 << 14
#: Texts at least this long are encoded through ``encode_batch``: the binding lets go of the GIL
#: there, not in ``encode`` (measured: 2 MB of text held every other thread for 1.2 s).
_LONG = 1 << 12
_CUT_SLACK = 16


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, printable))
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + len(chars) - len(printable)
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF = _byte_level_table()


class Tokenizer:
    """Encode, decode and render chats for one model."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
        extra_stop_ids: Iterable[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.content_parts = False  # a vision model's: its template reads contents as lists of parts
        self.count_images: Callable[[Sequence[bytes]], Callable[[str], str]] | None = None  # and what images add
        self.process_images: Callable[[Sequence[bytes]], None] | None = None  # images processed ahead, any thread
        self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        stops = set(extra_stop_ids)
        harmony = tokenizer.token_to_id("<|channel|>") is not None
        for name in (eos_token, *_END_OF_TURN):
            if harmony and name == "<|end|>":
                continue  # Harmony ends a channel with it, not the turn
            if name and (tid := tokenizer.token_to_id(name)) is not None:
                stops.add(tid)
        self.vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
        # Special tokens are shown to the output parser when they are markup it reads
        # (``<think>``, Harmony's channels ...); all others are dropped from the text.
        self.hidden_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items()
            if t.special and t.content not in MARKUP
        )
        self.dialect = Dialect.detect(chat_template, self.vocab)
        # Role injection: special-token text inside a message's content is encoded as plain
        # text (``<|im_start|>`` as the characters it is made of), never as a control token.
        specials = sorted(
            (t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content),
            key=len, reverse=True,
        )
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        if self.dialect.harmony and (call := tokenizer.token_to_id("<|call|>")) is not None:
            stops.add(call)  # a Harmony tool call ends the turn
        self.stop_ids: frozenset[int] = frozenset(stops)
        # Templates that read the ``tools`` variable render them themselves; the others get them
        # in a system preamble, or in the system message's ``tools`` field when they read that.
        self.renders_tools = False
        self._system_tools = (
            (self.dialect.tool_start, self.dialect.tool_end) if reads_system_tools(chat_template) else None
        )
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(chat_template)
            self.renders_tools = "tools" in meta.find_undeclared_variables(env.parse(chat_template))

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (and ``config.json`` if present)."""
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            config = json.loads((path / "tokenizer_config.json").read_text())
        extra: list[int] = []
        if (path / "config.json").exists():
            eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            _HFTokenizer.from_file(str(path / "tokenizer.json")),
            chat_template=config.get("chat_template"),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            extra_stop_ids=extra,
        )

    @functools.cached_property
    def _plain(self) -> _HFTokenizer:
        """A second tokenizer that encodes special-token text as plain text: built when first
        needed (a message that holds such text, ``/tokenize`` without ``parse_special``), as it
        holds as much memory as the first (~25 MB for a 49k vocabulary; built in ~0.1 s)."""
        plain = _HFTokenizer.from_str(self._tok.to_str())
        plain.encode_special_tokens = True
        return plain

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Constrained decoding's compiled grammars for this tokenizer (built on first use)."""
        eos = self.eos_id if self.eos_id is not None else min(self.stop_ids, default=0)
        return Grammars(self._tok.to_str(), vocab=self.vocab_size, eos_id=eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; special-token markup in the text is recognised as such."""
        ids = _ids(self._tok, text)
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def encode_rendered(self, text: str, contents: Iterable[str], expand: Callable[[str], str] = str) -> list[int]:
        """A rendered chat's ids, with every special-token text inside the messages' own
        ``contents`` encoded as plain text: only the template writes control tokens.  Contents
        are found in the rendered text in order; where none holds special-token text (nearly
        always) this is ``encode(text)``.  ``expand`` rewrites the template's own text (not the
        contents) before it is encoded: a vision model's image placeholders."""
        if self._special_text is None:
            return self.encode(expand(text))
        spans, at = [], 0
        for content in contents:
            if not content or not self._special_text.search(content):
                if content and (found := text.find(content, at)) != -1:
                    at = found + len(content)
                continue
            found = text.find(content, at)
            if found != -1:
                spans.append((found, found + len(content)))
                at = found + len(content)
        if not spans:
            return self.encode(expand(text))
        ids: list[int] = []
        at = 0
        for start, end in spans:
            ids += _ids(self._tok, expand(text[at:start]))
            ids += _ids(self._plain, text[start:end])
            at = end
        return ids + _ids(self._tok, expand(text[at:]))

    @functools.cached_property
    def longest_token(self) -> int:
        """The most characters one token of the vocabulary stands for (its longest entry; a
        byte-level entry is a character per byte)."""
        return max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))

    def surely_more_than(self, chars: int, limit: int) -> bool:
        """Whether any text of ``chars`` characters surely encodes to more than ``limit``
        tokens, from its length alone: no token stands for more than ``longest_token``
        characters (4x slack for normalisers that shorten text)."""
        return chars > 4 * self.longest_token * (limit + 1)

    def fewest_tokens(self, chars: int) -> int:
        """The fewest tokens any text of ``chars`` characters can encode to (the bound
        ``surely_more_than`` reads)."""
        return chars // (4 * self.longest_token)

    def surely_longer(self, text: str, limit: int) -> bool:
        """Whether ``text`` surely encodes to more than ``limit`` tokens, found without encoding
        all of a long text (see ``tokens_past``).  False means: encode it and see."""
        return self.tokens_past(text, limit) is not None

    def tokens_past(self, text: str, limit: int) -> int | None:
        """A lower bound, above ``limit``, on the tokens of a ``text`` that surely encodes to
        more than ``limit``, found without encoding all of a long text; ``None`` where it may
        not (encode it and see).  Encoding holds the model thread and the GIL (a 25 MiB text
        takes seconds, and every other stream would wait), so a text far too long for any
        tokenisation is refused by its length (its bound: ``fewest_tokens``), and a long one is
        encoded a slice at a time, cut before whitespace where it can be, until the count passes
        the limit by more than the cuts can account for (its bound: the count less that)."""
        if len(text) <= _SLICE:
            return None
        if self.surely_more_than(len(text), limit):
            return self.fewest_tokens(len(text))
        count, start, cuts = 0, 0, 0
        while start < len(text):
            end = min(start + _SLICE, len(text))
            if end < len(text):
                cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
                end, cuts = (cut if cut > start else end), cuts + 1
            count += len(_ids(self._tok, text[start:end]))
            if count > limit + _CUT_SLACK * cuts:
                return count - _CUT_SLACK * cuts
            start = end
        return None

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decode_visible(self, ids: Sequence[int]) -> str:
        """Text with the markup special tokens kept (for the output parser)."""
        hidden = self.hidden_ids
        return self._tok.decode([i for i in ids if i not in hidden], skip_special_tokens=False)

    # --- the tokenizer endpoints (``/tokenize``, ``/detokenize``) --------------------------

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """``text``'s ids as llama.cpp's ``/tokenize`` gives them: ``add_special`` adds the BOS
        this model's prompts begin with (if any); without ``parse_special``, special-token text
        is plain text."""
        ids = _ids(self._tok if parse_special else self._plain, text)
        if add_special and self.add_bos_token and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens written out (as llama.cpp's ``/detokenize``)."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_name(self, token_id: int) -> str:
        """The vocabulary's own spelling of a token (``Ġthe``, ``<0xE5>``)."""
        return self._tok.id_to_token(token_id) or ""

    def piece(self, token_id: int) -> bytes:
        """One token's bytes: a byte-level or byte-fallback token that is part of a character
        is not UTF-8 on its own."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        raw = self.token_name(token_id)
        if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", raw):
            return bytes([int(m.group(1), 16)])
        if raw and all(c in _BYTE_OF for c in raw):
            return bytes(_BYTE_OF[c] for c in raw)
        return text.encode()

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render a conversation with the model's own chat template.

        Raises:
            RequestInvalid: the model has no chat template, or the template refused the
                conversation (e.g. a role it does not support).
        """
        if self._template is None:
            raise RequestInvalid(
                "this model has no chat template (a base model): use /v1/completions instead"
            )
        if not self.renders_tools:
            messages, tools = tools_in_preamble(messages, tools or (), system_tools=self._system_tools), None
        if self.dialect.name == "mistral":
            messages = short_call_ids(messages)
        if self.content_parts:  # a vision model's template reads every content as a list of parts
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
                        else m for m in messages]
        try:
            return self._template.render(
                {
                    # thinking is on unless a flag says otherwise (as Qwen 3's template and
                    # llama.cpp's read it); flags never replace the conversation
                    "enable_thinking": True,
                    **(template_kwargs or {}),
                    "messages": list(messages),
                    "tools": list(tools) if tools else None,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": self.bos_token or "",
                    "eos_token": self.eos_token or "",
                }
            )
        except jinja2.TemplateError as exc:
            raise RequestInvalid(f"the chat template refused this conversation: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        # The template writes its own BOS; adding another degrades some models.
        return self.encode(self.render_chat(messages, **kwargs))

    @staticmethod
    def opens_reasoning(prompt: str) -> bool:
        """Whether a rendered prompt leaves the model inside ``<think>`` (its output starts as
        reasoning)."""
        return prompt.rstrip().endswith(THINK_START)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns a growing list of token ids into text pieces, never splitting a character.

    It decodes a short window of recent ids and emits what that window added; a window that
    ends inside a multi-byte character (decoded as U+FFFD) waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        before = self._tok.decode_visible(self._ids[self._prefix : self._read])
        after = self._tok.decode_visible(self._ids[self._prefix :])
        if len(after) <= len(before) or (not final and after.endswith("\ufffd")):
            return ""
        piece = after[len(before) :]
        self._prefix = self._read
        self._read = len(self._ids)
        return piece


def _ids(tok: Any, text: str) -> list[int]:
    """``text``'s ids from a ``tokenizers.Tokenizer``, no special tokens added; a long text
    without holding the GIL, so the event loop and the other threads run meanwhile."""
    if len(text) < _LONG:
        return tok.encode(text, add_special_tokens=False).ids  # type: ignore[no-any-return]
    return tok.encode_batch([text], add_special_tokens=False)[0].ids  # type: ignore[no-any-return]
