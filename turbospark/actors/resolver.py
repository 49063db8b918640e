"""The resolver: which model answers a request, and which models are loaded.

It owns the model actors' nursery (inside ``models_scope``, which shutdown cancels), every
model's own cancel scope, the resolution slots and the keep-alive timers.

Inbox:

- ``Resolve(name, want, reply, keep_alive, exact)``: takes a resolution slot (none free:
  ``ResolutionBusy`` at once, never queued) and looks the name up among the known models (the
  loadable ones, read again from the library when a name is missing, and the embedding models).
  A loaded model is granted at once: ``Grant(entry, lease, load_seconds)``.  A model that is
  not loaded is loaded, the slot passing to the load; requests for a model that is loading wait
  on that one load.  The lease is held by the route until its request ends (``Release``).
- ``Abandon(resolve)``: the asker left before its answer.  The last waiter of a load leaving
  cancels the load.
- ``Release(lease)``: a request ended.  When a model's last lease goes, its keep-alive timer
  starts: ``keep_alive`` seconds (the latest request's; a model named on ``--model`` keeps
  forever unless a request says otherwise), 0 unloads at once, forever never.
- ``Unload(name, reply)``: unload now if idle, else once its requests end (``keep_alive: 0``
  without a prompt); answers the entry.
- ``Running(reply)``: the loaded models (``/api/ps``); ``Refresh(reply)``: read the library again
  (after a pull, copy or delete).

A model is unloaded only when no lease is held: a request holds its lease from resolution until
its response is sent or its client has left, so no sequence ever runs on a model being unloaded.
Before a load, least recently used idle models are unloaded while ``--max-loaded-models`` or
``--max-loaded-memory`` would be exceeded (``lifecycle.evictions``); when busy models hold the
room, the load waits for them.  Unloading cancels the model actor's scope: its thread stops
within one step, and the actor tells the queue ``Retire``; a load tells it ``Open`` first.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, Literal

import attrs
import trio

from ..errors import (
    ModelLoadFailed,
    ModelNotFound,
    NoModel,
    RequestInvalid,
    ResolutionBusy,
    ResolutionFailed,
    ShuttingDown,
    TurboSparkError,
)
from .lifecycle import FOREVER, Loadable, ModelCard, Resident, evictions
from ..messages import ModelLoaded, ModelUnloaded, Open
from .registry import Capability, ModelEntry, Registry, alias_for
from ._mailbox import answer

__all__ = [
    "Abandon",
    "Grant",
    "Lifecycle",
    "LoadedModel",
    "Refresh",
    "Release",
    "Resolve",
    "ResolveFn",
    "Running",
    "Unload",
    "resolve_in_registry",
    "resolver",
]

log = logging.getLogger("turbospark")


@attrs.frozen
class Grant:
    """The model that answers, and the lease the request holds on it until it ends."""

    entry: ModelEntry
    lease: int | None  # None: a model that is never unloaded (embedding models)
    load_seconds: float = 0.0  # how long this request waited for the model to load


@attrs.frozen(eq=False)
class Resolve:
    name: str | None
    want: Capability
    reply: trio.MemorySendChannel[Grant | TurboSparkError]
    keep_alive: float | None = None  # seconds; None: the model's default
    exact: bool = False  # no single-model fallback (Ollama names models exactly)


@attrs.frozen
class Abandon:
    request: Resolve


@attrs.frozen
class Release:
    lease: int


@attrs.frozen
class Unload:
    name: str
    reply: trio.MemorySendChannel[ModelEntry | TurboSparkError]


@attrs.frozen
class LoadedModel:
    """A loaded model for ``/api/ps``: ``expires`` is a wall-clock time, None for never."""

    entry: ModelEntry
    loadable: Loadable
    expires: float | None
    requests: int


@attrs.frozen
class Running:
    reply: trio.MemorySendChannel[list[LoadedModel]]


@attrs.frozen
class Refresh:
    reply: trio.MemorySendChannel[Registry] | None = None


ResolverMessage = Resolve | Abandon | Release | Unload | Running | Refresh

ResolveFn = Callable[[Registry, str | None, Capability], Awaitable[ModelEntry]]
Library = Callable[[], Sequence[Loadable]]


async def resolve_in_registry(registry: Registry, name: str | None, want: Capability) -> ModelEntry:
    return registry.resolve(name, want)


@attrs.frozen
class Lifecycle:
    """How the resolver runs models (from ``Settings``, plus how to start one)."""

    start_model: Callable[..., Awaitable[None]]  # model_actor with everything but the spec bound
    queue: trio.MemorySendChannel[Any]  # the generation queue (Open)
    emit: Callable[[object], None]
    keep_alive: float = 300.0
    max_models: int = 3
    max_memory: int = 1 << 62


# --- internal messages, posted by the resolver's own tasks ---------------------------------


@attrs.frozen
class _Looked:
    request: Resolve
    result: ModelEntry | TurboSparkError
    token: object  # the resolution slot
    asked: float


@attrs.frozen
class _Known:
    loadables: tuple[Loadable, ...]
    reply: trio.MemorySendChannel[Registry] | None = None


@attrs.frozen
class _Ready:
    model: _Model
    info: Any


@attrs.frozen
class _Ended:
    model: _Model
    error: BaseException | None


State = Literal["pending", "loading", "ready", "leaving"]


@attrs.define(eq=False)
class _Model:
    loadable: Loadable
    keep_alive: float
    state: State = "pending"
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    entry: ModelEntry | None = None
    waiters: list[Resolve] = attrs.field(factory=list)
    asked: dict[Resolve, float] = attrs.field(factory=dict)
    leases: set[int] = attrs.field(factory=set)
    token: object | None = None  # the resolution slot its load holds
    began: float = 0.0
    last_used: float = 0.0
    expires: float = math.inf  # trio clock, while idle
    reason: str = "shutdown"  # why it is leaving

    @property
    def id(self) -> str:
        return self.loadable.id


def entry_for(loadable: Loadable, info: Any | None = None) -> ModelEntry:
    """The registry row of a model: from what its thread reported once loaded, else from what
    the library knows."""
    if info is None:
        return ModelEntry(
            id=loadable.id,
            context_window=loadable.context_window,
            capabilities=loadable.capabilities,
            aliases=(alias_for(loadable.id),),
            created=int(loadable.card.modified_at or time.time()),
        )
    return ModelEntry(
        id=info.id,
        context_window=info.context_window,
        capabilities=frozenset({"chat", "completion"} if info.has_chat_template else {"completion"}),
        aliases=(alias_for(info.id),),
        created=int(loadable.card.modified_at or time.time()),
        sampling_defaults=info.sampling_defaults,
        fingerprint=info.fingerprint,
        tokenizer=getattr(info, "tokenizer", None),
    )


class _Resolver:
    def __init__(
        self,
        post: trio.MemorySendChannel[Any],
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
        self.post = post
        self.tasks = tasks
        self.nursery = models
        self.models_scope = models_scope
        self.life = lifecycle
        self.library = library
        self.pinned = {p.id: p for p in pinned}
        self.fixed = tuple(fixed)
        self.resolve_fn = resolve
        self.limiter = trio.CapacityLimiter(slots)
        self.published = published
        self.known: dict[str, Loadable] = dict(self.pinned)
        self.models: dict[str, _Model] = {}  # pending, loading or ready, by id
        self.leaving: dict[str, _Model] = {}  # being unloaded, by id
        self.leases: dict[int, _Model] = {}
        self.lease_ids = itertools.count(1)
        self.starting: set[_Model] = set()  # loads at start-up
        self.start_error: BaseException | None = None
        self._publish()

    # --- the registry ---------------------------------------------------------------------

    def _publish(self) -> Registry:
        entries: list[ModelEntry] = []
        for loadable in self.known.values():
            model = self.models.get(loadable.id)
            entries.append(model.entry if model is not None and model.entry is not None else entry_for(loadable))
        ids = {e.id for e in entries}
        entries += [e for e in self.fixed if e.id not in ids]
        # A name two models would answer to (a copy named like another's alias) would make the
        # registry refuse them all: the later one is left out, and said so.
        taken: set[str] = set()
        kept = []
        for entry in entries:
            if taken.isdisjoint(entry.names):
                taken.update(entry.names)
                kept.append(entry)
            else:
                log.error("model %s answers to a name another model has (%s); it is not served",
                          entry.id, ", ".join(sorted(taken & set(entry.names))))
        self.published.registry = Registry(tuple(kept))
        self.published.loadables = dict(self.known)
        return self.published.registry

    def _loaded_ids(self) -> set[str]:
        return {m.id for m in self.models.values() if m.state == "ready"}

    async def _look_up(self, msg: Resolve, token: object) -> None:
        asked = trio.current_time()
        try:
            try:
                result: ModelEntry | TurboSparkError = await self._find(msg)
            except (ModelNotFound, NoModel):
                await self._refresh()  # a model stored since the last look
                result = await self._find(msg)
        except TurboSparkError as exc:
            result = exc
        except Exception:  # a broken resolution fails its request, not the server
            log.exception("model resolution failed for %r", msg.name)
            result = ResolutionFailed()
        await self.post.send(_Looked(msg, result, token, asked))

    async def _find(self, msg: Resolve) -> ModelEntry:
        if msg.exact or self.resolve_fn is resolve_in_registry:
            return self._find_now(msg)
        registry = self.published.registry
        try:
            return await self.resolve_fn(registry, msg.name, msg.want)
        except ModelNotFound:
            return self._only_loaded(registry, msg)

    def _find_now(self, msg: Resolve) -> ModelEntry:
        """The lookup itself, synchronous: the registry's policy, or an exact name."""
        registry = self.published.registry
        if not msg.exact:
            try:
                return registry.resolve(msg.name, msg.want)
            except ModelNotFound:
                return self._only_loaded(registry, msg)
        name = msg.name or ""
        entry = registry.lookup(name) or (registry.lookup(name[: -len(":latest")]) if name.endswith(":latest") else None)
        if entry is None:
            raise ModelNotFound(name, [])
        if msg.want not in entry.capabilities:
            what = {"chat": "chat", "completion": "generate", "embedding": "embeddings"}[msg.want]
            raise RequestInvalid(f"model '{entry.id}' does not support {what}", param="model")
        return entry

    def _only_loaded(self, registry: Registry, msg: Resolve) -> ModelEntry:
        """Several capable models, none named: the one loaded, if only one is."""
        loaded = [e for e in registry.entries if msg.want in e.capabilities and e.id in self._loaded_ids()]
        if len(loaded) == 1:
            return loaded[0]
        raise ModelNotFound(msg.name or "", [e.id for e in registry.entries if msg.want in e.capabilities])

    async def _refresh(self) -> Registry:
        loadables = await trio.to_thread.run_sync(self.library)
        answer_send, answer_recv = trio.open_memory_channel[Registry](1)
        with answer_recv:
            await self.post.send(_Known(tuple(loadables), answer_send))
            return await answer_recv.receive()

    # --- the loop -------------------------------------------------------------------------

    def next_deadline(self) -> float:
        return min((m.expires for m in self.models.values() if m.state == "ready" and not m.leases), default=math.inf)

    def expire(self) -> None:
        now = trio.current_time()
        for model in list(self.models.values()):
            if model.state == "ready" and not model.leases and model.expires <= now:
                self._unload(model, "expired")
        self._advance()

    def handle(self, msg: Any) -> None:
        if isinstance(msg, Resolve):
            self._resolve(msg)
        elif isinstance(msg, _Looked):
            self._looked(msg)
        elif isinstance(msg, Release):
            self._release(msg.lease)
        elif isinstance(msg, Abandon):
            self._abandon(msg.request)
        elif isinstance(msg, _Ready):
            self._ready(msg.model, msg.info)
        elif isinstance(msg, _Ended):
            self._ended(msg.model, msg.error)
        elif isinstance(msg, Unload):
            self._unload_request(msg)
        elif isinstance(msg, Running):
            answer(msg.reply, self._running())
        elif isinstance(msg, Refresh):
            self.tasks.start_soon(self._refresh_for, msg.reply)
        elif isinstance(msg, _Known):
            self.known = {**{l.id: l for l in msg.loadables}, **self.pinned}
            registry = self._publish()
            if msg.reply is not None:
                answer(msg.reply, registry)

    async def _refresh_for(self, reply: trio.MemorySendChannel[Registry] | None) -> None:
        try:
            registry = await self._refresh()
        except Exception:
            log.exception("reading the model library failed")
            registry = self.published.registry
        if reply is not None:
            answer(reply, registry)

    def _resolve(self, msg: Resolve) -> None:
        if self.models_scope.cancel_called:
            answer(msg.reply, ShuttingDown())
            return
        token = object()
        try:
            self.limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            answer(msg.reply, ResolutionBusy())
            return
        if self.resolve_fn is resolve_in_registry or msg.exact:
            # the common case answers in this turn of the loop: no task, the slot back at once
            # unless a load takes it; a name not known yet is looked for in the library
            try:
                found: ModelEntry | TurboSparkError = self._find_now(msg)
            except (ModelNotFound, NoModel):
                found = None  # type: ignore[assignment]
            except TurboSparkError as exc:
                found = exc
            if found is not None:
                self._looked(_Looked(msg, found, token, trio.current_time()))
                return
        self.tasks.start_soon(self._look_up, msg, token)

    def _looked(self, msg: _Looked) -> None:
        request, found = msg.request, msg.result
        if isinstance(found, TurboSparkError) or self.models_scope.cancel_called or _gone(request):
            self.limiter.release_on_behalf_of(msg.token)
            answer(request.reply, found if isinstance(found, TurboSparkError) else ShuttingDown())
            return
        loadable = self.known.get(found.id)
        if loadable is None:  # an embedding model: always loaded
            self.limiter.release_on_behalf_of(msg.token)
            answer(request.reply, Grant(found, None))
            return
        model = self.models.get(found.id)
        if model is None:
            keep = self.life.keep_alive if not loadable.pinned else FOREVER
            model = self.models[found.id] = _Model(loadable, keep, token=msg.token)
        else:
            self.limiter.release_on_behalf_of(msg.token)
        self._keep(model, request.keep_alive)
        if model.state == "ready":
            self._grant(model, request, 0.0)
            return
        model.waiters.append(request)
        model.asked[request] = msg.asked
        self._advance()

    def _keep(self, model: _Model, keep_alive: float | None) -> None:
        """The latest request's keep_alive is the model's; a request that does not say gives
        the default, except to a model named on --model, which keeps its own."""
        if keep_alive is not None:
            model.keep_alive = keep_alive
        elif not model.loadable.pinned:
            model.keep_alive = self.life.keep_alive

    def _grant(self, model: _Model, request: Resolve, waited: float) -> None:
        assert model.entry is not None
        lease = next(self.lease_ids)
        try:
            request.reply.send_nowait(Grant(model.entry, lease, waited))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the asker left
        else:
            model.leases.add(lease)
            self.leases[lease] = model
            model.expires = math.inf
        finally:
            request.reply.close()
        model.last_used = trio.current_time()
        if not model.leases:
            self._idle(model)

    def _release(self, lease: int) -> None:
        model = self.leases.pop(lease, None)
        if model is None:
            return
        model.leases.discard(lease)
        model.last_used = trio.current_time()
        if not model.leases:
            self._idle(model)
        self._advance()

    def _idle(self, model: _Model) -> None:
        if model.state != "ready":
            return
        if model.keep_alive <= 0:
            self._unload(model, "requested")
        else:
            model.expires = trio.current_time() + model.keep_alive

    def _abandon(self, request: Resolve) -> None:
        for model in list(self.models.values()):
            if request in model.waiters:
                model.waiters.remove(request)
                model.asked.pop(request, None)
                if not model.waiters and not model.leases and model not in self.starting:
                    if model.state == "pending":
                        del self.models[model.id]
                        self._free_slot(model)
                    elif model.state == "loading":
                        model.reason = "cancelled"
                        self._leave(model)
                return

    def _unload_request(self, msg: Unload) -> None:
        registry = self.published.registry
        name = msg.name
        entry = registry.lookup(name) or (registry.lookup(name[: -len(":latest")]) if name.endswith(":latest") else None)
        if entry is None:
            answer(msg.reply, ModelNotFound(name, []))
            return
        model = self.models.get(entry.id)
        if model is not None:
            model.keep_alive = 0.0
            if model.state == "ready" and not model.leases:
                self._unload(model, "requested")
                self._advance()
        answer(msg.reply, model.entry if model is not None and model.entry is not None else entry)

    def _running(self) -> list[LoadedModel]:
        now, wall = trio.current_time(), time.time()
        out = []
        for model in self.models.values():
            if model.state != "ready" or model.entry is None:
                continue
            if model.leases:
                expires = None if model.keep_alive == FOREVER else wall + model.keep_alive
            else:
                expires = None if model.expires == math.inf else wall + (model.expires - now)
            out.append(LoadedModel(model.entry, model.loadable, expires, len(model.leases)))
        return out

    # --- loading and unloading ------------------------------------------------------------

    def _residents(self) -> list[Resident]:
        out = [
            Resident(m.id, m.loadable.size, bool(m.leases) or m.state != "ready", m.loadable.pinned, m.last_used)
            for m in self.models.values() if m.state in ("loading", "ready")
        ]
        out += [Resident(m.id, m.loadable.size, True, m.loadable.pinned, m.last_used) for m in self.leaving.values()]
        return out

    def _advance(self) -> None:
        """Start the pending loads that fit, unloading idle models to make room."""
        for model in [m for m in self.models.values() if m.state == "pending"]:
            if self.models_scope.cancel_called:
                self._fail(model, ShuttingDown())
                continue
            if model.id in self.leaving:
                continue  # its previous instance is still stopping
            victims = evictions(
                self._residents(), model.loadable.size,
                max_models=self.life.max_models, max_memory=self.life.max_memory,
            )
            if victims is None:
                continue
            if victims:
                for victim in victims:
                    self._unload(self.models[victim], "evicted")
                continue  # loads once they have stopped
            self._start(model)

    def _start(self, model: _Model) -> None:
        model.state = "loading"
        model.began = trio.current_time()
        self.nursery.start_soon(self._life, model)

    async def _life(self, model: _Model) -> None:
        """A model from load to unload, in its own cancel scope."""
        error: BaseException | None = None
        try:
            with model.scope:
                await self.life.queue.send(Open(model.id))
                async with trio.open_nursery() as nursery:
                    info = await nursery.start(partial(self.life.start_model, model.id, model.loadable.make))
                    await self.post.send(_Ready(model, info))
        except Exception as exc:
            error = exc
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.post.send(_Ended(model, error))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the resolver itself has ended (the server is stopping)

    def _ready(self, model: _Model, info: Any) -> None:
        if model.state != "loading":
            return
        model.state = "ready"
        model.entry = entry_for(model.loadable, info)
        seconds = trio.current_time() - model.began
        self.life.emit(ModelLoaded(model.id, seconds, model.loadable.size))
        self._free_slot(model)
        self.starting.discard(model)
        self._publish()
        waiters, model.waiters = model.waiters, []
        for request in waiters:
            self._grant(model, request, trio.current_time() - model.asked.pop(request, model.began))
        if not model.leases:
            self._idle(model)

    def _unload(self, model: _Model, reason: str) -> None:
        model.reason = reason
        self._leave(model)

    def _leave(self, model: _Model) -> None:
        if self.models.get(model.id) is model:
            del self.models[model.id]
        model.state = "leaving"
        self.leaving[model.id] = model
        model.scope.cancel()

    def _ended(self, model: _Model, error: BaseException | None) -> None:
        was_ready = model.entry is not None
        if self.leaving.get(model.id) is model:
            del self.leaving[model.id]
        if self.models.get(model.id) is model:
            del self.models[model.id]
            model.reason = "failed"
        self._free_slot(model)
        for lease in model.leases:
            self.leases.pop(lease, None)
        if error is not None:
            log.error("model %s stopped: %r", model.id, error, exc_info=error)
        if model in self.starting:
            self.starting.discard(model)
            self.start_error = self.start_error or error or ShuttingDown()
        if model.waiters:
            self._fail(model, ShuttingDown() if self.models_scope.cancel_called else ModelLoadFailed())
        if was_ready:
            reason = "shutdown" if self.models_scope.cancel_called else model.reason
            self.life.emit(ModelUnloaded(model.id, reason))
            self._publish()
        self._advance()

    def _fail(self, model: _Model, error: TurboSparkError) -> None:
        for request in model.waiters:
            answer(request.reply, error)
        model.waiters.clear()
        if self.models.get(model.id) is model and model.state == "pending":
            del self.models[model.id]
            self._free_slot(model)

    def _free_slot(self, model: _Model) -> None:
        if model.token is not None:
            self.limiter.release_on_behalf_of(model.token)
            model.token = None


def _gone(request: Resolve) -> bool:
    try:
        return request.reply.statistics().open_receive_channels == 0
    except trio.ClosedResourceError:
        return True


@attrs.define
class Published:
    """The resolver's latest registry of every known model: an immutable snapshot that routes
    which never resolve (``/v1/models``, ``/health``) read."""

    registry: Registry = attrs.field(factory=Registry)
    loadables: Mapping[str, Loadable] = attrs.field(factory=dict)  # what the library says of each


async def resolver(
    inbox: trio.MemoryReceiveChannel[Any],
    post: trio.MemorySendChannel[Any],
    *,
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
    """Serve ``inbox`` until cancelled; ``post`` is a send end of ``inbox`` for its own tasks.
    Ready once every pinned model has loaded (a failure there is raised)."""
    with inbox, post:
        async with trio.open_nursery() as tasks:
            models: trio.Nursery = await tasks.start(_models_nursery, models_scope)
            state = _Resolver(post, tasks, models, models_scope, lifecycle, library, pinned, fixed,
                              resolve, slots, published)
            try:
                state.handle(_Known(tuple(await trio.to_thread.run_sync(library))))
            except Exception:
                log.exception("reading the model library failed")
            for loadable in pinned:
                model = state.models[loadable.id] = _Model(loadable, FOREVER)
                state.starting.add(model)
                state._start(model)
            ready = not pinned
            if ready:
                task_status.started()
            while True:
                with trio.move_on_at(state.next_deadline()):
                    msg = await inbox.receive()
                    state.handle(msg)
                    if state.start_error is not None and not ready:
                        raise state.start_error
                    if not ready and not state.starting:
                        ready = True
                        task_status.started()
                    continue
                state.expire()


async def _models_nursery(scope: trio.CancelScope, *, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    with scope:
        async with trio.open_nursery() as nursery:
            task_status.started(nursery)
            await trio.sleep_forever()


def loadable_for(spec: Any, info: Mapping[str, Any] | None = None) -> Loadable:
    """A backend handed to ``serve`` directly (tests, scripted runs): loaded at start, kept."""
    return Loadable(
        id=spec.id, make=spec.make, capabilities=frozenset({"chat", "completion"}),
        context_window=0, size=0, pinned=True, card=ModelCard(format="scripted", family="scripted"),
    )
