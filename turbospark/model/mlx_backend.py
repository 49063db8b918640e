"""The MLX backend: a model from the store, run on its own pinned thread, many sequences at once.

Everything here runs on the model thread that built the backend (MLX streams are thread-local):
loading, the prefix cache, prefill and decode.

- The engine is mlx-lm's ``BatchGenerator`` (continuous batching over a batched KV cache): each
  ``step`` is one decode step for every generating sequence and one prefill chunk for the
  sequences still reading their prompts.  The chunk is shared: ``prefill_chunk`` tokens a step
  in all, split between the prompts being read, so a new arrival stalls the running streams by
  one chunk's compute at most, and a cancelled prompt stops within one chunk.
- Decode is pipelined (step n+1 is dispatched before token n is read back).
- Sampling uses an explicit PRNG key per sequence, split per step: a request with a ``seed``
  repeats exactly, whatever shares its batch.  Greedy sequences share one sampler, so an
  all-greedy batch samples in one call.
- A sampler or logits processor that raises fails its own sequence only: the error is recorded,
  the step goes on with a harmless stand-in, and the sequence is reported as failed.
- The prefix cache keeps the KV caches of recent sequences (bounded in entries and bytes); a
  finished or cancelled sequence hands its KV back, and a new one starts from the longest cached
  prefix and prefills only the rest.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)
from mlx_lm.utils import load_model

from .. import __version__
from .backend import PrefillProgress, SamplingParams, StepOutput, fingerprint
from .constraint import Matcher
from .tokenizer import Tokenizer

__all__ = ["MlxBackend", "PrefixCache", "generation_defaults", "make_sampler"]

DEFAULT_CONTEXT = 4096


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """Greedy at temperature 0 (or ``top_p`` 0, OpenAI's most restrictive nucleus); otherwise
    top-k / top-p / min-p, then a draw with this request's own key."""
    if params.temperature == 0 or params.top_p == 0:
        return greedy
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


def make_processors(params: SamplingParams, prompt_len: int) -> list[Callable[..., mx.array]]:
    """Penalties, as logits processors for the batch engine.

    The engine hands each processor the tokens in the sequence's KV cache: the whole prompt, then
    what was generated.  Presence and frequency penalties see the generated text only (OpenAI's
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
        processors.append(
            lambda tokens, logits, penalty=penalty: penalty(tokens[prompt_len:], logits)
        )
    if params.repetition_penalty != 1:
        processors.append(make_repetition_penalty(params.repetition_penalty, 20))
    if params.logit_bias:
        ids = mx.array([i for i, _ in params.logit_bias])
        bias = mx.array([b for _, b in params.logit_bias], dtype=mx.float32)
        processors.append(lambda tokens, logits: logits.at[:, ids].add(bias.astype(logits.dtype)))
    return processors


def constrain(matcher: Matcher) -> Callable[[mx.array, mx.array], mx.array]:
    """Constrained decoding as a logits processor: consume the token sampled last step (the
    engine feeds it back as the newest context token; the first call sees the prompt's last
    token), then mask every token the grammar does not allow next."""
    calls = 0

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls
        if calls:
            matcher.consume(int(tokens[-1].item()))
        calls += 1
        if matcher.done:
            return logits
        allowed = matcher.allowed()
        mask = np.zeros(logits.shape[-1], dtype=bool)
        width = min(len(allowed), mask.size)
        mask[:width] = allowed[:width]
        return mx.where(mx.array(mask), logits, mx.array(-mx.inf, dtype=logits.dtype))

    return process


@attrs.define
class _Entry:
    tokens: list[int]
    cache: list[Any]

    @property
    def nbytes(self) -> int:
        return sum(getattr(c, "nbytes", 0) for c in self.cache)


def _trimmable(cache: list[Any]) -> bool:
    return all(getattr(c, "is_trimmable", lambda: False)() for c in cache)


@attrs.define
class PrefixCache:
    """KV caches of recent sequences, most recent last, bounded in entries and bytes.

    An entry's ``tokens`` are exactly what its cache holds.  Caches that cannot be trimmed (a
    rotating window, the array state of hybrid and state-space models, anything without an
    ``offset``) are reused only where no trim is needed: when the whole entry is a prefix of the
    new prompt.
    """

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
        if best is None or reuse <= 0:
            return None, 0
        trim = len(best.tokens) - reuse
        if trim and not _trimmable(best.cache):
            return None, 0
        if best_len == len(best.tokens):
            self.entries.remove(best)
            cache = best.cache
        else:
            cache = copy.deepcopy(best.cache)
        if trim and trim_prompt_cache(cache, trim) != trim:
            return None, 0
        return cache, reuse

    def peek(self, prompt: list[int]) -> int:
        """What ``take`` would reuse, without taking it."""
        best, best_len = None, 0
        for entry in self.entries:
            n = _common_prefix(entry.tokens, prompt)
            if n > best_len:
                best, best_len = entry, n
        reuse = min(best_len, len(prompt) - 1)
        if best is None or reuse <= 0 or (len(best.tokens) > reuse and not _trimmable(best.cache)):
            return 0
        return reuse

    def put(self, tokens: list[int], cache: list[Any]) -> None:
        if not tokens or not cache:
            return
        # An entry this one extends (or repeats) says nothing more: drop it, so a repeated prompt
        # does not fill the cache with copies and push other conversations out.
        self.entries = [e for e in self.entries if e.tokens != tokens[: len(e.tokens)]]
        self.entries.append(_Entry(list(tokens), cache))
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


@attrs.define
class _Running:
    uid: int  # the engine's id
    prompt: list[int]
    cached: int
    reading: bool = True  # still in prefill
    logprobs: int | None = None  # alternatives to report per token, when asked


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
        max_batch: int = 256,
    ) -> None:
        self.model_id = model_id
        self.stream = mx.new_thread_local_stream(mx.default_device())
        with mx.stream(self.stream):
            self.model, config = load_model(path)
            mx.eval(self.model.parameters())
            self._kv_size = _kv_sizes(self.model)
        self.tokenizer = Tokenizer.from_dir(path)
        self.tokenizer.grammars  # constrained decoding's tokenizer (~0.2 s): now, not in a step
        self.context_window = _context_window(path, config)
        self.sampling_defaults = generation_defaults(path)
        self.fingerprint = _fingerprint(path)
        on_gpu = mx.default_device().type == mx.gpu
        # Small chunks on CPU: a new arrival stalls the running streams, and a cancelled prompt
        # runs on, for one chunk at most.
        self.prefill_chunk = prefill_chunk or (512 if on_gpu else 128)
        self.max_batch = max_batch
        self.prefix_cache = PrefixCache(cache_entries, cache_bytes)
        self.decode_steps = 0  # tokens decoded, all sequences together (tests, benchmarks)
        self.engine_steps = 0
        self._running: dict[int, _Running] = {}
        self._by_uid: dict[int, int] = {}
        self._failed: dict[int, BaseException] = {}
        self.engine = self._new_engine()

    def _new_engine(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            sampler=greedy,
            completion_batch_size=self.max_batch,
            prefill_batch_size=self.max_batch,
            prefill_step_size=self.prefill_chunk,
            stream=self.stream,
        )

    # --- memory ----------------------------------------------------------------------------

    def kv_estimate(self, tokens: int) -> int:
        return self._kv_size(tokens)

    def kv_bytes(self) -> int:
        return int(self.engine.prompt_cache_nbytes)

    # --- sequences -------------------------------------------------------------------------

    def cached_prefix(self, prompt: list[int]) -> int:
        return self.prefix_cache.peek(prompt)

    def insert(self, seq: int, prompt: list[int], params: SamplingParams) -> int:
        cache, cached = self.prefix_cache.take(prompt)
        self._insert(seq, prompt, params, cache, cached)
        return cached

    def fork(self, seq: int, new: Mapping[int, SamplingParams]) -> bool:
        """Copies of ``seq``'s KV cache, trimmed to all but the last prompt token, start the new
        sequences: each feeds that token and samples its own way."""
        run = self._running[seq]
        with mx.stream(self.stream):
            (cache, tokens), = self.engine.extract_cache([run.uid]).values()
            mx.eval([c.state for c in cache])  # this sequence's KV only, not the batch's buffers
        keep = len(run.prompt) - 1
        if list(tokens[:keep]) != run.prompt[:keep] or (len(tokens) > keep and not _trimmable(cache)):
            return False
        trim = len(tokens) - keep
        copies = [copy.deepcopy(cache) for _ in new]
        if trim and any(trim_prompt_cache(c, trim) != trim for c in copies):
            return False  # before any of them is inserted: the caller inserts them afresh
        for (sid, params), cache_copy in zip(new.items(), copies, strict=True):
            self._insert(sid, run.prompt, params, cache_copy, keep)
        return True

    def _insert(self, seq: int, prompt: list[int], params: SamplingParams, cache: list[Any] | None, cached: int) -> None:
        sampler = make_sampler(params)
        if sampler is not greedy:
            sampler = self._guard(seq, sampler, greedy)
        steps = make_processors(params, len(prompt))
        if params.grammar is not None:
            steps.append(constrain(self.tokenizer.grammars.matcher(params.grammar)))
        processors = [self._guard(seq, p, lambda tokens, logits: logits) for p in steps]
        with mx.stream(self.stream):
            (uid,) = self.engine.insert(
                [prompt[cached:]],
                max_tokens=[params.max_tokens + 2],  # the model thread ends it, never the engine
                caches=[cache] if cache is not None else None,
                all_tokens=[prompt[:cached]],
                samplers=[sampler],
                logits_processors=[processors],
            )
        self._running[seq] = _Running(uid, prompt, cached, logprobs=params.logprobs)
        self._by_uid[uid] = seq

    def _guard(self, seq: int, fn: Callable[..., mx.array], stand_in: Callable[..., mx.array]) -> Callable[..., mx.array]:
        """``fn`` for one sequence; if it raises, the sequence is marked failed and the step goes
        on with ``stand_in`` for it."""

        def guarded(*args: mx.array) -> mx.array:
            if seq not in self._failed:
                try:
                    return fn(*args)
                except Exception as exc:
                    self._failed[seq] = exc
            return stand_in(*args)

        return guarded

    def step(self) -> StepOutput:
        prefilling = sum(r.reading for r in self._running.values())
        # One chunk a step in all, shared by the prompts being read.
        self.engine.prefill_step_size = max(16, self.prefill_chunk // max(1, prefilling))
        prompt_responses, generation_responses = self.engine.next()
        self.engine_steps += 1
        progress: dict[int, PrefillProgress] = {}
        for r in prompt_responses:
            seq = self._by_uid.get(r.uid)
            if seq is None:
                continue
            run = self._running[seq]
            done, total = r.progress
            if r.end_of_prompt:
                run.reading = False
            progress[seq] = PrefillProgress(run.cached + done, run.cached + total, run.cached)
        tokens: dict[int, int] = {}
        asked: list[tuple[int, mx.array, int, int]] = []
        for r in generation_responses:
            seq = self._by_uid.get(r.uid)
            if seq is not None:
                tokens[seq] = r.token
                self.decode_steps += 1
                if (k := self._running[seq].logprobs) is not None:
                    asked.append((seq, r.logprobs, r.token, k))
        logprobs = _logprobs(asked)
        failed, self._failed = self._failed, {}
        for seq in failed:
            self.remove(seq, keep_cache=False)
            tokens.pop(seq, None)
        return StepOutput(progress, tokens, failed, {s: v for s, v in logprobs.items() if s in tokens})

    def remove(self, seq: int, *, keep_cache: bool = True) -> None:
        run = self._running.get(seq)
        if run is None:
            return
        with mx.stream(self.stream):
            caches = self.engine.remove([run.uid], return_prompt_caches=keep_cache)
            if run.uid in caches:
                cache, tokens = caches[run.uid]
                # An extracted cache is a lazy slice of the whole batch's buffers: evaluate it
                # so the prefix cache holds this sequence's KV only, as its byte count says.
                mx.eval([c.state for c in cache])
                self.prefix_cache.put(list(tokens), cache)
        del self._running[seq], self._by_uid[run.uid]

    def reset(self) -> None:
        old, self.engine = self.engine, self._new_engine()
        self._running.clear()
        self._by_uid.clear()
        self._failed.clear()
        old.close()


def _logprobs(
    asked: list[tuple[int, mx.array, int, int]],
) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """The chosen token's log-probability and the ``k`` most likely tokens, for the sequences
    that asked (one evaluation for all of them; nothing for the others)."""
    if not asked:
        return {}
    picks = []
    for _, lp, token, k in asked:
        top = mx.argpartition(-lp, k - 1)[:k] if k else mx.array([], dtype=mx.uint32)
        picks.append((lp[token], top, lp[top] if k else top))
    mx.eval(picks)
    out = {}
    for (seq, _, _, _), (chosen, top, values) in zip(asked, picks, strict=True):
        pairs = sorted(zip(top.tolist(), values.tolist(), strict=True), key=lambda p: -p[1])
        out[seq] = (chosen.item(), tuple(pairs))
    return out


def _fingerprint(path: Path) -> str:
    """From the weights' digest and dtype the store recorded (else the directory's weight files'
    names and sizes, and its config), and the versions of the engine."""
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
        weights, f"turbospark {__version__}", f"mlx {mx.__version__}", f"mlx-lm {mlx_lm.__version__}"
    )


def _kv_sizes(model: Any) -> Callable[[int], int]:
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
