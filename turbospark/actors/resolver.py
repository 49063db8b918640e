"""Resolution slots: a bounded number of model resolutions in flight at once.

Inbox: ``Resolve(name, want, reply)``.  The actor holds a ``trio.CapacityLimiter``; a request that
finds every slot taken is answered ``ResolutionBusy`` at once (a retryable 503), never queued.  A
granted slot is held until the resolution finishes, even if the asker has gone.  ``/health`` and
``/v1/models`` never come here, so they are never blocked.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import trio

from ..errors import ResolutionBusy, ResolutionFailed, TurboSparkError
from ..routing import Capability, ModelEntry, Registry
from ._mailbox import answer

__all__ = ["Resolve", "resolve_in_registry", "resolver"]

log = logging.getLogger("turbospark")


@attrs.frozen
class Resolve:
    name: str | None
    want: Capability
    reply: trio.MemorySendChannel[ModelEntry | TurboSparkError]


ResolveFn = Callable[[Registry, str | None, Capability], Awaitable[ModelEntry]]


async def resolve_in_registry(registry: Registry, name: str | None, want: Capability) -> ModelEntry:
    return registry.resolve(name, want)


async def resolver(
    inbox: trio.MemoryReceiveChannel[Resolve],
    registry: Registry,
    *,
    slots: int,
    resolve: ResolveFn = resolve_in_registry,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    limiter = trio.CapacityLimiter(slots)

    async def run(msg: Resolve, lease: object) -> None:
        try:  # the slot is held until the resolution ends, even if the asker has left
            result: ModelEntry | TurboSparkError = await resolve(registry, msg.name, msg.want)
        except TurboSparkError as exc:
            result = exc
        except Exception:  # a broken resolution fails its request, not the server
            log.exception("model resolution failed for %r", msg.name)
            result = ResolutionFailed()
        finally:
            limiter.release_on_behalf_of(lease)
        answer(msg.reply, result)

    with inbox:
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for msg in inbox:
                lease = object()
                try:
                    limiter.acquire_on_behalf_of_nowait(lease)
                except trio.WouldBlock:
                    answer(msg.reply, ResolutionBusy())
                    continue
                nursery.start_soon(run, msg, lease)
