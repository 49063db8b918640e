"""What the generation routes share: the OpenAI families' sampling parameters, the
degradation header, and the streamed body (SSE, or Ollama's NDJSON)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence

import attrs
from quart import Response

from ..errors import RequestInvalid
from ..model.backend import SamplingParams
from ..turns.sampling import sampling
from ..turns.structured import Grammar
from ..wire.openai import GenerationFields, ResponsesRequest

__all__ = ["DEGRADATION_HEADER", "DROPPED_IMAGES", "degradation", "sampling_params", "stream_response"]

# Parameters that were accepted but not honoured are named here (comma-separated).
DEGRADATION_HEADER = "x-anyllm-degradation"
DROPPED_IMAGES = (
    "this server's model has no vision tower, so image content parts were ignored; "
    "run it against an install whose checkpoint carries one"
)
_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def sampling_params(
    body: GenerationFields | ResponsesRequest,
    *,
    max_tokens: int | None,
    model_defaults: Mapping[str, float],
    logprobs: int | None = None,
    grammar: Grammar | None = None,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """An OpenAI-family request's sampling fields (``turns.sampling``: the request's, else the
    model's, else the server's).  ``max_tokens``: the budget the request gave, if any;
    ``default_max_tokens``: the route's own default budget, if it has one.

    ``min_tokens`` (chat and completions) may not exceed a budget the request gave (a 400 naming
    it, as vLLM answers); a default budget grows to it instead.
    """
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    least = getattr(body, "min_tokens", 0)
    if max_tokens is not None and least > max_tokens:
        budget = "max_tokens" if getattr(body, "max_tokens", None) is not None else "max_completion_tokens"
        raise RequestInvalid(f"min_tokens ({least}) must not exceed {budget} ({max_tokens})", param="min_tokens")
    if max_tokens is None and default_max_tokens is not None:
        max_tokens = max(default_max_tokens, least)
    given = {name: getattr(body, name, None) for name in _FIELDS} | {
        "max_tokens": max_tokens, "speculative": getattr(body, "speculative", None)}
    bias = tuple((int(k), float(v)) for k, v in (getattr(body, "logit_bias", None) or {}).items())
    params = sampling(
        model_defaults, given, seed=body.seed, stop=tuple(stop), logit_bias=bias, logprobs=logprobs, grammar=grammar,
        min_tokens=least, ignore_eos=getattr(body, "ignore_eos", False),
        reasoning_budget=getattr(body, "thinking_token_budget", None),
    )
    return params if params.max_tokens >= least else attrs.evolve(params, max_tokens=least)


def degradation(labels: Sequence[str], images: int) -> str | None:
    """The degradation header: the labels, then (after ``; ``) why images were dropped."""
    header = ", ".join(labels)
    if images:
        header = f"{header}; {DROPPED_IMAGES}" if header else DROPPED_IMAGES
    return header or None


def stream_response(frames: AsyncIterator[bytes], content_type: str = "text/event-stream") -> Response:
    """A streamed body: never cached or buffered by a proxy, never cut by Quart's timeout."""
    response = Response(
        frames,
        content_type=content_type,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None  # Quart would cut a stream after RESPONSE_TIMEOUT otherwise
    return response
