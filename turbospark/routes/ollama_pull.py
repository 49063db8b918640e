"""Ollama's ``POST /api/pull``: a catalogue model pulled into the store.

Every pull is a job of the pulls actor (``actors/pulls.py``): one per model, at most two at
once, shared by every request for that model.  Not streamed, it answers ``{"status":
"success"}`` once the model is in place.  Streamed (the default), it sends progress as NDJSON
lines (a status line whenever the status changes, byte counts at most every percent) and ends
with ``success`` or an ``error`` line.  A pull whose requesters have all left stops at its next
report.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio
from quart import Blueprint, Response

from ..actors.pulls import Pull, PullFailed, Pulled
from ..errors import NotFound, RequestInvalid, ShuttingDown
from ..web.app import json_response, request_scope, system
from ..web.bodies import read_json
from ..wire.ollama import ndjson
from ._ollama import named, ndjson_response, shelf

blueprint = Blueprint("ollama_pull", __name__)


@blueprint.post("/api/pull")
async def pull() -> Response:
    sys_ = system()
    body = await read_json()
    name = named(body).removesuffix(":latest")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise RequestInvalid("stream must be true or false", param="stream")
    store = shelf()
    if not store.can_pull(name):
        raise NotFound(
            f"pull model manifest: '{name}' is not in this server's catalogue; it can pull: "
            f"{', '.join(store.catalogue())}", param="model",
        )
    assert sys_.pulls is not None  # a server with a model store runs the pulls actor
    send, frames = trio.open_memory_channel[Any](256)
    request_scope().enter_context(frames)  # a client that leaves lets go of the pull
    await sys_.pulls.send(Pull(name, store.digest(name), send))
    if not stream:
        async for item in frames:
            if isinstance(item, PullFailed):
                raise item.error
            if isinstance(item, Pulled):
                await sys_.refresh()
                return json_response({"status": "success"})
        raise ShuttingDown()
    return ndjson_response(_streamed(frames, sys_.refresh))


async def _streamed(frames: trio.MemoryReceiveChannel[Any], refresh: Callable[[], Awaitable[Any]]) -> AsyncIterator[bytes]:
    """The pull's lines as the body streams (outside the app context: ``refresh`` is the
    system's, taken before)."""
    async for item in frames:
        if isinstance(item, PullFailed):
            yield ndjson({"error": f"pull model failed: {item.error}"})
            return
        if isinstance(item, Pulled):
            await refresh()
            yield ndjson({"status": "success"})
            return
        yield ndjson(item)
    yield ndjson({"error": "pull model failed: stopped (the server is shutting down)"})


@blueprint.get("/api/catalogue")
async def catalogue() -> Response:
    """What ``/api/pull`` can fetch (an empty list without a model store); not Ollama's."""
    store = system().shelf
    return json_response({"models": [{"name": n} for n in (store.catalogue() if store is not None else [])]})
