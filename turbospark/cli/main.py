"""``python -m turbospark``: ``serve`` and ``models``; start-up, signals and exit statuses."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from .blas import describe as describe_blas
from .blas import reexec_with_openblas
from ..model.backend import BackendSpec
from ..model.encoder import EncoderSpec
from ..audio.engines import AudioSpec
from .._collector import freeze_start_up
from ..config import Settings
from .interrupt import interruptible, leaving

__all__ = ["main"]


from .args import build_parser, settings_from


async def _run(
    settings: Settings, specs: Sequence[BackendSpec | EncoderSpec | AudioSpec], shelf: Any, lifeline: Any = None
) -> None:
    from .attach import audio_catalogue
    from ..server import serve

    library = shelf.loadables if shelf is not None else tuple
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            running: list[Any] = []  # the Server, once it listens

            async def on_signal() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if not running:
                        # Loading reads the store and writes nothing; the model threads cannot be
                        # interrupted mid-load, so the process leaves without waiting for them.
                        print(f"turbospark: {name} while loading models, exiting", file=sys.stderr, flush=True)
                        os._exit(130)
                    if running[0].stop.is_set():  # a second signal: stop waiting for anything
                        print(f"turbospark: {name} again, exiting now", file=sys.stderr, flush=True)
                        os._exit(130)
                    print(f"turbospark: {name}, shutting down", file=sys.stderr, flush=True)
                    running[0].stop.set()

            nursery.start_soon(on_signal)
            # signals are handled from here on: a SIGTERM now ends the load with status 130
            print("turbospark: loading models", file=sys.stderr, flush=True)
            async with trio.open_nursery() as serving:  # ends when the server has shut down
                server = await serving.start(partial(
                    serve, settings, specs, audio_catalogue=audio_catalogue(), library=library, shelf=shelf
                ))
                running.append(server)
                freeze_start_up()  # the collector's full passes walk only what came since
                if lifeline is not None:  # serve --distributed: the other ranks' heartbeats
                    nursery.start_soon(lifeline.watch, server)
                print(f"turbospark listening on {server.url}", file=sys.stderr, flush=True)
                auth = "on (x-api-key or Authorization: Bearer, except /health)" if settings.api_key else "off"
                print(f"  auth: {auth}", file=sys.stderr)
                print(f"  models: {', '.join(server.system.registry.public_names()) or 'none'}", file=sys.stderr)
                audio = [spec.id for spec in specs if isinstance(spec, AudioSpec)]
                print(f"  audio: {', '.join(audio) or 'none'}", file=sys.stderr)
                images = [e.id for e in server.system.registry.entries if "text_to_image" in e.capabilities]
                print(f"  images: {', '.join(images) or 'none (import a Diffusers pipeline: docs/images.md)'}",
                      file=sys.stderr)  # fmt: skip
                if settings.mcp_servers:  # each has tried its first connection by now
                    for one in await server.system.mcp.listings():
                        said = f"{len(one.tools)} tools ({', '.join(t.name for t in one.tools) or 'none'})" \
                            if one.state == "up" else f"{one.state}: {one.error} (trying again with a backoff)"
                        print(f"  mcp: {one.server} ({one.transport}): {said}", file=sys.stderr)
                if settings.mcp_urls:
                    print("  mcp urls: a request's own MCP server, on public addresses only (--mcp-urls)",
                          file=sys.stderr)
                if "mlx.core" in sys.modules:
                    print(f"  blas: {describe_blas()}", file=sys.stderr)
                for entry in server.system.registry.entries:
                    if entry.kernels:  # a loaded MLX model: what computes its layers
                        print(f"  kernels: {entry.id}: {entry.kernels}", file=sys.stderr)
                sys.stderr.flush()
            nursery.cancel_scope.cancel()  # the signal watcher


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["models"]:  # its own parser, so that `models --help` and `models X -h` work
        from .models import main as models_main

        return models_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_usage(sys.stderr)
        return 2
    settings = settings_from(args, parser)
    if not settings.distributed and (taken := _port_taken(settings.host, settings.port)) is not None:
        print(taken, file=sys.stderr)  # before minutes of loading models, not after
        return 1
    from .attach import ModelSetupError, audio_specs, backend_specs, image_specs, needs_mlx, shelf_for

    try:
        if needs_mlx(settings):
            reexec_with_openblas([sys.executable, "-m", "turbospark", *argv])
            transformers_without_torch()
            import_mlx_lm_keeping_the_fd_limit()  # also what a model store (shelf_for) implies
        with interruptible():  # a pull or import stops at once, leaving nothing half-written
            if settings.distributed:
                from .distributed import distributed_group, follow_rank, sharded_spec

                group = distributed_group(settings)
                if group.rank() != 0:
                    return follow_rank(settings, group)
                sharded, lifeline = sharded_spec(settings, group)
                specs = [sharded, *backend_specs(settings, models=False), *audio_specs(settings)]
            else:
                specs, lifeline = [*backend_specs(settings), *audio_specs(settings), *image_specs(settings)], None
        trio.run(_run, settings, specs, shelf_for(settings), lifeline)
    except KeyboardInterrupt:
        print("turbospark: interrupted while preparing models; nothing half-written was left in "
              "the model store", file=sys.stderr)
        return 130
    except ModelSetupError as exc:
        if not exc.said:
            print(f"turbospark: {exc}", file=sys.stderr, flush=True)
        leaving()  # other ranks' launcher may end this one now
        return 1
    except BaseExceptionGroup as group:
        setup, rest = group.split(lambda exc: isinstance(exc, ModelSetupError) or _bind_error(exc))
        if setup is None or rest is not None:
            raise
        for exc in _leaves(setup):
            print(_cannot_listen(settings.host, settings.port, exc) if _bind_error(exc) else f"turbospark: {exc}", file=sys.stderr)
        leaving()
        return 1
    return 0


def _bind_error(exc: BaseException) -> bool:
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


def _cannot_listen(host: str, port: int, exc: BaseException) -> str:
    reason = exc.strerror.lower() if isinstance(exc, OSError) and exc.strerror else str(exc)
    return (f"turbospark: cannot listen on {host}:{port}: {reason} (another server "
            "there? --port N picks another port, --port 0 a free one)")


def _port_taken(host: str, port: int) -> str | None:
    """Why ``serve`` could not listen on ``host:port``, found by binding it for a moment (as the
    server will, with ``SO_REUSEADDR``); None when it can (or with port 0)."""
    import socket

    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return None  # the server's own bind reports a name that does not resolve
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if _bind_error(exc):
                return _cannot_listen(host, port, exc)
    return None


def import_mlx_lm_keeping_the_fd_limit() -> None:
    """Import ``mlx_lm.utils`` without the open-file limit its import sets, (2048, 4096) "for large
    models with lots of files": that lowers the hard limit for good (raising it again needs a
    privilege), and a server holds a descriptor per connection, its children (a balancer started
    beside it) inheriting the limit.  The soft limit is raised to 2048 where the hard one allows,
    which is what that import wanted."""
    import resource

    if "mlx_lm.utils" in sys.modules:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    setrlimit = resource.setrlimit
    resource.setrlimit = lambda *_: None  # type: ignore[assignment]
    try:
        import mlx_lm.utils  # noqa: F401
    finally:
        resource.setrlimit = setrlimit
    wanted = 2048 if hard == resource.RLIM_INFINITY else min(2048, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def transformers_without_torch() -> None:
    """Import transformers (mlx-lm's tokenizers) as if torch were not installed: where it is (the
    tests' reference implementations), transformers imports it for helpers the server never
    calls, some 185 MB of memory and a second of start-up.  Only ``serve`` does this, before
    anything has imported transformers; its advice that models need torch is not printed.  A
    transformers that asks otherwise simply loads torch."""
    import importlib.util
    import os

    if "transformers" in sys.modules:
        return
    find_spec, advice = importlib.util.find_spec, os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    importlib.util.find_spec = lambda name, package=None: None if name == "torch" else find_spec(name, package)  # type: ignore[assignment]
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        from transformers.utils import import_utils

        getattr(import_utils, "is_torch_available", lambda: None)()  # remembered for the process
    except ImportError:
        pass  # no transformers: nothing to keep torch out of
    finally:
        importlib.util.find_spec = find_spec
        if advice is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advice


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    return [
        leaf
        for exc in group.exceptions
        for leaf in (_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]


if __name__ == "__main__":
    sys.exit(main())
