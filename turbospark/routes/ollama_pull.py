"""Ollama's ``POST /api/pull``: a catalogue model pulled into the store.

Not streamed, it answers ``{"status": "success"}`` once the model is in place (abandoned if the
server stops).  Streamed (the default), the pull runs on its own thread and reports progress as
NDJSON lines (a status line whenever the status changes, byte counts at most every percent);
the stream ends with ``success`` or an ``error`` line.  A client that leaves stops the pull at
its next report.
"""

from __future__ import annotations

from typing import Any

import trio
from quart import Blueprint, Response, request

from ..errors import NotFound, RequestInvalid
from ..web.app import json_response, system
from ..wire.codec import parse_json
from ._ollama import named, ndjson_response, progress_frames, shelf

blueprint = Blueprint("ollama_pull", __name__)


@blueprint.post("/api/pull")
async def pull() -> Response:
    sys_ = system()
    body = parse_json(await request.get_data())
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
    if not stream:
        # abandoned if the server stops: a pull is built in a scratch directory and renamed into
        # place when done, so leaving it half-way leaves nothing behind in the store
        await trio.to_thread.run_sync(store.pull, name, lambda *_: None, abandon_on_cancel=True)
        await sys_.refresh()
        return json_response({"status": "success"})

    def work(report: Any) -> None:
        report("pulling manifest", None, None)
        store.pull(name, report)
        report("verifying sha256 digest", None, None)
        report("writing manifest", None, None)

    return ndjson_response(progress_frames(work, done=sys_.refresh, failure="pull model failed", thread=f"pull:{name}",
                                           digest=store.digest(name)))  # fmt: skip


@blueprint.get("/api/catalogue")
async def catalogue() -> Response:
    """What ``/api/pull`` can fetch (an empty list without a model store); not Ollama's."""
    store = system().shelf
    return json_response({"models": [{"name": n} for n in (store.catalogue() if store is not None else [])]})
