"""How a model marks its tool calls and reasoning, and how a closed tool-call block is read
into calls (sans-io).

``Dialect.detect`` reads a model's chat template and vocabulary: Harmony (gpt-oss), a family
format mlx-lm's parsers lack (``tool_formats``), one of mlx-lm's parsers, or the
``<tool_call>{json}</tool_call>`` form any model may fall back to.  ``parse_block`` reads a
closed block with the model's own parser first, then the JSON and XML forms.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs

from .tool_formats import family_format

__all__ = ["Dialect", "TOOL_END", "TOOL_START", "parse_block", "parse_hermes"]

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
H_CHANNEL, H_MESSAGE = "<|channel|>", "<|message|>"  # Harmony's (gpt-oss), as its vocabulary has them

# mlx-lm's tool parsers, by the name its template inference gives them.
_MLX_PARSERS = (
    "json_tools", "qwen3_coder", "glm47", "mistral", "kimi_k2", "kimi_k3", "pythonic",
    "function_gemma", "gemma4", "longcat", "minimax_m2", "minicpm5", "muse_spark",
)

Parse = Callable[[str, Sequence[Mapping[str, Any]] | None], Any]


@attrs.frozen
class Dialect:
    """How a model marks its tool calls and reasoning (read from its template and vocabulary)."""

    tool_start: str = TOOL_START
    tool_end: str = TOOL_END
    parse: Parse | None = None  # the model's own parser (mlx-lm's), tried before the fallbacks
    harmony: bool = False
    name: str = "hermes"

    @classmethod
    def detect(cls, chat_template: str | None, vocab: Collection[str]) -> Dialect:
        if H_CHANNEL in vocab and H_MESSAGE in vocab:
            return cls(harmony=True, name="harmony")
        name = _infer_mlx_parser(chat_template, vocab)
        if family := family_format(chat_template, name):  # formats mlx-lm's parsers lack
            return cls(*family[:3], name=family[3])
        if name is None or name == "json_tools":
            return cls()
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        return cls(module.tool_call_start, module.tool_call_end, module.parse_tool_call, name=name)


def _infer_mlx_parser(chat_template: str | None, vocab: Collection[str]) -> str | None:
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    class _Probe:  # the two things mlx-lm's inference reads from a tokenizer
        def __init__(self) -> None:
            self.chat_template = chat_template

        def get_vocab(self) -> dict[str, int]:
            return dict.fromkeys(vocab, 0)

    try:
        name = _infer_tool_parser(_Probe())
    except Exception:  # an inference that breaks on an odd template: the fallback forms
        return None
    return name if name in _MLX_PARSERS else None


def _exact_arguments(text: str, value: Any) -> str:
    """The JSON text of ``"arguments"`` as the model wrote it, when it can be found; else the
    value serialised."""
    at = text.find('"arguments"')
    if at != -1:
        colon = text.find(":", at + len('"arguments"'))
        if colon != -1:
            start = colon + 1
            while start < len(text) and text[start] in " \t\r\n":
                start += 1
            try:
                found, end = json.JSONDecoder().raw_decode(text, start)
            except json.JSONDecodeError:
                pass
            else:
                if found == value:
                    return text[start:end]
    return json.dumps(value, ensure_ascii=False)


def parse_hermes(text: str) -> list[tuple[str, str]]:
    """``{"name": N, "arguments": {...}}`` (or a list of them): (name, arguments JSON) pairs.
    ``parameters`` is read as ``arguments`` (Llama's spelling); arguments given as a JSON string
    are read as that string's object."""
    stripped = text.strip()
    value = json.loads(stripped)
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError("not a tool call")
        key = "arguments" if "arguments" in item else "parameters"
        args = item.get(key, {})
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            raise ValueError("tool call arguments are not an object")
        exact = _exact_arguments(stripped, args) if len(items) == 1 and key == "arguments" else None
        out.append((item["name"], exact or json.dumps(args, ensure_ascii=False)))
    return out


def parse_block(dialect: Dialect, inner: str, tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """A tool-call block's calls: the model's own parser, else the JSON and XML forms."""
    attempts: list[Callable[[], list[tuple[str, str]]]] = []
    if dialect.parse is not None:
        attempts.append(lambda: _from_mlx(dialect.parse(inner, list(tools))))  # type: ignore[misc]
    attempts.append(lambda: parse_hermes(inner))
    for name in ("qwen3_coder", "glm47"):
        if dialect.name != name and "<" in inner:
            module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
            attempts.append(lambda m=module: _from_mlx(m.parse_tool_call(inner, list(tools))))
    for attempt in attempts:
        try:
            calls = attempt()
        except Exception:
            continue
        if calls:
            return calls
    return []


def _from_mlx(parsed: Any) -> list[tuple[str, str]]:
    items = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for item in items:
        name, args = item.get("name"), item.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(name, str) or not isinstance(args, dict) or "raw" in args and len(args) == 1:
            raise ValueError("not a tool call")
        out.append((name, json.dumps(args, ensure_ascii=False)))
    return out
