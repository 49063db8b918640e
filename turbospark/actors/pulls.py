"""The pulls actor: every model pull (``/api/pull``) is one of its jobs.

    pulls            inbox: Pull
    └── one task × model being pulled, holding one of MAX_PULLS places; its worker thread
        (``to_thread``) runs the store's pull and reports through ``from_thread``

- **One job per model.**  A request for a model already being pulled joins its job and hears its
  progress from then on (the latest line first), instead of racing it into the store.
- **Bounded.**  At most ``MAX_PULLS`` pulls run at once; pulls of other models wait their turn.
- **Cancellable.**  A job whose requesters have all left stops at its next report, and every
  job stops at shutdown; the store builds a pull in a scratch directory, so nothing half-written
  is left.  A requester that stops reading (its channel full) is let go, not waited for.

Each requester's channel gets progress lines (Ollama's: a status line whenever the status
changes, byte counts at most every percent), then ``Pulled`` or ``PullFailed``; it is closed at
the end (closed without either: the server is stopping).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio

__all__ = ["MAX_PULLS", "ProgressLines", "Pull", "PullFailed", "Pulled", "pulls"]

MAX_PULLS = 2  # pulls running at once (each downloads and converts a model)

#: ``run_pull(name, report)``: the store's pull; ``report(status, completed, total)``
RunPull = Callable[[str, Callable[[str, int | None, int | None], None]], Any]


@attrs.frozen
class Pulled:
    pass


@attrs.frozen
class PullFailed:
    error: BaseException


@attrs.frozen
class Pull:
    """Pull ``name`` (or join its pull); ``frames`` hears how it goes.  ``digest``: its weights'
    digest, for the progress lines."""

    name: str
    digest: str
    frames: trio.MemorySendChannel[Any]


@attrs.define
class ProgressLines:
    """Ollama's progress lines from store work's reports: a line whenever the status changes,
    byte counts at most every percent (``/api/pull``, ``/api/create``)."""

    digest: str = ""
    last: tuple[str, int] = ("", -1)

    def line(self, status: str, completed: int | None, total: int | None) -> dict[str, Any] | None:
        """The line for a report, or None when it would repeat the last one's status and percent."""
        step = int(100 * (completed or 0) / total) if total else -1
        if (status, step) == self.last:
            return None
        self.last = (status, step)
        frame: dict[str, Any] = {"status": status}
        if total:
            frame |= {"total": total, "completed": completed or 0}
            if self.digest:
                frame["digest"] = f"sha256:{self.digest}"
        return frame


class _Abandoned(Exception):
    """Every requester has left: the pull stops."""


@attrs.define
class _Job:
    lines: ProgressLines
    listeners: list[trio.MemorySendChannel[Any]] = attrs.field(factory=list)
    latest: dict[str, Any] | None = None

    def join(self, frames: trio.MemorySendChannel[Any]) -> None:
        self.listeners.append(frames)
        if self.latest is not None:
            self._send(frames, self.latest)

    def publish(self, item: Any) -> bool:
        """Send ``item`` to every requester still listening; whether any is."""
        if isinstance(item, dict):
            self.latest = item
        for frames in list(self.listeners):
            self._send(frames, item)
        return bool(self.listeners)

    def _send(self, frames: trio.MemorySendChannel[Any], item: Any) -> None:
        try:
            frames.send_nowait(item)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.listeners.remove(frames)  # gone, or not reading
            frames.close()

    def close(self) -> None:
        for frames in self.listeners:
            frames.close()
        self.listeners.clear()

    def report(self, status: str, completed: int | None, total: int | None) -> None:
        """From the pull's thread: its progress line, if the report makes a new one."""
        trio.from_thread.check_cancelled()
        frame = self.lines.line(status, completed, total)
        if frame is not None and not trio.from_thread.run_sync(self.publish, frame):
            raise _Abandoned()


async def pulls(
    inbox: trio.MemoryReceiveChannel[Pull],
    run_pull: RunPull,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    jobs: dict[str, _Job] = {}
    places = trio.CapacityLimiter(MAX_PULLS)

    async def run(name: str, job: _Job) -> None:
        try:
            async with places:
                if not job.listeners:
                    return  # everyone left while it waited
                job.publish({"status": "pulling manifest"})
                await trio.to_thread.run_sync(partial(run_pull, name, job.report))
            for status in ("verifying sha256 digest", "writing manifest"):
                job.publish({"status": status})
            job.publish(Pulled())
        except _Abandoned:
            pass
        except Exception as exc:  # told to its requesters, never raised into the actor
            job.publish(PullFailed(exc))
        finally:
            del jobs[name]
            job.close()

    with inbox:
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for msg in inbox:
                job = jobs.get(msg.name)
                if job is None:
                    job = jobs[msg.name] = _Job(ProgressLines(msg.digest))
                    nursery.start_soon(run, msg.name, job)
                job.join(msg.frames)
