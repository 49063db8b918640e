"""Running the whole server: the actor tree and Hypercorn's trio server in one root nursery.

``serve`` is what ``python -m turbospark serve`` runs and what the tests start with
``nursery.start``: it hands back a ``Server`` once the models are loaded and the socket is bound.
Setting ``Server.stop`` begins a graceful shutdown: the server drains (``/health/ready`` answers
503, a new request a retryable 503 ``draining`` with ``Connection: close``) for ``drain_delay``
seconds, so a load balancer notices; then Hypercorn stops accepting, and in-flight requests get
``graceful_timeout`` seconds to finish.  Then the model actors are cancelled: each
model thread stops within one step and answers every sequence it still runs or holds with
``ShuttingDown`` (a 503, or an ``event: error`` frame on a stream), the queue answers what waits,
and the routes get ``SHUTDOWN_MARGIN`` more seconds to write those endings; then every write
still waiting on a client that stopped reading is abandoned (``web/bounded_writes.py``) and
Hypercorn closes what is left.  The other actors live until the root nursery ends, after HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from functools import partial

import attrs
import hypercorn.trio
import trio
from hypercorn.config import Config as HypercornConfig

from ._system import System, SystemSpec, run_system
from .model.backend import BackendSpec
from .model.encoder import EncoderSpec
from .audio.engines import AudioSpec
from .actors.lifecycle import Loadable
from .config import Settings
from .kernels import ops as kernels
from .routes.app import create_app
from .web.bounded_writes import install

__all__ = ["Server", "serve"]


@attrs.frozen
class Server:
    url: str
    system: System
    stop: trio.Event


# Seconds the routes get, after the models have answered ShuttingDown, to write those endings.
SHUTDOWN_MARGIN = 2.0


def _hypercorn_config(settings: Settings) -> HypercornConfig:
    config = HypercornConfig()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    config.bind = [f"{host}:{settings.port}"]
    config.graceful_timeout = settings.graceful_timeout + SHUTDOWN_MARGIN
    config.accesslog = None
    # Slow and idle clients (see Settings): Hypercorn's keep-alive timer runs from a connection's
    # start, and from each response's end, until a request's headers are complete, so it is the
    # header timeout and the idle keep-alive timeout at once; the body timeout is the app's
    # (BODY_TIMEOUT).  Hypercorn's read_timeout stays off: it limits the silence between two reads
    # for the whole life of a connection, so it would also cut a client that waits quietly for a
    # long generation.  The backlog absorbs a burst of connections opened at once.
    config.keep_alive_timeout = settings.header_timeout
    config.read_timeout = None
    config.backlog = 1024
    config.errorlog = "-"
    # Realtime transcription: larger WebSocket frames are refused by the protocol layer (1009).
    config.websocket_max_message_size = settings.max_audio_frame_bytes
    return config


async def serve(
    settings: Settings,
    backends: Sequence[BackendSpec | EncoderSpec | AudioSpec | Loadable],
    *,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
    **options: Any,
) -> None:
    """Serve ``backends`` (loaded at start and kept) over HTTP; ready with the ``Server`` once the
    socket is bound.  ``options``: the rest of ``SystemSpec`` (``resolve``, ``audio_catalogue``,
    ``library``, ``shelf``)."""
    if settings.kv_cache is not None:  # for the KV caches made from now on (kernels/ops.py)
        kernels.set_kv_cache(settings.kv_cache)
    spec = SystemSpec(settings, backends, **options)
    config = _hypercorn_config(settings)
    writes = install(config, settings.write_timeout)
    stop = trio.Event()
    closing = trio.Event()
    http_scope = trio.CancelScope()

    async def shut_down() -> None:
        await stop.wait()
        app.draining = True  # readiness is 503, a new request a retryable 503
        app.in_flight.draining.set()  # the status feeds end (routes/status_feed.py)
        await trio.sleep(settings.drain_delay)
        closing.set()  # Hypercorn stops accepting now (and closes idle keep-alive connections)
        with trio.move_on_after(settings.graceful_timeout):
            await app.in_flight.wait_idle()
        system.stop_models()
        with trio.move_on_after(SHUTDOWN_MARGIN):
            await app.in_flight.wait_idle()
        writes.abandon()  # a client that stopped reading holds nothing any more
        # Every request is answered (or out of time): what is left are idle keep-alive
        # connections, which Hypercorn would otherwise hold open until its own deadline.
        http_scope.cancel()

    async with trio.open_nursery() as root:
        system = await root.start(partial(run_system, spec))
        app = create_app(system)
        root.start_soon(shut_down)
        async with trio.open_nursery() as http:
            binds = await http.start(partial(_serve_http, http_scope, app, config, closing))
            task_status.started(Server(binds[0], system, stop))
        root.cancel_scope.cancel()


async def _serve_http(
    scope: trio.CancelScope,
    app: Any,
    config: HypercornConfig,
    closing: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    with scope:
        await hypercorn.trio.serve(app, config, shutdown_trigger=closing.wait, task_status=task_status)
