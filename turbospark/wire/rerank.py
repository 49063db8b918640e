"""Rerank and score bodies (sans-io): the Jina/Cohere ``/v1/rerank`` shape that llama.cpp and
vLLM serve (with llama.cpp's TEI form, ``texts`` in and a bare list out) and vLLM's
``/v1/score`` (``text_1`` against ``text_2``).

Checked before any work: a query that is not a string, documents that are missing, empty, or
neither strings nor objects with a ``text``, ``top_n`` under 1: each a 400 naming the field.
Scores come back sorted, best first, cut to ``top_n``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ..errors import RequestInvalid

__all__ = [
    "MAX_DOCUMENTS", "RerankBody", "RerankRequest", "ScoreBody", "rerank_request", "rerank_response",
    "score_pairs", "score_response",
]

MAX_DOCUMENTS = 2048  # as many as an embeddings request may carry


@attrs.frozen(kw_only=True)
class RerankBody:
    """As read off the wire; ``rerank_request`` checks the loosely typed fields."""

    model: str | None = None
    query: Any = None
    documents: Any = None
    texts: Any = None  # TEI's name (llama.cpp serves it): the answer is then a bare list
    top_n: Any = None
    return_documents: bool | None = None
    return_text: bool | None = None  # TEI's name for return_documents
    truncate: bool | None = None
    raw_scores: bool | None = None


@attrs.frozen
class RerankRequest:
    model: str | None
    query: str
    documents: tuple[str, ...]
    originals: tuple[Any, ...]  # as the client sent them (strings or objects)
    top_n: int | None
    return_documents: bool
    tei: bool


def rerank_request(body: RerankBody) -> RerankRequest:
    if not isinstance(body.query, str) or not body.query:
        raise RequestInvalid("query must be a non-empty string", param="query")
    tei = body.documents is None and body.texts is not None
    field = "texts" if tei else "documents"
    given = body.texts if tei else body.documents
    if not isinstance(given, list) or not given:
        raise RequestInvalid(f"{field} must be a non-empty array of strings or of objects with a text", param=field)
    if len(given) > MAX_DOCUMENTS:
        raise RequestInvalid(f"{field} holds {len(given)} documents, more than {MAX_DOCUMENTS}", param=field)
    texts = []
    for i, doc in enumerate(given):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise RequestInvalid(f"{field}[{i}] must be a string or an object with a text string", param=field)
        texts.append(text)
    top_n = body.top_n
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise RequestInvalid(f"top_n must be an integer of at least 1, got {top_n!r}", param="top_n")
    wanted = body.return_text if tei else body.return_documents
    return RerankRequest(body.model, body.query, tuple(texts), tuple(given), top_n, bool(wanted), tei)


def rerank_response(req: RerankRequest, scores: Sequence[float], *, model: str, tokens: int) -> Any:
    """The answer: results sorted by score, best first (ties in document order), cut to
    ``top_n``; each with its index and, when asked for, its document as it came."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: req.top_n or len(scores)]
    if req.tei:
        return [
            {"index": i, "score": float(scores[i]), **({"text": req.documents[i]} if req.return_documents else {})}
            for i in order
        ]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if req.return_documents:
            doc = req.originals[i]
            result["document"] = doc if isinstance(doc, dict) else {"text": doc}
        results.append(result)
    return {
        "object": "list", "model": model, "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


@attrs.frozen(kw_only=True)
class ScoreBody:
    """vLLM's ``/v1/score``: ``text_1`` (one or many) against ``text_2`` (one or many)."""

    model: str | None = None
    text_1: Any = None
    text_2: Any = None
    truncate_prompt_tokens: int | None = None
    encoding_format: str | None = None
    user: str | None = None


def score_pairs(body: ScoreBody) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score, in order: one against many, or many against as many."""
    sides = []
    for name in ("text_1", "text_2"):
        value = getattr(body, name)
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(t, str) for t in items):
            raise RequestInvalid(f"{name} must be a string or a non-empty array of strings", param=name)
        if len(items) > MAX_DOCUMENTS:
            raise RequestInvalid(f"{name} holds {len(items)} texts, more than {MAX_DOCUMENTS}", param=name)
        sides.append(items)
    first, second = sides
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise RequestInvalid(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2",
            param="text_2",
        )
    return list(zip(first, second, strict=True))


def score_response(scores: Sequence[float], *, id: str, created: int, model: str, tokens: int) -> Any:
    return {
        "id": id, "object": "list", "created": created, "model": model,
        "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
