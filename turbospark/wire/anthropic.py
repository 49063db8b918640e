"""Anthropic request shapes (``/v1/messages``, ``/v1/messages/count_tokens``).

Every top-level field the Messages API defines is declared, so an unknown key is refused by name.
Content blocks are checked by the route, block by block (their shape depends on their type).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from .openai import _at_most, _in_range, _positive, _stops

__all__ = ["AnthropicMessage", "CountTokensRequest", "MessagesRequest"]


def _content(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in value):
        return
    raise ValueError("content must be a string or an array of typed content blocks")


def _system(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None or isinstance(value, str):
        return
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in value):
        return
    raise ValueError("system must be a string or an array of text blocks")


# (content and system are typed Any and checked by validators: the converter's hooks for
# ``str | list[dict]`` belong to the OpenAI shapes)
@attrs.frozen
class AnthropicMessage:
    role: Literal["user", "assistant"]
    content: Any = attrs.field(validator=_content)


@attrs.frozen(kw_only=True)
class CountTokensRequest:
    """What a prompt is made of: the fields ``count_tokens`` takes."""

    model: str | None = None
    messages: list[AnthropicMessage] = attrs.field(validator=[attrs.validators.min_len(1), _at_most(4096)])
    system: Any = attrs.field(default=None, validator=_system)
    tools: list[dict[str, Any]] | None = attrs.field(default=None, validator=_at_most(128))
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    cache_control: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class MessagesRequest(CountTokensRequest):
    max_tokens: int | None = attrs.field(default=None, validator=_positive)
    temperature: float | None = attrs.field(default=None, validator=_in_range(0.0, 1.0))
    top_p: float | None = attrs.field(default=None, validator=_in_range(0.0, 1.0))
    top_k: int | None = attrs.field(default=None, validator=_in_range(0, 2**32 - 1))
    stop_sequences: list[str] | None = attrs.field(default=None, validator=_stops)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
