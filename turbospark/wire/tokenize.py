"""The tokenizer endpoints' request shapes: llama.cpp's ``/tokenize``, ``/detokenize`` and
vLLM's ``/tokenize`` with ``prompt`` or ``messages`` (sans-io).

``content`` is llama.cpp's (a string, or strings and token ids mixed); ``prompt`` and
``messages`` are vLLM's.  The chat messages are checked as chat's are (the route structures
them as a ``ChatCompletionRequest``), token ids against the model's vocabulary here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ..errors import RequestInvalid

__all__ = ["DetokenizeRequest", "TokenizeRequest", "check_ids", "mixed_content"]


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    model: str | None = None
    # llama.cpp
    content: Any = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    # vLLM
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    model: str | None = None
    tokens: list[int] = attrs.field(factory=list)


def mixed_content(content: Any) -> list[str | int]:
    """llama.cpp's ``content``: a string, or a list of strings and token ids."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list) and all(
        isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in content
    ):
        return list(content)
    raise RequestInvalid("content must be a string or a list of strings and token ids", param="content")


def check_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Every id must name a token of the model's vocabulary."""
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise RequestInvalid(
                f"{param}[{i}] is {token}, outside this model's vocabulary (0-{vocab_size - 1})", param=param
            )
