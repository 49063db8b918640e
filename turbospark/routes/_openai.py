"""What the generation routes share: the OpenAI families' sampling parameters, the
degradation header, and the streamed body (SSE, or Ollama's NDJSON)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence

from quart import Response

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
) -> SamplingParams:
    """An OpenAI-family request's sampling fields (``turns.sampling``: the request's, else the
    model's, else the server's)."""
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    given = {name: getattr(body, name, None) for name in _FIELDS} | {
        "max_tokens": max_tokens, "speculative": getattr(body, "speculative", None)}
    bias = tuple((int(k), float(v)) for k, v in (getattr(body, "logit_bias", None) or {}).items())
    return sampling(
        model_defaults, given, seed=body.seed, stop=tuple(stop), logit_bias=bias, logprobs=logprobs, grammar=grammar,
    )


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
