"""Python's cyclic garbage collector kept out of the streams' way.

A full pass of the collector walks every object the process holds, with the GIL held: with the
models, their tokenizers and the libraries loaded, 60-180 ms, during which no stream decodes or
writes (a few big request bodies' objects were enough to start one).  ``freeze_start_up``, once
the server has loaded its models, collects once and moves everything start-up made out of the
collector's reach (``gc.freeze``): a full pass then walks only what was made since (~6 ms).

What is frozen is never collected as a cycle, only freed by its reference count, and a model's
objects hold cycles (a backend and its engine's callbacks).  So when a model has been unloaded,
``collect_unloaded`` thaws, collects and freezes again: one full pass (the cost of one of the
pauses above, once per unload), after which the unloaded model's memory is free.  It waits a
moment first: the ``Cancelled`` that ended the model's actor holds, in its traceback, the frames
of the model's thread and so the model, until its cancel scope has caught it.
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["AFTER_UNLOAD_S", "collect_unloaded", "collecting", "freeze_start_up"]

#: How long after a model's actor ends its memory is collected: by then the ``Cancelled`` that
#: unloaded it, whose traceback holds the model thread's frames and so the model, is gone.
AFTER_UNLOAD_S = 0.1


def freeze_start_up() -> None:
    """Start-up's garbage collected, and what is left frozen (``serve``, once it listens)."""
    gc.collect()
    gc.freeze()


async def collect_unloaded() -> None:
    """An unloaded model's cycles collected where start-up was frozen (a no-op where it was not,
    as in a test process), ``AFTER_UNLOAD_S`` after its actor ended (a task of its own)."""
    await trio.sleep(AFTER_UNLOAD_S)
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def collecting(nursery: trio.Nursery, start_model: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """``start_model`` (``Lifecycle.start_model``: a model from load to unload) followed, once
    it has ended, by ``collect_unloaded`` in a task of ``nursery``'s."""

    async def start(loadable: Any, *, task_status: trio.TaskStatus[Any]) -> None:
        try:
            await start_model(loadable, task_status=task_status)
        finally:  # its actor is gone, and with it what held the model: its cycles go too
            nursery.start_soon(collect_unloaded)

    return start
