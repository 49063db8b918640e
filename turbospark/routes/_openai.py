"""What the generation routes share: sampling parameters, usage, the degradation header, and the
streamed body (SSE, or Ollama's NDJSON)."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import attrs
from quart import Response

from ..messages import Delta, Failed, Finished, TokenLogprob
from ..model.backend import SamplingParams
from ..turns.structured import Grammar
from ..wire.openai import GenerationFields, ResponsesRequest
from ..web import sse as _sse
from ..web.app import exception_body
from ._generation import Replies, events

__all__ = [
    "DEGRADATION_HEADER", "DROPPED_IMAGES", "Envelope", "chat_logprobs", "degradation",
    "sampling_params", "sse_response", "stream_response", "usage",
]

# Parameters that were accepted but not honoured are named here (comma-separated).
DEGRADATION_HEADER = "x-anyllm-degradation"
DROPPED_IMAGES = (
    "this server's model has no vision tower, so image content parts were ignored; "
    "run it against an install whose checkpoint carries one"
)

_ids = itertools.count()


@attrs.frozen
class Envelope:
    """The id, creation time, model name and system fingerprint every object of one response
    carries."""

    id: str
    created: int
    model: str
    fingerprint: str

    @classmethod
    def new(cls, prefix: str, model: str, fingerprint: str) -> Envelope:
        now = int(time.time())
        return cls(f"{prefix}-{now}-{next(_ids)}", now, model, fingerprint)

    def wrap(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }


def sampling_params(
    body: GenerationFields | ResponsesRequest,
    *,
    max_tokens: int | None,
    model_defaults: Mapping[str, float],
    logprobs: int | None = None,
    grammar: Grammar | None = None,
) -> SamplingParams:
    """Each sampling field from the request, else the model's own default (its
    ``generation_config.json``), else the server's (``SamplingParams``' defaults)."""
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    given = {
        name: value
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty")
        if (value := getattr(body, name, None)) is not None
    }
    if max_tokens is not None:
        given["max_tokens"] = max_tokens
    bias = tuple((int(k), float(v)) for k, v in (getattr(body, "logit_bias", None) or {}).items())
    return SamplingParams(
        seed=body.seed,
        stop=tuple(stop),
        logit_bias=bias,
        logprobs=logprobs,
        grammar=grammar,
        **{**model_defaults, **given},
    )


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``logprobs`` object: one entry per token, with its bytes and alternatives."""

    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def usage(finished: list[Finished]) -> dict[str, Any]:
    """One usage for all choices: the prompt counted once, every choice's tokens."""
    prompt = finished[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finished)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": finished[0].cached_tokens},
    }


def sse_response(
    replies: Replies,
    body: GenerationFields,
    *,
    keepalive: float,
    n: int,
    opening: list[dict[str, Any]],
    pieces: Callable[[Delta, list[TokenLogprob]], list[dict[str, Any]]],
    finish: Callable[[Finished, bool, list[TokenLogprob]], dict[str, Any]],
) -> Response:
    """An OpenAI-style stream: ``opening`` chunks; the ``pieces`` chunks of each delta that
    shows something (given the log-probabilities of the tokens since the last chunk of its
    choice); each choice's ``finish`` chunk (given whether it made tool calls, and the tokens not
    yet reported); once all ``n`` choices have finished, with ``stream_options.include_usage``
    a chunk with no choices and the usage, then ``[DONE]``; a failure is one ``event: error``
    frame and no ``[DONE]``."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def frames() -> AsyncIterator[bytes]:
        for chunk in opening:
            yield _sse.data(chunk)
        finished: list[Finished] = []
        pending: list[list[TokenLogprob]] = [[] for _ in range(n)]
        called = [False] * n
        async for msg in events(replies, keepalive=keepalive, n=n):
            if msg is None:
                yield _sse.KEEPALIVE
            elif isinstance(msg, Delta):
                if msg.logprob is not None:
                    pending[msg.index].append(msg.logprob)
                called[msg.index] |= bool(msg.tool_calls)
                if msg.text or msg.reasoning or msg.tool_calls:
                    for chunk in pieces(msg, pending[msg.index]):
                        yield _sse.data(chunk)
                    pending[msg.index] = []
            elif isinstance(msg, Finished):
                last = finish(msg, called[msg.index], pending[msg.index])
                yield _sse.data(last)
                finished.append(msg)
                if len(finished) == n:
                    if include_usage:
                        yield _sse.data(last | {"choices": [], "usage": usage(finished)})
                    yield _sse.DONE
            else:
                assert isinstance(msg, Failed)
                yield _sse.event("error", exception_body(msg.error, "openai"))

    return stream_response(frames())


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
