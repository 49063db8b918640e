"""Start a pinned OS thread and wait until it says it is ready.

A model's or an encoder's thread loads its backend, hands it to ``ready`` (through
``trio.from_thread.run_sync``), and then serves until its scope is cancelled.  ``start_pinned``
runs such a body once with ``trio.to_thread.run_sync(..., abandon_on_cancel=False)`` (an
abandoned thread would keep computing and holding memory) as a task of the caller's nursery, and
returns what the thread handed to ``ready``.

If the thread raises before it is ready (a failed load), the nursery cancels the wait and raises
what the thread raised; if the caller is cancelled while the thread loads, the nursery waits for
the thread to stop.  A thread that returns before it is ready is a ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import trio

__all__ = ["start_pinned"]

T = TypeVar("T")


async def start_pinned(
    nursery: trio.Nursery,
    thread_name: str,
    serve: Callable[..., None],
    *args: Any,
    **kwargs: Any,
) -> T:
    """Run ``serve(*args, ready=..., **kwargs)`` on its own thread in ``nursery``; return the
    first value it hands to ``ready``."""
    ready_send, ready_recv = trio.open_memory_channel[Any](1)

    async def run() -> None:
        body = partial(serve, *args, ready=ready_send.send_nowait, **kwargs)
        await trio.to_thread.run_sync(body, thread_name=thread_name, abandon_on_cancel=False)
        ready_send.close()  # returned: a wait for ready that is still pending would never end

    nursery.start_soon(run)
    try:
        return await ready_recv.receive()
    except trio.EndOfChannel:
        raise RuntimeError(f"thread {thread_name} ended before it was ready") from None
