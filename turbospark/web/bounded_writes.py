"""Hypercorn's TCP connections, with writes that cannot wait for ever.

Hypercorn shields every socket write from cancellation, so that a response is never cut
mid-frame.  A client that stops reading then holds its connection, and the server's shutdown,
for ever: the write waits for room in a socket buffer that never drains.  ``BoundedWrites``
gives each write a deadline of its own, renewed every ``SLICE`` bytes that go out
(``--write-timeout``, as nginx's ``send_timeout`` between two writes), and
``Writes.abandon`` (shutdown, once its grace is over) ends every write still waiting.  A write
that gives up closes its connection: the request ends as if its client had left, so its
generation stops within a step.

It takes the place of Hypercorn's ``TCPServer`` where ``hypercorn.trio.run`` builds connections
(Hypercorn 0.18, pinned below 0.19); the server's ``Writes`` ride on its Hypercorn config.
"""

from __future__ import annotations

from typing import Any

import hypercorn.trio.run
import trio
from hypercorn.events import Closed, RawData
from hypercorn.trio.tcp_server import TCPServer

__all__ = ["BoundedWrites", "SLICE", "Writes", "install"]

#: a write's deadline runs for each slice this large, so a slow client that keeps reading a long
#: response is never cut: only one that takes nothing of a slice for --write-timeout is
SLICE = 256 * 1024


class Writes:
    """One server's writes that wait for room, and how long each may."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.waiting: set[trio.CancelScope] = set()
        self.abandoned = False

    def abandon(self) -> None:
        """Shutdown's grace is over: every write still waiting, and every later one, gives up."""
        self.abandoned = True
        for scope in list(self.waiting):
            scope.cancel()


class BoundedWrites(TCPServer):
    async def protocol_send(self, event: Any) -> None:
        writes: Writes | None = getattr(self.config, "turbospark_writes", None)
        if not isinstance(event, RawData) or writes is None:
            await super().protocol_send(event)
            return
        data = memoryview(event.data)
        async with self.send_lock:
            for start in range(0, max(len(data), 1), SLICE):  # the deadline is for progress
                with trio.CancelScope(shield=True, deadline=trio.current_time() + writes.timeout) as scope:
                    if writes.abandoned:
                        scope.cancel()
                    writes.waiting.add(scope)
                    try:
                        await self.stream.send_all(data[start : start + SLICE])
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        scope.cancel()  # the client has gone: the same ending
                    finally:
                        writes.waiting.discard(scope)
                if scope.cancelled_caught:  # cut mid-write, or the client took nothing in time
                    with trio.CancelScope(shield=True):
                        await self.stream.aclose()
                    break
        if scope.cancelled_caught:
            await self.protocol.handle(Closed())


def install(config: Any, timeout: float) -> Writes:
    """Bounded writes for the server that ``config`` (a Hypercorn config) will run."""
    hypercorn.trio.run.TCPServer = BoundedWrites  # type: ignore[misc]
    config.turbospark_writes = writes = Writes(timeout)
    return writes
