"""The observer actor: the one sink for what happened, feeding metrics, the events file and
subscribers.

Anything may ``emit`` an event (a sync, never-blocking call: routes, other actors, and the model
threads through ``from_thread.run_sync``).  The observer keeps the Prometheus metrics, hands each
event as a JSON line to the events file's own writer (``_events_file``: a slow disk never holds
the metrics back), and forwards it to subscribers.  Trio channels do not
broadcast, so every subscriber has its own bounded channel; one that falls behind is dropped and
closed rather than slowing anybody down.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary
from prometheus_client.exposition import generate_latest

from ..messages import (
    BatchState,
    Embedded,
    EmbeddingBatch,
    Generated,
    GenerationBegan,
    FAULT_ACTORS,
    JobFault,
    ModelLoaded,
    ModelUnloaded,
    QueueDepth,
    QueueRejected,
    RequestFinished,
    RequestRouted,
    RequestStarted,
)
from ..audio.messages import (
    AudioBusyEvent, AudioModelsChanged, AudioRequest, AudioWorkBegan, AudioWorkEnded, JobsChanged,
)
from ._image_metrics import IMAGE_EVENTS, ImageMetrics
from ._mcp_metrics import McpCalled, McpMetrics
from ._events_file import EVENTS_FILE_QUEUE, event_to_json, events_writer
from ._latency import Latency
from ._mailbox import answer

__all__ = ["Observer", "RenderMetrics", "Subscribe", "event_to_json", "observer"]

log = logging.getLogger("turbospark")

Event = (
    BatchState
    | RequestStarted
    | RequestRouted
    | GenerationBegan
    | Generated
    | QueueDepth
    | QueueRejected
    | JobFault
    | RequestFinished
    | EmbeddingBatch
    | Embedded
    | AudioRequest
    | AudioBusyEvent
    | AudioWorkBegan
    | AudioWorkEnded
    | AudioModelsChanged
    | JobsChanged  # and the image jobs' (IMAGE_EVENTS)
    | ModelLoaded
    | ModelUnloaded
    | McpCalled
)


@attrs.frozen
class RenderMetrics:
    reply: trio.MemorySendChannel[bytes]
    dropped: int  # events emit() could not deliver (a full inbox), counted by the sender side


@attrs.frozen
class Subscribe:
    events: trio.MemorySendChannel[Event]


@attrs.frozen
class ReadDepths:
    """How many generations wait for each model now (``/health/ready``)."""

    reply: trio.MemorySendChannel[dict[str, int]]


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "turbospark_requests", "HTTP requests answered", ["route", "status"], registry=reg
        )
        self.in_flight = Gauge(
            "turbospark_generations_in_flight",
            "Sequences the models are working on (each choice of a request counts)", registry=reg
        )
        self.queue_depth = Gauge(
            "turbospark_queue_depth", "Generations waiting in the queues", registry=reg
        )
        self.tokens = Counter(
            "turbospark_generated_tokens", "Tokens generated (decode steps)", registry=reg
        )
        self.prompt_tokens = Counter(
            "turbospark_prompt_tokens", "Prompt tokens processed", registry=reg
        )
        self.cancellations = Counter(
            "turbospark_cancellations",
            "Generations stopped because their client left",
            ["phase"],
            registry=reg,
        )
        for phase in ("queued", "prefill", "decode"):
            self.cancellations.labels(phase)
        self.faults = Counter(
            "turbospark_job_faults", "Jobs failed by an internal fault (a 500 with an error id)", ["model"],
            registry=reg,
        )
        self.fault_counts = dict.fromkeys(FAULT_ACTORS, 0)  # shared with the Observer handle
        self.fault_gauge = Gauge(
            "turbospark_faults", "Internal faults by actor (each failed its job alone, or an event)", ["actor"],
            registry=reg,
        )
        self.rejections = Counter(
            "turbospark_queue_rejections", "Requests refused with queue_full", registry=reg
        )
        self.latency = Latency(reg)  # per model, as vLLM's
        self.dropped = Gauge(
            "turbospark_observer_dropped_events",
            "Events lost because the observer's inbox was full (metrics may be off by these)",
            registry=reg,
        )
        self.file_dropped = Counter(
            "turbospark_events_file_dropped",
            "Events left out of --events-file because its writer fell behind (a slow disk)",
            registry=reg,
        )
        self.batch_size = Gauge(
            "turbospark_batch_size", "Sequences in a model's running batch", ["model"], registry=reg
        )
        self.kv_bytes = Gauge(
            "turbospark_kv_cache_bytes",
            "KV cache bytes held by a model's running sequences",
            ["model"],
            registry=reg,
        )
        self.embedding_inputs = Counter(
            "turbospark_embedding_inputs", "Inputs embedded (vectors computed)", registry=reg
        )
        self.embedding_tokens = Counter(
            "turbospark_embedding_tokens", "Tokens read by the encoders (padding excluded)", registry=reg
        )
        self.embedding_batch = Histogram(
            "turbospark_embedding_batch_inputs",
            "Inputs per encoder forward pass, from any number of requests",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=reg,
        )
        self.embedding_ends = Counter(
            "turbospark_embedding_requests",
            "Embedding requests ended, by outcome (Done, Cancelled, Error, Shutdown)",
            ["outcome"],
            registry=reg,
        )
        for outcome in ("Done", "Cancelled", "Error", "Shutdown"):
            self.embedding_ends.labels(outcome)
        # audio (the original server's series, plus work by outcome and the audio processed)
        self.audio_requests = Counter(
            "turbospark_audio_requests", "Audio requests answered, by endpoint and status",
            ["endpoint", "status"], registry=reg,
        )  # fmt: skip
        self.audio_duration = Summary(
            "turbospark_audio_request_duration_seconds", "Time to answer audio requests (headers, for streams)",
            ["endpoint", "status"], registry=reg,
        )  # fmt: skip
        self.audio_in_flight = Gauge(
            "turbospark_audio_in_flight", "Audio work an audio model's thread is running", registry=reg
        )
        self.audio_busy = Counter("turbospark_audio_busy", "Audio requests refused with 429", registry=reg)
        self.audio_models = Gauge("turbospark_audio_models_loaded", "Audio models attached", registry=reg)
        self.audio_jobs = Gauge("turbospark_audio_jobs", "Async audio jobs by status", ["status"], registry=reg)
        for status in ("running", "succeeded", "failed", "cancelled"):
            self.audio_jobs.labels(status)
        self.audio_work = Counter(
            "turbospark_audio_work", "Audio work ended, by endpoint and outcome (done, failed, cancelled, shutdown)",
            ["endpoint", "outcome"], registry=reg,
        )  # fmt: skip
        self.audio_cancellations = Counter(
            "turbospark_audio_cancellations", "Audio work stopped because its client left, by phase",
            ["phase"], registry=reg,
        )  # fmt: skip
        for phase in ("queued", "running"):
            self.audio_cancellations.labels(phase)
        self.audio_seconds = Counter(
            "turbospark_audio_processed_seconds", "Seconds of audio transcribed or spoken", ["endpoint"], registry=reg
        )
        self.loaded = Gauge(
            "turbospark_loaded_models", "Models loaded now (weights in memory)", registry=reg
        )
        self.loaded_bytes = Gauge(
            "turbospark_loaded_model_bytes", "Memory held by the loaded models' weights", registry=reg
        )
        self.loads = Counter("turbospark_model_loads", "Models loaded", ["model"], registry=reg)
        self.load_seconds = Histogram(
            "turbospark_model_load_seconds",
            "How long a model took to load",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=reg,
        )
        self.unloads = Counter(
            "turbospark_model_unloads",
            "Models unloaded, by reason (expired, evicted, requested, failed, cancelled, shutdown)",
            ["reason"],
            registry=reg,
        )
        for reason in ("expired", "evicted", "requested"):
            self.unloads.labels(reason)
        # per model, for a balancer or an autoscaler (docs/deployment.md, "Metrics")
        self.model_queue = Gauge(
            "turbospark_model_queue_depth", "Generations waiting for a model", ["model"], registry=reg
        )
        self.model_loaded = Gauge(
            "turbospark_model_loaded", "1 while a model is loaded, 0 once unloaded", ["model"], registry=reg
        )
        self.images, self.mcp = ImageMetrics(reg), McpMetrics(reg)
        self._sizes: dict[str, int] = {}
        self._depths: dict[str, int] = {}
        self._running: dict[str, int] = {}

    def record(self, event: Event) -> None:
        if isinstance(event, RequestFinished):
            self.requests.labels(event.route, str(event.status)).inc()
        elif isinstance(event, Generated):
            self.tokens.inc(event.new_tokens)
            self.prompt_tokens.inc(event.prompt_tokens)
            if event.stop_reason == "Cancelled" and event.phase:
                self.cancellations.labels(event.phase).inc()
            self.latency.record(event)
        elif isinstance(event, QueueRejected):
            self.rejections.inc()
        elif isinstance(event, JobFault):
            self.faults.labels(event.model).inc()
        elif isinstance(event, BatchState):
            # Gauges are set from the state each event reports, never counted up and down, so
            # an event dropped under load is corrected by the next one.
            self.batch_size.labels(event.model).set(event.running)
            self.kv_bytes.labels(event.model).set(event.kv_bytes)
            self._running[event.model] = event.running
            self.in_flight.set(sum(self._running.values()))
        elif isinstance(event, EmbeddingBatch):
            self.embedding_inputs.inc(event.inputs)
            self.embedding_tokens.inc(event.tokens)
            self.embedding_batch.observe(event.inputs)
        elif isinstance(event, Embedded):
            self.embedding_ends.labels(event.outcome).inc()
        elif isinstance(event, AudioRequest):
            self.audio_requests.labels(event.endpoint, str(event.status)).inc()
            self.audio_duration.labels(event.endpoint, str(event.status)).observe(event.seconds)
        elif isinstance(event, AudioBusyEvent):
            self.audio_busy.inc()
        elif isinstance(event, AudioWorkBegan):
            self.audio_in_flight.inc()
        elif isinstance(event, AudioWorkEnded):
            if event.phase == "running":
                self.audio_in_flight.dec()
            self.audio_work.labels(event.endpoint, event.outcome).inc()
            if event.outcome == "cancelled":
                self.audio_cancellations.labels(event.phase).inc()
            self.audio_seconds.labels(event.endpoint).inc(event.audio_seconds)
        elif isinstance(event, (*IMAGE_EVENTS, McpCalled)):
            (self.mcp if isinstance(event, McpCalled) else self.images).record(event)
        elif isinstance(event, AudioModelsChanged):
            self.audio_models.set(event.loaded)
        elif isinstance(event, JobsChanged):
            for status, count in event.counts.items():
                self.audio_jobs.labels(status).set(count)
        elif isinstance(event, ModelLoaded):
            self.loads.labels(event.model).inc()
            self.load_seconds.observe(event.seconds)
            self._sizes[event.model] = event.size
            self.model_loaded.labels(event.model).set(1)
            self.loaded.set(len(self._sizes))
            self.loaded_bytes.set(sum(self._sizes.values()))
        elif isinstance(event, ModelUnloaded):
            self.unloads.labels(event.reason).inc()
            self._sizes.pop(event.model, None)
            self.model_loaded.labels(event.model).set(0)
            self.loaded.set(len(self._sizes))
            self.loaded_bytes.set(sum(self._sizes.values()))
        elif isinstance(event, QueueDepth):
            self._depths[event.model] = event.depth
            self.model_queue.labels(event.model).set(event.depth)
            self.queue_depth.set(sum(self._depths.values()))

    def render(self, dropped: int) -> bytes:
        self.dropped.set(dropped)
        for actor, count in self.fault_counts.items():
            self.fault_gauge.labels(actor).set(count)
        return generate_latest(self.registry)


ObserverMessage = Event | RenderMetrics | Subscribe | ReadDepths


@attrs.define
class Observer:
    """The send side every producer uses; ``emit`` never blocks and never raises."""

    inbox: trio.MemorySendChannel[ObserverMessage]
    #: faults by actor (FAULT_ACTORS), shared with the observer: counted here, as they are
    #: emitted, so ``/health`` reads them without waiting and a full inbox loses none
    faults: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(FAULT_ACTORS, 0))
    dropped: int = 0

    def emit(self, event: object) -> None:
        if isinstance(event, JobFault):
            self.faults[event.actor] = self.faults.get(event.actor, 0) + 1
        try:
            self.inbox.send_nowait(event)  # type: ignore[arg-type]
        except trio.WouldBlock:
            self.dropped += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # shutting down


async def observer(
    inbox: trio.MemoryReceiveChannel[ObserverMessage],
    *,
    events_path: Path | None = None,
    task_status: trio.TaskStatus[dict[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Ready with the fault counts it shares with its ``Observer`` handle."""
    metrics = _Metrics()
    subscribers: list[trio.MemorySendChannel[Event]] = []
    # The events file has a task of its own (a slow disk delays the file, never the metrics);
    # a line it has no room for is counted, never waited for.
    lines: trio.MemorySendChannel[str] | None = None
    async with trio.open_nursery() as nursery:
        if events_path is not None:
            lines, pending = trio.open_memory_channel[str](EVENTS_FILE_QUEUE)
            await nursery.start(events_writer, events_path, pending, metrics.fault_counts)
        try:
            await _observe(inbox, metrics, subscribers, lines, task_status)
        finally:
            if lines is not None:
                lines.close()  # the writer writes what waits, then ends


async def _observe(
    inbox: trio.MemoryReceiveChannel[ObserverMessage],
    metrics: _Metrics,
    subscribers: list[trio.MemorySendChannel[Event]],
    lines: trio.MemorySendChannel[str] | None,
    task_status: trio.TaskStatus[dict[str, int]],
) -> None:
    try:
        with inbox:
            task_status.started(metrics.fault_counts)
            async for msg in inbox:
                if isinstance(msg, RenderMetrics):
                    answer(msg.reply, metrics.render(msg.dropped))
                    continue
                if isinstance(msg, Subscribe):
                    subscribers.append(msg.events)
                    continue
                if isinstance(msg, ReadDepths):
                    answer(msg.reply, dict(metrics._depths))
                    continue
                try:
                    metrics.record(msg)
                except Exception:  # one event the metrics cannot read never ends the observer
                    log.exception("recording event %r failed", type(msg).__name__)
                    metrics.fault_counts["observer"] += 1
                if lines is not None:
                    try:
                        lines.send_nowait(json.dumps(event_to_json(msg), default=str) + "\n")
                    except trio.WouldBlock:
                        metrics.file_dropped.inc()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        lines = None  # the file failed: its writer said so and ended
                for sub in list(subscribers):
                    try:
                        sub.send_nowait(msg)
                    except (trio.WouldBlock, trio.BrokenResourceError):
                        subscribers.remove(sub)
                        sub.close()
    finally:
        for sub in subscribers:
            sub.close()
