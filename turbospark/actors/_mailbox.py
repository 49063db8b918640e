"""The one-shot request/reply: ``call`` on the asking side, ``answer`` on the actor's side."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from typing import Any, TypeVar

import trio

__all__ = ["answer", "call"]

R = TypeVar("R")


async def call(inbox: trio.MemorySendChannel[Any], make: Callable[[trio.MemorySendChannel[R]], Any]) -> R:
    """Send ``make(reply)`` to ``inbox`` and wait for the one answer on ``reply``.

    Leaving (cancellation) closes the receive end, which tells the actor its answer is unwanted.
    """
    reply_send, reply_recv = trio.open_memory_channel[R](1)
    with reply_recv:
        await inbox.send(make(reply_send))
        return await reply_recv.receive()


def answer(reply: trio.MemorySendChannel[R], message: R) -> None:
    """Send the one answer on ``reply`` and close it; an asker that has left (its receive end
    closed) simply does not get it."""
    with reply, suppress(trio.BrokenResourceError):
        reply.send_nowait(message)
