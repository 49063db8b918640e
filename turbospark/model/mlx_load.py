"""What the MLX backend reads and measures when it loads a model directory of the store.

The context window and sampling defaults (from the files the store wrote), the fingerprint (the
weights and the engine's versions), and how many bytes of KV cache a sequence of n tokens holds
(measured by running one token; a model whose caches mlx-lm cannot batch is refused here).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .. import __version__
from .backend import fingerprint

__all__ = ["DEFAULT_CONTEXT", "context_window", "generation_defaults", "kv_sizes", "model_fingerprint"]

DEFAULT_CONTEXT = 4096


def model_fingerprint(path: Path, *extra: str) -> str:
    """From the weights' digest and dtype the store recorded (else the directory's weight files'
    names and sizes, and its config), the versions of the engine, and ``extra`` (what else
    decides the output: a float16 KV cache)."""
    import mlx_lm

    manifest = path / "manifest.json"
    meta = json.loads(manifest.read_text()) if manifest.exists() else {}
    if isinstance(meta.get("source_sha256"), str):
        weights = f"{meta['source_sha256']} {meta.get('dtype')}"
    else:
        files = sorted(path.glob("*.safetensors"))
        config = (path / "config.json").read_text() if (path / "config.json").exists() else ""
        weights = " ".join(f"{f.name}:{f.stat().st_size}" for f in files) + config
    return fingerprint(
        weights, f"turbospark {__version__}", f"mlx {mx.__version__}", f"mlx-lm {mlx_lm.__version__}", *extra
    )


def kv_sizes(model: Any) -> Callable[[int], int]:
    """Bytes of KV cache one sequence of n tokens holds, measured by running one token: layers
    that grow with the sequence, rotating windows that stop growing at their size, and state
    that does not grow (hybrid models' arrays).  Refuses a model whose caches mlx-lm cannot
    batch."""
    cache = make_prompt_cache(model)
    unbatchable = sorted({type(c).__name__ for c in cache if not hasattr(c, "merge")})
    if unbatchable:
        raise ValueError(f"this architecture's KV cache ({', '.join(unbatchable)}) cannot be batched")
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    growing = fixed = 0
    windows: list[tuple[int, int]] = []  # (bytes per token, window)
    for c in cache:
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array) and keys.ndim == 4 and keys.shape[2] > 0:
            per_token = c.nbytes // keys.shape[2]
            if isinstance(getattr(c, "max_size", None), int):
                windows.append((per_token, c.max_size))
            else:
                growing += per_token
        else:
            fixed += getattr(c, "nbytes", 0)

    def size(tokens: int) -> int:
        return fixed + growing * tokens + sum(b * min(tokens, w) for b, w in windows)

    return size


def generation_defaults(path: Path) -> dict[str, float]:
    """The model's sampling defaults, as ``SamplingParams`` field names, from the
    ``generation_config.json`` the store wrote into its directory (``do_sample: false`` means
    greedy)."""
    file = path / "generation_config.json"
    config = json.loads(file.read_text()) if file.exists() else {}
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    defaults = {k: float(config[k]) for k in names if isinstance(config.get(k), (int, float))}
    if "top_k" in defaults:
        defaults["top_k"] = int(defaults["top_k"])
    if config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def context_window(path: Path, config: dict[str, Any]) -> int:
    """The model's context window: from its config, else its tokenizer's, else 4096."""
    for key in ("max_position_embeddings", "context_length", "n_ctx", "max_seq_len"):
        if isinstance(config.get(key), int):
            return int(config[key])
    tok_config = path / "tokenizer_config.json"
    if tok_config.exists():
        limit = json.loads(tok_config.read_text()).get("model_max_length")
        if isinstance(limit, int) and limit < 10**7:
            return limit
    return DEFAULT_CONTEXT
