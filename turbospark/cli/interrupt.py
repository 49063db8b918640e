"""SIGTERM like SIGINT while the process prepares models (before it serves).

Pulls, imports and conversions are plain synchronous code: SIGINT already raises
``KeyboardInterrupt`` there, so their ``finally`` blocks remove the scratch directory they built
in (the store renames a finished model into place atomically, so no partial model is ever under
its name). SIGTERM's default action would kill the process before any of that runs;
``interruptible`` makes it raise ``KeyboardInterrupt`` too, for the block's duration.

Once the process has said why it ends (a refused model, a lost rank), ``leaving`` gives SIGTERM its
default action back: a launcher that ends the other ranks when one exits then ends this one at
once and silently, not with a ``KeyboardInterrupt`` raised inside whatever runs by then (an
``atexit`` callback, a ``__del__``), which Python reports as a traceback.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

__all__ = ["interruptible", "leaving"]


def _raise(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    try:
        previous = signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is _raise:  # not after ``leaving``
            signal.signal(signal.SIGTERM, previous)


def leaving() -> None:
    """From here on the process only ends: SIGTERM ends it by default, quietly."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # not the main thread
        pass
