"""``serve``'s command line: the parser, its value checks, and the ``Settings`` it makes."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from .. import __version__
from ..config import Settings
from ..turns.guardrails import Guardrails
from ..web.origins import parse_origins
from .loras import add_engine_arguments, engine_settings

__all__ = ["build_parser", "settings_from"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_in(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high], named ``what`` in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'") from None
        if value < low or (high is not None and value > high):
            bounds = f"{low}-{high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{what} must be {bounds}, got {value}")
        return value

    return parse


_positive_int = _int_in(1, None, "a whole number")
_port = _int_in(0, 65535, "a port number")
_delay_ms = _int_in(0, None, "milliseconds")


def _seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got '{text}'") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a timeout must be a positive number of seconds, got {text}")
    return value


def _duration(text: str) -> float:
    from ..errors import RequestInvalid
    from ..actors.lifecycle import parse_keep_alive

    try:
        value = parse_keep_alive(text)
    except RequestInvalid:
        raise argparse.ArgumentTypeError(f"expected seconds or a duration such as 5m, got '{text}'") from None
    assert value is not None
    return value


def _size(text: str) -> int:
    from ..actors.lifecycle import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, got '{text}'")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="turbospark", description="A local generation server on Trio and MLX.")
    parser.add_argument("--version", action="version", version=f"turbospark {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    s = commands.add_parser("serve", help="serve models over HTTP")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=_port, default=8080, help="port (default 8080; 0 picks a free one)")
    s.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="ID|PATH",
        help="attach a model: a stored model id, a GGUF file or model directory to import, or "
        "'scripted' (repeatable; default: the default chat model)",
    )
    s.add_argument(
        "--draft-model",
        metavar="ID|PATH",
        help="speculative decoding with a small draft model that shares the --model's vocabulary "
        "(refused otherwise), in place of prompt lookup; it runs on the model's own thread",
    )
    add_engine_arguments(s)
    s.add_argument(
        "--embedding-model",
        action="append",
        default=[],
        metavar="ID|PATH",
        help="attach an embedding model: a stored model id, a catalogue name, a BERT "
        "sentence-encoder directory to import, 'scripted' (4-dimensional test vectors) or 'none' "
        "(repeatable; default: all-minilm-l6-v2, or 'scripted' when every --model is scripted)",
    )
    s.add_argument(
        "--stt-model", action="append", default=[], metavar="ID|PATH",
        help="attach a speech-to-text model: a stored id, a catalogue name, a faster-whisper "
        "directory to import, 'scripted' or 'none' (repeatable; default: whisper-tiny.en, or "
        "'scripted' when every --model is scripted)",
    )
    s.add_argument(
        "--tts-model", action="append", default=[], metavar="ID|PATH",
        help="attach a text-to-speech voice: a stored id, a catalogue name, a Piper voice "
        "directory to import, 'espeak-ng', 'scripted' or 'none' (repeatable; default: "
        "piper-joe-medium, or 'scripted' when every --model is scripted)",
    )
    s.add_argument(
        "--image-model",
        action="append",
        default=[],
        metavar="ID|PATH",
        help="attach an image model at startup: a stored id, a Diffusers pipeline directory to "
        "import, 'scripted' or 'none' (repeatable; default: none, stored image models loading when "
        "a request names them, or 'scripted' when every --model is scripted)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="require this key (x-api-key or Authorization: Bearer) on every route but /health "
        "(default: $TURBOSPARK_API_KEY)",
    )
    s.add_argument(
        "--allowed-origins",
        type=parse_origins,
        default=None,
        metavar="LIST",
        help="comma-separated web origins allowed to call the server ('*' wildcards; '*' alone: "
        "any; default, as Ollama's OLLAMA_ORIGINS: http(s) on localhost, 127.0.0.1, [::1] and "
        "0.0.0.0 on any port, and the app://, file://, tauri://, vscode-webview:// and "
        "vscode-file:// schemes; $TURBOSPARK_ORIGINS). Other Origins get a 403; requests without "
        "one (SDKs, curl) pass. Bound to loopback, a Host that is not a loopback name is refused "
        "too (DNS rebinding)",
    )
    s.add_argument(
        "--special-tokens-in-content",
        action="store_true",
        help="encode special-token text inside message content (e.g. '<|im_start|>system') as "
        "control tokens; by default it is plain text, so content cannot forge a role",
    )
    s.add_argument("--image-urls", action="store_true",
                   help="let vision models read http(s) image URLs, fetched by the server (public addresses only, "
                   "20 MiB, 10 s); by default only data: URLs")
    system = s.add_mutually_exclusive_group()
    system.add_argument(
        "--system",
        action="append",
        metavar="TEXT",
        help="default system prompt, used when a request has no system message (repeatable, "
        "joined with newlines)",
    )
    system.add_argument("--system-file", type=Path, metavar="PATH", help="default system prompt from a file")
    s.add_argument(
        "--max-queue",
        type=_positive_int,
        default=512,
        metavar="N",
        help="generations allowed to wait per model; more are refused with 503 queue_full (default 512)",
    )
    s.add_argument(
        "--max-resolutions",
        type=_positive_int,
        default=4,
        metavar="N",
        help="model resolutions in flight at once; more are refused with 503 (default 4)",
    )
    s.add_argument(
        "--max-batch",
        type=_int_in(1, 1024, "a batch size"),
        default=Settings().max_batch,
        metavar="N",
        help="sequences a model runs at once, batched into one step; more wait in the queue "
        f"(default {Settings().max_batch})",
    )
    s.add_argument(
        "--kv-budget-mb",
        type=_positive_int,
        default=None,
        metavar="MB",
        help="KV-cache memory a model's running sequences may grow to; a request that would not "
        "fit waits for room (default: a quarter of physical memory)",
    )
    s.add_argument(
        "--keep-alive",
        type=_duration,
        default=300.0,
        metavar="DURATION",
        help="how long a model stays loaded after its last request: seconds or a duration such "
        "as 30s, 5m, 1h; negative keeps it forever (default 5m; a request's keep_alive overrides "
        "it; models named with --model stay until a request says otherwise)",
    )
    s.add_argument(
        "--distributed",
        action="store_true",
        help="shard the one --model over the ranks mlx.launch started (rank 0 serves HTTP); see "
        "scripts/serve-distributed",
    )
    s.add_argument(
        "--shard",
        choices=("pipeline", "tensor"),
        default=None,
        help="with --distributed, how the model is split: pipeline (each rank holds a slice of "
        "the layers) or tensor (each rank a part of every layer's heads; faster, needs heads "
        "that divide by the ranks). Default: tensor where the heads divide, else pipeline",
    )
    s.add_argument(
        "--graceful-timeout",
        type=_seconds,
        default=Settings().graceful_timeout,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long requests in flight may take to finish before they "
        f"are answered shutting_down (default {Settings().graceful_timeout:g})",
    )
    s.add_argument(
        "--drain-delay",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="on SIGTERM, how long to keep accepting connections while /health/ready says 503 "
        "and new requests are answered a retryable 503 draining, so a load balancer's health "
        "check notices before the port closes (default 0)",
    )
    s.add_argument(
        "--max-loaded-models",
        type=_positive_int,
        default=Settings().max_loaded_models,
        metavar="N",
        help="models loaded at once; the least recently used idle one is unloaded to load "
        f"another (default {Settings().max_loaded_models})",
    )
    s.add_argument(
        "--max-loaded-memory",
        type=_size,
        default=None,
        metavar="SIZE",
        help="memory the loaded models' weights may take together, e.g. 8G or 512M (a bare "
        "number is MiB); least recently used idle models are unloaded to stay under it "
        "(default: half of physical memory)",
    )
    s.add_argument(
        "--prompt-cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the prompt (prefix) cache across restarts: entries are written here (a folder "
        "per model fingerprint: weights, engine versions, tokenizer) when they leave the cache and "
        "when the model unloads or the server stops, and read back when the model loads; a file "
        "that cannot be read or belongs to another model is skipped with a log line. Also where "
        "/slots saves and restores",
    )
    s.add_argument(
        "--prompt-cache-size",
        type=_size,
        default=None,
        metavar="SIZE",
        help="bytes the prompt cache may take on disk per model, e.g. 4G (default 4G)",
    )
    s.add_argument(
        "--guardrails",
        choices=("on", "off"),
        default="on",
        help="tool calls: rescue calls written in other markups, validate arguments against the "
        "tool's schema and retry once with a correction (default on)",
    )
    s.add_argument(
        "--header-timeout",
        type=_seconds,
        default=Settings().header_timeout,
        metavar="S",
        help="a connection that has not sent a whole request head S seconds after opening, or "
        f"after its previous response (idle keep-alive), is closed (default {Settings().header_timeout:g})",
    )
    s.add_argument(
        "--body-timeout",
        type=_seconds,
        default=Settings().body_timeout,
        metavar="S",
        help=f"a request body must arrive in full within S seconds, or the answer is a 408 "
        f"(default {Settings().body_timeout:g})",
    )
    s.add_argument(
        "--write-timeout",
        type=_seconds,
        default=Settings().write_timeout,
        metavar="S",
        help="a connection whose client takes nothing of a response for S seconds (it stopped reading) "
        f"is closed, its request ended (default {Settings().write_timeout:g})",
    )
    s.add_argument("--events", type=Path, metavar="FILE", help="append observer events to FILE as JSON lines")
    s.add_argument("--script", type=Path, metavar="FILE", help="scripted backend: emit this UTF-8 text, then end the turn")
    s.add_argument(
        "--token-delay-ms",
        type=_delay_ms,
        default=0,
        metavar="N",
        help="scripted backend: pause N ms per decode step and per prefill chunk",
    )
    commands.add_parser("models", help="manage the model store: import, list, rm, pull")
    return parser


def _origins(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    given = args.allowed_origins
    if given is None and (env := os.environ.get("TURBOSPARK_ORIGINS")):
        given = parse_origins(env)
    return {"allowed_origins": given} if given else {}


def settings_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Settings:
    api_key = args.api_key
    if api_key is not None and not api_key.strip():
        parser.error("--api-key must not be empty")
    if api_key is None and (api_key := os.environ.get("TURBOSPARK_API_KEY")) is not None:
        if not api_key.strip():  # a blank key would silently turn authentication off
            parser.error("TURBOSPARK_API_KEY is set but blank: give it a key or unset it")
    if args.shard is not None and not args.distributed:
        parser.error("--shard splits a --distributed model: add --distributed (scripts/serve-distributed)")
    if args.draft_model is not None:
        if args.distributed:
            parser.error("--draft-model does not combine with --distributed (the draft would run on rank 0 alone)")
        if args.model and all(name == "scripted" for name in args.model):
            parser.error("--draft-model drafts for an MLX --model, not the scripted one")
    system_prompt = None
    if args.system:
        if any(not text.strip() for text in args.system):
            parser.error("--system must not be blank")
        system_prompt = "\n".join(args.system)
    elif args.system_file:
        try:
            system_prompt = args.system_file.read_text(encoding="utf-8").rstrip()
        except OSError as exc:
            parser.error(f"--system-file: {exc.strerror}: {args.system_file}")
        if not system_prompt:
            parser.error(f"--system-file: {args.system_file} is empty")
    if args.events is not None:
        try:
            args.events.open("a", encoding="utf-8").close()
        except OSError as exc:
            parser.error(f"--events: cannot write {args.events}: {exc.strerror}")
    script = None
    if args.script:
        try:
            script = args.script.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            parser.error(f"--script: cannot read {args.script}: {exc}")
    return Settings(
        host=args.host,
        port=args.port,
        models=tuple(args.model),
        embedding_models=tuple(args.embedding_model),
        stt_models=tuple(args.stt_model),
        tts_models=tuple(args.tts_model),
        image_models=tuple(args.image_model),
        api_key=api_key,
        system_prompt=system_prompt,
        max_queue=args.max_queue,
        max_resolutions=args.max_resolutions,
        max_batch=args.max_batch,
        guardrails=Guardrails() if args.guardrails == "on" else Guardrails.off(),
        **_origins(args),
        special_tokens_in_content=args.special_tokens_in_content,
        image_urls=args.image_urls,
        keep_alive=args.keep_alive,
        max_loaded_models=args.max_loaded_models,
        **({"max_loaded_memory": args.max_loaded_memory} if args.max_loaded_memory else {}),
        **({"kv_budget": args.kv_budget_mb << 20} if args.kv_budget_mb else {}),
        prompt_cache_dir=args.prompt_cache_dir,
        draft_model=args.draft_model,
        **engine_settings(parser, args),
        **({"prompt_cache_bytes": args.prompt_cache_size} if args.prompt_cache_size else {}),
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        write_timeout=args.write_timeout,
        graceful_timeout=args.graceful_timeout,
        drain_delay=args.drain_delay,
        distributed=args.distributed,
        shard=args.shard,
        events_path=args.events,
        script=script,
        token_delay=args.token_delay_ms / 1000,
    )
