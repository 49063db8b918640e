"""``POST /v1/completions``: the legacy OpenAI text completion, with no chat template.

The prompt is encoded as is (with BOS where the model wants one), so base models such as Gemma 3
270M, which have no chat template, are served here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quart import Blueprint, Response, g, request

from ..wire.codec import parse_json, structure
from ..errors import RequestInvalid
from ..turns.guardrails import Rescued, inspect
from ..messages import RequestRouted, TextPrompt, TokenLogprob, ToolCall
from ..model.output import call_id
from ..turns.structured import function_tools, grammar_for, json_demand, select_tools
from ..wire.openai import CompletionRequest
from ..web.app import json_response, system
from ._generation import collect, start
from ._openai import DEGRADATION_HEADER, Envelope, sampling_params, sse_response, usage
from .openai_chat import call_wire

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


def _logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, alternatives as {token: logprob}."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def _degradation(body: CompletionRequest) -> str | None:
    return "best_of" if body.best_of not in (None, 1) else None


@blueprint.post("/v1/completions")
@blueprint.post("/completions")
async def completions() -> Response:
    sys_ = system()
    body = structure(parse_json(await request.get_data()), CompletionRequest)
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
    replies = await start(
        request_id=g.record.id,
        model=entry.id,
        prompt=TextPrompt(text, tools),
        params=sampling_params(
            body,
            max_tokens=body.max_tokens or DEFAULT_MAX_TOKENS,
            model_defaults=entry.sampling_defaults,
            logprobs=body.logprobs,
            grammar=grammar,
        ),
        n=n,
    )
    env = Envelope.new("cmpl", body.model or entry.id, entry.fingerprint)

    def choice(
        text: str, index: int, finish: str | None = None, entries: Sequence[TokenLogprob] = (),
        calls: Sequence[ToolCall] = (),
    ) -> dict[str, Any]:
        reported = _logprobs(entries) if body.logprobs is not None else None
        out = {"text": text, "index": index, "logprobs": reported, "finish_reason": finish}
        if calls:  # the chat shape's calls, beside the legacy text (an extension, as tools are)
            out["tool_calls"] = [{k: v for k, v in call_wire(c).items() if k != "index"} for c in calls]
            out["finish_reason"] = "tool_calls"
        return out

    if body.stream:
        response = sse_response(
            replies,
            body,
            keepalive=sys_.settings.keepalive_interval,
            n=n,
            opening=[env.wrap("text_completion", [choice(echoed, i)]) for i in range(n)] if echoed else [],
            pieces=lambda d, e: [env.wrap("text_completion", [choice(d.text, d.index, None, e, d.tool_calls)])]
            if d.text or d.tool_calls else [],
            finish=lambda f, called, e: env.wrap(
                "text_completion", [choice("", f.index, "tool_calls" if called else f.finish_reason, e)]
            ),
        )
    else:
        done = await collect(replies, n)
        if tools and sys_.settings.guardrails.rescue:  # no template to replay a retry: rescue only
            for i in range(n):
                verdict = inspect(content=done.texts[i], calls=done.calls[i], tools=tools,
                                  call_required=False, guardrails=sys_.settings.guardrails, new_id=call_id)
                if isinstance(verdict, Rescued):
                    done.texts[i], done.calls[i] = "", verdict.calls
        choices = [
            choice(echoed + text, i, fin.finish_reason, entries, calls)
            for i, (text, fin, entries, calls) in enumerate(
                zip(done.texts, done.finished, done.logprobs, done.calls, strict=True)
            )
        ]
        response = json_response(
            env.wrap("text_completion", choices) | {"usage": usage(done.finished)}
        )
    if header := _degradation(body):
        response.headers[DEGRADATION_HEADER] = header
    return response
