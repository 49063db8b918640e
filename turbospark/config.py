"""Settings for one server process."""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from .turns.guardrails import Guardrails
from .wire.mcp_config import McpServerSpec

__all__ = ["DEFAULT_ORIGINS", "Settings"]

# Which web pages may call the server (web/origins.py): Ollama's default list, loopback names on
# any port and the schemes desktop apps and editors use.
DEFAULT_ORIGINS: tuple[str, ...] = (
    *(f"{scheme}://{host}{port}"
      for scheme in ("http", "https")
      for host in ("localhost", "127.0.0.1", "[::1]", "0.0.0.0")
      for port in ("", ":*")),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)


@attrs.frozen
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    models: tuple[str, ...] = ()
    api_key: str | None = None
    system_prompt: str | None = None
    max_queue: int = 512  # Ollama's OLLAMA_MAX_QUEUE: a burst waits, a runaway is refused
    max_resolutions: int = 4
    # Sequences a model runs at once: what benchmarks/bench_batch.py shows is best on CPU (see
    # docs/performance.md): 16 streams give 1.6x the aggregate throughput of 8, each keeping
    # over 80 % of its pace.
    max_batch: int = 16
    # Bytes of KV cache a model's running batch may grow to: a quarter of physical memory.
    kv_budget: int = attrs.field(factory=lambda: _physical_memory() // 4)
    # Embedding models to attach (ids, catalogue names or paths; "scripted"; "none"): empty means
    # the default (see attach.py).
    embedding_models: tuple[str, ...] = ()
    # Inputs an encoder runs in one forward pass, from any number of requests: what
    # benchmarks/bench_embed.py shows is best on CPU (see docs/performance.md).
    embedding_batch: int = 64
    # Audio models to attach (catalogue names, store ids, "scripted", "espeak-ng", "none"): empty
    # means the defaults (see attach.py).
    stt_models: tuple[str, ...] = ()
    tts_models: tuple[str, ...] = ()
    # Image models attached at startup (store ids, Diffusers directories, "scripted", "none"):
    # empty means none but the scripted one when every --model is scripted; stored image models
    # also load when a request names them (see attach.py).
    image_models: tuple[str, ...] = ()
    # Realtime transcription: the largest WebSocket frame, and the idle and session limits.
    max_audio_frame_bytes: int = 1 << 20
    realtime_idle_seconds: float = 60.0
    realtime_max_seconds: float = 3600.0
    # Model lifecycle: how long an idle model stays loaded (seconds; inf: forever), how many
    # models may be loaded at once, and the memory their weights may take together (half of
    # physical memory by default); least recently used idle models make room.
    keep_alive: float = 300.0
    # Ollama loads 3 models per device; ours are chat, embedding, speech-to-text and speech by
    # default, all loaded at start: room for those four, and a fifth on demand.
    max_loaded_models: int = 5
    max_loaded_memory: int = attrs.field(factory=lambda: _physical_memory() // 2)
    # The prefix cache on disk (--prompt-cache-dir): where, and the bytes it may take per model.
    prompt_cache_dir: Path | None = None
    prompt_cache_bytes: int = 4 << 30
    events_path: Path | None = None
    script: str | None = None
    token_delay: float = 0.0
    graceful_timeout: float = 5.0
    # On shutdown, how long the port stays open while readiness is 503 and new requests are
    # answered ``draining`` (for a load balancer's health check to notice); then it closes.
    drain_delay: float = 0.0
    # --draft-model: a small model that drafts for the --model models (same vocabulary), in
    # place of prompt lookup.
    draft_model: str | None = None
    # --lora NAME=PATH: LoRA adapters of the first --model, each served as the model NAME.
    loras: tuple[tuple[str, str], ...] = ()
    # --kv-cache: the fused layers' KV cache type, "f16", "q8_0" or "q4_0" (None: the process's,
    # TURBOSPARK_KV_CACHE or f16)
    kv_cache: str | None = None
    # --reasoning-budget: the most tokens a model reasons before it is made to answer, where a
    # request names no budget of its own (None: no cap)
    reasoning_budget: int | None = None
    # --context-shift: instead of a 400, a budget past what the prompt leaves is cut to it, and a
    # prompt past a model's context loses its oldest messages (its system messages kept)
    context_shift: bool = False
    # ``serve --distributed``: the one --model is sharded over the ranks of mlx.distributed.
    distributed: bool = False
    # How: "pipeline" (layers), "tensor" (heads), or None: tensor where the heads divide.
    shard: str | None = None
    # Slow and idle clients.  A connection must complete its request line and headers within
    # header_timeout seconds of opening, or of its previous response (so this is also how long
    # an idle keep-alive connection is kept); then it is closed.  A request body must arrive in
    # full within body_timeout seconds of the route asking for it, or the answer is a 408.
    header_timeout: float = 5.0
    body_timeout: float = 60.0
    # A write to a client that takes nothing for write_timeout seconds (it stopped reading)
    # closes its connection, as nginx's send_timeout does.
    write_timeout: float = 60.0
    keepalive_interval: float = 15.0
    max_body_bytes: int = 25 * 1024 * 1024
    # Tool calls: rescue what the parser missed, validate arguments, one corrective retry.
    guardrails: Guardrails = attrs.field(factory=Guardrails)
    # Web pages allowed to call the server (``Origin``); requests without one always pass.
    allowed_origins: tuple[str, ...] = DEFAULT_ORIGINS
    # Role injection: special-token text in message content is plain text unless this is set.
    special_tokens_in_content: bool = False
    # Vision: fetch http(s) image URLs (never from loopback or private addresses); off: data: URLs only.
    image_urls: bool = False
    # MCP servers the server runs (serve --mcp-config): each an actor, its tools offered on request.
    mcp_servers: tuple[McpServerSpec, ...] = ()
    # A request's own MCP servers by URL (public addresses only); off: configured servers only.
    mcp_urls: bool = False


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30
