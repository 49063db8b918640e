"""The health probes, never authenticated, answered while the server drains:

- ``GET /health``: ``{status, state}``, never waits on an actor (``state``: ``ready`` when any
  model is known, else ``empty``).
- ``GET /health/live``: the process and its actors run: 200 ``{"status": "live", "faults":
  {...}}`` when the observer and the resolver answer within ``PROBE_TIMEOUT``, else 503.  A
  liveness probe that fails means restart the process.  ``faults``: the internal faults so far,
  by actor (``model``, ``encoder``, ``audio``, ``observer``), each of which failed its own job
  alone (or lost one event) while the actor carried on: no reason to restart.
- ``GET /health/ready``: 200 ``{"status": "ready", ...}`` when the server should be sent
  requests: not draining, every model named at start loaded, no model's queue full; else 503
  ``{"status": "not_ready", "reasons": [...], ...}``.  A balancer stops sending while it fails;
  nothing is restarted.  Both carry ``models`` (loaded) and ``queue`` (waiting per model).
"""

from __future__ import annotations

import trio
from quart import Blueprint, Response, current_app

from ..web.app import json_response, system

blueprint = Blueprint("health", __name__)

#: how long a probe waits for the actors it asks
PROBE_TIMEOUT = 2.0


@blueprint.get("/health")
async def health() -> Response:
    state = "ready" if system().registry.entries else "empty"
    return json_response({"status": "ok", "state": state})


async def _ask() -> tuple[list[str], dict[str, int]] | None:
    """The loaded models and the queue depths, or None when an actor did not answer in time."""
    sys_ = system()
    with trio.move_on_after(PROBE_TIMEOUT):
        loaded = sorted(m.entry.id for m in await sys_.running())
        return loaded, await sys_.queue_depths()
    return None


@blueprint.get("/health/live")
async def live() -> Response:
    if await _ask() is None:
        return json_response({"status": "not_live", "reasons": ["the actors did not answer"]}, 503)
    return json_response({"status": "live", "faults": dict(system().observer.faults)})


@blueprint.get("/health/ready")
async def ready() -> Response:
    sys_ = system()
    reasons: list[str] = []
    if current_app.draining:  # type: ignore[attr-defined]
        reasons.append("draining")
    reasons += [f"failed: {error.code}" for error in sys_.failure]
    asked = await _ask()
    if asked is None:
        return json_response({"status": "not_ready", "reasons": [*reasons, "the actors did not answer"]}, 503)
    loaded, depths = asked
    pinned = sorted(l.id for l in sys_.published.loadables.values() if l.pinned)
    reasons += [f"model {m} is not loaded" for m in pinned if m not in loaded]
    limit = sys_.settings.max_queue
    reasons += [f"the queue of {m} is full" for m, depth in sorted(depths.items()) if depth >= limit]
    body = {"status": "not_ready" if reasons else "ready", "models": loaded, "queue": depths}
    if reasons:
        body["reasons"] = reasons
    return json_response(body, 503 if reasons else 200)
