"""``POST /v1/chat/completions``: the OpenAI chat contract, streaming and not."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint, Response, g, request

from ..chat import DEFAULT_MAX_TOKENS, TemplateMessage, apply_default_system, text_of, tool_call
from ..codec import parse_json, structure
from ..messages import ChatPrompt, Delta, Failed, Finished, RequestRouted
from ..model.backend import SamplingParams
from ..wire.openai import ChatCompletionRequest
from . import _sse
from ._app import exception_body, json_response, system
from ._generation import Replies, collect, events, start

blueprint = Blueprint("openai_chat", __name__)

_ids = itertools.count()
DEGRADATION_HEADER = "x-anyllm-degradation"
DROPPED_IMAGES = (
    "this server's model has no vision tower, so image content parts were ignored; "
    "run it against an install whose checkpoint carries one"
)


def _messages(body: ChatCompletionRequest) -> tuple[list[TemplateMessage], int]:
    out: list[TemplateMessage] = []
    dropped = 0
    for m in body.messages:
        text, other = text_of(m.content)
        dropped += other
        role = {"function": "tool", "developer": "system"}.get(m.role, m.role)
        msg: TemplateMessage = {"role": role, "content": text}
        if m.tool_calls:
            msg["tool_calls"] = [tool_call(c) for c in m.tool_calls]
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if text or m.tool_calls:
            out.append(msg)
    return out, dropped


def _params(body: ChatCompletionRequest) -> SamplingParams:
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    defaults = SamplingParams()
    return SamplingParams(
        max_tokens=body.max_tokens or body.max_completion_tokens or DEFAULT_MAX_TOKENS,
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop=tuple(stop),
    )


def _degradation(body: ChatCompletionRequest, dropped_images: int) -> str | None:
    labels = []
    if body.response_format and body.response_format.get("type") != "text":
        labels.append("response_format")
    if body.n is not None and body.n > 1:
        labels.append("n")
    for name in ("logprobs", "top_logprobs", "logit_bias", "prediction", "audio", "web_search_options"):
        if getattr(body, name) is not None:
            labels.append(name)
    if body.tools and body.tool_choice != "none":
        labels.append("tool_calls")
        if body.tool_choice not in (None, "auto"):
            labels.append("tool_choice")
        if body.parallel_tool_calls is not None:
            labels.append("parallel_tool_calls")
    if body.modalities and set(body.modalities) != {"text"}:
        labels.append("modalities")
    if body.stream_options and body.stream_options.include_obfuscation:
        labels.append("include_obfuscation")
    if body.reasoning_effort is not None:
        labels.append("reasoning_content")  # passed to the template, not yet split out
    header = ", ".join(labels)
    if dropped_images:
        header = f"{header}; {DROPPED_IMAGES}" if header else DROPPED_IMAGES
    return header or None


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """Flags for the model's own chat template: ``reasoning_effort`` (and the ``enable_thinking``
    switch that Qwen-style templates read), then the caller's ``chat_template_kwargs``."""
    kwargs: dict[str, Any] = {}
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
        kwargs["enable_thinking"] = body.reasoning_effort not in ("off", "none", "minimal")
    kwargs.update(body.chat_template_kwargs or {})
    return kwargs


def _usage(fin: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    sys_ = system()
    body = structure(parse_json(await request.get_data()), ChatCompletionRequest)
    entry = await sys_.resolve(body.model, "chat")
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    messages, dropped = _messages(body)
    messages = apply_default_system(messages, sys_.settings.system_prompt)
    tools = tuple(body.tools or ()) if body.tool_choice != "none" else ()
    replies = await start(
        request_id=g.record.id,
        model=entry.id,
        prompt=ChatPrompt(tuple(messages), tools, _template_kwargs(body)),
        params=_params(body),
    )
    response_id = f"chatcmpl-{int(time.time())}-{next(_ids)}"
    created = int(time.time())
    model_name = body.model or entry.id
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        response = Response(
            _stream(
                replies,
                response_id,
                created,
                model_name,
                include_usage=include_usage,
                keepalive=sys_.settings.keepalive_interval,
            ),
            content_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        response.timeout = None  # Quart would cut a stream after RESPONSE_TIMEOUT otherwise
    else:
        done = await collect(replies)
        fin = done.finished
        response = json_response(
            {
                "id": response_id,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": done.text},
                        "logprobs": None,
                        "finish_reason": fin.finish_reason,
                    }
                ],
                "usage": _usage(fin),
            }
        )
    if header := _degradation(body, dropped):
        response.headers[DEGRADATION_HEADER] = header
    return response


async def _stream(
    replies: Replies,
    response_id: str,
    created: int,
    model: str,
    *,
    include_usage: bool,
    keepalive: float,
) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse.data(
            {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
        )

    yield chunk({"role": "assistant", "content": ""})
    async for msg in events(replies, keepalive=keepalive):
        if msg is None:
            yield _sse.KEEPALIVE
        elif isinstance(msg, Delta):
            if msg.text:
                yield chunk({"content": msg.text})
        elif isinstance(msg, Finished):
            yield chunk({}, msg.finish_reason)
            if include_usage:
                yield _sse.data(
                    {
                        "id": response_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": _usage(msg),
                    }
                )
            yield _sse.DONE
        else:
            assert isinstance(msg, Failed)
            yield _sse.event("error", exception_body(msg.error, "openai"))
