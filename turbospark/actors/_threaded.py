"""What the audio and images actors share: their models, each on a pinned thread of its own that
takes jobs one at a time from a bounded queue, attached and detached on the resolver's word.

``ThreadedModels`` is the actor's own state (only its task touches it).  ``run`` is a model's
worker, started in the actor's nursery: it starts the thread (``serve(make, take, emit, ready)``,
never abandoned), is started itself with the model's info once the thread says it is ready, and,
when cancelled or when the thread ends, forgets the model, closes its queue and answers what
still waits in it (``refuse``): nobody will run those any more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

import attrs
import trio

from ..errors import ModelLoadFailed, TurboSparkError
from ._mailbox import answer

__all__ = ["Threaded", "ThreadedModels"]

log = logging.getLogger("turbospark.actors")

Info = TypeVar("Info")
Job = TypeVar("Job")


@attrs.define(eq=False)
class Threaded(Generic[Info, Job]):
    info: Info
    queue: trio.MemorySendChannel[Job]
    scope: trio.CancelScope
    ended: trio.Event  # set once its thread has ended


@attrs.define(eq=False)
class ThreadedModels(Generic[Info, Job]):
    """The loaded models of one kind (``kind``: threads' names, log lines) and the attaches under
    way.  ``describe(id, engine)``: what routes may know of a model its thread has loaded;
    ``changed()``: called whenever the set of loaded models changes."""

    kind: str
    serve: Callable[..., None]
    describe: Callable[[str, Any], Info]
    refuse: Callable[[Job], None]
    emit: Callable[[object], None]
    changed: Callable[[], None]
    queue_size: int
    models: dict[str, Threaded[Info, Job]] = attrs.field(factory=dict)
    attaching: dict[str, trio.Event] = attrs.field(factory=dict)  # each set once its attach has ended

    async def run(self, model_id: str, make: Callable[[], Any], *, task_status: trio.TaskStatus[Info]) -> None:
        queue_send, queue_recv = trio.open_memory_channel[Job](self.queue_size)
        ready_send, ready_recv = trio.open_memory_channel[Any](1)
        scope = trio.CancelScope()
        ended = trio.Event()

        async def take() -> Job | None:
            try:
                return await queue_recv.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return None

        with scope, queue_recv, ready_recv:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        partial(
                            trio.to_thread.run_sync, self.serve, make, take, self.emit, ready_send.send_nowait,
                            thread_name=f"{self.kind}:{model_id}", abandon_on_cancel=False,
                        )
                    )  # fmt: skip
                    info = self.describe(model_id, await ready_recv.receive())
                    if model_id in self.models:
                        raise RuntimeError(f"two {self.kind} models answer to the name '{model_id}'")
                    self.models[model_id] = Threaded(info, queue_send, scope, ended)
                    self.changed()
                    task_status.started(info)
            finally:
                entry = self.models.get(model_id)
                if entry is not None and entry.scope is scope:
                    del self.models[model_id]
                    self.changed()
                queue_send.close()
                while True:
                    try:
                        job = queue_recv.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                        break
                    self.refuse(job)
                ended.set()

    async def attach(
        self, model_id: str, make: Callable[[], Any], reply: trio.MemorySendChannel[Any], nursery: trio.Nursery
    ) -> None:
        """Load ``model_id`` (``make`` builds it on its thread); answer ``reply`` with its info,
        or the error (a load that fails unexpectedly is logged, and answered as ``ModelLoadFailed``:
        its text is not the client's)."""
        self.attaching[model_id] = done = trio.Event()
        try:
            if model_id in self.models:
                raise RuntimeError(f"two {self.kind} models answer to the name '{model_id}'")
            result: Any = await nursery.start(self.run, model_id, make)
        except TurboSparkError as exc:
            result = exc
        except Exception:
            log.exception("loading %s model %s failed", self.kind, model_id)
            result = ModelLoadFailed()
        finally:
            del self.attaching[model_id]
            done.set()
        answer(reply, result)

    async def detach(self, model_id: str, reply: trio.MemorySendChannel[None]) -> None:
        """Stop ``model_id``'s thread; answer ``reply`` once it has ended."""
        try:
            if (loading := self.attaching.get(model_id)) is not None:
                await loading.wait()  # an attach its asker left: what it loaded goes too
            entry = self.models.pop(model_id, None)
            if entry is not None:
                entry.scope.cancel()
                self.changed()
                await entry.ended.wait()
        finally:
            answer(reply, None)
