"""``POST /v1/rerank`` (also ``/rerank``, ``/v2/rerank``) and vLLM's ``/v1/score``: documents
scored against a query by the embedding model the name resolves to.

A cross-encoder (a stored ``BertForSequenceClassification``) reads each (query, document) pair;
an embedding model scores by the cosine similarity of the two vectors, and the answer says so in
the degradation header.  Either way the pairs of every request run in the encoder's shared
batches (``threads/encoder_thread.py``), and a request that leaves is dropped there before its
next batch, like an embeddings request.
"""

from __future__ import annotations

import time

import trio
from quart import Blueprint, Response, g

from ..actors.registry import ModelEntry
from ..messages import Vectors
from ..web.bodies import read_body
from ..wire.rerank import RerankBody, ScoreBody, rerank_request, rerank_response, score_pairs, score_response
from ._embedding import embed, embedding_model, json_body
from ._openai import DEGRADATION_HEADER

blueprint = Blueprint("rerank", __name__)

BY_SIMILARITY = (
    "relevance_score: cosine similarity of embeddings; this model is not a cross-encoder, "
    "load one (a BertForSequenceClassification) for trained relevance scores"
)


@blueprint.post("/v1/rerank")
@blueprint.post("/v2/rerank")
@blueprint.post("/rerank")
async def rerank() -> Response:
    body = await read_body(RerankBody)
    req = rerank_request(body)
    entry = (await embedding_model(g.record.id, req.model)).entry
    result = await _scores(entry, req.query, req.documents, truncate=body.truncate is not False)
    answer = rerank_response(req, result.vectors[:, 0].tolist(), model=entry.id, tokens=result.prompt_tokens)
    return _marked(await json_body(answer, numbers=0), result)


@blueprint.post("/v1/score")
@blueprint.post("/score")
async def score() -> Response:
    body = await read_body(ScoreBody)
    pairs = score_pairs(body)
    entry = (await embedding_model(g.record.id, body.model)).entry
    # one job per distinct text_1 (its pairs batch together), all of them at once
    groups: dict[str, list[int]] = {}
    for i, (first, _) in enumerate(pairs):
        groups.setdefault(first, []).append(i)
    scores = [0.0] * len(pairs)
    results: list[Vectors] = []

    async def run(first: str, indices: list[int]) -> None:
        result = await _scores(entry, first, [pairs[i][1] for i in indices], truncate=True)
        for row, i in enumerate(indices):
            scores[i] = float(result.vectors[row, 0])
        results.append(result)

    async with trio.open_nursery() as nursery:
        for first, indices in groups.items():
            nursery.start_soon(run, first, indices)
    tokens = sum(r.prompt_tokens for r in results)
    answer = score_response(scores, id=f"score-{g.record.id}", created=int(time.time()), model=entry.id, tokens=tokens)
    return _marked(await json_body(answer, numbers=0), *results)


async def _scores(entry: ModelEntry, query: str, documents: tuple[str, ...] | list[str], *, truncate: bool) -> Vectors:
    return await embed(request_id=g.record.id, model=entry, inputs=documents, truncate=truncate, query=query)


def _marked(response: Response, *results: Vectors) -> Response:
    if any(r.by_similarity for r in results):
        response.headers[DEGRADATION_HEADER] = BY_SIMILARITY
    return response
