"""``GET /status/feed``: the live status as server-sent events, for the web page.

Each frame is ``data: <snapshot>`` (``web/status.py``), one per ``interval`` seconds (``?interval=``,
0.2 to 10, default 1).  Between frames the route folds the observer's events as they arrive, so
a slow reader gets fewer snapshots, never stale counts, and never slows the observer (which
drops a subscriber whose buffer is full; the feed then subscribes again and counts a gap).
The stream ends when the client leaves, or when the server begins to shut down (it would
otherwise hold the graceful shutdown for its whole timeout).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Blueprint, Response, current_app, request

from ..errors import RequestInvalid
from ..web import sse
from ..web.app import request_scope, system
from ..web.status import StatusFold
from ._openai import stream_response

blueprint = Blueprint("status_feed", __name__)


def _interval() -> float:
    text = request.args.get("interval", "1")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.2 <= value <= 10:
        raise RequestInvalid(f"interval must be a number of seconds from 0.2 to 10, not {text!r}", param="interval")
    return value


def _loaded_row(model: Any) -> dict[str, Any]:
    return {"model": model.entry.id, "leases": model.requests, "expires": model.expires,
            "context_length": model.entry.context_window}  # fmt: skip


async def _cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


@blueprint.get("/status/feed")
async def feed() -> Response:
    sys_ = system()
    interval = _interval()
    draining = current_app.in_flight.draining  # type: ignore[attr-defined]
    fold = StatusFold()
    metrics, events = await sys_.watch()
    fold.seed(metrics.decode())
    request_scope().callback(lambda: events.close())  # also when the body never starts

    async def frames() -> AsyncIterator[bytes]:
        nonlocal events
        try:
            deadline = trio.current_time()
            while not draining.is_set():
                loaded = [_loaded_row(m) for m in await sys_.running()]
                yield sse.data(fold.snapshot(time.time(), loaded))
                deadline = max(deadline + interval, trio.current_time())
                async with trio.open_nursery() as wait:  # until the tick, or a shutdown
                    wait.start_soon(_cancel_on, draining, wait.cancel_scope)
                    with trio.move_on_at(deadline):
                        async for event in events:
                            fold.record(event, time.time())
                        # the observer dropped this feed (it fell behind): subscribe again
                        fold.gaps += 1
                        metrics, events = await sys_.watch()
                        fold.seed(metrics.decode())
                    wait.cancel_scope.cancel()
        finally:
            events.close()

    return stream_response(frames())
