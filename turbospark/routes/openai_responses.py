"""``POST /v1/responses``: OpenAI's Responses API on the same generation core as chat.

Input items become a conversation (``message``, ``function_call``, ``function_call_output``;
``reasoning`` items are accepted and not re-rendered); ``instructions`` lead it.  Output is a list
of items on one output-index cursor: a ``reasoning`` item, ``message`` items and
``function_call`` items, in the order the model wrote them.

``previous_response_id`` continues a stored response: its conversation (its own output included)
comes before the new input, so the prompt repeats the previous one and the prefix cache finds it.
Responses are stored (``store`` defaults to true, as OpenAI's) in a bounded in-memory store;
``GET`` and ``DELETE /v1/responses/{id}`` read and remove them.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import attrs
from quart import Blueprint, Response, g, request

from ..turns.chat import TemplateMessage, apply_default_system, image_urls, text_of
from ..wire.codec import parse_json, structure
from ..turns.conversations import StoredResponse
from ..errors import NotFound, RequestInvalid
from ..messages import ChatPrompt, Delta, Failed, Finished, RequestRouted, ToolCall
from ..turns.structured import check_images, function_tools, grammar_for, select_tools
from ..wire.openai import ResponsesRequest
from ..web import sse as _sse
from ..web.app import exception_body, json_response, system
from ._generation import Completion, collect, events, generate_turn, start
from ._openai import DEGRADATION_HEADER, sampling_params, stream_response
from .openai_chat import DROPPED_IMAGES

blueprint = Blueprint("openai_responses", __name__)

DEFAULT_MAX_OUTPUT = 256


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text(content: Any, where: str) -> tuple[str, list[str]]:
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list) or not all(isinstance(p, Mapping) for p in content):
        raise RequestInvalid(f"{where}.content must be a string or an array of parts", param="input")
    for i, p in enumerate(content):
        if p.get("type") in ("input_text", "output_text", "text") and not isinstance(p.get("text"), str):
            raise RequestInvalid(f"{where}.content[{i}].text must be a string", param="input")
    text, _ = text_of(
        {"type": "text", "text": p["text"]} for p in content
        if p.get("type") in ("input_text", "output_text", "text") and isinstance(p.get("text"), str)
    )
    return text, image_urls(content)


def _items(items: str | list[dict[str, Any]]) -> tuple[list[TemplateMessage], list[str]]:
    """The input as template messages, and the image URLs it carried."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], []
    out: list[TemplateMessage] = []
    images: list[str] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestInvalid(
                    f"{where}.role must be one of 'user', 'assistant', 'system', 'developer', got {role!r}",
                    param="input",
                )
            text, urls = _text(item.get("content"), where)
            images += urls
            msg = {"role": "system" if role == "developer" else role, "content": text}
            if text:
                out.append(msg)
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, str):
                raise RequestInvalid(
                    f"{where}: a function_call item needs string name, call_id and arguments", param="input"
                )
            try:
                args: Any = json.loads(arguments)
            except json.JSONDecodeError:
                args = arguments
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if isinstance(output, list):
                output, _ = _text(output, where)
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise RequestInvalid(
                    f"{where}: a function_call_output item needs a string call_id and output", param="input"
                )
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # the model's earlier reasoning: not part of what it is shown again
        else:
            raise RequestInvalid(f"{where}.type {kind!r} is not a supported input item", param="input")
    return out, images


def _tools(body: ResponsesRequest) -> tuple[dict[str, Any], ...]:
    """Responses' flat function tools, in the chat shape the core takes."""
    nested = []
    for i, tool in enumerate(body.tools or ()):
        kind = tool.get("type", "function")
        if kind != "function":
            raise RequestInvalid(
                f"tools[{i}].type {kind!r} is not supported: this server runs function tools only",
                param="tools",
            )
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
        nested.append({"type": "function", "function": function})
    return function_tools(nested)


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _format(body: ResponsesRequest) -> tuple[dict[str, Any] | None, bool]:
    fmt = (body.text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise RequestInvalid("text.format.schema must be a JSON Schema object", param="text")
        return schema, False
    if kind == "json_object":
        return None, True
    if kind != "text":
        raise RequestInvalid(
            f"text.format.type must be one of 'text', 'json_object', 'json_schema', got {kind!r}", param="text"
        )
    return None, False


def _effort(body: ResponsesRequest) -> dict[str, Any]:
    effort = (body.reasoning or {}).get("effort")
    if effort is None:
        return {}
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise RequestInvalid(
            "reasoning.effort must be one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh', "
            f"got {effort!r}", param="reasoning",
        )
    return {"reasoning_effort": effort, "enable_thinking": effort not in ("none", "minimal")}


def _degradation(body: ResponsesRequest, images: int) -> str | None:
    labels = []
    if body.truncation == "auto":
        labels.append("truncation")
    for name in ("include", "background", "max_tool_calls", "top_logprobs", "prompt", "conversation"):
        if getattr(body, name):
            labels.append(name)
    header = ", ".join(labels)
    if images:
        header = f"{header}; {DROPPED_IMAGES}" if header else DROPPED_IMAGES
    return header or None


# --- output items ---------------------------------------------------------------------------

def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id, "type": "message", "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed" else [],
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id, "type": "reasoning",
        "summary": [{"type": "summary_text", "text": text}] if text else [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


def _call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "id": f"fc_{call.id}", "type": "function_call", "call_id": call.id, "name": call.name,
        "arguments": call.arguments if status == "completed" else "", "status": status,
    }


@attrs.define
class _Response:
    """One response being built: its envelope, its items, and (streaming) its events."""

    id: str
    model: str
    body: ResponsesRequest
    created_at: int = attrs.field(factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = attrs.field(factory=list)
    seq: int = 0
    open: dict[str, Any] | None = None  # the item being streamed
    open_text: str = ""

    def envelope(self, status: str, usage: dict[str, Any] | None = None,
                 finished: Finished | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = finished is not None and finished.finish_reason == "length"
        return {
            "id": self.id, "object": "response", "type": "response", "created_at": self.created_at,
            "status": status, "model": self.model,
            "output": list(self.output),
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id,
            "tools": b.tools or [],
            "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": b.text or {"format": {"type": "text"}},
            "reasoning": b.reasoning,
            "store": b.store is not False,
            "metadata": b.metadata or {},
            "usage": usage,
        }

    # --- events: one output-index cursor for every item ---------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _sse.event(kind, payload)

    def created(self) -> bytes:
        return self.event("response.created", response=self.envelope("in_progress"))

    def _index(self) -> int:
        return len(self.output)

    def text(self, delta: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self.close()
            self.open, self.open_text = _message_item(_new_id("msg"), "", "in_progress"), ""
            out.append(self.event("response.output_item.added", output_index=self._index(), item=self.open))
            out.append(self.event(
                "response.content_part.added", item_id=self.open["id"], output_index=self._index(),
                content_index=0, part={"type": "output_text", "text": "", "annotations": []},
            ))
        self.open_text += delta
        out.append(self.event(
            "response.output_text.delta", item_id=self.open["id"], output_index=self._index(),
            content_index=0, delta=delta, logprobs=[],
        ))
        return out

    def reasoning(self, delta: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self.close()
            self.open, self.open_text = _reasoning_item(_new_id("rs"), ""), ""
            out.append(self.event("response.output_item.added", output_index=self._index(), item=self.open))
        self.open_text += delta
        out.append(self.event(
            "response.reasoning_text.delta", item_id=self.open["id"], output_index=self._index(),
            content_index=0, delta=delta,
        ))
        return out

    def call(self, call: ToolCall) -> list[bytes]:
        out = self.close()
        index = self._index()
        item = _call_item(call)
        out += [
            self.event("response.output_item.added", output_index=index, item=_call_item(call, "in_progress")),
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=call.arguments),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        self.output.append(item)
        return out

    def close(self) -> list[bytes]:
        """Close the open item: its done events, then it joins the output."""
        if self.open is None:
            return []
        item, text, index = self.open, self.open_text, self._index()
        self.open = None
        if item["type"] == "message":
            done = _message_item(item["id"], text)
            part = done["content"][0]
            out = [
                self.event("response.output_text.done", item_id=item["id"], output_index=index,
                           content_index=0, text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index,
                           content_index=0, part=part),
            ]
        else:
            done = _reasoning_item(item["id"], text)
            out = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text)]
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        return out

    def whole(self, done: Completion) -> None:
        """The items of a finished generation, without events."""
        if done.reasoning[0]:
            self.output.append(_reasoning_item(_new_id("rs"), done.reasoning[0]))
        if done.texts[0]:
            self.output.append(_message_item(_new_id("msg"), done.texts[0]))
        self.output.extend(_call_item(c) for c in done.calls[0])


def _usage(fin: Finished) -> dict[str, Any]:
    return {
        "input_tokens": fin.prompt_tokens,
        "input_tokens_details": {"cached_tokens": fin.cached_tokens},
        "output_tokens": fin.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    }


def _status(fin: Finished) -> str:
    return "incomplete" if fin.finish_reason == "length" else "completed"


def _said(output: Sequence[Mapping[str, Any]]) -> list[TemplateMessage]:
    """A response's output as the assistant's turn, for the conversation it continues."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    reasoning = "".join(
        part["text"] for item in output if item["type"] == "reasoning" for part in item["content"]
    )
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": _loads(item["arguments"])}}
        for item in output if item["type"] == "function_call"
    ]
    turn: TemplateMessage = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = reasoning
    return [turn] if text or calls else []


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@blueprint.post("/v1/responses")
@blueprint.post("/responses")
async def create_response() -> Response:
    sys_ = system()
    body = structure(parse_json(await request.get_data()), ResponsesRequest)
    entry = await sys_.resolve(body.model, "chat")
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    history: tuple[TemplateMessage, ...] = ()
    if body.previous_response_id is not None:
        stored = sys_.responses.get(body.previous_response_id)
        if stored is None:
            raise NotFound(
                f"Previous response with id '{body.previous_response_id}' not found.",
                param="previous_response_id", code="previous_response_not_found",
            )
        history = stored.messages
    new, urls = _items(body.input)
    if not new and not history:
        raise RequestInvalid("input must hold at least one message or item", param="input")
    images = check_images(urls)
    conversation = [*history, *new]
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *conversation]
    else:
        messages = apply_default_system(conversation, sys_.settings.system_prompt)
    tools, required = select_tools(_tools(body), _tool_choice(body.tool_choice))
    schema, any_object = _format(body)
    grammar = grammar_for(
        json_schema=schema, json_object=any_object, tools=tools, call_required=required,
        parallel=body.parallel_tool_calls is True,
    )
    prompt = ChatPrompt(tuple(messages), tools, _effort(body))
    params = sampling_params(
        body, max_tokens=body.max_output_tokens or DEFAULT_MAX_OUTPUT,
        model_defaults=entry.sampling_defaults, grammar=grammar,
    )
    resp = _Response(_new_id("resp"), body.model or entry.id, body)

    def keep(fin: Finished) -> dict[str, Any]:
        final = resp.envelope(_status(fin), _usage(fin), fin)
        if body.store is not False:
            sys_.responses.put(resp.id, StoredResponse(final, (*conversation, *_said(resp.output))))
        return final

    guardrails = sys_.settings.guardrails
    if tools and guardrails.active:
        done = await generate_turn(
            request_id=g.record.id, model=entry.id, prompt=prompt, params=params, n=1,
            call_required=required, guardrails=guardrails, parallel=body.parallel_tool_calls is not False,
        )
        response = _buffered(resp, done, keep) if body.stream else None
        if response is None:
            resp.whole(done)
            response = json_response(keep(done.finished[0]))
    else:
        replies = await start(request_id=g.record.id, model=entry.id, prompt=prompt, params=params)
        if body.stream:
            response = _live(resp, replies, keep)
        else:
            done = await collect(replies)
            resp.whole(done)
            response = json_response(keep(done.finished[0]))
    if header := _degradation(body, images):
        response.headers[DEGRADATION_HEADER] = header
    return response


def _live(resp: _Response, replies: Any, keep: Any) -> Response:
    keepalive = system().settings.keepalive_interval  # read here: the body runs outside the app context

    async def frames() -> AsyncIterator[bytes]:
        yield resp.created()
        async for msg in events(replies, keepalive=keepalive):
            if msg is None:
                yield _sse.KEEPALIVE
            elif isinstance(msg, Delta):
                for frame in _delta_frames(resp, msg.reasoning, msg.text, msg.tool_calls):
                    yield frame
            elif isinstance(msg, Finished):
                for frame in resp.close():
                    yield frame
                yield resp.event("response.completed", response=keep(msg))
            else:
                assert isinstance(msg, Failed)
                error = exception_body(msg.error, "openai")["error"]
                yield resp.event("response.failed", response=resp.envelope("failed", error=error)
                                 | {"status_details": {"error": error}})

    return stream_response(frames())


def _delta_frames(resp: _Response, reasoning: str, text: str, calls: Sequence[ToolCall]) -> list[bytes]:
    out: list[bytes] = []
    if reasoning:
        out += resp.reasoning(reasoning)
    if text:
        out += resp.text(text)
    for call in calls:
        out += resp.call(call)
    return out


def _buffered(resp: _Response, done: Completion, keep: Any) -> Response:
    async def frames() -> AsyncIterator[bytes]:
        yield resp.created()
        for frame in _delta_frames(resp, done.reasoning[0], done.texts[0], done.calls[0]):
            yield frame
        for frame in resp.close():
            yield frame
        yield resp.event("response.completed", response=keep(done.finished[0]))

    return stream_response(frames())


@blueprint.get("/v1/responses/<path:response_id>")
@blueprint.get("/responses/<path:response_id>")
async def get_response(response_id: str) -> Response:
    stored = system().responses.get(response_id)
    if stored is None:
        raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
    return json_response(stored.body)


@blueprint.delete("/v1/responses/<path:response_id>")
@blueprint.delete("/responses/<path:response_id>")
async def delete_response(response_id: str) -> Response:
    if not system().responses.delete(response_id):
        raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})
