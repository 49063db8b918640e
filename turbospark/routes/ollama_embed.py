"""Ollama's embedding routes, on the same embedding actors as ``/v1/embeddings``.

- ``POST /api/embed``: ``{model, input: string | [string], truncate?, dimensions?, options?,
  keep_alive?}`` -> ``{model, embeddings, total_duration, load_duration, prompt_eval_count}``.
  An empty input (``[]`` or ``""``) gives no embeddings, as Ollama does; with ``truncate: false``
  an input longer than the model reads is a 400.
- ``POST /api/embeddings`` (Ollama's older route): ``{model, prompt}`` -> ``{embedding}``; an
  empty prompt gives an empty embedding.

The same limits as the OpenAI route (2,048 inputs, 1 MiB); errors in Ollama's shape
``{"error": "..."}`` (400 bad input, 404 a name none of several embedding models answers to, 503
none known).  A stored embedding model not loaded yet loads when named (``load_duration``), and
stays for ``keep_alive`` after the request (Ollama's rule, as for chat: ``0`` unloads it at once;
an empty input only loads it); ``options`` (Ollama's runner settings) are accepted and named on
the ``x-anyllm-degradation`` header.
"""

from __future__ import annotations

import re

import time
from typing import Any

from quart import Blueprint, Response, g

from ..web.bodies import read_body
from ..wire.embedding_checks import check_dimensions, check_inputs, encode_vector, inputs_of, shorten
from ..actors.lifecycle import parse_keep_alive
from ..wire.embeddings import OllamaEmbeddingsRequest, OllamaEmbedRequest
from ._embedding import embed, embedding_model, json_body

blueprint = Blueprint("ollama_embed", __name__)

DEGRADATION_HEADER = "x-anyllm-degradation"


def _degradation(response: Response, options: dict[str, Any] | None) -> Response:
    if options:
        # option names come from the caller: only plain names go into a header
        named = sorted(k for k in options if re.fullmatch(r"[A-Za-z0-9_]{1,64}", k))
        labels = [f"options.{k}" for k in named] + (["options"] if len(named) < len(options) else [])
        response.headers[DEGRADATION_HEADER] = ", ".join(labels)
    return response


@blueprint.post("/api/embed")
async def embed_route() -> Response:
    began = time.monotonic()
    body = await read_body(OllamaEmbedRequest)
    inputs = [] if body.input is None or body.input == "" else inputs_of(body.input)
    check_inputs(inputs, allow_empty=True)
    check_dimensions(body.dimensions)
    keep_alive = parse_keep_alive(body.keep_alive)
    grant = await embedding_model(g.record.id, body.model, keep_alive)
    entry = grant.entry
    check_dimensions(body.dimensions, entry.dimensions, entry.matryoshka, entry.id)
    vectors: list[list[float]] = []
    tokens = 0
    if inputs:
        result = await embed(request_id=g.record.id, model=entry, inputs=inputs, truncate=body.truncate)
        vectors = [encode_vector(v, "float") for v in shorten(result.vectors, body.dimensions)]  # type: ignore[misc]
        tokens = result.prompt_tokens
    answer = {
        "model": entry.id,
        "embeddings": vectors,
        "total_duration": round((time.monotonic() - began) * 1e9),
        "load_duration": round(grant.load_seconds * 1e9),
        "prompt_eval_count": tokens,
    }
    return _degradation(await json_body(answer, numbers=sum(len(v) for v in vectors)), body.options)


@blueprint.post("/api/embeddings")
async def embeddings_route() -> Response:
    body = await read_body(OllamaEmbeddingsRequest)
    inputs = [body.prompt] if body.prompt else []
    check_inputs(inputs, field="prompt", allow_empty=True)
    entry = (await embedding_model(g.record.id, body.model, parse_keep_alive(body.keep_alive))).entry
    vector: list[float] = []
    if inputs:
        result = await embed(request_id=g.record.id, model=entry, inputs=inputs, truncate=True)
        vector = encode_vector(result.vectors[0], "float")  # type: ignore[assignment]
    return _degradation(await json_body({"embedding": vector}, numbers=len(vector)), body.options)
