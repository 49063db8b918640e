"""Ollama's API: ``/api/chat`` and ``/api/generate`` on the same generation core as the OpenAI
routes, and model management (``/api/tags``, ``show``, ``ps``, ``pull``, ``delete``, ``copy``,
``version``, ``HEAD /``).

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
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio
from quart import Blueprint, Response, g, request

from .. import __version__
from ..turns.chat import TemplateMessage, apply_default_system
from ..wire.codec import parse_json, structure
from ..errors import ContextOverflow, ModelNotFound, NotFound, RequestInvalid, TurboSparkError
from ..actors.lifecycle import Loadable, parse_keep_alive
from ..messages import ChatPrompt, Delta, Failed, Finished, RequestRouted, Started, TextPrompt, ToolCall
from ..model.backend import SamplingParams
from ..actors.registry import ModelEntry
from ..turns.structured import check_images, function_tools, grammar_for
from ..wire.ollama import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    check_image,
    check_messages,
    created_at,
    ndjson,
    nanoseconds,
    options_params,
    rfc3339,
)
from ..web.app import json_response, system
from ._generation import Completion, collect, events, generate_turn, start
from ._openai import DEGRADATION_HEADER
from .openai_chat import DROPPED_IMAGES

blueprint = Blueprint("ollama", __name__)

NDJSON = "application/x-ndjson"
#: ``expires_at`` of a model kept forever
NEVER = "2318-08-02T00:00:00Z"


# --- the generation routes -----------------------------------------------------------------


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


def _ndjson_response(frames: AsyncIterator[bytes]) -> Response:
    response = Response(frames, content_type=NDJSON, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.timeout = None  # Quart would cut a stream after RESPONSE_TIMEOUT otherwise
    return response


def _buffered(turn: _Turn, done: Completion) -> Response:
    async def frames() -> AsyncIterator[bytes]:
        text, thinking, calls = done.texts[0], done.reasoning[0], done.calls[0]
        if thinking or text:
            yield ndjson(turn.piece(text, thinking))
        if calls:
            yield ndjson(turn.piece("", "", calls))
        turn.first = turn.first or turn.started
        yield ndjson(turn.final(done.finished[0], bool(calls)))

    return _ndjson_response(frames())


def _stream(turn: _Turn, replies: Any) -> Response:
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

    return _ndjson_response(frames())


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


# --- model management ----------------------------------------------------------------------


def _details(loadable: Loadable | None, entry: ModelEntry) -> dict[str, Any]:
    card = loadable.card if loadable is not None else None
    family = (card.family if card else "") or ("bert" if "embedding" in entry.capabilities else "")
    return {
        "parent_model": "",
        "format": card.format if card else ("safetensors" if "embedding" in entry.capabilities else ""),
        "family": family,
        "families": [family] if family else None,
        "parameter_size": card.parameter_size if card else "",
        "quantization_level": card.quantization_level if card else "",
    }


def _loadable(entry: ModelEntry) -> Loadable | None:
    return system().published.loadables.get(entry.id)


def _capabilities(entry: ModelEntry, loadable: Loadable | None) -> list[str]:
    if "embedding" in entry.capabilities:
        return ["embedding"]
    out = ["completion"]
    if "chat" in entry.capabilities:
        out.append("tools")
        template = loadable.card.template if loadable is not None else ""
        if "think" in template:
            out.append("thinking")
    return out


def _tag_row(entry: ModelEntry) -> dict[str, Any]:
    loadable = _loadable(entry)
    card = loadable.card if loadable is not None else None
    return {
        "name": entry.id,
        "model": entry.id,
        "modified_at": rfc3339(card.modified_at if card and card.modified_at else entry.created or time.time()),
        "size": loadable.size if loadable is not None else 0,
        "digest": card.digest if card else "",
        "details": _details(loadable, entry),
    }


def _named(body: Any) -> str:
    if not isinstance(body, dict):
        raise RequestInvalid("the request body must be a JSON object")
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise RequestInvalid("model is required", param="model")
    return name


async def _entry(name: str) -> ModelEntry:
    registry = await system().refresh()
    entry = registry.lookup(name) or (registry.lookup(name.removesuffix(":latest")) if name.endswith(":latest") else None)
    if entry is None:
        raise ModelNotFound(name, [])
    return entry


@blueprint.route("/", methods=["GET", "HEAD"])
async def root() -> Response:
    return Response("Ollama is running", content_type="text/plain; charset=utf-8")


@blueprint.get("/api/version")
async def version() -> Response:
    return json_response({"version": __version__})


@blueprint.get("/api/tags")
async def tags() -> Response:
    registry = await system().refresh()
    return json_response({"models": [_tag_row(e) for e in registry.entries]})


@blueprint.post("/api/show")
async def show() -> Response:
    entry = await _entry(_named(parse_json(await request.get_data())))
    loadable = _loadable(entry)
    card = loadable.card if loadable is not None else None
    info: dict[str, Any] = dict(card.model_info) if card and card.model_info else {}
    if not info:
        arch = "bert" if "embedding" in entry.capabilities else "turbospark"
        info = {"general.architecture": arch, f"{arch}.context_length": entry.context_window}
        if entry.dimensions:
            info[f"{arch}.embedding_length"] = entry.dimensions
    return json_response({
        "license": "",
        "modelfile": f"# Modelfile generated by turbospark\nFROM {entry.id}\n",
        "parameters": card.parameters if card else "",
        "template": card.template if card else "",
        "details": _details(loadable, entry),
        "model_info": info,
        "capabilities": _capabilities(entry, loadable),
        "modified_at": _tag_row(entry)["modified_at"],
    })


@blueprint.get("/api/ps")
async def ps() -> Response:
    rows = []
    for model in await system().running():
        rows.append(_tag_row(model.entry) | {
            "expires_at": NEVER if model.expires is None else rfc3339(model.expires),
            "size_vram": 0,  # MLX on CPU here: the weights are in ordinary memory
            "context_length": model.entry.context_window,
        })
    return json_response({"models": rows})


def _shelf() -> Any:
    shelf = system().shelf
    if shelf is None:
        raise RequestInvalid(
            "this server has no model store to manage (every --model is scripted); start it with "
            "a stored model to pull, copy or delete models"
        )
    return shelf


@blueprint.route("/api/delete", methods=["DELETE"])
async def delete() -> Response:
    sys_ = system()
    name = _named(parse_json(await request.get_data()))
    shelf = _shelf()
    entry = await _entry(name)
    loadable = _loadable(entry)
    if loadable is None or loadable.pinned:
        flag = "--embedding-model" if "embedding" in entry.capabilities else "--model"
        raise RequestInvalid(f"'{entry.id}' was named with {flag} when the server started; it cannot be deleted while it runs")
    await sys_.unload(entry.id)
    if not await trio.to_thread.run_sync(shelf.delete, entry.id):
        raise ModelNotFound(name, [])
    await sys_.refresh()
    return Response("", status=200)


@blueprint.post("/api/copy")
async def copy() -> Response:
    sys_ = system()
    body = parse_json(await request.get_data())
    if not isinstance(body, dict) or not isinstance(body.get("source"), str) or not isinstance(body.get("destination"), str):
        raise RequestInvalid("source and destination are required model names")
    shelf = _shelf()
    source = (await _entry(body["source"])).id
    try:
        copied = await trio.to_thread.run_sync(shelf.copy, source, body["destination"].removesuffix(":latest"))
    except Exception as exc:  # an invalid destination name
        raise RequestInvalid(str(exc), param="destination") from None
    if not copied:
        raise ModelNotFound(body["source"], [])
    await sys_.refresh()
    return Response("", status=200)


class _Progress:
    """Pull progress from the pulling thread to the route: a status line whenever the status
    changes, and byte counts at most every percent."""

    def __init__(self, send: trio.MemorySendChannel[dict[str, Any]], token: Any, digest: str) -> None:
        self.send, self.token, self.digest = send, token, digest
        self.last: tuple[str, int] = ("", -1)

    def __call__(self, status: str, completed: int | None, total: int | None) -> None:
        step = int(100 * (completed or 0) / total) if total else -1
        if (status, step) == self.last:
            return
        self.last = (status, step)
        frame: dict[str, Any] = {"status": status}
        if total:
            frame |= {"digest": f"sha256:{self.digest}", "total": total, "completed": completed or 0}
        trio.from_thread.run(self.send.send, frame, trio_token=self.token)  # raises once the client left


@blueprint.post("/api/pull")
async def pull() -> Response:
    sys_ = system()
    body = parse_json(await request.get_data())
    name = _named(body).removesuffix(":latest")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise RequestInvalid("stream must be true or false", param="stream")
    shelf = _shelf()
    if not shelf.can_pull(name):
        raise NotFound(
            f"pull model manifest: '{name}' is not in this server's catalogue; it can pull: "
            f"{', '.join(shelf.catalogue())}", param="model",
        )
    if not stream:
        # abandoned if the server stops: a pull is built in a scratch directory and renamed into
        # place when done, so leaving it half-way leaves nothing behind in the store
        await trio.to_thread.run_sync(shelf.pull, name, lambda *_: None, abandon_on_cancel=True)
        await sys_.refresh()
        return json_response({"status": "success"})

    send, recv = trio.open_memory_channel[dict[str, Any]](16)
    token = trio.lowlevel.current_trio_token()
    outcome: list[BaseException] = []

    def work() -> None:
        report = _Progress(send, token, shelf.digest(name))
        try:
            report("pulling manifest", None, None)
            shelf.pull(name, report)
            report("verifying sha256 digest", None, None)
            report("writing manifest", None, None)
        except BaseException as exc:  # told to the stream, never raised into a bare thread
            outcome.append(exc)
        finally:  # channels are closed on the Trio side, never from this thread
            try:
                trio.from_thread.run_sync(send.close, trio_token=token)
            except trio.RunFinishedError:
                pass

    async def frames() -> AsyncIterator[bytes]:
        with recv:
            threading.Thread(target=work, name=f"pull:{name}", daemon=True).start()
            async for frame in recv:
                yield ndjson(frame)
            if outcome:
                exc = outcome[0]
                message = str(exc) if not isinstance(exc, (trio.BrokenResourceError, trio.Cancelled)) else "pull stopped"
                yield ndjson({"error": f"pull model failed: {message}"})
                return
            await sys_.refresh()
            yield ndjson({"status": "success"})

    return _ndjson_response(frames())
