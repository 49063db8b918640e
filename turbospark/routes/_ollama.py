"""What the Ollama routes share: the NDJSON streamed body, the model a management request
names, and the model store they manage."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio
from quart import Response

from ..actors.pulls import ProgressLines
from ..errors import RequestInvalid
from ..web.app import system
from ..wire.ollama import ndjson
from ._openai import stream_response

#: ``report(status, completed, total)``: how far store work is (``store/progress.py``'s ``Report``).
Report = Callable[[str, int | None, int | None], None]

__all__ = ["NDJSON", "named", "ndjson_response", "progress_frames", "shelf"]

NDJSON = "application/x-ndjson"


def ndjson_response(frames: AsyncIterator[bytes]) -> Response:
    return stream_response(frames, NDJSON)


def named(body: Any) -> str:
    """The model a management request names (``model``, or the older ``name``)."""
    if not isinstance(body, dict):
        raise RequestInvalid("the request body must be a JSON object")
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise RequestInvalid("model is required", param="model")
    return name


def shelf() -> Any:
    """The model store to pull into, copy in or delete from; refused without one."""
    found = system().shelf
    if found is None:
        raise RequestInvalid(
            "this server has no model store to manage (every --model is scripted); start it with "
            "a stored model to pull, copy or delete models"
        )
    return found


class _Progress:
    """Store work's progress lines (``ProgressLines``) from its thread to the route."""

    def __init__(self, send: trio.MemorySendChannel[dict[str, Any]], token: Any, digest: str) -> None:
        self.send, self.token, self.lines = send, token, ProgressLines(digest)

    def __call__(self, status: str, completed: int | None, total: int | None) -> None:
        frame = self.lines.line(status, completed, total)
        if frame is not None:
            trio.from_thread.run(self.send.send, frame, trio_token=self.token)  # raises once the client left


def progress_frames(
    job: Callable[[Report], object], *, done: Callable[[], Awaitable[object]], failure: str, thread: str,
    digest: str = "",
) -> AsyncIterator[bytes]:
    """Ollama's NDJSON progress of ``job(report)``, run on its own thread: its status lines, then
    ``success`` (after ``done()``) or one ``error`` line starting with ``failure``.  A client
    that leaves stops the job at its next report."""
    send, recv = trio.open_memory_channel[dict[str, Any]](16)
    token = trio.lowlevel.current_trio_token()
    outcome: list[BaseException] = []

    def work() -> None:
        try:
            job(_Progress(send, token, digest))
        except BaseException as exc:  # told to the stream, never raised into a bare thread
            outcome.append(exc)
        finally:  # channels are closed on the Trio side, never from this thread
            try:
                trio.from_thread.run_sync(send.close, trio_token=token)
            except trio.RunFinishedError:
                pass

    async def frames() -> AsyncIterator[bytes]:
        with recv:
            threading.Thread(target=work, name=thread, daemon=True).start()
            async for frame in recv:
                yield ndjson(frame)
            if outcome:
                exc = outcome[0]
                stopped = isinstance(exc, (trio.BrokenResourceError, trio.Cancelled))
                yield ndjson({"error": f"{failure}: {'stopped' if stopped else exc}"})
                return
            await done()
            yield ndjson({"status": "success"})

    return frames()
