"""Ollama's request shapes and what they mean here (sans-io).

- ``OllamaChatRequest`` / ``OllamaGenerateRequest``: Ollama's field names, unknown fields refused
  by the one converter; ``messages`` are checked here so that each error names its place.
- ``options_params``: Ollama's ``options`` -> sampling fields.  ``temperature``, ``top_p``,
  ``top_k``, ``min_p``, ``seed``, ``num_predict`` (``max_tokens``; negative: the default budget),
  ``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``, ``stop``, ``num_ctx`` (checked
  against the model's context window by the route).  Runner settings (``num_thread``,
  ``num_gpu`` ...) are accepted and reported as not honoured; anything else is a 400 (vLLM's
  ``ignore_eos`` and ``min_tokens`` among them: Ollama has no name for either).
- ``ndjson``: one JSON object and a newline per frame; ``created_at``, ``nanoseconds``.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import json
from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import RequestInvalid

__all__ = [
    "OllamaChatRequest",
    "OllamaGenerateRequest",
    "OllamaGenerationFields",
    "Options",
    "check_messages",
    "created_at",
    "ndjson",
    "nanoseconds",
    "options_params",
    "rfc3339",
]


@attrs.frozen(kw_only=True)
class OllamaGenerationFields:
    """What ``/api/chat`` and ``/api/generate`` share: the model, the output's format, options,
    streaming, how long the model stays loaded, thinking and log-probabilities."""

    model: str = ""
    format: Any = None  # "json", "" or a JSON Schema
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: Any = None
    think: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # a prompt past the context loses its oldest messages (its start) instead of a 400; a
    # budget past it is cut to what is left (``GenerationJob.truncate``, ``clamp``)
    truncate: bool | None = None
    shift: bool | None = None


@attrs.frozen(kw_only=True)
class OllamaChatRequest(OllamaGenerationFields):
    messages: list[Any] | None = None
    tools: list[Any] | None = None


@attrs.frozen(kw_only=True)
class OllamaGenerateRequest(OllamaGenerationFields):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None


#: Ollama's runner settings: accepted, not honoured here (named on the degradation header).
RUNNER_OPTIONS = frozenset({
    "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
    "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "tfs_z", "typical_p",
    "repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline",
})


@attrs.frozen
class Options:
    """What ``options`` asks: sampling fields (``SamplingParams`` names), ``num_ctx``, and the
    options accepted but not honoured."""

    sampling: dict[str, Any]
    num_ctx: int | None
    ignored: tuple[str, ...]


def _number(options: Mapping[str, Any], name: str, *, whole: bool = False, lo: float | None = None,
            hi: float | None = None) -> float | int | None:
    value = options.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and not float(value).is_integer()):
        kind = "a whole number" if whole else "a number"
        raise RequestInvalid(f"options.{name} must be {kind}, got {json.dumps(value)}", param=f"options.{name}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestInvalid(f"options.{name} must be between {lo} and {hi}, got {value}", param=f"options.{name}")
    return int(value) if whole else float(value)


def options_params(options: Mapping[str, Any] | None) -> Options:
    options = dict(options or {})
    sampling: dict[str, Any] = {}
    for name, field, kwargs in (
        ("temperature", "temperature", {"lo": 0.0, "hi": 2.0}),
        ("top_p", "top_p", {"lo": 0.0, "hi": 1.0}),
        ("min_p", "min_p", {"lo": 0.0, "hi": 1.0}),
        ("repeat_penalty", "repetition_penalty", {"lo": 0.01, "hi": 10.0}),
        ("presence_penalty", "presence_penalty", {"lo": -2.0, "hi": 2.0}),
        ("frequency_penalty", "frequency_penalty", {"lo": -2.0, "hi": 2.0}),
    ):
        if (value := _number(options, name, **kwargs)) is not None:
            sampling[field] = value
    if (top_k := _number(options, "top_k", whole=True, lo=0)) is not None:
        sampling["top_k"] = top_k
    if (seed := _number(options, "seed", whole=True)) is not None:
        sampling["seed"] = seed
    predict = _number(options, "num_predict", whole=True)
    if predict is not None and predict >= 0:
        if predict == 0:
            raise RequestInvalid("options.num_predict must be at least 1 (or negative for the default)",
                                 param="options.num_predict")
        sampling["max_tokens"] = predict
    stop = options.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestInvalid("options.stop must be a list of strings", param="options.stop")
        sampling["stop"] = tuple(s for s in stop if s)
    num_ctx = _number(options, "num_ctx", whole=True, lo=1)
    known = {"temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
             "top_k", "seed", "num_predict", "stop", "num_ctx"}
    unknown = sorted(set(options) - known - RUNNER_OPTIONS)
    if unknown:
        raise RequestInvalid(f"unknown option(s) {', '.join(unknown)}", param="options")
    ignored = tuple(sorted(k for k in options if k in RUNNER_OPTIONS and options[k] is not None))
    return Options(sampling, int(num_ctx) if num_ctx is not None else None, ignored)


def check_image(value: Any, where: str) -> str:
    """An image of Ollama's (base64, no data: prefix) as a data URL, or a 400."""
    if not isinstance(value, str) or not value:
        raise RequestInvalid(f"{where} must be a base64-encoded image", param="images")
    text = value.split(",", 1)[1] if value.startswith("data:") else value
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestInvalid(f"{where} is not valid base64 image data", param="images") from None
    return f"data:image/*;base64,{text}"


def check_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Ollama's messages, each checked: ``role``, ``content``, ``images``, ``tool_calls``,
    ``tool_name``, ``thinking``."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestInvalid(f"{where} must be an object", param="messages")
        unknown = set(m) - {"role", "content", "images", "tool_calls", "tool_name", "thinking", "name",
                            "tool_call_id"}
        if unknown:
            raise RequestInvalid(f"{where} has unknown field(s) {', '.join(sorted(unknown))}", param="messages")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestInvalid(f"{where}.role must be system, user, assistant or tool, got {json.dumps(role)}",
                                 param="messages")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RequestInvalid(f"{where}.content must be a string", param="messages")
        images = m.get("images") or []
        if not isinstance(images, list):
            raise RequestInvalid(f"{where}.images must be a list of base64 images", param="messages")
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise RequestInvalid(f"{where}.tool_calls must be a list", param="messages")
        for k, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestInvalid(f"{where}.tool_calls[{k}] needs a function with a name", param="messages")
        for field in ("thinking", "tool_name"):
            if m.get(field) is not None and not isinstance(m.get(field), str):
                raise RequestInvalid(f"{where}.{field} must be a string", param="messages")
        out.append(
            {
                "role": role,
                "content": content,
                "images": [check_image(img, f"{where}.images[{k}]") for k, img in enumerate(images)],
                "tool_calls": calls,
                "tool_name": m.get("tool_name") or m.get("name"),
                "thinking": m.get("thinking") or "",
            }
        )
    return out


def rfc3339(seconds: float) -> str:
    """A wall-clock time as Ollama writes it: RFC 3339, UTC, ``Z``."""
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def created_at() -> str:
    return rfc3339(datetime.datetime.now(datetime.timezone.utc).timestamp())


def nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def ndjson(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
