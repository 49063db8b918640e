"""``POST /v1/completions``: the legacy OpenAI text completion, with no chat template.

The prompt is encoded as is (with BOS where the model wants one), so base models such as Gemma 3
270M, which have no chat template, are served here.
"""

from __future__ import annotations

from quart import Blueprint, Response, g

from ..errors import RequestInvalid
from ..messages import RequestRouted, TextPrompt
from ..turns.grammars import demanded_grammar, peer_grammar
from ..turns.sampling import adapters_chosen
from ..turns.structured import function_tools, grammar_for, json_demand, select_tools
from ..wire.openai import CompletionRequest
from ..web.app import exception_body, system
from ..web.bodies import json_answer, read_body
from ._openai import DEGRADATION_HEADER, degradation, sampling_params, stream_response
from ._turn import TurnPlan, framed, open_turn
from .openai_chat_events import CompletionStream, Envelope, completion_whole

blueprint = Blueprint("openai_completions", __name__)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


def _prompt(body: CompletionRequest) -> str:
    if isinstance(body.prompt, str):
        return body.prompt
    if len(body.prompt) != 1:
        raise RequestInvalid(
            f"this server accepts exactly one prompt per request, got {len(body.prompt)}",
            param="prompt",
        )
    return body.prompt[0]


def _unhonoured(body: CompletionRequest) -> list[str]:
    return ["best_of"] if body.best_of not in (None, 1) else []


@blueprint.post("/v1/completions")
@blueprint.post("/completions")
async def completions() -> Response:
    sys_ = system()
    body = await read_body(CompletionRequest)
    entry = await sys_.resolve(body.model, "completion")
    sys_.emit(RequestRouted(g.record.id, body.model, entry.id, body.stream))
    if body.suffix is not None:
        raise RequestInvalid("suffix (fill-in-the-middle) is not supported", param="suffix")
    n = body.n or 1
    text = _prompt(body)
    if body.echo and body.logprobs is not None:
        raise RequestInvalid(
            "echo with logprobs is not supported: this server does not score prompt tokens",
            param="echo",
        )
    echoed = text if body.echo else ""
    tools, required = select_tools(function_tools(body.tools), body.tool_choice)
    schema, any_object = json_demand(body.response_format)
    grammar = grammar_for(
        json_schema=schema, json_object=any_object, tools=tools, call_required=required,
        parallel=body.parallel_tool_calls is True,
    )
    grammar = demanded_grammar(grammar, peer_grammar(body))
    params = sampling_params(
        body, max_tokens=body.max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS,
        model_defaults=entry.sampling_defaults, logprobs=body.logprobs, grammar=grammar,
    )
    params = adapters_chosen(params, entry.adapters, body.model, body.lora)
    # no template to replay a corrective turn on: the guardrails rescue, never retry
    plan = TurnPlan(entry.id, TextPrompt(text, tools), params, n, call_required=required)
    turn = await open_turn(plan, request_id=g.record.id, guardrails=sys_.settings.guardrails)
    env = Envelope.new("cmpl", body.model or entry.id, entry.fingerprint)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    framer = CompletionStream(env, n, body.logprobs, include_usage, echoed, return_progress=body.return_progress)
    if body.stream:
        response = stream_response(framed(
            turn, framer, keepalive=sys_.settings.keepalive_interval,
            error=lambda exc: framer.error(exception_body(exc, "openai")),
        ))
    else:
        whole = await turn.collect()
        response = await json_answer(completion_whole(framer, whole), numbers=whole.numbers)
    if header := degradation(_unhonoured(body), 0):
        response.headers[DEGRADATION_HEADER] = header
    return response
