"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API on
the same generation core as chat.

The HTTP side only: parse, look up the stored response a ``previous_response_id`` continues,
translate (``openai_responses_request``), run the turn through the turn driver (``_turn``), and
send the response whole or as its events (``openai_responses_events``), both framed from the
same turn events.

``previous_response_id`` continues a stored response: its conversation (its own output included)
comes before the new input, so the prompt repeats the previous one and the prefix cache finds it.
Responses are stored (``store`` defaults to true, as OpenAI's) in a bounded in-memory store
(``System.responses``), written here when a response finishes.

``mcp`` tools name servers of ``serve --mcp-config``: their tools are listed (once per
conversation), offered to the model, and its calls to them run by the server (``_mcp``), the
approvals a request answers first; the response's output holds every step.
"""

from __future__ import annotations

from typing import Any


from quart import Blueprint, Response, g

from ..errors import NotFound, RequestInvalid
from ..actors.mcp import McpServers
from ..messages import ToolCall
from ..messages import RequestRouted
from ..turns.chat import TemplateMessage
from ..turns.conversations import StoredResponse
from ..turns.mcp_uses import McpOffer, responses_uses
from ..turns.sampling import adapters_chosen
from ..web.app import exception_body, json_response, system
from ..web.bodies import json_answer, read_body
from ..wire.openai import ResponsesRequest
from ._images import fetch_images
from ._openai import DEGRADATION_HEADER, degradation, sampling_params, stream_response
from ._mcp import MAX_CALLS, Approved, McpLoop, prepared
from ._turn import RETRIES_HEADER, TurnPlan, framed, open_turn
from .openai_responses_events import ResponseStream, new_id
from .openai_responses_request import DEFAULT_MAX_OUTPUT, plan, said, unhonoured

blueprint = Blueprint("openai_responses", __name__)


@blueprint.post("/v1/responses")
@blueprint.post("/responses")
async def create_response() -> Response:
    sys_ = system()
    body = await read_body(ResponsesRequest)
    entry = await sys_.resolve(body.model, "chat")
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    history: tuple[TemplateMessage, ...] = ()
    stored: StoredResponse | None = None
    if body.previous_response_id is not None:
        stored = sys_.responses.get(body.previous_response_id)
        if stored is None:
            raise NotFound(
                f"Previous response with id '{body.previous_response_id}' not found.",
                param="previous_response_id", code="previous_response_not_found",
            )
        history = stored.messages
    uses = responses_uses(body.tools, sys_.mcp.names, remote=sys_.settings.mcp_urls)
    servers, listings, mcp = await prepared(sys_.mcp, uses, "tools")
    p = plan(body, history, sys_.settings.system_prompt, "vision" in entry.capabilities, sys_.settings.image_urls,
             mcp_tools=mcp.tools)
    await fetch_images(p.prompt.messages)  # http(s) image URLs, where --image-urls allows them
    params = sampling_params(
        body, max_tokens=body.max_output_tokens or DEFAULT_MAX_OUTPUT,
        model_defaults=entry.sampling_defaults, grammar=p.grammar,
    )
    params = adapters_chosen(params, entry.adapters, body.model)

    def keep(final: dict[str, Any]) -> None:
        if body.store is not False:
            # only its own turns: the conversation it continues is the stored one's
            own = (*p.conversation[len(history):], *said(resp.output))
            sys_.responses.put(resp.id, StoredResponse(final, own, stored))

    resp = ResponseStream(new_id("resp"), body.model or entry.id, body, keep=keep, mcp=mcp.routes)
    turn_plan = TurnPlan(entry.id, p.prompt, params, call_required=p.call_required,
                         parallel=body.parallel_tool_calls is not False)
    if mcp or p.approvals:
        return await _with_mcp(body, turn_plan, p, mcp, resp, stored, listings, servers)
    turn = await open_turn(turn_plan, request_id=g.record.id, guardrails=sys_.settings.guardrails)
    if body.stream:
        response = stream_response(framed(
            turn, resp, keepalive=sys_.settings.keepalive_interval,
            error=lambda exc: resp.error(exception_body(exc, "openai")),
        ))
    else:
        whole = await turn.collect()
        response = await json_answer(resp.whole(whole), numbers=whole.numbers)
        if turn.retries:
            response.headers[RETRIES_HEADER] = str(turn.retries)
    if header := degradation(unhonoured(body), p.images):
        response.headers[DEGRADATION_HEADER] = header
    return response


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


async def _with_mcp(body: ResponsesRequest, turn_plan: TurnPlan, p: Any, mcp: McpOffer, resp: ResponseStream,
                    stored: StoredResponse | None, listings: dict[str, Any], servers: McpServers) -> Response:
    """A response whose turns may call MCP tools (``_mcp.McpLoop``)."""
    sys_ = system()
    earlier = {**_items_of(stored), **p.mcp_items}
    listed = {item["server_label"] for item in earlier.values() if item["type"] == "mcp_list_tools"}

    loop = McpLoop(
        turn_plan, mcp, servers, g.record.id, sys_.settings.guardrails,
        listed=[(use, listings[use.server]) for use in mcp.uses if use.label not in listed],
        approved=[_approved(request_id, approve, earlier, mcp) for request_id, approve in p.approvals],
        max_calls=body.max_tool_calls or MAX_CALLS,
        # a later turn forces no call; text.format's grammar, where the request set one, still holds
        text_format=p.grammar if p.grammar is not None and p.grammar.what == "response_format" else None,
    )
    await loop.start()
    if body.stream:
        response = stream_response(loop.frames(resp, keepalive=sys_.settings.keepalive_interval,
                                               error=lambda exc: resp.error(exception_body(exc, "openai"))))
    else:
        await loop.whole(resp)
        assert resp.result is not None
        response = json_response(resp.result)
    if header := degradation(unhonoured(body), p.images):
        response.headers[DEGRADATION_HEADER] = header
    return response


def _items_of(stored: StoredResponse | None) -> dict[str, dict[str, Any]]:
    """The output items of the responses a request continues, by id."""
    out: dict[str, dict[str, Any]] = {}
    while stored is not None:
        out = {item["id"]: item for item in stored.body.get("output", ()) if "id" in item} | out
        stored = stored.parent
    return out


def _approved(request_id: str, approve: bool, earlier: dict[str, dict[str, Any]], mcp: McpOffer) -> Approved:
    asked = earlier.get(request_id)
    if asked is None or asked["type"] != "mcp_approval_request":
        raise RequestInvalid(f"mcp_approval_response: no mcp_approval_request {request_id!r} in this conversation",
                             param="input")
    label, tool = asked["server_label"], asked["name"]
    name = next((n for n, r in mcp.routes.items() if (r.label, r.tool) == (label, tool)), None)
    if name is None:
        raise RequestInvalid(f"mcp_approval_response {request_id!r}: the tool {tool!r} of {label!r} is not among "
                             "this request's mcp tools", param="input")
    call = ToolCall(0, request_id.split("_", 1)[1], name, asked["arguments"])
    return Approved(call, mcp.routes[name], request_id, approve)
