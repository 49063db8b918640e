"""``POST /v1/chat/completions``: the OpenAI chat contract, streaming and not.

Content, reasoning and tool calls come typed from the model thread.  A request that offers tools
(with the guardrails on) is generated whole before anything is sent, so that a missed call can be
rescued and a bad one retried; its stream is then framed from the finished turn.  Any other
stream is sent as the model writes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from quart import Blueprint, Response, g, request

from ..turns.chat import TemplateMessage, apply_default_system, image_urls, text_of, tool_call
from ..wire.codec import parse_json, structure
from ..errors import RequestInvalid
from ..messages import ChatPrompt, Delta, Finished, RequestRouted, TokenLogprob, ToolCall
from ..turns.structured import check_images, function_tools, grammar_for, json_demand, select_tools
from ..wire.openai import ChatCompletionRequest
from ..web import sse as _sse
from ..web.app import json_response, system
from ._generation import Completion, collect, generate_turn, start
from ._openai import (
    DEGRADATION_HEADER,
    Envelope,
    chat_logprobs,
    sampling_params,
    sse_response,
    stream_response,
    usage,
)

blueprint = Blueprint("openai_chat", __name__)

DROPPED_IMAGES = (
    "this server's model has no vision tower, so image content parts were ignored; "
    "run it against an install whose checkpoint carries one"
)


def _messages(body: ChatCompletionRequest) -> tuple[list[TemplateMessage], int]:
    """The conversation for the template, and how many images it carried (validated; the
    models served here have no vision tower, so they are dropped)."""
    out: list[TemplateMessage] = []
    images = check_images(url for m in body.messages for url in image_urls(m.content))
    for i, m in enumerate(body.messages):
        text, _ = text_of(m.content)
        role = {"function": "tool", "developer": "system"}.get(m.role, m.role)
        msg: TemplateMessage = {"role": role, "content": text}
        calls = list(m.tool_calls or ())
        if m.function_call is not None:  # the deprecated single-call form
            calls.append({"id": f"call_{i}", "type": "function", "function": m.function_call})
        if calls:
            msg["tool_calls"] = [_history_call(c, i) for c in calls]
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if text or calls or role == "tool":  # an empty tool result is still the call's answer
            out.append(msg)
    return out, images


def _history_call(call: Any, at: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestInvalid(
            f"messages[{at}].tool_calls entries need a function with a name", param="messages"
        )
    return tool_call(call)


def _degradation(body: ChatCompletionRequest, images: int) -> str | None:
    """Fields accepted but not honoured.  Identifiers (``user``, ``safety_identifier``,
    ``prompt_cache_key``, ``metadata``) change nothing by definition; ``service_tier`` ``auto``
    and ``default`` are what every request gets."""
    labels = [name for name in ("prediction", "audio", "web_search_options", "verbosity") if getattr(body, name) is not None]
    if body.store:
        labels.append("store")
    if body.service_tier not in (None, "auto", "default"):
        labels.append("service_tier")
    if body.modalities and set(body.modalities) != {"text"}:
        labels.append("modalities")
    if body.stream_options and body.stream_options.include_obfuscation:
        labels.append("include_obfuscation")
    header = ", ".join(labels)
    if images:
        header = f"{header}; {DROPPED_IMAGES}" if header else DROPPED_IMAGES
    return header or None


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """Flags for the model's own chat template: ``reasoning_effort`` (and the ``enable_thinking``
    switch that Qwen-style templates read), then the caller's ``chat_template_kwargs``."""
    kwargs: dict[str, Any] = {}
    if body.reasoning_effort is not None:
        effort = "none" if body.reasoning_effort == "off" else body.reasoning_effort  # the reference's spelling
        kwargs["reasoning_effort"] = effort
        kwargs["enable_thinking"] = effort not in ("none", "minimal")
    kwargs.update(body.chat_template_kwargs or {})
    return kwargs


def call_wire(call: ToolCall, *, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": call.index} if index is None else {"index": index}
    return out | {"id": call.id, "type": "function",
                  "function": {"name": call.name, "arguments": call.arguments}}


def _message(text: str, reasoning: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [
            {k: v for k, v in call_wire(c).items() if k != "index"} for c in calls
        ]
    return message


@blueprint.post("/v1/chat/completions")
@blueprint.post("/chat/completions")  # clients whose base URL lacks /v1
async def chat_completions() -> Response:
    sys_ = system()
    body = structure(parse_json(await request.get_data()), ChatCompletionRequest)
    entry = await sys_.resolve(body.model, "chat")
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    messages, images = _messages(body)
    messages = apply_default_system(messages, sys_.settings.system_prompt)
    tools, required = select_tools(function_tools(body.tools), body.tool_choice)
    schema, any_object = json_demand(body.response_format)
    grammar = grammar_for(
        json_schema=schema, json_object=any_object, tools=tools, call_required=required,
        parallel=body.parallel_tool_calls is True,
    )
    n = body.n or 1
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestInvalid("top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prompt = ChatPrompt(tuple(messages), tools, _template_kwargs(body))
    params = sampling_params(
        body,
        max_tokens=body.max_tokens or body.max_completion_tokens,
        model_defaults=entry.sampling_defaults,
        logprobs=logprobs,
        grammar=grammar,
    )
    env = Envelope.new("chatcmpl", body.model or entry.id, entry.fingerprint)
    guardrails = sys_.settings.guardrails
    if tools and guardrails.active:
        done = await generate_turn(
            request_id=g.record.id, model=entry.id, prompt=prompt, params=params, n=n,
            call_required=required, guardrails=guardrails,
            parallel=body.parallel_tool_calls is not False,
        )
        response = _buffered_stream(env, body, done, logprobs) if body.stream else _whole(env, done, logprobs)
    else:
        replies = await start(request_id=g.record.id, model=entry.id, prompt=prompt, params=params, n=n)
        if body.stream:
            response = _live_stream(env, body, replies, n, logprobs)
        else:
            response = _whole(env, await collect(replies, n), logprobs)
    if header := _degradation(body, images):
        response.headers[DEGRADATION_HEADER] = header
    return response


def _finish_reason(fin: Finished, called: bool) -> str:
    return "tool_calls" if called else fin.finish_reason


def _whole(env: Envelope, done: Completion, logprobs: int | None) -> Response:
    choices = [
        {
            "index": i,
            "message": _message(text, reasoning, calls),
            "logprobs": chat_logprobs(entries) if logprobs is not None else None,
            "finish_reason": _finish_reason(fin, bool(calls)),
        }
        for i, (text, reasoning, calls, fin, entries) in enumerate(
            zip(done.texts, done.reasoning, done.calls, done.finished, done.logprobs, strict=True)
        )
    ]
    return json_response(env.wrap("chat.completion", choices) | {"usage": usage(done.finished)})


def _chunk(
    env: Envelope, delta: dict[str, Any], index: int, finish: str | None = None,
    entries: Sequence[TokenLogprob] = (), logprobs: int | None = None,
) -> dict[str, Any]:
    reported = chat_logprobs(entries) if logprobs is not None and entries else None
    choice = {"index": index, "delta": delta, "logprobs": reported, "finish_reason": finish}
    return env.wrap("chat.completion.chunk", [choice])


def _live_stream(env: Envelope, body: ChatCompletionRequest, replies: Any, n: int, logprobs: int | None) -> Response:
    def pieces(d: Delta, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if d.reasoning:
            deltas.append({"reasoning_content": d.reasoning, "reasoning": d.reasoning})
        if d.text:
            deltas.append({"content": d.text})
        if d.tool_calls:
            deltas.append({"tool_calls": [call_wire(c) for c in d.tool_calls]})
        return [
            _chunk(env, delta, d.index, None, entries if k == 0 else (), logprobs)
            for k, delta in enumerate(deltas)
        ]

    return sse_response(
        replies,
        body,
        keepalive=system().settings.keepalive_interval,
        n=n,
        opening=[_chunk(env, {"role": "assistant", "content": ""}, i) for i in range(n)],
        pieces=pieces,
        finish=lambda fin, called, entries: _chunk(
            env, {}, fin.index, _finish_reason(fin, called), entries, logprobs
        ),
    )


def _buffered_stream(env: Envelope, body: ChatCompletionRequest, done: Completion, logprobs: int | None) -> Response:
    """A finished turn framed as a stream: per choice its role, reasoning, content and calls,
    then its finish; then the usage (when asked) and ``[DONE]``."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def frames() -> AsyncIterator[bytes]:
        last: dict[str, Any] = {}
        for i, (text, reasoning, calls, fin, entries) in enumerate(
            zip(done.texts, done.reasoning, done.calls, done.finished, done.logprobs, strict=True)
        ):
            yield _sse.data(_chunk(env, {"role": "assistant", "content": ""}, i))
            deltas: list[dict[str, Any]] = []
            if reasoning:
                deltas.append({"reasoning_content": reasoning, "reasoning": reasoning})
            if text:
                deltas.append({"content": text})
            deltas += [{"tool_calls": [call_wire(call)]} for call in calls]
            for k, delta in enumerate(deltas):  # the turn's log-probabilities ride on its first chunk
                yield _sse.data(_chunk(env, delta, i, None, entries if k == 0 else (), logprobs))
            last = _chunk(env, {}, i, _finish_reason(fin, bool(calls)), () if deltas else entries, logprobs)
            yield _sse.data(last)
        if include_usage:
            yield _sse.data(last | {"choices": [], "usage": usage(done.finished)})
        yield _sse.DONE

    return stream_response(frames())
