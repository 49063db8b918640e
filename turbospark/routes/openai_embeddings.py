"""``POST /v1/embeddings``: OpenAI's embeddings, from the embedding model the name resolves to.

Checked in the original server's order before any work: ``encoding_format``, an empty input, more
than 2,048 inputs, more than 1 MiB of text, ``dimensions`` of 0; then the model is resolved among
the embedding models (an unknown name, such as an SDK's ``text-embedding-3-small``, reaches the
only one; a stored one not loaded yet loads), and ``dimensions`` is checked against its width.  Inputs longer than the model reads
are truncated, as sentence-transformers does; ``usage.prompt_tokens`` counts the tokens the model
read (special tokens included).
"""

from __future__ import annotations

from quart import Blueprint, Response, g

from ..web.bodies import read_body
from ..wire.embedding_checks import check_dimensions, check_encoding_format, check_inputs, encode_vector, inputs_of, shorten
from ..wire.embeddings import EmbeddingRequest
from ._embedding import embed, embedding_model, json_body

blueprint = Blueprint("openai_embeddings", __name__)


@blueprint.post("/v1/embeddings")
@blueprint.post("/embeddings")
async def embeddings() -> Response:
    body = await read_body(EmbeddingRequest)
    encoding_format = check_encoding_format(body.encoding_format)
    inputs = inputs_of(body.input, ids=True)
    check_inputs(inputs)
    check_dimensions(body.dimensions)
    entry = (await embedding_model(g.record.id, body.model)).entry
    check_dimensions(body.dimensions, entry.dimensions, entry.matryoshka, entry.id)
    result = await embed(request_id=g.record.id, model=entry, inputs=inputs, truncate=True)
    vectors = shorten(result.vectors, body.dimensions)
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
        for i, v in enumerate(vectors)
    ]
    tokens = result.prompt_tokens
    return await json_body(
        {
            "object": "list",
            "data": data,
            "model": entry.id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
        numbers=vectors.size if encoding_format == "float" else 0,
    )
