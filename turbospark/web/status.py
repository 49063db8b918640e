"""The live status the web page shows (sans-io): the observer's events folded into one snapshot.

``GET /status/feed`` (``routes/status_feed.py``) subscribes to the observer and folds every event
into a ``StatusFold`` as it arrives; every tick it sends ``snapshot()``, the state as it stands.
A client that reads slowly gets fewer snapshots, each complete (they coalesce), and never slows
the observer: the fold keeps up with the events whatever the socket does.  Counters start from
the observer's metrics at subscription (``seed``), so they agree with ``/metrics``.

History: one point per second (tokens generated that second, sequences running at its end),
the last ``HISTORY_SECONDS``, for the page's plots.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs
from prometheus_client.parser import text_string_to_metric_families

from ..messages import (
    BatchState, Generated, ModelLoaded, ModelUnloaded, QueueDepth, QueueRejected, RequestFinished,
)

__all__ = ["HISTORY_SECONDS", "MAX_ERRORS", "StatusFold"]

HISTORY_SECONDS = 300
MAX_ERRORS = 20
PHASES = ("queued", "prefill", "decode")


@attrs.define
class _Model:
    running: int = 0
    kv_bytes: int = 0
    queued: int = 0
    size: int = 0
    loaded: bool = False
    tokens: int = 0


@attrs.define
class StatusFold:
    """Events in (``record``), snapshots out; ``now`` is wall-clock seconds, passed in."""

    models: dict[str, _Model] = attrs.field(factory=dict)
    cancellations: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(PHASES, 0))
    generated_tokens: int = 0
    prompt_tokens: int = 0
    generations: int = 0
    requests: int = 0
    rejections: int = 0
    errors: deque[dict[str, Any]] = attrs.field(factory=lambda: deque(maxlen=MAX_ERRORS))
    history: deque[tuple[int, int, int]] = attrs.field(factory=lambda: deque(maxlen=HISTORY_SECONDS))
    gaps: int = 0  # times the feed fell behind the observer and subscribed again
    _second: int | None = None
    _second_tokens: int = 0

    def seed(self, metrics_text: str) -> None:
        """Counters as the observer's metrics have them (Prometheus text)."""
        requests = 0
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                name, value = sample.name, int(sample.value)
                if name == "turbospark_cancellations_total":
                    self.cancellations[sample.labels["phase"]] = value
                elif name == "turbospark_generated_tokens_total":
                    self.generated_tokens = value
                elif name == "turbospark_prompt_tokens_total":
                    self.prompt_tokens = value
                elif name == "turbospark_requests_total":
                    requests += value
                elif name == "turbospark_queue_rejections_total":
                    self.rejections = value
        self.requests = requests

    def _model(self, name: str) -> _Model:
        return self.models.setdefault(name, _Model())

    def record(self, event: object, now: float) -> None:
        self.tick(now)
        if isinstance(event, Generated):
            self.generated_tokens += event.new_tokens
            self.prompt_tokens += event.prompt_tokens
            self.generations += 1
            self._second_tokens += event.new_tokens
            self._model(event.model).tokens += event.new_tokens
            if event.stop_reason == "Cancelled" and event.phase:
                self.cancellations[event.phase] = self.cancellations.get(event.phase, 0) + 1
        elif isinstance(event, BatchState):
            m = self._model(event.model)
            m.running, m.kv_bytes = event.running, event.kv_bytes
        elif isinstance(event, QueueDepth):
            self._model(event.model).queued = event.depth
        elif isinstance(event, QueueRejected):
            self.rejections += 1
        elif isinstance(event, ModelLoaded):
            m = self._model(event.model)
            m.loaded, m.size = True, event.size
        elif isinstance(event, ModelUnloaded):
            m = self._model(event.model)
            m.loaded, m.running, m.kv_bytes, m.queued = False, 0, 0, 0
        elif isinstance(event, RequestFinished):
            self.requests += 1
            if event.status >= 400:
                self.errors.appendleft({
                    "id": event.id, "route": event.route, "status": event.status,
                    "error": event.error, "at": round(now, 3),
                })  # fmt: skip

    def tick(self, now: float) -> None:
        """Close the seconds that have passed (a second without events is a point too)."""
        second = int(now)
        if self._second is None:
            self._second = second
        while self._second < second:
            running = sum(m.running for m in self.models.values())
            self.history.append((self._second, self._second_tokens, running))
            self._second_tokens = 0
            self._second += 1
            if second - self._second > HISTORY_SECONDS:  # a long silence: skip ahead
                self._second = second - HISTORY_SECONDS

    def snapshot(self, now: float, loaded: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The state for the page; ``loaded``: the resolver's loaded models (leases, expiry)."""
        self.tick(now)
        recent = list(self.history)[-10:]
        tok_s = sum(t for _, t, _ in recent) / len(recent) if recent else 0.0
        return {
            "at": round(now, 3),
            "models": {
                name: attrs.asdict(m) for name, m in sorted(self.models.items())
            },
            "loaded": loaded or [],
            "queue_depth": sum(m.queued for m in self.models.values()),
            "running": sum(m.running for m in self.models.values()),
            "kv_bytes": sum(m.kv_bytes for m in self.models.values()),
            "tokens_per_second": round(tok_s, 2),
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "generations": self.generations,
            "requests": self.requests,
            "rejections": self.rejections,
            "cancellations": dict(self.cancellations),
            "errors": list(self.errors),
            "history": [{"t": s, "tokens": t, "running": r} for s, t, r in self.history],
            "gaps": self.gaps,
        }
