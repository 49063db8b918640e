"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the same
generation core as chat (decisions/0013-anthropic-surface.md).

The HTTP side only: parse, translate (``anthropic_request``), start the generation, and send the
response whole or as its events (``anthropic_events``), both framed from the same turn events
of the turn driver (``_turn``): with tools offered, text streams as the model writes it and a
``tool_use`` block's input as ``input_json_delta`` pieces, pings while anything is held back.
``count_tokens`` renders the same prompt with the model's tokenizer, off the model thread: no
queue, no generation.  A prompt too long for the model, from Claude Code, is answered with the
flags that leave Claude Code's own system prompt and tools out (``CLAUDE_CODE_HINT``).
``mcp_servers`` (Anthropic's MCP connector) name servers of ``serve --mcp-config``: the model's
calls to their tools are run by the server (``_mcp``), each an ``mcp_tool_use`` block and its
``mcp_tool_result``, until the model answers.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import trio
from quart import Blueprint, Response, g, request

from ..errors import ContextOverflow, RequestInvalid, TurboSparkError
from ..messages import RequestRouted, Started
from ..threads.prompt import count_prompt
from ..turns.mcp_uses import anthropic_uses
from ..turns.sampling import adapters_chosen
from ..web.app import exception_body, json_response, system
from ..wire.anthropic import MessagesRequest
from ..web.bodies import read_json
from ..wire.codec import structure
from ._images import fetch_images
from ._openai import DEGRADATION_HEADER, degradation, stream_response
from ._mcp import McpLoop, prepared
from ._turn import RETRIES_HEADER, TurnPlan, framed, open_turn
from .anthropic_events import MessageStream
from .anthropic_request import default_max_tokens, normalise, plan, sampling_params, unhonoured

blueprint = Blueprint("anthropic", __name__)

#: Added to a context overflow's message for Claude Code, whose own prompt is the long part.
CLAUDE_CODE_HINT = (
    "Claude Code sends its own system prompt and tool definitions, longer than a small model's "
    "context: to leave them out, run `claude --bare -p \"...\" --system-prompt \"Be brief.\" --tools \"\"`."
)


def _from_claude_code() -> bool:
    """Claude Code says so in its User-Agent (``claude-cli/<version> (...)``) and its
    ``X-Claude-Code-Session-Id`` header; either is enough."""
    headers = request.headers
    return headers.get("user-agent", "").startswith("claude-cli/") or "x-claude-code-session-id" in headers


def _for_client(exc: TurboSparkError, claude_code: bool) -> TurboSparkError:
    return exc.hinted(CLAUDE_CODE_HINT) if claude_code and isinstance(exc, ContextOverflow) else exc


@contextmanager
def _hinting(claude_code: bool) -> Iterator[None]:
    """A context overflow raised inside, with Claude Code's hint when the client is Claude Code."""
    try:
        yield
    except ContextOverflow as exc:
        if not claude_code:
            raise
        raise exc.hinted(CLAUDE_CODE_HINT) from None


@blueprint.post("/v1/messages/count_tokens")
async def count_tokens() -> Response:
    sys_ = system()
    # the whole Messages body is accepted (clients send the request they will make); only what
    # makes up the prompt counts
    body = structure(normalise(await read_json()), MessagesRequest)
    entry = await sys_.resolve(body.model, "chat")
    p = plan(body, sys_.settings.system_prompt, "vision" in entry.capabilities, sys_.settings.image_urls)
    await fetch_images(p.messages)  # http(s) image URLs, where --image-urls allows them
    if entry.tokenizer is None:
        raise RequestInvalid("this model cannot count tokens")
    # exact up to 4 context windows, or EXACT_UP_TO characters; a prompt surely longer than
    # both is refused before it is all encoded
    with _hinting(_from_claude_code()):
        ids = await trio.to_thread.run_sync(
            partial(count_prompt, entry.tokenizer, p.prompt, 4 * entry.context_window,
                    window=entry.context_window, special_tokens_in_content=sys_.settings.special_tokens_in_content)
        )
    response = json_response({"input_tokens": len(ids)})
    if header := degradation([], p.images):
        response.headers[DEGRADATION_HEADER] = header
    return response


@blueprint.post("/v1/messages")
async def messages() -> Response:
    sys_ = system()
    body = structure(normalise(await read_json()), MessagesRequest)
    entry = await sys_.resolve(body.model, "chat")
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    uses = anthropic_uses(body.mcp_servers, body.tools, sys_.mcp.names, remote=sys_.settings.mcp_urls)
    servers, _, mcp = await prepared(sys_.mcp, uses, "mcp_servers")
    p = plan(body, sys_.settings.system_prompt, "vision" in entry.capabilities, sys_.settings.image_urls,
             mcp_tools=mcp.tools)
    await fetch_images(p.messages)  # http(s) image URLs, where --image-urls allows them
    p.labels += unhonoured(body)
    asked = body.max_tokens or default_max_tokens(entry.context_window)
    params = adapters_chosen(sampling_params(body, p, defaults=entry.sampling_defaults, max_tokens=asked),
                             entry.adapters, body.model)
    began: list[Started] = []
    turn_plan = TurnPlan(entry.id, p.prompt, params, call_required=p.call_required, parallel=p.parallel, clamp=True)
    claude_code = _from_claude_code()
    if mcp:
        return await _with_mcp(turn_plan, mcp, p, body, entry, claude_code, servers)
    with _hinting(claude_code):  # a refused prompt is a 400, streamed or not: nothing was sent
        turn = await open_turn(turn_plan, request_id=g.record.id, guardrails=sys_.settings.guardrails,
                               on_started=began.append)
    if began and asked > entry.context_window - began[0].prompt_tokens:
        p.labels.append("max_tokens_clamped")  # cut to what the context window leaves
    message = MessageStream("msg_" + secrets.token_hex(12), body.model or entry.id, p.cache_marked,
                            began[0] if began else None)
    if body.stream:
        response = stream_response(framed(
            turn, message, keepalive=sys_.settings.keepalive_interval,
            error=lambda exc: message.error(exception_body(_for_client(exc, claude_code), "anthropic")),
        ))
    else:
        with _hinting(claude_code):  # a corrective retry's longer prompt may be refused too
            response = json_response(message.whole(await turn.collect()))
        if turn.retries:
            response.headers[RETRIES_HEADER] = str(turn.retries)
    if header := degradation(p.labels, p.images):
        response.headers[DEGRADATION_HEADER] = header
    return response


async def _with_mcp(turn_plan: TurnPlan, mcp: Any, p: Any, body: MessagesRequest, entry: Any, claude_code: bool,
                    servers: Any) -> Response:
    """A message whose turns may call the MCP servers' tools (``_mcp.McpLoop``)."""
    sys_ = system()

    message = MessageStream("msg_" + secrets.token_hex(12), body.model or entry.id, p.cache_marked, mcp=mcp.routes)
    loop = McpLoop(turn_plan, mcp, servers, g.record.id, sys_.settings.guardrails)
    with _hinting(claude_code):
        await loop.start()
    if body.stream:
        response = stream_response(loop.frames(
            message, keepalive=sys_.settings.keepalive_interval,
            error=lambda exc: message.error(exception_body(_for_client(exc, claude_code), "anthropic"))))
    else:
        with _hinting(claude_code):
            await loop.whole(message)
        assert message.result is not None
        response = json_response(message.result)
    if header := degradation(p.labels, p.images):
        response.headers[DEGRADATION_HEADER] = header
    return response
