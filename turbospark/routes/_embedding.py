"""How a route runs an embedding job: resolve the model (through the resolver, which loads a
stored embedding model when it is named, and keeps it for the request), hand the job to the
model's embedding actor, wait for the one answer, and write a (possibly large) JSON body without
holding up the event loop (``web/bodies.write_json``).

The reply channel's receive end is entered into the request scope first thing, so whatever ends
the request closes it, and the encoder thread drops the job at its next crossing, before the
job's next forward pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import trio
from quart import Response

from ..actors.registry import ModelEntry
from ..actors.resolution import Grant
from ..errors import ShuttingDown
from ..messages import EmbeddingJob, EmbeddingReply, Failed, RequestRouted, Vectors
from ..web.app import request_scope, system
from ..web.bodies import json_answer

__all__ = ["embed", "embedding_model", "json_body"]


async def embedding_model(request_id: int, name: str | None, keep_alive: float | None = None) -> Grant:
    """The embedding model ``name`` resolves to, loaded and held until the request ends; a
    request that leaves while it loads abandons its wait (the load stops if it was the last)."""
    sys_ = system()
    grant = await sys_.lease(name, "embedding", keep_alive=keep_alive)
    sys_.emit(RequestRouted(request_id, name, grant.entry.id, False))
    return grant


async def embed(
    *, request_id: int, model: ModelEntry, inputs: Sequence[str | tuple[int, ...]], truncate: bool,
    query: str | None = None,
) -> Vectors:
    """The vectors of ``inputs`` (texts, or token ids) from embedding model ``model`` (its entry,
    as resolved); with ``query``, their relevance to it instead (``(len(inputs), 1)``, see
    ``EmbeddingJob``).

    Raises what the actor or the encoder answered (``QueueFull``, ``RequestInvalid``,
    ``ShuttingDown`` ...).
    """
    reply_send, reply_recv = trio.open_memory_channel[EmbeddingReply](1)
    request_scope().enter_context(reply_recv)
    job = EmbeddingJob(request_id, model.id, tuple(inputs), truncate, reply_send, time.monotonic(), query)
    try:
        system().embed(model, job)
    except BaseException:
        reply_send.close()
        raise
    try:
        msg = await reply_recv.receive()
    except trio.EndOfChannel:
        raise ShuttingDown() from None
    if isinstance(msg, Failed):
        raise msg.error
    return msg


async def json_body(body: Any, numbers: int, status: int = 200) -> Response:
    """``body`` (vectors in it as numpy arrays) as a JSON response; written off the loop when it
    holds many numbers (a 2,048 x 384 answer took ~0.4 s of ``json.dumps``)."""
    return await json_answer(body, numbers=numbers, status=status)
