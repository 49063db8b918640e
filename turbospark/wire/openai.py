"""OpenAI request shapes (``/v1/chat/completions``).

Every field a current client may send is declared, so an unknown key is refused by name; fields
that are accepted but not honoured are reported on the ``x-anyllm-degradation`` header by the
route.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from .codec import converter

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GenerationFields",
    "LoraChoice",
    "ResponsesRequest",
    "SamplingFields",
    "StreamOptions",
]

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


def _positive(_: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be greater than 0")


def _in_range(lo: float, hi: float):  # type: ignore[no-untyped-def]
    def check(_: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
        if value is not None and not lo <= value <= hi:
            raise ValueError(f"{attribute.name} must be between {lo} and {hi}, got {value}")

    return check


def _one_of(*allowed: str):  # type: ignore[no-untyped-def]
    """An enum the API defines: anything else is refused by name (never ignored)."""

    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        values = value if isinstance(value, list) else [value]
        for v in values:
            if v is not None and v not in allowed:
                names = ", ".join(repr(a) for a in allowed)
                raise ValueError(f"{attribute.name} must be one of {names}, got {v!r}")

    return check


def _response_format(_: object, attribute: attrs.Attribute[Any], value: dict[str, Any] | None) -> None:
    if value is None:
        return
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(
            f"response_format.type must be one of 'text', 'json_object', 'json_schema', got {kind!r}"
        )
    if kind == "json_schema" and not isinstance(value.get("json_schema"), dict):
        raise ValueError("response_format.json_schema must be an object when type is 'json_schema'")


def _tool_choice(_: object, attribute: attrs.Attribute[Any], value: str | dict[str, Any] | None) -> None:
    if isinstance(value, str) and value not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be one of 'none', 'auto', 'required' or an object, got {value!r}")


# Limits on what a request can grow (beyond them, a 400 naming the field).  OpenAI allows 4
# stop strings; agent frameworks written for Ollama and llama.cpp send more, so 16.
MAX_STOPS, MAX_STOP_CHARS = 16, 1024
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's limit
MAX_BUDGET = 1_000_000  # tokens: past any context window here, refused before any work


def _stops(_: object, attribute: attrs.Attribute[Any], value: str | list[str] | None) -> None:
    stops = [value] if isinstance(value, str) else value or []
    if len(stops) > MAX_STOPS:
        raise ValueError(f"{attribute.name} may hold at most {MAX_STOPS} strings, got {len(stops)}")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"{attribute.name} strings may be at most {MAX_STOP_CHARS} characters, got {len(s)}")


def _at_most(limit: int):  # type: ignore[no-untyped-def]
    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        size = value if isinstance(value, int) else len(value)
        if size > limit:
            what = "" if isinstance(value, int) else " entries"
            raise ValueError(f"{attribute.name} may be at most {limit}{what}, got {size}")

    return check


def _budget(_: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    _positive(_, attribute, value)
    _at_most(MAX_BUDGET)(_, attribute, value)


def _logit_bias(_: object, attribute: attrs.Attribute[Any], value: dict[str, float] | None) -> None:
    """OpenAI's shape: token ids (as strings) to a bias between -100 and 100."""
    if value is None:
        return
    if len(value) > 1024:
        raise ValueError(f"logit_bias may hold at most 1024 tokens, got {len(value)}")
    for key, bias in value.items():
        if not key.isdigit():
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if not -100 <= bias <= 100:
            raise ValueError(f"logit_bias values must be between -100 and 100, got {bias}")


@attrs.frozen
class ChatMessage:
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None


@attrs.frozen
class LoraChoice:
    """One of llama.cpp's ``lora`` entries: an adapter's index, and its scale (1 where not given)."""

    id: int = attrs.field(validator=_in_range(0, 1 << 16))
    scale: float = attrs.field(default=1.0, validator=_in_range(-100.0, 100.0))


@attrs.frozen
class StreamOptions:
    include_usage: bool = False
    include_obfuscation: bool | None = None


@attrs.frozen(kw_only=True)
class SamplingFields:
    """What every OpenAI request that generates shares, Responses included: the model, sampling,
    penalties and stop strings."""

    model: str | None = None
    temperature: float | None = attrs.field(default=None, validator=_in_range(0.0, 2.0))
    top_p: float | None = attrs.field(default=None, validator=_in_range(0.0, 1.0))
    top_k: int | None = attrs.field(default=None, validator=_in_range(0, 2**32 - 1))
    min_p: float | None = attrs.field(default=None, validator=_in_range(0.0, 1.0))
    seed: int | None = None
    stop: str | list[str] | None = attrs.field(default=None, validator=_stops)
    presence_penalty: float | None = attrs.field(default=None, validator=_in_range(-2.0, 2.0))
    frequency_penalty: float | None = attrs.field(default=None, validator=_in_range(-2.0, 2.0))
    repetition_penalty: float | None = attrs.field(default=None, validator=_in_range(0.01, 10.0))
    speculative: bool | None = None  # extension: false turns prompt-lookup speculation off


@attrs.frozen(kw_only=True)
class GenerationFields(SamplingFields):
    """What the chat and completion requests share besides sampling: the budget and streaming."""

    max_tokens: int | None = attrs.field(default=None, validator=_budget)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = attrs.field(default=None, validator=_in_range(1, 128))  # OpenAI's bound
    logit_bias: dict[str, float] | None = attrs.field(default=None, validator=_logit_bias)
    user: str | None = None
    # the peers' output constraints (turns/grammars.py checks their shapes): llama.cpp's, vLLM's
    grammar: Any = None
    json_schema: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    return_progress: bool = False  # llama.cpp's: prompt_progress chunks while the prompt is read
    # vLLM's and llama.cpp's, as benchmark clients send them: the end of the turn (its stop
    # tokens) never comes, or not before min_tokens (vLLM's; nor a stop string); not above the
    # request's budget (the route checks: both budget fields are known there)
    ignore_eos: bool = False
    min_tokens: int = attrs.field(default=0, validator=_in_range(0, MAX_BUDGET))
    # llama.cpp's: the LoRA adapters (``serve --lora``'s, by index) and their scales; where given,
    # these alone (the model name's adapter aside)
    lora: list[LoraChoice] | None = attrs.field(default=None, validator=_at_most(64))
    # vLLM's: at most this many tokens of reasoning, then the model closes it and answers
    thinking_token_budget: int | None = attrs.field(default=None, validator=_in_range(1, MAX_BUDGET))


@attrs.frozen(kw_only=True)
class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = attrs.field(
        validator=[attrs.validators.min_len(1), _at_most(MAX_MESSAGES)]
    )
    max_completion_tokens: int | None = attrs.field(default=None, validator=_budget)
    logprobs: bool | None = None
    top_logprobs: int | None = attrs.field(default=None, validator=_in_range(0, 20))
    response_format: dict[str, Any] | None = attrs.field(default=None, validator=_response_format)
    tools: list[dict[str, Any]] | None = attrs.field(default=None, validator=_at_most(MAX_TOOLS))
    tool_choice: str | dict[str, Any] | None = attrs.field(default=None, validator=_tool_choice)
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = attrs.field(
        default=None, validator=_one_of("none", "minimal", "low", "medium", "high", "xhigh", "off")
    )
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = attrs.field(
        default=None, validator=_one_of("auto", "default", "flex", "scale", "priority")
    )
    modalities: list[str] | None = attrs.field(default=None, validator=_one_of("text", "audio"))
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = attrs.field(default=None, validator=_one_of("low", "medium", "high"))


@attrs.frozen(kw_only=True)
class CompletionRequest(GenerationFields):
    """``/v1/completions``: plain text in, no chat template."""

    prompt: str | list[str]
    response_format: dict[str, Any] | None = attrs.field(default=None, validator=_response_format)
    tools: list[dict[str, Any]] | None = attrs.field(default=None, validator=_at_most(MAX_TOOLS))
    tool_choice: str | dict[str, Any] | None = attrs.field(default=None, validator=_tool_choice)
    parallel_tool_calls: bool | None = None
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = attrs.field(default=None, validator=_in_range(0, 5))
    suffix: str | None = None


@attrs.frozen(kw_only=True)
class ResponsesRequest(SamplingFields):
    """``/v1/responses``: items in, items out.  ``input`` items are checked by the route (their
    shape depends on their type)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = attrs.field(default=None, validator=_at_most(MAX_TOOLS))
    tool_choice: str | dict[str, Any] | None = attrs.field(default=None, validator=_tool_choice)
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = attrs.field(default=None, validator=_budget)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = attrs.field(default=None, validator=_one_of("auto", "disabled"))
    include: list[str] | None = None
    service_tier: str | None = attrs.field(
        default=None, validator=_one_of("auto", "default", "flex", "scale", "priority")
    )
    top_logprobs: int | None = attrs.field(default=None, validator=_in_range(0, 20))
    background: bool | None = None
    max_tool_calls: int | None = attrs.field(default=None, validator=_positive)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None


def _structure_content(value: Any, _: type) -> str | list[dict[str, Any]] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str) for p in value
    ):
        return value
    raise TypeError("content must be a string or an array of typed content parts")


def _string_or_strings(name: str):  # type: ignore[no-untyped-def]
    def structure(value: Any, _: type) -> str | list[str] | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise TypeError(f"{name} must be a string or an array of strings")

    return structure


def _structure_tool_choice(value: Any, _: type) -> str | dict[str, Any] | None:
    if value is None or isinstance(value, (str, dict)):
        return value
    raise TypeError("expected a string or an object")


converter.register_structure_hook(str | list[dict[str, Any]] | None, _structure_content)
converter.register_structure_hook(str | list[str] | None, _string_or_strings("stop"))
converter.register_structure_hook(str | list[str], _string_or_strings("prompt"))


def _structure_input(value: Any, _: type) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return value
    raise TypeError("input must be a string or an array of input items")


converter.register_structure_hook(str | list[dict[str, Any]], _structure_input)
converter.register_structure_hook(str | dict[str, Any] | None, _structure_tool_choice)
