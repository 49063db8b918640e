"""The events file (``--events-file``): one task of its own beside the observer, so that a slow
disk delays the file and never the metrics.  The observer hands it each event as a JSON line
without waiting (a line it has no room for is counted in ``turbospark_events_file_dropped``);
the writer appends every line waiting in one write, through Trio's thread pool.  A file that
cannot be opened or written is reported and turned off: events never cost a request.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import attrs
import trio

from ..errors import inject

__all__ = ["EVENTS_FILE_QUEUE", "event_to_json", "events_writer"]

log = logging.getLogger("turbospark")

def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def event_to_json(event: Any) -> dict[str, Any]:
    """An event (an attrs class) as its line: ``{"kind": <camelCase event name>, ...camelCase
    fields}``."""
    name = type(event).__name__
    out: dict[str, Any] = {"kind": name[0].lower() + name[1:]}
    for field in attrs.fields(type(event)):
        out[_camel(field.name)] = getattr(event, field.name)
    return out


EVENTS_FILE_QUEUE = 16384  # lines the events file's writer may fall behind by


async def _open_events(path: Path) -> Any:
    return await trio.open_file(path, "a", encoding="utf-8")


async def events_writer(
    path: Path, pending: trio.MemoryReceiveChannel[str], faults: dict[str, int], *,
    task_status: trio.TaskStatus[None],
) -> None:
    """Append the event lines to ``path`` (through Trio's thread pool), every line waiting in
    one write.  A file that cannot be opened or written is reported and turned off (a write that
fails is an observer fault in ``faults``)."""
    with pending:
        try:
            sink = await _open_events(path)
        except OSError as exc:
            log.error("events file %s cannot be opened (%s); events will not be written", path, exc)
            task_status.started()
            return
        task_status.started()
        try:
            async for line in pending:
                batch = [line]
                with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
                    while len(batch) < 1024:
                        batch.append(pending.receive_nowait())
                try:
                    inject("observer write")
                    await sink.write("".join(batch))
                    await sink.flush()
                except Exception as exc:
                    log.error("writing the events file %s failed (%s); events are no longer written", path, exc)
                    faults["observer"] += 1
                    return
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                with contextlib.suppress(OSError, ValueError):
                    await sink.aclose()
