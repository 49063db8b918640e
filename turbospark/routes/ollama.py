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
  says so) go through the same core as the OpenAI side: the turn driver (``_turn``), framed by
  ``ollama_events`` (content streams as written with tools offered; a call is sent whole once
  it is complete, as Ollama sends it).
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, g

from ..actors.lifecycle import parse_keep_alive
from ..actors.registry import ModelEntry
from ..errors import ContextOverflow, RequestInvalid
from ..messages import ChatPrompt, RequestRouted, Started, TextPrompt
from ..model.backend import SamplingParams
from ..turns.chat import TemplateMessage, apply_default_system
from ..turns.images import with_images
from ..turns.sampling import adapters_chosen, sampling
from ..turns.structured import check_images, function_tools, grammar_for
from ..web.app import json_response, system
from ..web.bodies import json_answer, read_body
from ..wire.ollama import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    check_image,
    check_messages,
    options_params,
)
from ._ollama import ndjson_response
from ._openai import DEGRADATION_HEADER, degradation
from ._turn import RETRIES_HEADER, TurnPlan, framed, open_turn
from .ollama_events import OllamaStream

blueprint = Blueprint("ollama", __name__)


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


def _ollama_history(messages: list[dict[str, Any]], vision: bool = False) -> list[TemplateMessage]:
    """The conversation for the template; a ``vision`` model's messages keep their images (before
    their text, as Ollama places them)."""
    out: list[TemplateMessage] = []
    for i, m in enumerate(messages):
        msg: TemplateMessage = {"role": m["role"], "content": m["content"]}
        if vision and m["images"]:
            parts = [("image", url) for url in m["images"]] + [("text", m["content"])]
            msg["content"] = with_images(parts, f"messages[{i}]")
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
        if msg["content"] or m["tool_calls"]:
            out.append(msg)
    return out


async def _lifecycle_only(out: OllamaStream, keep_alive: float | None) -> Response:
    """A request without a prompt: load the model (or, with ``keep_alive: 0``, unload it)."""
    sys_ = system()
    want = "chat" if out.kind == "chat" else "completion"
    if keep_alive == 0:
        await sys_.unload(out.model)
        reason = "unload"
    else:
        grant = await sys_.lease(out.model, want, keep_alive=keep_alive, exact=True)
        sys_.emit(RequestRouted(g.record.id, out.model, grant.entry.id, False))
        reason = "load"
    fields: dict[str, Any] = (
        {"message": {"role": "assistant", "content": ""}} if out.kind == "chat" else {"response": ""}
    )
    return json_response(out.frame(**fields, done=True, done_reason=reason))


async def _run(out: OllamaStream, stream: bool, entry: ModelEntry, prompt: ChatPrompt | TextPrompt,
               params: SamplingParams, num_ctx: int | None, labels: list[str], images: int,
               fit: tuple[bool, bool] = (False, False)) -> Response:
    """``fit``: the body's ``truncate`` and ``shift``: a prompt past the context loses its oldest
    messages, a budget past it is cut to what is left (the KV cache itself never shifts)."""
    truncate, shift = fit
    sys_ = system()

    def admit(started: Started) -> None:
        out.started = out.clock()
        if num_ctx is not None and started.prompt_tokens + params.max_tokens > num_ctx:
            raise ContextOverflow(
                f"options.num_ctx is {num_ctx} tokens; the prompt has {started.prompt_tokens} tokens "
                f"and num_predict asks for {params.max_tokens} more. Shorten the prompt, lower "
                "num_predict or raise num_ctx.", param="options.num_ctx",
            )

    plan = TurnPlan(entry.id, prompt, params, truncate=truncate, clamp=shift)
    turn = await open_turn(plan, request_id=g.record.id,
                           guardrails=sys_.settings.guardrails, admit=admit)
    if stream:
        response = ndjson_response(framed(turn, out, keepalive=sys_.settings.keepalive_interval, error=out.error))
    else:
        whole = await turn.collect()
        response = await json_answer(out.whole(whole), numbers=whole.numbers)
        if turn.retries:
            response.headers[RETRIES_HEADER] = str(turn.retries)
    if header := degradation(labels, images):
        response.headers[DEGRADATION_HEADER] = header
    return response


def _params(entry: ModelEntry, options: dict[str, Any], grammar: Any, name: str) -> SamplingParams:
    return adapters_chosen(sampling(entry.sampling_defaults, options, grammar=grammar), entry.adapters, name)


def _check_num_ctx(entry: ModelEntry, num_ctx: int | None) -> None:
    if num_ctx is not None and entry.context_window and num_ctx > entry.context_window:
        raise RequestInvalid(
            f"options.num_ctx is {num_ctx}, but '{entry.id}' reads at most {entry.context_window} "
            "tokens of context", param="options.num_ctx",
        )


@blueprint.post("/api/chat")
async def chat() -> Response:
    sys_ = system()
    body = await read_body(OllamaChatRequest)
    out = OllamaStream("chat", body.model)
    if not body.model:
        raise RequestInvalid("model is required", param="model")
    keep_alive = _keep_alive(body)
    options = options_params(body.options)
    labels = [f"options.{k}" for k in options.ignored]
    messages = check_messages(body.messages or [])
    tools = function_tools(body.tools)
    grammar = _grammar(body.format, tools)
    template_kwargs = _think_kwargs(body.think)
    images = check_images(url for m in messages for url in m["images"])
    if body.logprobs:
        labels.append("logprobs")
    if not messages:
        return await _lifecycle_only(out, keep_alive)
    grant = await sys_.lease(body.model, "chat", keep_alive=keep_alive, exact=True)
    out.load_seconds = grant.load_seconds
    entry = grant.entry
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    _check_num_ctx(entry, options.num_ctx)
    vision = "vision" in entry.capabilities
    history = apply_default_system(_ollama_history(messages, vision), sys_.settings.system_prompt)
    prompt = ChatPrompt(tuple(history), tools, template_kwargs)
    params = _params(entry, options.sampling, grammar, body.model)
    return await _run(out, body.stream, entry, prompt, params, options.num_ctx, labels, 0 if vision else images,
                      (body.truncate is True, body.shift is True))


@blueprint.post("/api/generate")
async def generate() -> Response:
    sys_ = system()
    body = await read_body(OllamaGenerateRequest)
    out = OllamaStream("generate", body.model)
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
    labels = [f"options.{k}" for k in options.ignored]
    if body.context:
        labels.append("context")
    grammar = _grammar(body.format, ())
    template_kwargs = _think_kwargs(body.think)
    images = check_images(check_image(img, f"images[{k}]") for k, img in enumerate(body.images or ()))
    if body.logprobs:
        labels.append("logprobs")
    if not body.prompt:
        return await _lifecycle_only(out, keep_alive)
    grant = await sys_.lease(body.model, "completion", keep_alive=keep_alive, exact=True)
    out.load_seconds = grant.load_seconds
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
        if "vision" in entry.capabilities and body.images:
            urls = [("image", check_image(img, f"images[{k}]")) for k, img in enumerate(body.images)]
            turns[-1]["content"] = with_images([*urls, ("text", body.prompt)], "prompt")
            images = 0
        turns = apply_default_system(turns, sys_.settings.system_prompt)
        prompt = ChatPrompt(tuple(turns), (), template_kwargs)
    params = _params(entry, options.sampling, grammar, body.model)
    return await _run(out, body.stream, entry, prompt, params, options.num_ctx, labels, images,
                      (body.truncate is True, body.shift is True))
