"""``POST /v1/chat/completions``: the OpenAI chat contract, streaming and not."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quart import Blueprint, Response, g, request

from ..chat import TemplateMessage, apply_default_system, text_of, tool_call
from ..codec import parse_json, structure
from ..errors import RequestInvalid
from ..messages import ChatPrompt, RequestRouted, TokenLogprob
from ..wire.openai import ChatCompletionRequest
from ._app import json_response, system
from ._generation import collect, start
from ._openai import (
    DEGRADATION_HEADER,
    Envelope,
    chat_logprobs,
    sampling_params,
    sse_response,
    usage,
)

blueprint = Blueprint("openai_chat", __name__)

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


def _degradation(body: ChatCompletionRequest, dropped_images: int) -> str | None:
    labels = []
    if body.response_format and body.response_format.get("type") != "text":
        labels.append("response_format")
    for name in ("prediction", "audio", "web_search_options"):
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
        kwargs["enable_thinking"] = body.reasoning_effort not in ("none", "minimal")
    kwargs.update(body.chat_template_kwargs or {})
    return kwargs


@blueprint.post("/v1/chat/completions")
@blueprint.post("/chat/completions")  # clients whose base URL lacks /v1
async def chat_completions() -> Response:
    sys_ = system()
    body = structure(parse_json(await request.get_data()), ChatCompletionRequest)
    entry = await sys_.resolve(body.model, "chat")
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    messages, dropped = _messages(body)
    messages = apply_default_system(messages, sys_.settings.system_prompt)
    tools = tuple(body.tools or ()) if body.tool_choice != "none" else ()
    n = body.n or 1
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestInvalid("top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    replies = await start(
        request_id=g.record.id,
        model=entry.id,
        prompt=ChatPrompt(tuple(messages), tools, _template_kwargs(body)),
        params=sampling_params(
            body,
            max_tokens=body.max_tokens or body.max_completion_tokens,
            model_defaults=entry.sampling_defaults,
            logprobs=logprobs,
        ),
        n=n,
    )
    env = Envelope.new("chatcmpl", body.model or entry.id, entry.fingerprint)

    def reported(entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        return chat_logprobs(entries) if logprobs is not None and entries else None

    def chunk(
        delta: dict[str, Any], index: int, finish: str | None = None, entries: Sequence[TokenLogprob] = ()
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": reported(entries), "finish_reason": finish}
        return env.wrap("chat.completion.chunk", [choice])

    if body.stream:
        response = sse_response(
            replies,
            body,
            keepalive=sys_.settings.keepalive_interval,
            n=n,
            opening=[chunk({"role": "assistant", "content": ""}, i) for i in range(n)],
            piece=lambda text, i, entries: chunk({"content": text}, i, None, entries),
            finish=lambda reason, i, entries: chunk({}, i, reason, entries),
        )
    else:
        done = await collect(replies, n)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": chat_logprobs(entries) if logprobs is not None else None,
                "finish_reason": fin.finish_reason,
            }
            for i, (text, fin, entries) in enumerate(
                zip(done.texts, done.finished, done.logprobs, strict=True)
            )
        ]
        response = json_response(
            env.wrap("chat.completion", choices) | {"usage": usage(done.finished)}
        )
    if header := _degradation(body, dropped):
        response.headers[DEGRADATION_HEADER] = header
    return response
