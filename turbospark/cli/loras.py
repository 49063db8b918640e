"""``serve``'s engine choices: ``--lora NAME=PATH`` (LoRA adapters of the first ``--model``,
``model/mlx_adapters.py``), ``--kv-cache``, ``--reasoning-budget``, ``--context-shift``, and the MCP
servers the server runs (``--mcp-config``, ``--mcp-urls``: ``actors/mcp.py``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..model.scripted import SCRIPTED_ID
from ..wire.mcp_config import read_mcp_config

__all__ = ["add_engine_arguments", "engine_settings", "lora_pairs"]


def add_engine_arguments(s: argparse.ArgumentParser) -> None:
    """``--lora``, ``--kv-cache``, ``--reasoning-budget``, ``--context-shift``, ``--mcp-config`` and
    ``--mcp-urls``."""
    s.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="a LoRA or DoRA adapter of the first --model (an mlx-lm adapter directory or a GGUF "
                   "LoRA), served as the model NAME beside it and as llama.cpp's lora id (in order); "
                   "requests with different adapters decode in one batch (repeatable)")
    s.add_argument("--kv-cache", choices=("f16", "q8_0", "q4_0"),
                   help="the KV cache of the layers the CPU kernels fuse: f16 (the default), or llama.cpp's "
                   "q8_0 or q4_0 blocks (0.53x and 0.28x the bytes; also TURBOSPARK_KV_CACHE)")
    s.add_argument("--reasoning-budget", type=_positive, metavar="N",
                   help="at most N tokens of reasoning (inside <think>), then the model is made to close it and "
                   "answer, where a request sets no budget (Anthropic's thinking.budget_tokens, vLLM's "
                   "thinking_token_budget); default: no cap")
    s.add_argument("--context-shift", action="store_true",
                   help="instead of a 400, a budget past what the prompt leaves is cut to it, and a prompt past "
                   "the model's context loses its oldest messages (its system messages and its last kept), in "
                   "every API family (Ollama's truncate and shift ask it for one request)")
    s.add_argument("--mcp-config", type=Path, metavar="FILE",
                   help="MCP servers to run, in the mcpServers JSON of Claude Desktop, Cursor and LM Studio "
                   "({\"mcpServers\": {NAME: {\"command\", \"args\", \"env\"} or {\"url\", \"headers\"}}}); their "
                   "tools serve OpenAI's Responses mcp tool and Anthropic's mcp_servers, and GET /v1/mcp/tools "
                   "lists them (also TURBOSPARK_MCP_CONFIG)")
    s.add_argument("--mcp-urls", action="store_true",
                   help="let a request reach its own MCP server by URL (OpenAI's server_url, Anthropic's mcp_servers "
                   "url), over streamable HTTP, on public addresses only, at most 4 per request, for the request's "
                   "time; off: only the servers of --mcp-config, by name")


def engine_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The ``Settings`` fields of the engine choices, checked (the parser's error where one is wrong)."""
    mcp = args.mcp_config or os.environ.get("TURBOSPARK_MCP_CONFIG") or None
    try:
        servers = read_mcp_config(mcp) if mcp else ()
    except ValueError as exc:
        parser.error(f"--mcp-config: {exc}")
    return {"loras": lora_pairs(parser, args), "kv_cache": args.kv_cache, "reasoning_budget": args.reasoning_budget,
            "context_shift": args.context_shift, "mcp_servers": servers, "mcp_urls": args.mcp_urls}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def lora_pairs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """``--lora``'s (name, path) pairs, checked (the parser's error where one is wrong)."""
    pairs = []
    for one in args.lora:
        name, _, path = one.partition("=")
        if not name.strip() or not path:
            parser.error(f"--lora takes NAME=PATH, got {one!r}")
        if not Path(path).expanduser().exists():
            parser.error(f"--lora {name}: {path} does not exist")
        pairs.append((name.strip(), str(Path(path).expanduser())))
    if pairs and (args.distributed or (args.model and args.model[0] == SCRIPTED_ID)):
        parser.error("--lora adapts the first MLX --model (not the scripted one, nor a --distributed one)")
    if len({n for n, _ in pairs}) < len(pairs):
        parser.error("two --lora adapters have one name")
    return tuple(pairs)
