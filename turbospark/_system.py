"""The actor tree: ``run_system`` starts every actor in dependency order and hands back a
``System``, the immutable set of handles routes use to talk to them.

    run_system (one nursery)
    ├── observer            inbox: events, RenderMetrics, Subscribe
    ├── generation_queue    inbox: Submit, Withdraw, Take, Retire, Open
    ├── audio_actor         inbox: ResolveAudio, SubmitAudio, jobs, AttachModel/DetachModel;
    │                       runs the attached audio models' worker threads and queues, and the
    │                       async jobs (started when an audio model may be served)
    ├── images_actor        inbox: AttachImages/DetachImages, SubmitImage; image models' threads
    ├── pulls               inbox: Pull (with a model store); one job per model pulled
    ├── parser              inbox: ParseJson, DumpJson; JSON too big for the loop, in a child process
    ├── mcp_server × server inbox: ListTools, CallTool; one per server of --mcp-config, owning its
    │                       child process or connection (``actors/mcp.py``)
    └── resolver            inbox: Resolve, Unload, Running, Refresh, Adopt; notes (unbounded, never
        │                   dropped): Release, Abandon; owns the resolution slots, keep-alives and:
        └── models nursery (``System.models_scope``)
            └── one life × loaded model, each in its own cancel scope (loaded on demand,
                unloaded when idle; the models handed to ``serve`` loaded at start and kept):
                ├── model_actor       a generation model; Take goes to the queue
                ├── embedding_model   an embedding actor and its inbox (on the model's entry)
                ├── attached_audio    an audio model, attached to the audio actor meanwhile
                └── attached          an image model, attached to the images actor meanwhile

Shutdown begins with ``System.stop_models``: the models' scope is cancelled (each model thread
answers what it holds ``ShuttingDown`` within a step; the queue, told by ``Retire``, what waits),
and so are the embedding, audio and images actors'.  The rest of the tree keeps serving the routes
until the root nursery (``server.serve``) ends after HTTP has.
"""

from __future__ import annotations

import math
import weakref
from contextlib import ExitStack
from collections.abc import Mapping, Sequence
from typing import Any
from functools import partial

import attrs
import trio

from ._collector import collecting
from ._scope import current_scope, enter_request_scope, request_scope
from .actors._attached import attached, attached_audio
from .actors._mailbox import call
from .actors.audio import AudioMessage, audio_actor
from .actors.embedding import embedding_model
from .actors.images import AttachImages, DetachImages, ImageMessage, images_actor
from .images.files import ImageFiles
from .images.messages import ImageSpec
from .actors.generation import QueueMessage, generation_queue
from .actors.models import model_actor
from .actors.pulls import Pull, pulls
from .actors.mcp import McpServers, start_mcp_servers
from .actors.parser import DumpJson, ParseJson, parser
from .actors.observer import Event, Observer, ObserverMessage, ReadDepths, RenderMetrics, Subscribe, observer
from .actors.resolution import Abandon, Adopt, Grant, Lifecycle, LoadedModel, Published, Refresh, Release, Resolve, Running, Unload
from .actors.resolver import Library, ResolveFn, resolve_in_registry, resolver
from .config import Settings
from .turns.conversations import ResponseStore
from .errors import QueueFull, ShuttingDown, TurboSparkError
from .messages import EmbeddingJob, Failed, GenerationJob, QueueRejected, SlotCommand, Submit, Withdraw
from .threads.encoder_thread import EmbeddingLimits
from .threads.model_thread import Limits
from .model.backend import BackendSpec
from .model.encoder import EncoderSpec
from .audio.engines import AudioSpec
from .actors.lifecycle import Loadable, pinned_loadable
from .actors.registry import Capability, ModelEntry, Registry

__all__ = [
    "BackendSpec", "EncoderSpec", "System", "current_scope", "enter_request_scope", "request_scope",
    "run_system", "SystemSpec",
]

@attrs.frozen
class System:
    settings: Settings
    observer: Observer
    queue: trio.MemorySendChannel[QueueMessage]
    resolver: trio.MemorySendChannel[Any]
    #: the resolver's lease bookkeeping (Release, Abandon): unbounded, so never dropped
    notes: trio.MemorySendChannel[Any] | None = None
    published: Published = attrs.field(factory=Published)
    #: cancelled at shutdown: every model actor (the resolver's nursery) and every load
    models_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: cancelled at shutdown with it: the audio and images actors' own scopes
    model_scopes: tuple[trio.CancelScope, ...] = ()
    responses: ResponseStore = attrs.field(factory=ResponseStore)  # for previous_response_id
    #: the audio jobs actor's inbox (None: no audio model may be served, no audio routes)
    audio: trio.MemorySendChannel[AudioMessage] | None = None
    #: the images actor's inbox (None: no image model may be served); the images kept for URLs
    images: trio.MemorySendChannel[ImageMessage] | None = None
    image_files: ImageFiles = attrs.field(factory=ImageFiles)
    #: the model store routes manage (pull, delete, copy); None when the server has none
    shelf: Any = None
    #: the pulls actor's inbox (with a model store): every /api/pull is one of its jobs
    pulls: trio.MemorySendChannel[Pull] | None = None
    #: the parser actor's inbox: big request bodies are decoded, big answers written, off the loop
    parser: trio.MemorySendChannel[ParseJson | DumpJson] | None = None
    #: the aliases ``POST /v1/audio/models`` may attach, each with how to build its spec
    #: (pulling it into the store: call it on a worker thread)
    audio_catalogue: Mapping[str, Any] = attrs.field(factory=dict)
    #: the generation jobs submitted, while anything holds them (weak), for ``fail``
    jobs: weakref.WeakSet[GenerationJob] = attrs.field(factory=weakref.WeakSet)
    #: the error every request gets once the server can serve nothing more (``fail``)
    failure: list[TurboSparkError] = attrs.field(factory=list)
    #: the MCP servers' actors (serve --mcp-config), by name
    mcp: McpServers = attrs.field(factory=McpServers)

    @property
    def registry(self) -> Registry:
        """Every known model (loaded or loadable): the resolver's latest snapshot."""
        return self.published.registry

    def stop_models(self) -> None:
        """Shutdown's first step: every model thread (of every kind) stops within a step and answers
        what it runs ``ShuttingDown``, the queue what waits; the other actors keep serving."""
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
        exact: bool = False, scope: ExitStack | None = None,
    ) -> Grant:
        """``resolve``, with how long the request waited for a load.  The lease is held until
        ``scope`` closes (default: the current request's)."""
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
            scope = scope if scope is not None else current_scope()
            if scope is None:
                self._post(Release(result.lease))
            else:
                scope.callback(self._post, Release(result.lease))
        return result

    def _post(self, msg: object) -> None:
        """Sync, never blocking, never dropped: safe in a cancelled ``finally``.  The notes
        channel is unbounded; what it holds is bounded by the leases and resolutions
        outstanding (decision 0019)."""
        try:
            (self.notes or self.resolver).send_nowait(msg)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the resolver has ended (the server is stopping)

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

    async def adopt(self, loadable: Loadable) -> Registry:
        """Know ``loadable`` too, pinned; it loads when a request names it."""
        return await call(self.resolver, partial(Adopt, loadable))

    async def submit(self, job: GenerationJob) -> None:
        self.jobs.add(job)
        await self.queue.send(Submit(job))

    def fail(self, error: TurboSparkError) -> None:
        """The server can serve nothing more (a rank of its sharded model is lost): every job a
        route still reads is answered ``error`` now, and every new request gets it (``web/app.py``)."""
        self.failure.append(error)
        for job in list(self.jobs):
            try:
                job.reply.send_nowait(Failed(error))
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # its route has left, or the job ended

    def withdraw(self, job: GenerationJob) -> None:
        """Tell the queue the route is leaving (sync: safe in a cancelled ``finally``)."""
        try:
            self.queue.send_nowait(Withdraw(job))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the model thread's first send will find the closed reply channel instead

    def embed(self, model: ModelEntry, job: EmbeddingJob) -> None:
        """Hand ``job`` to embedding model ``model`` (its loaded entry), or refuse it at once:
        ``QueueFull`` when ``max_queue`` jobs already wait, ``ShuttingDown`` when it has stopped."""
        if model.inbox is None:
            raise ShuttingDown()
        try:
            model.inbox.send_nowait(job)
        except trio.WouldBlock:
            self.emit(QueueRejected(job.request_id, job.model))
            raise QueueFull(job.model, embedding_queue(self.settings)) from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ShuttingDown() from None

    async def slots(self, model: ModelEntry, action: str, slot: int | None, filename: str | None) -> Any:
        """Run a slot command on generation model ``model``'s thread (its loaded entry): the
        answer's body, or the ``SlotError`` (or other error) that says why not."""
        if model.inbox is None:
            raise ShuttingDown()
        reply_send, reply_recv = trio.open_memory_channel[Any](1)
        with reply_recv:
            try:
                await model.inbox.send(SlotCommand(action, slot, filename, reply_send))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                raise ShuttingDown() from None
            try:
                return await reply_recv.receive()
            except trio.EndOfChannel:
                raise ShuttingDown() from None

    async def metrics(self) -> bytes:
        return await call(self.observer.inbox, partial(RenderMetrics, dropped=self.observer.dropped))

    async def queue_depths(self) -> dict[str, int]:
        """How many generations wait for each model now."""
        return await call(self.observer.inbox, ReadDepths)

    def subscribe(self, buffer: int = 256) -> trio.MemoryReceiveChannel[Event]:
        """A channel that receives every event from now on (dropped if it falls behind)."""
        send, recv = trio.open_memory_channel[Event](buffer)
        self.observer.inbox.send_nowait(Subscribe(send))
        return recv

    async def watch(self, buffer: int = 4096) -> tuple[bytes, trio.MemoryReceiveChannel[Event]]:
        """The metrics as they stand and a channel of every event after them: both messages go
        into the observer's inbox with no checkpoint between, so nothing is counted twice or
        missed."""
        reply_send, reply_recv = trio.open_memory_channel[bytes](1)
        send, recv = trio.open_memory_channel[Event](buffer)
        self.observer.inbox.send_nowait(RenderMetrics(reply_send, self.observer.dropped))
        self.observer.inbox.send_nowait(Subscribe(send))
        with reply_recv:
            return await reply_recv.receive(), recv


@attrs.frozen
class SystemSpec:
    """What ``run_system`` (and ``server.serve``) is given.  ``backends``: models loaded at start
    and kept (pinned): generation backends, encoders, audio engines, or ``Loadable``s;
    ``library``: every model that may be loaded on demand."""

    settings: Settings
    backends: Sequence[BackendSpec | EncoderSpec | AudioSpec | ImageSpec | Loadable]
    resolve: ResolveFn = resolve_in_registry
    audio_catalogue: Mapping[str, Any] | None = None
    library: Library = tuple
    shelf: Any = None


async def run_system(spec: SystemSpec, *, task_status: trio.TaskStatus[System] = trio.TASK_STATUS_IGNORED) -> None:
    """Start the actor tree for ``spec``; ready with the ``System`` of handles to it."""
    settings, backends, library = spec.settings, spec.backends, spec.library
    async with trio.open_nursery() as nursery:
        obs_send, obs_recv = trio.open_memory_channel[ObserverMessage](4096)
        faults = await nursery.start(partial(observer, obs_recv, events_path=settings.events_path))
        obs = Observer(obs_send, faults)

        # Withdraw is sent with send_nowait from cancelled routes: leave it room.
        queue_send, queue_recv = trio.open_memory_channel[QueueMessage](QUEUE_INBOX)
        await nursery.start(
            partial(generation_queue, queue_recv, obs.emit, max_queue=settings.max_queue)
        )

        pinned = [pinned_loadable(spec) for spec in backends]
        scopes: list[trio.CancelScope] = []
        audio_send = None
        if library is not tuple or any(p.kind in _AUDIO_TASK for p in pinned):
            # the audio routes exist when an audio model may be served: one given, or a store
            audio_send, audio_recv = trio.open_memory_channel[AudioMessage](256)
            scopes.append(scope := trio.CancelScope())
            await nursery.start(_in_scope, scope, partial(audio_actor, (), audio_recv, obs.emit))

        images_send = None
        if library is not tuple or any(p.kind == "text-to-image" for p in pinned):  # a store, or one given
            images_send, images_recv = trio.open_memory_channel[ImageMessage](256)
            scopes.append(scope := trio.CancelScope())
            await nursery.start(_in_scope, scope, partial(images_actor, images_recv, obs.emit, queue_size=settings.max_queue))

        limits = Limits(settings.max_batch, settings.kv_budget, settings.special_tokens_in_content)
        embedding_limits = EmbeddingLimits(settings.embedding_batch, embedding_queue(settings))

        async def start_model(loadable: Loadable, *, task_status: trio.TaskStatus[Any]) -> None:
            if loadable.kind == "generation":
                await model_actor(loadable.id, loadable.make, queue_send.clone(), obs.emit, limits,
                                  task_status=task_status)
            elif loadable.kind == "embedding":
                await embedding_model(loadable.id, loadable.make, obs.emit, embedding_limits,
                                      task_status=task_status)
            elif loadable.kind == "text-to-image":
                await attached(images_send, partial(AttachImages, loadable.id, loadable.make),
                               partial(DetachImages, loadable.id), task_status=task_status)
            else:
                spec = AudioSpec(loadable.id, _AUDIO_TASK[loadable.kind], loadable.make)
                await attached_audio(audio_send, spec, task_status=task_status)

        lifecycle = Lifecycle(
            start_model=collecting(nursery, start_model), queue=queue_send, emit=obs.emit,
            keep_alive=settings.keep_alive, max_models=settings.max_loaded_models,
            max_memory=settings.max_loaded_memory,
        )
        resolve_send, resolve_recv = trio.open_memory_channel[Any](RESOLVER_INBOX)
        # Release and Abandon are sent with send_nowait from leaving routes: their own channel
        notes_send, notes_recv = trio.open_memory_channel[Any](math.inf)
        published = Published()
        models_scope = trio.CancelScope()
        await nursery.start(
            partial(
                resolver, resolve_recv, resolve_send.clone(), notes=(notes_send.clone(), notes_recv),
                lifecycle=lifecycle, published=published,
                models_scope=models_scope, library=library, pinned=pinned,
                slots=settings.max_resolutions, resolve=spec.resolve,
            )
        )
        pulls_send = None
        if spec.shelf is not None:
            pulls_send, pulls_recv = trio.open_memory_channel[Pull](64)
            await nursery.start(pulls, pulls_recv, lambda name, report: spec.shelf.pull(name, report))
        parse_send, parse_recv = trio.open_memory_channel[ParseJson | DumpJson](64)
        await nursery.start(parser, parse_recv)
        mcp = await start_mcp_servers(nursery, settings.mcp_servers, obs.emit, remotes=settings.mcp_urls)
        task_status.started(
            System(
                settings=settings,
                observer=obs,
                queue=queue_send,
                resolver=resolve_send,
                notes=notes_send,
                published=published,
                models_scope=models_scope,
                model_scopes=tuple(scopes),
                audio=audio_send,
                images=images_send,
                shelf=spec.shelf,
                pulls=pulls_send,
                parser=parse_send,
                audio_catalogue=spec.audio_catalogue or {},
                mcp=mcp,
            )
        )


#: how many Resolve, Unload, Running, Refresh and Adopt may wait for the resolver (a route's
#: send waits when it is full; lease bookkeeping has its own channel)
RESOLVER_INBOX = 1024
#: how many Submit, Take and Open may wait for the queue (Withdraw too: one dropped on a full inbox
#: only costs a place until the model thread finds its reply channel closed)
QUEUE_INBOX = 1024

_AUDIO_TASK: dict[str, Any] = {"speech-to-text": "speech_to_text", "text-to-speech": "text_to_speech"}
def embedding_queue(settings: Settings) -> int:
    """Embedding jobs allowed to wait per model (and held by its thread at once): ``max_queue``, or
    a forward pass's worth of single-input requests if more (what batching is for)."""
    return max(settings.max_queue, settings.embedding_batch)


async def _in_scope(scope: trio.CancelScope, actor: Any, *, task_status: trio.TaskStatus[Any]) -> None:
    with scope:
        await actor(task_status=task_status)
