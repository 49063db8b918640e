"""The resolver actor: which model answers a request, and which models are loaded.

It owns the model actors' nursery (inside ``models_scope``, which shutdown cancels), each loaded
model's cancel scope, and the registry snapshot it publishes (``Published``).  What to load, keep
and unload is decided by its sans-io policy, ``_residency.Residency`` (the load state machine,
resolution slots, leases, keep-alive deadlines, eviction); names are looked up by
``registry.Registry``; its messages are in ``resolution``.  This module is the Trio side: the
inbox loop (waiting on the nearest keep-alive deadline with ``move_on_at``, no timer tasks),
the lookups that need a task, each model's life, and carrying out the policy's decisions.

Its own tasks post ``_Looked`` (a lookup's answer), ``_Known`` (the library, read on a worker
thread), ``_Ready`` and ``_Ended`` (a model's start and end); these two, ``Release`` and
``Abandon`` come on ``notes``, unbounded and so never dropped (decision 0019).  Every kind of
model lives the same way, through ``Lifecycle.start_model``: a generation model's actor (a load
tells the queue ``Open`` first; unloading cancels the actor's scope: its thread stops within one
step, and the actor tells the queue ``Retire``), an embedding model's actor (its inbox is on its
registry entry), an audio model attached to the audio actor for as long as it is loaded.

Imports ``resolution``, ``_residency``, ``lifecycle``, ``registry``, ``_mailbox``, ``messages``
and ``errors``; the model actor comes in through ``Lifecycle.start_model``.  Never ``routes``,
``web`` or ``store``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any

import attrs
import trio

from ..errors import ModelNotFound, NoModel, ResolutionBusy, ResolutionFailed, ShuttingDown, TurboSparkError, inject
from ..messages import ModelLoaded, ModelUnloaded, Open
from ._mailbox import answer
from ._residency import Decision, Granted, Instance, Load, Loaded, Refused, Residency, Stop, Unloaded
from .lifecycle import Loadable, described, entry_for
from .registry import Capability, ModelEntry, Registry
from ._resolver_notes import Ended as _Ended, Known as _Known, Looked as _Looked, Ready as _Ready
from .resolution import (
    Abandon, Adopt, Grant, Lifecycle, LoadedModel, Published, Refresh, Release, Resolve, Running, Unload,
)

__all__ = ["Library", "ResolveFn", "resolve_in_registry", "resolver"]

log = logging.getLogger("turbospark")

#: A name no model has is looked for in the library at most once in this many seconds.
STRANGER_S = 2.0


ResolveFn = Callable[[Registry, str | None, Capability], Awaitable[ModelEntry]]
Library = Callable[[], Sequence[Loadable]]


async def resolve_in_registry(registry: Registry, name: str | None, want: Capability) -> ModelEntry:
    return registry.resolve(name, want)


class _Resolver:
    def __init__(
        self,
        post: trio.MemorySendChannel[Any],
        note: trio.MemorySendChannel[Any],
        tasks: trio.Nursery,
        models: trio.Nursery,
        models_scope: trio.CancelScope,
        lifecycle: Lifecycle,
        library: Library,
        pinned: Sequence[Loadable],
        fixed: Sequence[ModelEntry],
        resolve: ResolveFn,
        slots: int,
        published: Published,
    ) -> None:
        self.post, self.note = post, note  # the inbox's send end; the notes' (never full)
        self.tasks = tasks
        self.nursery = models
        self.models_scope = models_scope
        self.life = lifecycle
        self.library = library
        self.pinned = {p.id: p for p in pinned}
        self.fixed = tuple(fixed)
        self.resolve_fn = resolve
        self.published = published
        self.policy = Residency(
            slots=slots, keep_alive=lifecycle.keep_alive, max_models=lifecycle.max_models,
            max_memory=lifecycle.max_memory,
        )
        self.scopes: dict[Instance, trio.CancelScope] = {}  # each loading or loaded model's
        self.waiting: trio.CancelScope | None = None  # the inbox loop's wait for a deadline
        self.known: dict[str, Loadable] = dict(self.pinned)
        self.strangers: dict[str, float] = {}  # names looked for in the library, and when
        self._publish()

    # --- the registry ---------------------------------------------------------------------

    def _publish(self) -> Registry:
        loaded, now = self.policy.loaded(), time.time()
        entries = [loaded.get(l.id) or entry_for(l, now=now) for l in self.known.values()]
        ids = {e.id for e in entries}
        registry, left_out = Registry.first_come([*entries, *(e for e in self.fixed if e.id not in ids)])
        for entry, names in left_out:
            log.error("model %s answers to a name another model has (%s); it is not served",
                      entry.id, ", ".join(names))
        self.published.registry = registry
        self.published.loadables = dict(self.known)
        return registry

    # --- lookups --------------------------------------------------------------------------

    def _find_now(self, msg: Resolve) -> ModelEntry:
        """The lookup itself, synchronous: an exact name (Ollama), or the registry's policy."""
        registry = self.published.registry
        if msg.exact:
            return registry.resolve_exact(msg.name or "", msg.want)
        return registry.resolve(msg.name, msg.want, self.policy.loaded())

    async def _find(self, msg: Resolve) -> ModelEntry:
        if msg.exact or self.resolve_fn is resolve_in_registry:
            return self._find_now(msg)
        registry = self.published.registry
        try:
            return await self.resolve_fn(registry, msg.name, msg.want)
        except ModelNotFound:
            return registry.only_loaded(msg.name, msg.want, self.policy.loaded())

    async def _look_up(self, msg: Resolve, stranger: bool) -> None:
        asked = trio.current_time()
        try:
            try:
                result: ModelEntry | TurboSparkError = await self._find(msg)
                if stranger:  # answered by a fallback: unless the library knows it now
                    await self._refresh()
                    result = await self._find(msg)
            except (ModelNotFound, NoModel):
                await self._refresh()  # a model stored since the last look
                result = await self._find(msg)
        except TurboSparkError as exc:
            result = exc
        except Exception:  # a broken resolution fails its request, not the server
            log.exception("model resolution failed for %r", msg.name)
            result = ResolutionFailed()
        await self.post.send(_Looked(msg, result, asked))

    async def _refresh(self) -> Registry:
        loadables = await trio.to_thread.run_sync(self.library)
        answer_send, answer_recv = trio.open_memory_channel[Registry](1)
        with answer_recv:
            await self.post.send(_Known(tuple(loadables), answer_send))
            return await answer_recv.receive()

    async def _refresh_for(self, reply: trio.MemorySendChannel[Registry] | None) -> None:
        try:
            registry = await self._refresh()
        except Exception:
            log.exception("reading the model library failed")
            registry = self.published.registry
        if reply is not None:
            answer(reply, registry)

    # --- the loop -------------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        self.policy.stopping = self.models_scope.cancel_called
        now = trio.current_time()
        if isinstance(msg, Resolve):
            self._resolve(msg)
        elif isinstance(msg, _Looked):
            self._looked(msg)
        elif isinstance(msg, Release):
            self._apply(self.policy.release(msg.lease, now))
        elif isinstance(msg, Abandon):
            self._apply(self.policy.abandon(msg.request))
        elif isinstance(msg, _Ready):
            self._apply(self.policy.ready(msg.model, entry_for(msg.model.loadable, msg.info, now=time.time()), now))
        elif isinstance(msg, _Ended):
            self._ended(msg.model, msg.error)
        elif isinstance(msg, Unload):
            self._unload(msg)
        elif isinstance(msg, Running):
            answer(msg.reply, self._running())
        elif isinstance(msg, Refresh):
            self.tasks.start_soon(self._refresh_for, msg.reply)
        elif isinstance(msg, _Known):
            library = {l.id: l for l in msg.loadables}
            self.pinned = {i: described(p, library.get(i)) for i, p in self.pinned.items()}
            self.known = {**library, **self.pinned}
            registry = self._publish()
            if msg.reply is not None:
                answer(msg.reply, registry)
        elif isinstance(msg, Adopt):
            loadable = described(attrs.evolve(msg.loadable, pinned=True), self.known.get(msg.loadable.id))
            self.pinned[loadable.id] = self.known[loadable.id] = loadable
            answer(msg.reply, self._publish())

    async def read_notes(self, notes: trio.MemoryReceiveChannel[Any]) -> None:
        async for msg in notes:  # between two inbox messages; the inbox loop looks again
            self.handle(msg)
            if self.waiting is not None:
                self.waiting.cancel()

    def expire(self) -> None:
        self.policy.stopping = self.models_scope.cancel_called
        self._apply(self.policy.expire(trio.current_time()))

    def _resolve(self, msg: Resolve) -> None:
        if self.policy.stopping:
            answer(msg.reply, ShuttingDown())
            return
        if not self.policy.take_slot():
            answer(msg.reply, ResolutionBusy())
            return
        if self.resolve_fn is resolve_in_registry or msg.exact:
            # the common case answers in this turn of the loop: no task, the slot back at once
            # unless a load takes it; a name not known yet is looked for in the library
            try:
                found: ModelEntry | TurboSparkError = self._find_now(msg)
            except (ModelNotFound, NoModel):
                pass
            except TurboSparkError as exc:
                self._looked(_Looked(msg, exc, trio.current_time()))
                return
            else:
                if not self._stranger(msg):
                    self._looked(_Looked(msg, found, trio.current_time()))
                    return
        stranger = self._stranger(msg)
        if stranger:  # looked for from now: a burst of requests naming it takes one look, not a slot each
            now = trio.current_time()  # the names of the last few seconds only
            self.strangers = {n: t for n, t in self.strangers.items() if now - t <= STRANGER_S}
            self.strangers[msg.name or ""] = now
        self.tasks.start_soon(self._look_up, msg, stranger)

    def _stranger(self, msg: Resolve) -> bool:
        """A name no known model has, not looked for in the library these last ``STRANGER_S``
        seconds: it may be a model stored since (``models import`` beside a running server), not
        a client's own (``gpt-4o``), which a fallback answers."""
        name = msg.name or ""
        return (bool(name) and not msg.exact and self.published.registry.lookup(name) is None
                and trio.current_time() - self.strangers.get(name, -math.inf) > STRANGER_S)

    def _looked(self, msg: _Looked) -> None:
        request, found = msg.request, msg.result
        if isinstance(found, TurboSparkError) or self.policy.stopping or _gone(request):
            self.policy.give_slot()
            answer(request.reply, found if isinstance(found, TurboSparkError) else ShuttingDown())
            return
        loadable = self.known.get(found.id)
        if loadable is None:  # a fixed entry: always there
            self.policy.give_slot()
            answer(request.reply, Grant(found, None))
            return
        self._apply(self.policy.found(request, loadable, request.keep_alive, msg.asked, trio.current_time()))

    def _unload(self, msg: Unload) -> None:
        entry = self.published.registry.find(msg.name)
        if entry is None:
            answer(msg.reply, ModelNotFound(msg.name, []))
            return
        loaded = self.policy.loaded().get(entry.id, entry)
        self._apply(self.policy.unload(entry.id, trio.current_time()))
        answer(msg.reply, loaded)

    def _running(self) -> list[LoadedModel]:
        now, wall = trio.current_time(), time.time()
        out = []
        for model in self.policy.running():
            assert model.entry is not None
            expires = self.policy.expires_in(model, now)
            out.append(LoadedModel(model.entry, model.loadable, None if expires is None else wall + expires,
                                   len(model.leases)))
        return out

    # --- carrying out the policy's decisions ----------------------------------------------

    def _apply(self, decisions: Iterable[Decision]) -> None:
        todo = deque(decisions)
        while todo:
            decision = todo.popleft()
            if isinstance(decision, Granted):
                if not self._deliver(decision):  # the asker left: its lease goes back
                    todo.extend(self.policy.release(decision.lease, trio.current_time()))
            elif isinstance(decision, Refused):
                answer(decision.waiter.reply, decision.error)  # type: ignore[attr-defined]
            elif isinstance(decision, Load):
                scope = self.scopes[decision.instance] = trio.CancelScope()
                self.nursery.start_soon(self._life, decision.instance, scope)
            elif isinstance(decision, Stop):
                self.scopes[decision.instance].cancel()
            elif isinstance(decision, Loaded):
                model = decision.instance
                self.life.emit(ModelLoaded(model.id, decision.seconds, model.loadable.size))
                self._publish()
            elif isinstance(decision, Unloaded):
                self.life.emit(ModelUnloaded(decision.instance.id, decision.reason))
                self._publish()

    def _deliver(self, granted: Granted) -> bool:
        request: Resolve = granted.waiter  # type: ignore[assignment]
        try:
            request.reply.send_nowait(Grant(granted.entry, granted.lease, granted.waited))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        finally:
            request.reply.close()
        return True

    def _ended(self, model: Instance, error: BaseException | None) -> None:
        self.scopes.pop(model, None)
        if error is not None:
            log.error("model %s stopped: %r", model.id, error, exc_info=error)
        self._apply(self.policy.ended(model, error, trio.current_time()))

    async def _life(self, model: Instance, scope: trio.CancelScope) -> None:
        """A model from load to unload, in its own cancel scope."""
        error: BaseException | None = None
        try:
            with scope:
                inject("resolver load")
                if model.loadable.kind == "generation":
                    await self.life.queue.send(Open(model.id))
                async with trio.open_nursery() as nursery:
                    info = await nursery.start(partial(self.life.start_model, model.loadable))
                    self.note.send_nowait(_Ready(model, info))
        except Exception as exc:
            error = exc
        finally:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                self.note.send_nowait(_Ended(model, error))  # unless the resolver has ended


def _gone(request: Resolve) -> bool:
    try:
        return request.reply.statistics().open_receive_channels == 0
    except trio.ClosedResourceError:
        return True


async def resolver(
    inbox: trio.MemoryReceiveChannel[Any],
    post: trio.MemorySendChannel[Any],
    *,
    notes: tuple[trio.MemorySendChannel[Any], trio.MemoryReceiveChannel[Any]] | None = None,
    lifecycle: Lifecycle,
    published: Published,
    models_scope: trio.CancelScope,
    library: Library = tuple,
    pinned: Sequence[Loadable] = (),
    fixed: Sequence[ModelEntry] = (),
    slots: int,
    resolve: ResolveFn = resolve_in_registry,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``inbox`` until cancelled; ``post`` is a send end of ``inbox`` for its own tasks,
    ``notes`` both ends of the unbounded channel for lease bookkeeping (opened if not given).
    Ready once every pinned model has loaded (a failure there is raised)."""
    note, noted = notes if notes is not None else trio.open_memory_channel[Any](math.inf)
    with inbox, post, note, noted:
        async with trio.open_nursery() as tasks:
            models: trio.Nursery = await tasks.start(_models_nursery, models_scope)
            state = _Resolver(post, note, tasks, models, models_scope, lifecycle, library, pinned, fixed,
                              resolve, slots, published)
            tasks.start_soon(state.read_notes, noted)
            try:
                state.handle(_Known(tuple(await trio.to_thread.run_sync(library))))
            except Exception:
                log.exception("reading the model library failed")
            state._apply(state.policy.pin(list(state.pinned.values()), trio.current_time()))
            ready = not pinned
            if ready:
                task_status.started()
            while True:
                if state.policy.start_error is not None and not ready:
                    raise state.policy.start_error
                if not ready and not state.policy.starting:
                    ready = True
                    task_status.started()
                with trio.move_on_at(state.policy.next_deadline()) as state.waiting:
                    state.handle(await inbox.receive())
                    continue
                state.expire()


async def _models_nursery(scope: trio.CancelScope, *, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    with scope:
        async with trio.open_nursery() as nursery:
            task_status.started(nursery)
            await trio.sleep_forever()
