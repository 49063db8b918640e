"""Ollama's ``POST /api/pull``: a catalogue model pulled into the store.

Not streamed, it answers ``{"status": "success"}`` once the model is in place (abandoned if the
server stops).  Streamed (the default), the pull runs on its own thread and reports progress as
NDJSON lines (a status line whenever the status changes, byte counts at most every percent);
the stream ends with ``success`` or an ``error`` line.  A client that leaves stops the pull at
its next report.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Blueprint, Response, request

from ..errors import NotFound, RequestInvalid
from ..web.app import json_response, system
from ..wire.codec import parse_json
from ..wire.ollama import ndjson
from ._ollama import named, ndjson_response, shelf

blueprint = Blueprint("ollama_pull", __name__)


class _Progress:
    """Pull progress from the pulling thread to the route: a status line whenever the status
    changes, and byte counts at most every percent."""

    def __init__(self, send: trio.MemorySendChannel[dict[str, Any]], token: Any, digest: str) -> None:
        self.send, self.token, self.digest = send, token, digest
        self.last: tuple[str, int] = ("", -1)

    def __call__(self, status: str, completed: int | None, total: int | None) -> None:
        step = int(100 * (completed or 0) / total) if total else -1
        if (status, step) == self.last:
            return
        self.last = (status, step)
        frame: dict[str, Any] = {"status": status}
        if total:
            frame |= {"digest": f"sha256:{self.digest}", "total": total, "completed": completed or 0}
        trio.from_thread.run(self.send.send, frame, trio_token=self.token)  # raises once the client left


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

    send, recv = trio.open_memory_channel[dict[str, Any]](16)
    token = trio.lowlevel.current_trio_token()
    outcome: list[BaseException] = []

    def work() -> None:
        report = _Progress(send, token, store.digest(name))
        try:
            report("pulling manifest", None, None)
            store.pull(name, report)
            report("verifying sha256 digest", None, None)
            report("writing manifest", None, None)
        except BaseException as exc:  # told to the stream, never raised into a bare thread
            outcome.append(exc)
        finally:  # channels are closed on the Trio side, never from this thread
            try:
                trio.from_thread.run_sync(send.close, trio_token=token)
            except trio.RunFinishedError:
                pass

    async def frames() -> AsyncIterator[bytes]:
        with recv:
            threading.Thread(target=work, name=f"pull:{name}", daemon=True).start()
            async for frame in recv:
                yield ndjson(frame)
            if outcome:
                exc = outcome[0]
                message = str(exc) if not isinstance(exc, (trio.BrokenResourceError, trio.Cancelled)) else "pull stopped"
                yield ndjson({"error": f"pull model failed: {message}"})
                return
            await sys_.refresh()
            yield ndjson({"status": "success"})

    return ndjson_response(frames())


@blueprint.get("/api/catalogue")
async def catalogue() -> Response:
    """What ``/api/pull`` can fetch (an empty list without a model store); not Ollama's."""
    store = system().shelf
    return json_response({"models": [{"name": n} for n in (store.catalogue() if store is not None else [])]})
