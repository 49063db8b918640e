"""The actor tree: ``run_system`` starts every actor in dependency order and hands back a
``System``, the immutable set of handles routes use to talk to them.

    run_system (one nursery)
    ├── observer            inbox: events, RenderMetrics, Subscribe
    ├── generation_queue    inbox: Submit, Withdraw, Take, Retire, Open
    ├── embedding_actor × M inbox: EmbeddingJob; each owns one pinned encoder thread
    ├── audio_actor         inbox: ResolveAudio, SubmitAudio, jobs, attach/detach; owns the audio
    │                       models' worker threads and queues, and the async jobs
    └── resolver            inbox: Resolve, Abandon, Release, Unload, Running, Refresh; owns
        │                   the resolution slots, the keep-alive timers and:
        └── models nursery (``System.models_scope``)
            └── model_actor × loaded, each in its own cancel scope (loaded on demand,
                                    unloaded when idle); Take goes to the queue

Shutdown begins with ``System.stop_models``: the models' scope is cancelled (each model actor's,
its thread notices at its next ``check_cancelled`` (one step) and answers every sequence it holds
``ShuttingDown``; the queue, told by ``Retire``, answers the jobs still waiting.  Embedding actors
are cancelled the same way: the encoder thread answers what it holds, the actor what waits in its
inbox.  The rest of the
tree keeps serving the routes until the root nursery (``server.serve``) ends after HTTP has.
"""

from __future__ import annotations

import contextvars
import time
from contextlib import ExitStack
from collections.abc import Mapping, Sequence
from typing import Any
from functools import partial

import attrs
import trio

from .actors._mailbox import call
from .actors.audio import AudioMessage, audio_actor
from .actors.embedding import embedding_actor
from .actors.generation import QueueMessage, generation_queue
from .actors.models import model_actor
from .actors.observer import Observer, ObserverMessage, RenderMetrics, Subscribe, observer
from .actors.resolution import (
    Abandon, Grant, Lifecycle, LoadedModel, Published, Refresh, Release, Resolve, Running, Unload,
)
from .actors.resolver import Library, ResolveFn, resolve_in_registry, resolver
from .config import Settings
from .turns.conversations import ResponseStore
from .errors import QueueFull, ShuttingDown, TurboSparkError
from .actors.observer import Event
from .messages import EmbeddingJob, GenerationJob, QueueRejected, Submit, Withdraw
from .threads.encoder_thread import EmbeddingLimits
from .threads.model_thread import Limits
from .model.backend import BackendSpec
from .model.encoder import EncoderSpec
from .audio.engines import AudioSpec
from .actors.lifecycle import Loadable, loadable_for
from .actors.registry import Capability, ModelEntry, Registry

__all__ = [
    "BackendSpec", "EncoderSpec", "System", "current_scope", "enter_request_scope", "request_scope",
    "run_system",
]

# --- the request scope -------------------------------------------------------------------------
# An ``ExitStack`` that lives exactly as long as the current HTTP request (body included, or until
# its client leaves). ``web/app.py`` sets it for every request; whatever a request holds (reply
# channels, the model leases ``System.resolve`` grants) is put there and let go when it ends.
_request_scope: contextvars.ContextVar[ExitStack] = contextvars.ContextVar("turbospark_request_scope")


def request_scope() -> ExitStack:
    """The exit stack of the current HTTP request (closed when its connection scope ends)."""
    return _request_scope.get()


def current_scope() -> ExitStack | None:
    """The current request's exit stack, or None outside a request."""
    return _request_scope.get(None)


def enter_request_scope(stack: ExitStack) -> contextvars.Token[ExitStack]:
    """Make ``stack`` the current request's scope (``web/app.py``, once per request)."""
    return _request_scope.set(stack)



@attrs.frozen
class System:
    settings: Settings
    observer: Observer
    queue: trio.MemorySendChannel[QueueMessage]
    resolver: trio.MemorySendChannel[Any]
    published: Published = attrs.field(factory=Published)
    #: cancelled at shutdown: every model actor (the resolver's nursery) and every load
    models_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: each embedding actor's own scope
    model_scopes: tuple[trio.CancelScope, ...] = ()
    responses: ResponseStore = attrs.field(factory=ResponseStore)  # for previous_response_id
    #: each embedding model's inbox, by id
    embedders: Mapping[str, trio.MemorySendChannel[EmbeddingJob]] = attrs.field(factory=dict)
    #: the audio jobs actor's inbox (None: no audio model was attached at start, no audio routes)
    audio: trio.MemorySendChannel[AudioMessage] | None = None
    #: the model store routes manage (pull, delete, copy); None when the server has none
    shelf: Any = None

    @property
    def registry(self) -> Registry:
        """Every known model (loaded or loadable): the resolver's latest snapshot."""
        return self.published.registry

    def stop_models(self) -> None:
        """Shutdown's first step: every model thread stops within a step and answers what it
        runs ``ShuttingDown``; the queue answers what waits.  The other actors keep serving the
        routes until the root nursery ends."""
        self.models_scope.cancel()
        for scope in self.model_scopes:
            scope.cancel()

    def emit(self, event: object) -> None:
        self.observer.emit(event)

    async def resolve(
        self, name: str | None, want: Capability = "chat", *, keep_alive: float | None = None,
        exact: bool = False,
    ) -> ModelEntry:
        """Which model answers ``name``, loaded; raises the resolution error (404/503)
        otherwise.  Within a request, the model stays loaded until the request ends."""
        return (await self.lease(name, want, keep_alive=keep_alive, exact=exact)).entry

    async def lease(
        self, name: str | None, want: Capability = "chat", *, keep_alive: float | None = None,
        exact: bool = False,
    ) -> Grant:
        """``resolve``, with how long the request waited for a load."""
        reply_send, reply_recv = trio.open_memory_channel[Grant | TurboSparkError](1)
        msg = Resolve(name, want, reply_send, keep_alive, exact)
        result: Grant | TurboSparkError | None = None
        with reply_recv:
            try:
                await self.resolver.send(msg)
                result = await reply_recv.receive()
            finally:
                if result is None:  # left before the answer: a grant already sent goes back
                    try:
                        late = reply_recv.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        late = None
                    if isinstance(late, Grant) and late.lease is not None:
                        self._post(Release(late.lease))
                    self._post(Abandon(msg))
        if isinstance(result, TurboSparkError):
            raise result
        if result.lease is not None:
            scope = current_scope()
            if scope is None:
                self._post(Release(result.lease))
            else:
                scope.callback(self._post, Release(result.lease))
        return result

    def _post(self, msg: object) -> None:
        """Sync, never blocking: safe in a cancelled ``finally`` (the inbox leaves room)."""
        try:
            self.resolver.send_nowait(msg)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def unload(self, name: str) -> ModelEntry:
        """Unload ``name`` now if idle, else once its requests end; 404 if unknown."""
        answer = await call(self.resolver, partial(Unload, name))
        if isinstance(answer, TurboSparkError):
            raise answer
        return answer

    async def running(self) -> list[LoadedModel]:
        return await call(self.resolver, Running)

    async def refresh(self) -> Registry:
        """Read the library again (after the store changed)."""
        return await call(self.resolver, Refresh)

    async def submit(self, job: GenerationJob) -> None:
        await self.queue.send(Submit(job))

    def withdraw(self, job: GenerationJob) -> None:
        """Tell the queue the route is leaving (sync: safe in a cancelled ``finally``)."""
        try:
            self.queue.send_nowait(Withdraw(job))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the model thread's first send will find the closed reply channel instead

    def embed(self, job: EmbeddingJob) -> None:
        """Hand ``job`` to its embedding model, or refuse it at once: ``QueueFull`` when
        ``max_queue`` jobs already wait, ``ShuttingDown`` when the model has stopped."""
        try:
            self.embedders[job.model].send_nowait(job)
        except trio.WouldBlock:
            self.emit(QueueRejected(job.request_id, job.model))
            raise QueueFull(job.model, embedding_queue(self.settings)) from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ShuttingDown() from None

    async def metrics(self) -> bytes:
        return await call(self.observer.inbox, partial(RenderMetrics, dropped=self.observer.dropped))

    def subscribe(self, buffer: int = 256) -> trio.MemoryReceiveChannel[Event]:
        """A channel that receives every event from now on (dropped if it falls behind)."""
        send, recv = trio.open_memory_channel[Event](buffer)
        self.observer.inbox.send_nowait(Subscribe(send))
        return recv


async def run_system(
    settings: Settings,
    backends: Sequence[BackendSpec | EncoderSpec | AudioSpec | Loadable],
    *,
    resolve: ResolveFn = resolve_in_registry,
    audio_catalogue: Mapping[str, Any] | None = None,
    library: Library = tuple,
    shelf: Any = None,
    task_status: trio.TaskStatus[System] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``backends``: models loaded at start and kept (``BackendSpec`` or pinned ``Loadable``)
    and embedding models; ``library``: every model that may be loaded on demand."""
    async with trio.open_nursery() as nursery:
        obs_send, obs_recv = trio.open_memory_channel[ObserverMessage](4096)
        await nursery.start(partial(observer, obs_recv, events_path=settings.events_path))
        obs = Observer(obs_send)

        # Withdraw is sent with send_nowait from cancelled routes: leave it room.
        queue_send, queue_recv = trio.open_memory_channel[QueueMessage](1024)
        await nursery.start(
            partial(generation_queue, queue_recv, obs.emit, max_queue=settings.max_queue)
        )

        fixed = []
        scopes: list[trio.CancelScope] = []
        embedders: dict[str, trio.MemorySendChannel[EmbeddingJob]] = {}
        pinned: list[Loadable] = []
        audio_specs = [spec for spec in backends if isinstance(spec, AudioSpec)]
        audio_send = None
        if audio_specs:
            audio_send, audio_recv = trio.open_memory_channel[AudioMessage](256)
            scopes.append(scope := trio.CancelScope())
            await nursery.start(
                _in_scope, scope,
                partial(audio_actor, audio_specs, audio_recv, obs.emit, catalogue=audio_catalogue or {}),
            )  # fmt: skip
        for spec in backends:
            if isinstance(spec, AudioSpec):
                continue
            if isinstance(spec, EncoderSpec):
                fixed.append(await _start_encoder(nursery, spec, settings, obs, scopes, embedders))
            elif isinstance(spec, Loadable):
                pinned.append(attrs.evolve(spec, pinned=True))
            else:
                pinned.append(loadable_for(spec))

        limits = Limits(settings.max_batch, settings.kv_budget, settings.special_tokens_in_content)

        async def start_model(model_id: str, make: Any, *, task_status: trio.TaskStatus[Any]) -> None:
            await model_actor(model_id, make, queue_send.clone(), obs.emit, limits, task_status=task_status)

        lifecycle = Lifecycle(
            start_model=start_model, queue=queue_send, emit=obs.emit,
            keep_alive=settings.keep_alive, max_models=settings.max_loaded_models,
            max_memory=settings.max_loaded_memory,
        )
        # Release and Abandon are sent with send_nowait from leaving routes: leave them room.
        resolve_send, resolve_recv = trio.open_memory_channel[Any](1024)
        published = Published()
        models_scope = trio.CancelScope()
        await nursery.start(
            partial(
                resolver, resolve_recv, resolve_send.clone(), lifecycle=lifecycle, published=published,
                models_scope=models_scope, library=library, pinned=pinned, fixed=fixed,
                slots=settings.max_resolutions, resolve=resolve,
            )
        )
        task_status.started(
            System(
                settings=settings,
                observer=obs,
                queue=queue_send,
                resolver=resolve_send,
                published=published,
                models_scope=models_scope,
                model_scopes=tuple(scopes),
                embedders=embedders,
                audio=audio_send,
                shelf=shelf,
            )
        )


def embedding_queue(settings: Settings) -> int:
    """Embedding jobs allowed to wait per model (and held by its thread at once)."""
    return max(settings.max_queue, settings.embedding_batch)


async def _start_encoder(
    nursery: trio.Nursery,
    spec: EncoderSpec,
    settings: Settings,
    obs: Observer,
    scopes: list[trio.CancelScope],
    embedders: dict[str, trio.MemorySendChannel[EmbeddingJob]],
) -> ModelEntry:
    """Start one embedding actor (ready once its thread has loaded the encoder).

    Its inbox holds ``max_queue`` jobs, or a forward pass's worth of single-input requests if
    that is more: many small concurrent requests are what batching is for."""
    room = embedding_queue(settings)
    send, recv = trio.open_memory_channel[EmbeddingJob](room)
    limits = EmbeddingLimits(settings.embedding_batch, room)
    scopes.append(scope := trio.CancelScope())
    info = await nursery.start(
        _in_scope, scope, partial(embedding_actor, spec.id, spec.make, recv, obs.emit, limits)
    )
    embedders[info.id] = send
    return ModelEntry(
        id=info.id,
        context_window=info.max_tokens,
        capabilities=frozenset({"embedding"}),
        created=int(time.time()),
        fingerprint=info.fingerprint,
        dimensions=info.dimensions,
    )


async def _in_scope(scope: trio.CancelScope, actor: Any, *, task_status: trio.TaskStatus[Any]) -> None:
    with scope:
        await actor(task_status=task_status)
