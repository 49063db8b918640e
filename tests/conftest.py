"""Shared fixtures: an in-process server on a real Hypercorn socket (127.0.0.1:0).

Tests that touch sockets or model threads never use the autojump clock (it would fire their
deadlines at once); only the pure-Trio actor tests do.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from turbospark.cli.main import import_mlx_lm_keeping_the_fd_limit

# as the server does, before anything imports mlx_lm: the processes the tests start (HAProxy
# among them) keep the run's open-file limit
import_mlx_lm_keeping_the_fd_limit()

from turbospark.audio.engines import AudioSpec  # noqa: E402
from turbospark.images.messages import ImageSpec  # noqa: E402
from turbospark.config import Settings  # noqa: E402
from turbospark.model.backend import BackendSpec  # noqa: E402
from turbospark.model.encoder import Encoder, EncoderSpec  # noqa: E402
from turbospark.model.scripted import ScriptedBackend  # noqa: E402
from turbospark.server import Server, serve  # noqa: E402

from . import _skips  # noqa: E402


_EXIT = pytest.StashKey[int]()  # pytest's exit status, kept for ``pytest_unconfigure``
_REFUSED = pytest.StashKey[list[tuple[str, str]]]()  # skips whose reason is not allowed (``_skips``)
_SKIPS: list[tuple[str, str]] = []  # (test, reason) of every skip in this run


def _skipped(report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append((report.nodeid, _skips.reason_of(report.longrepr)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _skipped(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _skipped(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skip whose reason is not on ``_skips.ALLOWED`` fails the run (the tests that ran passed,
    but the suite did not run what it should have)."""
    refused = session.config.stash[_REFUSED] = _skips.refused(_SKIPS)
    if refused and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.stash[_EXIT] = int(exitstatus)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    refused = config.stash.get(_REFUSED, [])
    if refused:
        terminalreporter.section("skips that are not allowed (tests/_skips.py)", red=True, bold=True)
        for test, reason in refused:
            terminalreporter.line(f"{test}: {reason}")
        terminalreporter.line(f"{len(refused)} skipped for reasons that are not allowed: the run fails")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the test process with pytest's own status and without interpreter finalization.

    MLX 0.32 frees thread-local state (compile caches, streams) in destructors that can run after
    Python has finalized, and that can crash a process whose every test passed (exit 139 once
    here after "1063 passed"; ml-explore/mlx#4347).  Everything pytest reports is written by now.
    """
    if _EXIT in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_EXIT])


@pytest.fixture
def fast_ops_restored() -> Any:
    """``mx.fast``'s functions and ``mx.logsumexp`` after the test as they were before it: a test
    that installs the kernels in a model of its own leaves MLX's own to the tests after it."""
    from turbospark.kernels import ops

    with ops.fast_ops_restored():
        yield


@pytest.fixture
async def start_server(nursery: trio.Nursery) -> AsyncIterator[Callable[..., Any]]:
    """``await start_server(backends=[...], encoders=[...], **settings)`` -> a running ``Server``.
    ``library=[Loadable, ...]`` adds models that load on demand (``backends`` load at start)."""
    servers: list[Server] = []

    async def start(
        backends: Sequence[ScriptedBackend] | None = None,
        encoders: Sequence[Encoder] = (),
        audio: Sequence[Any] = (),
        images: Sequence[Any] = (),
        **settings: Any,
    ) -> Server:
        backends = backends if backends is not None else [ScriptedBackend()]
        specs: list[Any] = [
            BackendSpec(b.model_id, partial(lambda b: b, b)) for b in backends
        ]
        specs += [EncoderSpec(e.model_id, partial(lambda e: e, e)) for e in encoders]
        specs += [AudioSpec(e.model_id, e.task, partial(lambda e: e, e)) for e in audio]
        specs += [ImageSpec(e.model_id, partial(lambda e: e, e)) for e in images]
        resolve = settings.pop("resolve", None)
        kwargs: dict[str, Any] = {"resolve": resolve} if resolve else {}
        if "audio_catalogue" in settings:
            kwargs["audio_catalogue"] = settings.pop("audio_catalogue")
        # models loaded on demand: a sequence of Loadables (or a callable returning them)
        library = settings.pop("library", None)
        if library is not None:
            kwargs["library"] = library if callable(library) else partial(tuple, library)
        if (shelf := settings.pop("shelf", None)) is not None:
            kwargs["shelf"] = shelf
        config = Settings(**{"host": "127.0.0.1", "port": 0, "graceful_timeout": 1.0, **settings})
        server = await nursery.start(partial(serve, config, specs, **kwargs))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop.set()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as c:
        yield c
