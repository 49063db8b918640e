"""``POST /v1/chat/completions``: the OpenAI chat contract, streaming and not.

The HTTP side: parse, translate the conversation, plan the turn, and send it through the turn
driver (``_turn``): live as ``chat.completion.chunk`` objects, or whole, both framed from the
same events (``openai_chat_events``).  With tools offered, content and reasoning stream as the
model writes them; only what may begin a call is held until it is decided.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, g

from ..turns.chat import TemplateMessage, apply_default_system, image_urls, text_of, tool_call
from ..turns.images import openai_parts, with_images
from ..errors import RequestInvalid
from ..messages import ChatPrompt, RequestRouted
from ..turns.grammars import demanded_grammar, peer_grammar
from ..turns.sampling import adapters_chosen
from ..turns.structured import check_images, function_tools, grammar_for, json_demand, select_tools
from ..wire.openai import ChatCompletionRequest
from ..web.app import exception_body, system
from ..web.bodies import json_answer, read_body
from ._images import fetch_images
from ._input_audio import transcribed_audio
from ._openai import DEGRADATION_HEADER, degradation, sampling_params, stream_response
from ._turn import RETRIES_HEADER, TurnPlan, framed, open_turn
from .openai_chat_events import ChatStream, Envelope, chat_whole

blueprint = Blueprint("openai_chat", __name__)

def _messages(body: ChatCompletionRequest, vision: bool = False, remote: bool = False) -> tuple[list[TemplateMessage], int]:
    """The conversation for the template, and how many images it carried (validated).  For a
    ``vision`` model a message with images keeps them, in a list of parts (``turns.images``);
    otherwise images are dropped."""
    out: list[TemplateMessage] = []
    images = check_images((url for m in body.messages for url in image_urls(m.content)), remote and vision)
    for i, m in enumerate(body.messages):
        text, _ = text_of(m.content)
        role = {"function": "tool", "developer": "system"}.get(m.role, m.role)
        msg: TemplateMessage = {"role": role, "content": text}
        if vision and image_urls(m.content):
            msg["content"] = with_images(openai_parts(m.content or ()), f"messages[{i}]")
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
        if text or calls or role == "tool" or msg["content"]:  # an empty tool result is still the call's answer
            out.append(msg)
    return out, images


def _history_call(call: Any, at: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestInvalid(
            f"messages[{at}].tool_calls entries need a function with a name", param="messages"
        )
    return tool_call(call)


def _unhonoured(body: ChatCompletionRequest) -> list[str]:
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
    return labels


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


@blueprint.post("/v1/chat/completions")
@blueprint.post("/chat/completions")  # clients whose base URL lacks /v1
async def chat_completions() -> Response:
    sys_ = system()
    body = await read_body(ChatCompletionRequest)
    entry = await sys_.resolve(body.model, "chat")
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    vision = "vision" in entry.capabilities
    body, heard = await transcribed_audio(body)  # input_audio parts, as their transcripts
    messages, images = _messages(body, vision, sys_.settings.image_urls)
    await fetch_images(messages)  # http(s) image URLs, where --image-urls allows them
    messages = apply_default_system(messages, sys_.settings.system_prompt)
    tools, required = select_tools(function_tools(body.tools), body.tool_choice)
    schema, any_object = json_demand(body.response_format)
    grammar = grammar_for(
        json_schema=schema, json_object=any_object, tools=tools, call_required=required,
        parallel=body.parallel_tool_calls is True,
    )
    grammar = demanded_grammar(grammar, peer_grammar(body))
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
    params = adapters_chosen(params, entry.adapters, body.model, body.lora)
    env = Envelope.new("chatcmpl", body.model or entry.id, entry.fingerprint)
    plan = TurnPlan(entry.id, prompt, params, n, call_required=required, parallel=body.parallel_tool_calls is not False)
    turn = await open_turn(plan, request_id=g.record.id, guardrails=sys_.settings.guardrails)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        framer = ChatStream(env, n, logprobs, include_usage, return_progress=body.return_progress)
        response = stream_response(framed(
            turn, framer, keepalive=sys_.settings.keepalive_interval,
            error=lambda exc: framer.error(exception_body(exc, "openai")),
        ))
    else:
        whole = await turn.collect()
        response = await json_answer(chat_whole(env, whole, logprobs), numbers=whole.numbers)
        if turn.retries:
            response.headers[RETRIES_HEADER] = str(turn.retries)
    if header := degradation([*heard, *_unhonoured(body)], 0 if vision else images):
        response.headers[DEGRADATION_HEADER] = header
    return response
