"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the same
generation core as chat.

The request is normalised as the reference does (a first ``system`` message promoted when there
is no top-level ``system``; any other role rewritten to ``user`` where it stands), translated
block by block into the conversation the chat template renders, and answered from the typed
output: ``thinking``, ``text`` and ``tool_use`` blocks.  ``count_tokens`` renders the same prompt
with the model's tokenizer, off the model thread: no queue, no generation.

Usage splits the prompt into disjoint parts from the prefix cache: ``cache_read_input_tokens``
were reused; when the request marks anything with ``cache_control`` the rest was written to the
cache (``cache_creation_input_tokens``), otherwise it is plain ``input_tokens``.
"""

from __future__ import annotations

import json
import logging
from functools import partial
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import attrs
import trio
from quart import Blueprint, Response, g, request

from ..turns.chat import TemplateMessage, apply_default_system
from ..wire.codec import parse_json, structure
from ..errors import GenerationFailed, RequestInvalid, TurboSparkError
from ..messages import ChatPrompt, Delta, Failed, Finished, RequestRouted, Started, ToolCall
from ..model._worker import render_prompt
from ..actors.registry import ModelEntry
from ..model.backend import SamplingParams
from ..turns.structured import Grammar, check_images, function_tools, grammar_for, select_tools
from ..wire.anthropic import CountTokensRequest, MessagesRequest
from ..web import sse as _sse
from ..web.app import exception_body, json_response, system
from ._generation import Completion, collect, events, start, turn
from ._openai import DEGRADATION_HEADER, stream_response
from .openai_chat import DROPPED_IMAGES

blueprint = Blueprint("anthropic", __name__)
log = logging.getLogger("turbospark")

# Server tools run by Anthropic's own servers: nothing here can run them.
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "xhigh"}
_USER_BLOCKS = {"text", "image", "tool_result", "document"}
_ASSISTANT_BLOCKS = {"text", "tool_use", "thinking", "redacted_thinking"}


@attrs.define
class _Plan:
    """A request translated: the conversation, tools and what is not honoured."""

    messages: list[TemplateMessage]
    tools: tuple[dict[str, Any], ...]
    call_required: bool
    parallel: bool
    template_kwargs: dict[str, Any]
    images: int = 0
    labels: list[str] = attrs.field(factory=list)
    cache_marked: bool = False


def normalise(raw: Any) -> Any:
    """The reference's normalisation, on the raw body: a leading ``system`` message becomes the
    top-level ``system`` when there is none (and more messages follow); any role other than
    ``user`` and ``assistant`` is rewritten to ``user`` where it stands."""
    if not isinstance(raw, dict) or not isinstance(raw.get("messages"), list):
        return raw
    messages = [dict(m) if isinstance(m, dict) else m for m in raw["messages"]]
    first = messages[0] if messages else None
    if (
        isinstance(first, dict) and str(first.get("role", "")).lower() == "system"
        and raw.get("system") is None and len(messages) > 1
    ):
        raw = {**raw, "system": first.get("content")}
        messages = messages[1:]
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"].lower() not in ("user", "assistant"):
            m["role"] = "user"
    return {**raw, "messages": messages}


def _marked(value: Any) -> bool:
    """Whether ``cache_control`` appears anywhere in a block structure."""
    if isinstance(value, Mapping):
        return value.get("cache_control") is not None or any(_marked(v) for v in value.values())
    if isinstance(value, list):
        return any(_marked(v) for v in value)
    return False


def _text_blocks(blocks: Sequence[Mapping[str, Any]], where: str) -> str:
    texts = []
    for b in blocks:
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise RequestInvalid(f"{where}: expected text blocks")
        texts.append(b["text"])
    return "\n".join(texts)


def _image_url(block: Mapping[str, Any], where: str) -> str:
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise RequestInvalid(f"{where}.source must be an object")
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise RequestInvalid(f"{where}.source.type {source.get('type')!r} is not supported (base64 or url)")


def _tool_result(block: Mapping[str, Any], where: str, urls: list[str]) -> TemplateMessage:
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise RequestInvalid(f"{where}.content[{i}] must be a content block")
            if part.get("type") == "image":
                urls.append(_image_url(part, f"{where}.content[{i}]"))
            elif part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise RequestInvalid(f"{where}.content[{i}]: a tool result holds text and image blocks")
        content = "\n".join(texts)
    if not isinstance(content, str) or not isinstance(block.get("tool_use_id"), str):
        raise RequestInvalid(f"{where}: a tool_result needs a tool_use_id and text content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _conversation(body: CountTokensRequest, labels: list[str]) -> tuple[list[TemplateMessage], list[str]]:
    out: list[TemplateMessage] = []
    urls: list[str] = []
    if body.system is not None:
        system_text = body.system if isinstance(body.system, str) else _text_blocks(body.system, "system")
        out.append({"role": "system", "content": system_text})
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        allowed = _USER_BLOCKS if m.role == "user" else _ASSISTANT_BLOCKS
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        results: list[TemplateMessage] = []
        for j, block in enumerate(m.content):
            kind, at = block["type"], f"{where}.content[{j}]"
            if kind not in allowed:
                raise RequestInvalid(f"{at}: a {kind!r} block is not supported in a {m.role} message")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise RequestInvalid(f"{at}.text must be a string")
                texts.append(block["text"])
            elif kind == "image":
                urls.append(_image_url(block, at))
            elif kind == "tool_result":
                results.append(_tool_result(block, at, urls))
            elif kind == "document":
                if "document_blocks" not in labels:
                    labels.append("document_blocks")
            elif kind == "tool_use":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise RequestInvalid(f"{at}: a tool_use block needs an id and a name")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input") or {}}})
            elif kind == "thinking" and isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        out.extend(results)
        if texts or calls:
            msg: TemplateMessage = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
            out.append(msg)
    return out, urls


def _tools(body: CountTokensRequest) -> tuple[dict[str, Any], ...]:
    nested = []
    server = []
    for i, tool in enumerate(body.tools or ()):
        kind = tool.get("type", "custom")
        if kind != "custom":
            server.append(f"{tool.get('name', '?')} ({kind})")
            continue
        if "input_schema" in tool and not isinstance(tool["input_schema"], dict):
            raise RequestInvalid(f"tools[{i}].input_schema must be a JSON Schema object")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        nested.append({"type": "function", "function": function})
    if server:
        raise RequestInvalid(
            "this server cannot run server tools: " + ", ".join(server)
            + "; offer them as client tools (with an input_schema) instead"
        )
    return function_tools(nested)


def _tool_choice(choice: Mapping[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool]:
    """The chat ``tool_choice`` and whether parallel calls are allowed."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise RequestInvalid('tool_choice.type must be "auto", "any", "tool" (with a name) or "none"')


def _effort(body: CountTokensRequest) -> dict[str, Any]:
    """``thinking`` and ``output_config.effort`` as the template's reasoning switches."""
    effort = None
    thinking = body.thinking or {}
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise RequestInvalid("thinking.budget_tokens must be a positive integer")
        effort = "low" if budget < 4000 else "medium" if budget < 16000 else "high"
    elif kind == "adaptive":
        effort = "medium"
    elif kind == "disabled":
        effort = "none"
    elif kind is not None:
        raise RequestInvalid('thinking.type must be "enabled", "adaptive" or "disabled"')
    wanted = (body.output_config or {}).get("effort")
    if wanted is not None:
        if not isinstance(wanted, str) or wanted not in _EFFORTS:
            raise RequestInvalid('output_config.effort must be "low", "medium", "high" or "max"')
        effort = _EFFORTS[wanted] if effort != "none" else effort
    if effort is None:
        return {}
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}


def plan(body: CountTokensRequest, default_system: str | None) -> _Plan:
    labels: list[str] = []
    if body.mcp_servers:
        raise RequestInvalid("mcp_servers is not supported: this server cannot connect to MCP servers")
    messages, urls = _conversation(body, labels)
    messages = apply_default_system(messages, default_system)
    images = check_images(urls)
    choice, parallel = _tool_choice(body.tool_choice)
    tools, required = select_tools(_tools(body), choice)
    if body.context_management:
        labels.append("context_management")
    if (body.thinking or {}).get("type") == "enabled":
        labels.append("thinking.budget_tokens")  # mapped to an effort, not enforced as a budget
    return _Plan(messages, tools, required, parallel, _effort(body), images, labels, _marked(attrs.asdict(body)))


def _header(labels: Sequence[str], images: int) -> str | None:
    header = ", ".join(labels)
    if images:
        header = f"{header}; {DROPPED_IMAGES}" if header else DROPPED_IMAGES
    return header or None


def _usage(fin: Finished, cache_marked: bool) -> dict[str, Any]:
    fresh = fin.prompt_tokens - fin.cached_tokens
    return {
        "input_tokens": 0 if cache_marked else fresh,
        "cache_creation_input_tokens": fresh if cache_marked else 0,
        "cache_read_input_tokens": fin.cached_tokens,
        "output_tokens": fin.completion_tokens,
    }


def _stop_reason(fin: Finished, called: bool) -> str:
    if called:
        return "tool_use"
    if fin.stop_reason == "StopString":
        return "stop_sequence"
    return "max_tokens" if fin.finish_reason == "length" else "end_turn"


def _tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": _tool_id(call), "name": call.name, "input": arguments}


def _tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _default_max_tokens(entry: ModelEntry) -> int:
    return max(1, min(entry.context_window // 2, 4096))


@blueprint.post("/v1/messages/count_tokens")
async def count_tokens() -> Response:
    sys_ = system()
    # the whole Messages body is accepted (clients send the request they will make); only what
    # makes up the prompt counts
    body = structure(normalise(parse_json(await request.get_data())), MessagesRequest)
    entry = await sys_.resolve(body.model, "chat")
    p = plan(body, sys_.settings.system_prompt)
    prompt = ChatPrompt(tuple(p.messages), p.tools, p.template_kwargs)
    if entry.tokenizer is None:
        raise RequestInvalid("this model cannot count tokens")
    # exact up to 4 context windows; a prompt surely longer is refused before it is all encoded
    ids, _ = await trio.to_thread.run_sync(
        partial(render_prompt, entry.tokenizer, prompt, 4 * entry.context_window,
                special_tokens_in_content=sys_.settings.special_tokens_in_content)
    )
    response = json_response({"input_tokens": len(ids)})
    if header := _header([], p.images):
        response.headers[DEGRADATION_HEADER] = header
    return response


@blueprint.post("/v1/messages")
async def messages() -> Response:
    sys_ = system()
    raw = normalise(parse_json(await request.get_data()))
    body = structure(raw, MessagesRequest)
    entry = await sys_.resolve(body.model, "chat")
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    p = plan(body, sys_.settings.system_prompt)
    if body.service_tier not in (None, "auto", "standard_only"):
        p.labels.append("service_tier")
    p.labels += [name for name in ("speed", "diagnostics", "inference_geo") if getattr(body, name) is not None]
    asked = body.max_tokens or _default_max_tokens(entry)
    params = _params(body, entry, asked, grammar_for(tools=p.tools, call_required=p.call_required, parallel=False))
    prompt = ChatPrompt(tuple(p.messages), p.tools, p.template_kwargs)
    began: list[Started] = []
    replies = await start(
        request_id=g.record.id, model=entry.id, prompt=prompt, params=params, clamp=True,
        on_started=began.append,
    )
    if began and asked > entry.context_window - began[0].prompt_tokens:
        p.labels.append("max_tokens_clamped")  # cut to what the context window leaves
    message = _Message("msg_" + secrets.token_hex(12), body.model or entry.id, p.cache_marked)
    keepalive = sys_.settings.keepalive_interval
    guardrails = sys_.settings.guardrails
    steps = (
        turn(replies, request_id=g.record.id, model=entry.id, prompt=prompt, params=params, n=1,
             call_required=p.call_required, guardrails=guardrails, parallel=p.parallel,
             keepalive=keepalive, clamp=True)
        if p.tools and guardrails.active else None
    )
    if body.stream:
        frames = _buffered(message, began, steps) if steps is not None else _live(message, began, replies, keepalive)
        response = stream_response(frames)
    else:
        if steps is not None:
            async with aclosing(steps) as items:
                done = [d async for d in items if d is not None][0]
        else:
            done = await collect(replies)
        response = json_response(message.whole(done))
    if header := _header(p.labels, p.images):
        response.headers[DEGRADATION_HEADER] = header
    return response


def _params(body: MessagesRequest, entry: ModelEntry, max_tokens: int, grammar: Grammar | None) -> SamplingParams:
    given = {
        name: value
        for name in ("temperature", "top_p", "top_k")
        if (value := getattr(body, name)) is not None
    }
    return SamplingParams(
        stop=tuple(s for s in body.stop_sequences or () if s),
        grammar=grammar,
        **{**entry.sampling_defaults, **given, "max_tokens": max_tokens},
    )


@attrs.define
class _Message:
    """One Messages response being built: the envelope, the blocks, the stream's block index."""

    id: str
    model: str
    cache_marked: bool
    index: int = 0
    open: str | None = None  # the type of the block being streamed

    def envelope(self, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def whole(self, done: Completion) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if done.reasoning[0]:
            content.append({"type": "thinking", "thinking": done.reasoning[0], "signature": ""})
        if done.texts[0]:
            content.append({"type": "text", "text": done.texts[0]})
        content += [_tool_use(c) for c in done.calls[0]]
        fin = done.finished[0]
        return self.envelope(content, _stop_reason(fin, bool(done.calls[0])), fin.stop_sequence,
                             _usage(fin, self.cache_marked))

    # --- the stream ------------------------------------------------------------------------

    def start(self, began: Sequence[Started]) -> bytes:
        """``message_start``, its usage split as the end will split it (the prefix-cache hit the
        model reported when it started)."""
        prompt, cached = (began[0].prompt_tokens, began[0].cached_tokens) if began else (0, 0)
        fresh = prompt - cached
        usage = {"input_tokens": 0 if self.cache_marked else fresh,
                 "cache_creation_input_tokens": fresh if self.cache_marked else 0,
                 "cache_read_input_tokens": cached, "output_tokens": 0}
        return _sse.event("message_start", {
            "type": "message_start", "message": self.envelope([], None, None, usage),
        })

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.open = kind
        out.append(_sse.event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block,
        }))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse.event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(_sse.event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        self.index += 1
        return out

    def parts(self, reasoning: str, text: str, calls: Sequence[ToolCall]) -> list[bytes]:
        out: list[bytes] = []
        if reasoning:
            if self.open != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if text:
            if self.open != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in calls:
            out += self._open("tool_use", {"type": "tool_use", "id": _tool_id(call), "name": call.name, "input": {}})
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            out += self.close()
        return out

    def end(self, fin: Finished, called: bool) -> list[bytes]:
        out = self.close()
        out.append(_sse.event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": _stop_reason(fin, called), "stop_sequence": fin.stop_sequence},
            "usage": _usage(fin, self.cache_marked),
        }))
        out.append(_sse.event("message_stop", {"type": "message_stop"}))
        return out


PING = _sse.event("ping", {"type": "ping"})


def _error(exc: Any) -> bytes:
    return _sse.event("error", exception_body(exc, "anthropic"))


async def _live(message: _Message, began: list[Started], replies: Any, keepalive: float) -> AsyncIterator[bytes]:
    yield message.start(began)
    yield PING
    called = False
    async for msg in events(replies, keepalive=keepalive):
        if msg is None:
            yield PING
        elif isinstance(msg, Delta):
            called |= bool(msg.tool_calls)
            for frame in message.parts(msg.reasoning, msg.text, msg.tool_calls):
                yield frame
        elif isinstance(msg, Finished):
            for frame in message.end(msg, called):
                yield frame
        else:
            assert isinstance(msg, Failed)
            yield _error(msg.error)


async def _buffered(message: _Message, began: list[Started], steps: AsyncIterator[Completion | None]) -> AsyncIterator[bytes]:
    """A tool turn: generated whole under the guardrails (pings meanwhile), then its blocks."""
    yield message.start(began)
    yield PING
    done = None
    try:
        async with aclosing(steps) as items:  # type: ignore[type-var]
            async for item in items:
                if item is None:
                    yield PING
                else:
                    done = item
    except TurboSparkError as exc:  # a retry the queue refused, a generation that failed
        yield _error(exc)
        return
    except Exception:
        error = GenerationFailed.new()
        log.exception("a tool turn failed (error id %s)", error.error_id)
        yield _error(error)
        return
    assert done is not None
    for frame in message.parts(done.reasoning[0], done.texts[0], done.calls[0]):
        yield frame
    for frame in message.end(done.finished[0], bool(done.calls[0])):
        yield frame
