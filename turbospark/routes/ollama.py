"""Ollama's generation routes: ``/api/chat`` and ``/api/generate`` on the same generation core
as the OpenAI routes.  (Model management is ``ollama_models``, pulls ``ollama_pull``.)

- Streams are NDJSON (``application/x-ndjson``; ``stream`` defaults to true): one object per
  decode step that shows something, then a final ``done: true`` object with Ollama's counters
  and durations (nanoseconds).  A failure mid-stream ends it with ``done_reason: "error"`` and
  ``error``.  Errors before the first byte are ``{"error": "..."}`` with Ollama's status codes.
- Models are named exactly (``name`` or ``name:latest``): an unknown one is a 404, never
  another model.  Naming a stored model loads it; ``keep_alive`` says how long it stays loaded
  after the request (a request with no prompt or messages only loads, or with ``keep_alive: 0``
  unloads).
- ``tools``/``tool_calls``, ``format`` (``"json"`` or a JSON Schema, enforced by constrained
  decoding), ``think`` (the reasoning comes as ``thinking``) and ``images`` (validated, then
  dropped: the models served here have no vision tower; the ``x-anyllm-degradation`` header
  says so) go through the same core as the OpenAI side.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from quart import Blueprint, Response, g, request

from ..actors.lifecycle import parse_keep_alive
from ..actors.registry import ModelEntry
from ..errors import ContextOverflow, RequestInvalid, TurboSparkError
from ..messages import ChatPrompt, Delta, Failed, Finished, RequestRouted, Started, TextPrompt, ToolCall
from ..model.backend import SamplingParams
from ..turns.chat import TemplateMessage, apply_default_system
from ..turns.structured import check_images, function_tools, grammar_for
from ..web.app import json_response, system
from ..wire.codec import parse_json, structure
from ..wire.ollama import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    check_image,
    check_messages,
    created_at,
    ndjson,
    nanoseconds,
    options_params,
)
from ._generation import Completion, Replies, collect, events, generate_turn, start
from ._ollama import ndjson_response
from ._openai import DEGRADATION_HEADER, DROPPED_IMAGES

blueprint = Blueprint("ollama", __name__)


class _Turn:
    """One ``/api/chat`` or ``/api/generate`` request on its way through the core."""

    def __init__(self, kind: str, body: OllamaChatRequest | OllamaGenerateRequest) -> None:
        self.kind = kind  # "chat" or "generate"
        self.body = body
        self.began = time.monotonic()
        self.load_seconds = 0.0
        self.started = self.first = self.ended = 0.0
        self.degraded: list[str] = []

    def frame(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.body.model, "created_at": created_at(), **fields}

    def piece(self, text: str, thinking: str = "", calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
        if self.kind == "generate":
            out = self.frame(response=text)
            if thinking:
                out["thinking"] = thinking
            return out | {"done": False}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [_call_wire(c) for c in calls]
        return self.frame(message=message, done=False)

    def final(self, fin: Finished, called: bool, text: str = "", thinking: str = "",
              calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
        out = self.piece(text, thinking, calls)
        end = self.ended or time.monotonic()
        first = self.first or end
        out.update(
            done=True,
            done_reason="length" if fin.finish_reason == "length" and not called else "stop",
            total_duration=nanoseconds(end - self.began),
            load_duration=nanoseconds(self.load_seconds),
            prompt_eval_count=fin.prompt_tokens,
            prompt_eval_duration=nanoseconds(first - (self.started or first)),
            eval_count=fin.completion_tokens,
            eval_duration=nanoseconds(end - first),
        )
        return out

    def error(self, exc: TurboSparkError) -> dict[str, Any]:
        return self.frame(done=True, done_reason="error", error=exc.message)


def _call_wire(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        arguments = {}
    if not isinstance(arguments, dict):
        arguments = {"value": arguments}
    return {"function": {"name": call.name, "arguments": arguments}}


def _keep_alive(body: Any) -> float | None:
    try:
        return parse_keep_alive(body.keep_alive)
    except RequestInvalid as exc:
        raise RequestInvalid(exc.message, param="keep_alive") from None


def _grammar(fmt: Any, tools: tuple[dict[str, Any], ...]) -> Any:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return grammar_for(json_object=True)
    if isinstance(fmt, dict):
        return grammar_for(json_schema=fmt)
    raise RequestInvalid('format must be "json" or a JSON Schema object', param="format")


def _think_kwargs(think: Any) -> dict[str, Any]:
    if think is None:
        return {}
    if not isinstance(think, (bool, str)):
        raise RequestInvalid('think must be true, false, "low", "medium" or "high"', param="think")
    if isinstance(think, str):
        if think not in ("low", "medium", "high"):
            raise RequestInvalid('think must be true, false, "low", "medium" or "high"', param="think")
        return {"reasoning_effort": think, "enable_thinking": True}
    return {"enable_thinking": think}


def _ollama_history(messages: list[dict[str, Any]]) -> list[TemplateMessage]:
    out: list[TemplateMessage] = []
    for i, m in enumerate(messages):
        msg: TemplateMessage = {"role": m["role"], "content": m["content"]}
        if m["tool_calls"]:
            msg["tool_calls"] = [
                {"id": f"call_{i}_{k}", "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments") or {}}}
                for k, c in enumerate(m["tool_calls"])
            ]
        if m["thinking"]:
            msg["reasoning_content"] = m["thinking"]
        if m["role"] == "tool" and m["tool_name"]:
            msg["name"] = m["tool_name"]
        if m["content"] or m["tool_calls"]:
            out.append(msg)
    return out


async def _lifecycle_only(turn: _Turn, keep_alive: float | None) -> Response:
    """A request without a prompt: load the model (or, with ``keep_alive: 0``, unload it)."""
    sys_ = system()
    want = "chat" if turn.kind == "chat" else "completion"
    if keep_alive == 0:
        await sys_.unload(turn.body.model)
        reason = "unload"
    else:
        grant = await sys_.lease(turn.body.model, want, keep_alive=keep_alive, exact=True)
        sys_.emit(RequestRouted(g.record.id, turn.body.model, grant.entry.id, False))
        reason = "load"
    fields: dict[str, Any] = (
        {"message": {"role": "assistant", "content": ""}} if turn.kind == "chat" else {"response": ""}
    )
    return json_response(turn.frame(**fields, done=True, done_reason=reason))


async def _run(turn: _Turn, entry: ModelEntry, prompt: ChatPrompt | TextPrompt, params: SamplingParams,
               num_ctx: int | None) -> Response:
    sys_ = system()

    def admit(started: Started) -> None:
        turn.started = time.monotonic()
        if num_ctx is not None and started.prompt_tokens + params.max_tokens > num_ctx:
            raise ContextOverflow(
                f"options.num_ctx is {num_ctx} tokens; the prompt has {started.prompt_tokens} tokens "
                f"and num_predict asks for {params.max_tokens} more. Shorten the prompt, lower "
                "num_predict or raise num_ctx.", param="options.num_ctx",
            )

    tools = prompt.tools if isinstance(prompt, ChatPrompt) else ()
    guardrails = sys_.settings.guardrails
    if tools and guardrails.active:
        assert isinstance(prompt, ChatPrompt)
        done = await generate_turn(
            request_id=g.record.id, model=entry.id, prompt=prompt, params=params, n=1,
            call_required=False, guardrails=guardrails, admit=admit,
        )
        turn.ended = time.monotonic()
        response = _buffered(turn, done) if turn.body.stream else _whole(turn, done)
    else:
        replies = await start(request_id=g.record.id, model=entry.id, prompt=prompt, params=params, admit=admit)
        if turn.body.stream:
            response = _stream(turn, replies)
        else:
            done = await collect(replies)
            turn.ended = time.monotonic()
            response = _whole(turn, done)
    if turn.degraded:
        response.headers[DEGRADATION_HEADER] = "; ".join(turn.degraded)
    return response


def _whole(turn: _Turn, done: Completion) -> Response:
    turn.first = turn.first or turn.started
    calls = done.calls[0]
    return json_response(turn.final(done.finished[0], bool(calls), done.texts[0], done.reasoning[0], calls))


def _buffered(turn: _Turn, done: Completion) -> Response:
    async def frames() -> AsyncIterator[bytes]:
        text, thinking, calls = done.texts[0], done.reasoning[0], done.calls[0]
        if thinking or text:
            yield ndjson(turn.piece(text, thinking))
        if calls:
            yield ndjson(turn.piece("", "", calls))
        turn.first = turn.first or turn.started
        yield ndjson(turn.final(done.finished[0], bool(calls)))

    return ndjson_response(frames())


def _stream(turn: _Turn, replies: Replies) -> Response:
    keepalive = system().settings.keepalive_interval

    async def frames() -> AsyncIterator[bytes]:
        called = False
        async for msg in events(replies, keepalive=keepalive):
            if msg is None:
                continue  # NDJSON has no comments; Ollama's clients wait quietly
            if isinstance(msg, Delta):
                turn.first = turn.first or time.monotonic()
                called |= bool(msg.tool_calls)
                if msg.text or msg.reasoning or msg.tool_calls:
                    yield ndjson(turn.piece(msg.text, msg.reasoning, msg.tool_calls))
            elif isinstance(msg, Finished):
                turn.ended = time.monotonic()
                yield ndjson(turn.final(msg, called))
            else:
                assert isinstance(msg, Failed)
                yield ndjson(turn.error(msg.error))

    return ndjson_response(frames())


def _params(entry: ModelEntry, options: dict[str, Any], grammar: Any) -> SamplingParams:
    fields = {**entry.sampling_defaults, **options}
    return SamplingParams(grammar=grammar, **fields)


def _check_num_ctx(entry: ModelEntry, num_ctx: int | None) -> None:
    if num_ctx is not None and entry.context_window and num_ctx > entry.context_window:
        raise RequestInvalid(
            f"options.num_ctx is {num_ctx}, but '{entry.id}' reads at most {entry.context_window} "
            "tokens of context", param="options.num_ctx",
        )


@blueprint.post("/api/chat")
async def chat() -> Response:
    sys_ = system()
    body = structure(parse_json(await request.get_data()), OllamaChatRequest)
    turn = _Turn("chat", body)
    if not body.model:
        raise RequestInvalid("model is required", param="model")
    keep_alive = _keep_alive(body)
    options = options_params(body.options)
    if options.ignored:
        turn.degraded.append(", ".join(f"options.{k}" for k in options.ignored))
    messages = check_messages(body.messages or [])
    tools = function_tools(body.tools)
    grammar = _grammar(body.format, tools)
    template_kwargs = _think_kwargs(body.think)
    images = check_images(url for m in messages for url in m["images"])
    if images:
        turn.degraded.append(DROPPED_IMAGES)
    if body.logprobs:
        turn.degraded.append("logprobs")
    if not messages:
        return await _lifecycle_only(turn, keep_alive)
    grant = await sys_.lease(body.model, "chat", keep_alive=keep_alive, exact=True)
    turn.load_seconds = grant.load_seconds
    entry = grant.entry
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    _check_num_ctx(entry, options.num_ctx)
    history = apply_default_system(_ollama_history(messages), sys_.settings.system_prompt)
    prompt = ChatPrompt(tuple(history), tools, template_kwargs)
    return await _run(turn, entry, prompt, _params(entry, options.sampling, grammar), options.num_ctx)


@blueprint.post("/api/generate")
async def generate() -> Response:
    sys_ = system()
    body = structure(parse_json(await request.get_data()), OllamaGenerateRequest)
    turn = _Turn("generate", body)
    if not body.model:
        raise RequestInvalid("model is required", param="model")
    if body.suffix:
        raise RequestInvalid(
            "suffix (fill-in-the-middle) is not supported by this server's models; send the text "
            "before the gap as the prompt", param="suffix",
        )
    if body.template:
        raise RequestInvalid(
            "template overrides are not supported: the model's own chat template applies (or send "
            "raw: true with the prompt already formatted)", param="template",
        )
    keep_alive = _keep_alive(body)
    options = options_params(body.options)
    if options.ignored:
        turn.degraded.append(", ".join(f"options.{k}" for k in options.ignored))
    if body.context:
        turn.degraded.append("context")
    grammar = _grammar(body.format, ())
    template_kwargs = _think_kwargs(body.think)
    images = check_images(check_image(img, f"images[{k}]") for k, img in enumerate(body.images or ()))
    if images:
        turn.degraded.append(DROPPED_IMAGES)
    if body.logprobs:
        turn.degraded.append("logprobs")
    if not body.prompt:
        return await _lifecycle_only(turn, keep_alive)
    grant = await sys_.lease(body.model, "completion", keep_alive=keep_alive, exact=True)
    turn.load_seconds = grant.load_seconds
    entry = grant.entry
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    _check_num_ctx(entry, options.num_ctx)
    prompt: ChatPrompt | TextPrompt
    if body.raw:
        prompt = TextPrompt(body.prompt)
    elif "chat" not in entry.capabilities:  # a base model: its text, the system prompt first
        prompt = TextPrompt(f"{body.system}\n\n{body.prompt}" if body.system else body.prompt)
    else:
        turns: list[TemplateMessage] = [{"role": "system", "content": body.system}] if body.system else []
        turns.append({"role": "user", "content": body.prompt})
        prompt = ChatPrompt(tuple(apply_default_system(turns, sys_.settings.system_prompt)), (), template_kwargs)
    return await _run(turn, entry, prompt, _params(entry, options.sampling, grammar), options.num_ctx)
