"""The MLX backend: a model from the store, run on its own pinned thread.

Everything here runs on the model thread that built the backend (MLX streams are thread-local):
loading, the prefix cache, prefill and decode.

- Prefill runs in chunks of ``prefill_chunk`` tokens and yields ``PrefillProgress`` after each,
  so the worker can stop a cancelled prompt between chunks.
- Decode is mlx-lm's own pipelined ``generate_step`` (step n+1 is dispatched before token n is
  handed out), fed the last prompt token and the warmed KV cache; the worker stops it between
  steps by closing the generator.
- Sampling uses an explicit PRNG key per request, split per step: a request with a ``seed``
  repeats exactly, whatever other models or requests do meanwhile.
- The prefix cache keeps the KV caches of recent generations (bounded in entries and bytes); a
  request that shares a prefix with one of them reuses it and prefills only the rest.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)
from mlx_lm.utils import load_model

from .backend import PrefillProgress, SamplingParams
from .tokenizer import Tokenizer

__all__ = ["MlxBackend", "PrefixCache", "generation_defaults", "make_sampler"]

DEFAULT_CONTEXT = 4096


def make_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """Greedy at temperature 0 (or ``top_p`` 0, OpenAI's most restrictive nucleus); otherwise
    top-k / top-p / min-p, then a draw with this request's own key."""
    if params.temperature == 0 or params.top_p == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    key = mx.random.key(seed % 2**64)
    inv_temp = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, draw = mx.random.split(key)
        if 0 < params.top_k < logprobs.shape[-1]:  # a k past the vocabulary filters nothing
            logprobs = apply_top_k(logprobs, params.top_k)
        if params.top_p < 1:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p > 0:
            logprobs = apply_min_p(logprobs, params.min_p)
        return mx.random.categorical(logprobs * inv_temp, key=draw)

    return sample


def make_processors(params: SamplingParams, prompt: list[int]) -> list[Callable[..., mx.array]]:
    """Penalties, as logits processors for ``generate_step``.

    ``generate_step`` is handed only the last prompt token, so the history it passes starts with
    that token: presence and frequency penalties skip it and see the generated text only (OpenAI's
    meaning); the repetition penalty sees the end of the prompt as well (Hugging Face's meaning,
    over mlx-lm's 20-token window).
    """
    processors: list[Callable[..., mx.array]] = []
    generated_only = [
        make_presence_penalty(params.presence_penalty, params.max_tokens)
        if params.presence_penalty
        else None,
        make_frequency_penalty(params.frequency_penalty, params.max_tokens)
        if params.frequency_penalty
        else None,
    ]
    for penalty in filter(None, generated_only):
        processors.append(lambda tokens, logits, penalty=penalty: penalty(tokens[1:], logits))
    if params.repetition_penalty != 1:
        window = 20
        repeat = make_repetition_penalty(params.repetition_penalty, window)
        before = mx.array(prompt[-window:-1], dtype=mx.int32)
        processors.append(lambda tokens, logits: repeat(mx.concatenate([before, tokens]), logits))
    return processors


@attrs.define
class _Entry:
    tokens: list[int]
    cache: list[Any]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache)


@attrs.define
class PrefixCache:
    """KV caches of recent generations, most recent last, bounded in entries and bytes."""

    max_entries: int = 4
    max_bytes: int = 1 << 30
    entries: list[_Entry] = attrs.field(factory=list)

    def take(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        """A KV cache holding the longest cached prefix of ``prompt`` (at most all but its last
        token, which must be fed to get the first logits), and that prefix's length;
        ``(None, 0)`` when nothing useful is cached.

        An entry that is wholly a prefix of the prompt (the same conversation, one turn on) is
        handed over and comes back, grown, through ``put``; an entry that only shares a prefix
        (another conversation with the same system prompt) is copied, so it stays whole for its
        own next turn.
        """
        best, best_len = None, 0
        for entry in self.entries:
            n = _common_prefix(entry.tokens, prompt)
            if n > best_len:
                best, best_len = entry, n
        reuse = min(best_len, len(prompt) - 1)
        if best is None or reuse <= 0 or not can_trim_prompt_cache(best.cache):
            return None, 0
        if best_len == len(best.tokens):
            self.entries.remove(best)
            cache = best.cache
        else:
            cache = copy.deepcopy(best.cache)
        have = cache[0].offset
        if trim_prompt_cache(cache, have - reuse) != have - reuse:
            return None, 0
        return cache, reuse

    def put(self, tokens: list[int], cache: list[Any]) -> None:
        # An entry this one extends (or repeats) says nothing more: drop it, so a repeated prompt
        # does not fill the cache with copies and push other conversations out.
        self.entries = [e for e in self.entries if e.tokens != tokens[: len(e.tokens)]]
        self.entries.append(_Entry(tokens, cache))
        while self.entries and (
            len(self.entries) > self.max_entries
            or sum(e.nbytes for e in self.entries) > self.max_bytes
        ):
            self.entries.pop(0)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class MlxBackend:
    """A model directory of the store (MLX / Hugging Face layout), loaded on this thread."""

    def __init__(
        self,
        path: Path,
        *,
        model_id: str,
        prefill_chunk: int | None = None,
        cache_entries: int = 4,
        cache_bytes: int = 1 << 30,
    ) -> None:
        self.model_id = model_id
        self.stream = mx.new_thread_local_stream(mx.default_device())
        with mx.stream(self.stream):
            self.model, config = load_model(path)
            mx.eval(self.model.parameters())
        self.tokenizer = Tokenizer.from_dir(path)
        self.context_window = _context_window(path, config)
        self.sampling_defaults = generation_defaults(path)
        on_gpu = mx.default_device().type == mx.gpu
        # Small chunks on CPU: a cancelled prompt stops within one chunk.
        self.prefill_chunk = prefill_chunk or (512 if on_gpu else 128)
        self.prefix_cache = PrefixCache(cache_entries, cache_bytes)
        self.decode_steps = 0  # what really ran, for tests and benchmarks

    def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> Generator[PrefillProgress | int, None, None]:
        cache, cached = self.prefix_cache.take(prompt)
        if cache is None:
            cache = make_prompt_cache(self.model)
        total = len(prompt)
        tokens = list(prompt)
        try:
            yield PrefillProgress(cached, total, cached)
            with mx.stream(self.stream):
                done = cached
                while total - done > 1:
                    n = min(self.prefill_chunk, total - done - 1)
                    self.model(mx.array(prompt[done : done + n])[None], cache=cache)
                    mx.eval([c.state for c in cache])
                    done += n
                    yield PrefillProgress(done, total, cached)
                mx.clear_cache()
            steps = generate_step(
                mx.array(prompt[-1:]),
                self.model,
                self.stream,
                max_tokens=-1,
                sampler=make_sampler(params),
                logits_processors=make_processors(params, prompt) or None,
                prompt_cache=cache,
            )
            try:
                for token, _ in steps:
                    self.decode_steps += 1
                    tokens.append(token)
                    yield token
            finally:
                steps.close()
        except GeneratorExit:
            # Stopped at a yield (finished or cancelled): the cache holds exactly the prompt
            # and the tokens handed out so far, and is worth keeping.  Any other exception
            # leaves it in an unknown state, and it is dropped.
            if cache[0].offset > 0:
                self.prefix_cache.put(tokens[: cache[0].offset], cache)
            raise


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


def _context_window(path: Path, config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "context_length", "n_ctx", "max_seq_len"):
        if isinstance(config.get(key), int):
            return int(config[key])
    tok_config = path / "tokenizer_config.json"
    if tok_config.exists():
        limit = json.loads(tok_config.read_text()).get("model_max_length")
        if isinstance(limit, int) and limit < 10**7:
            return limit
    return DEFAULT_CONTEXT
