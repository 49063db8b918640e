"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the same
generation core as chat (decisions/0013-anthropic-surface.md).

The HTTP side only: parse, translate (``anthropic_request``), start the generation, and send the
response whole or as its events (``anthropic_events``).  ``count_tokens`` renders the same prompt
with the model's tokenizer, off the model thread: no queue, no generation.  A streamed tool turn
under the guardrails is generated whole (pings meanwhile) and then framed as blocks; any other
stream is live.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial

import trio
from quart import Blueprint, Response, g, request

from ..errors import GenerationFailed, RequestInvalid, TurboSparkError
from ..messages import Failed, RequestRouted, Started
from ..model._worker import render_prompt
from ..web.app import exception_body, json_response, system
from ..wire.anthropic import MessagesRequest
from ..wire.codec import parse_json, structure
from ._generation import Completion, Replies, collect, events, start, turn
from ._openai import DEGRADATION_HEADER, degradation, stream_response
from .anthropic_events import MessageStream
from .anthropic_request import default_max_tokens, normalise, plan, sampling_params, unhonoured

blueprint = Blueprint("anthropic", __name__)
log = logging.getLogger("turbospark")


@blueprint.post("/v1/messages/count_tokens")
async def count_tokens() -> Response:
    sys_ = system()
    # the whole Messages body is accepted (clients send the request they will make); only what
    # makes up the prompt counts
    body = structure(normalise(parse_json(await request.get_data())), MessagesRequest)
    entry = await sys_.resolve(body.model, "chat")
    p = plan(body, sys_.settings.system_prompt)
    if entry.tokenizer is None:
        raise RequestInvalid("this model cannot count tokens")
    # exact up to 4 context windows; a prompt surely longer is refused before it is all encoded
    ids, _ = await trio.to_thread.run_sync(
        partial(render_prompt, entry.tokenizer, p.prompt, 4 * entry.context_window,
                special_tokens_in_content=sys_.settings.special_tokens_in_content)
    )
    response = json_response({"input_tokens": len(ids)})
    if header := degradation([], p.images):
        response.headers[DEGRADATION_HEADER] = header
    return response


@blueprint.post("/v1/messages")
async def messages() -> Response:
    sys_ = system()
    body = structure(normalise(parse_json(await request.get_data())), MessagesRequest)
    entry = await sys_.resolve(body.model, "chat")
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    p = plan(body, sys_.settings.system_prompt)
    p.labels += unhonoured(body)
    asked = body.max_tokens or default_max_tokens(entry.context_window)
    params = sampling_params(body, p, defaults=entry.sampling_defaults, max_tokens=asked)
    prompt = p.prompt
    began: list[Started] = []
    replies = await start(
        request_id=g.record.id, model=entry.id, prompt=prompt, params=params, clamp=True,
        on_started=began.append,
    )
    if began and asked > entry.context_window - began[0].prompt_tokens:
        p.labels.append("max_tokens_clamped")  # cut to what the context window leaves
    message = MessageStream("msg_" + secrets.token_hex(12), body.model or entry.id, p.cache_marked)
    keepalive = sys_.settings.keepalive_interval
    guardrails = sys_.settings.guardrails
    steps = (
        turn(replies, request_id=g.record.id, model=entry.id, prompt=prompt, params=params, n=1,
             call_required=p.call_required, guardrails=guardrails, parallel=p.parallel,
             keepalive=keepalive, clamp=True)
        if p.tools and guardrails.active else None
    )
    first = began[0] if began else None
    if body.stream:
        frames = _buffered(message, first, steps) if steps is not None else _live(message, first, replies, keepalive)
        response = stream_response(frames)
    else:
        if steps is not None:
            async with aclosing(steps) as items:
                done = [d async for d in items if d is not None][0]
        else:
            done = await collect(replies)
        response = json_response(message.whole(done.reasoning[0], done.texts[0], done.calls[0], done.finished[0]))
    if header := degradation(p.labels, p.images):
        response.headers[DEGRADATION_HEADER] = header
    return response


def _error(message: MessageStream, exc: TurboSparkError) -> bytes:
    return message.error(exception_body(exc, "anthropic"))


async def _live(message: MessageStream, began: Started | None, replies: Replies, keepalive: float) -> AsyncIterator[bytes]:
    for frame in message.start(began):
        yield frame
    async for msg in events(replies, keepalive=keepalive):
        if isinstance(msg, Failed):
            yield _error(message, msg.error)
        else:
            for frame in message.feed(msg):
                yield frame


async def _buffered(message: MessageStream, began: Started | None,
                    steps: AsyncIterator[Completion | None]) -> AsyncIterator[bytes]:
    """A tool turn: generated whole under the guardrails (pings meanwhile), then its blocks."""
    for frame in message.start(began):
        yield frame
    done = None
    try:
        async with aclosing(steps) as items:  # type: ignore[type-var]
            async for item in items:
                if item is None:
                    for frame in message.feed(None):
                        yield frame
                else:
                    done = item
    except TurboSparkError as exc:  # a retry the queue refused, a generation that failed
        yield _error(message, exc)
        return
    except Exception:
        error = GenerationFailed.new()
        log.exception("a tool turn failed (error id %s)", error.error_id)
        yield _error(message, error)
        return
    assert done is not None
    for frame in message.turn(done.reasoning[0], done.texts[0], done.calls[0], done.finished[0]):
        yield frame
