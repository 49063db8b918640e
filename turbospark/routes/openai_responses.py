"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API on
the same generation core as chat.

The HTTP side only: parse, look up the stored response a ``previous_response_id`` continues,
translate (``openai_responses_request``), start the generation, and send the response whole or
as its events (``openai_responses_events``).  A turn that offered tools (with the guardrails
on) is generated whole first, its stream then framed from the finished turn.

``previous_response_id`` continues a stored response: its conversation (its own output included)
comes before the new input, so the prompt repeats the previous one and the prefix cache finds it.
Responses are stored (``store`` defaults to true, as OpenAI's) in a bounded in-memory store
(``System.responses``), written here when a response finishes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint, Response, g, request

from ..errors import NotFound
from ..messages import Failed, Finished, RequestRouted
from ..turns.chat import TemplateMessage
from ..turns.conversations import StoredResponse
from ..web.app import exception_body, json_response, system
from ..wire.codec import parse_json, structure
from ..wire.openai import ResponsesRequest
from ._generation import Completion, Replies, collect, events, generate_turn, start
from ._openai import DEGRADATION_HEADER, degradation, sampling_params, stream_response
from .openai_responses_events import ResponseStream, new_id
from .openai_responses_request import DEFAULT_MAX_OUTPUT, plan, said, unhonoured

blueprint = Blueprint("openai_responses", __name__)


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
    p = plan(body, history, sys_.settings.system_prompt)
    params = sampling_params(
        body, max_tokens=body.max_output_tokens or DEFAULT_MAX_OUTPUT,
        model_defaults=entry.sampling_defaults, grammar=p.grammar,
    )
    resp = ResponseStream(new_id("resp"), body.model or entry.id, body)

    def keep(fin: Finished) -> dict[str, Any]:
        final = resp.final(fin)
        if body.store is not False:
            sys_.responses.put(resp.id, StoredResponse(final, (*p.conversation, *said(resp.output))))
        return final

    guardrails = sys_.settings.guardrails
    if p.prompt.tools and guardrails.active:
        done = await generate_turn(
            request_id=g.record.id, model=entry.id, prompt=p.prompt, params=params, n=1,
            call_required=p.call_required, guardrails=guardrails,
            parallel=body.parallel_tool_calls is not False,
        )
        if body.stream:
            response = stream_response(_buffered(resp, done, keep))
        else:
            resp.whole(done.reasoning[0], done.texts[0], done.calls[0])
            response = json_response(keep(done.finished[0]))
    else:
        replies = await start(request_id=g.record.id, model=entry.id, prompt=p.prompt, params=params)
        if body.stream:
            keepalive = sys_.settings.keepalive_interval  # read here: the body runs outside the app context
            response = stream_response(_live(resp, replies, keep, keepalive))
        else:
            done = await collect(replies)
            resp.whole(done.reasoning[0], done.texts[0], done.calls[0])
            response = json_response(keep(done.finished[0]))
    if header := degradation(unhonoured(body), p.images):
        response.headers[DEGRADATION_HEADER] = header
    return response


async def _live(resp: ResponseStream, replies: Replies, keep: Any, keepalive: float) -> AsyncIterator[bytes]:
    yield resp.created()
    async for msg in events(replies, keepalive=keepalive):
        if isinstance(msg, Finished):
            for frame in resp.close():
                yield frame
            yield resp.completed(keep(msg))
        elif isinstance(msg, Failed):
            yield resp.failed(exception_body(msg.error, "openai")["error"])
        else:
            for frame in resp.feed(msg):
                yield frame


async def _buffered(resp: ResponseStream, done: Completion, keep: Any) -> AsyncIterator[bytes]:
    yield resp.created()
    for frame in resp.parts(done.reasoning[0], done.texts[0], done.calls[0]):
        yield frame
    for frame in resp.close():
        yield frame
    yield resp.completed(keep(done.finished[0]))


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
