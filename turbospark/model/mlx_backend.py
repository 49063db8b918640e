"""The MLX backend: a model from the store, run on its own pinned thread, many sequences at once.

This module is the engine adapter: ``MlxBackend`` implements ``backend.Backend`` over mlx-lm's
``BatchGenerator``.  Everything here runs on the model thread that built the backend (MLX streams
are thread-local): loading, the prefix cache, prefill and decode.

- Each ``step`` is one decode step for every generating sequence and one prefill chunk for the
  sequences still reading their prompts.  The chunk is shared: at most ``prefill_chunk`` tokens
  a step in all, split between the prompts being read, so a cancelled prompt stops within one
  chunk; while others decode, ``pacing.JoinPacer`` sizes it so that their longest gap between
  tokens stays under twice their usual one.  For llama-stack models, a step that decodes and
  reads one prompt (or a chunk of an image request's, ``mlx_vision``) is one forward pass
  (``mlx_fused``), and a newcomer's KV joins the batch's a few layers a step (``mlx_joining``).
- While at most ``speculate_up_to`` sequences decode (4; 1 on the CPU kernels) and none reads a
  prompt, a step checks drafts instead (``mlx_speculate``): several exact tokens a step.  Drafts
  come from each sequence's own prompt and output (prompt lookup), or from a draft model
  (``mlx_draft``).  A look for drafts reads back the pending tokens, so it costs the step its
  pipelining: after a look that kept nothing, the next waits a few plain steps (``Backoff``).
- Decode is pipelined (step n+1 is dispatched before token n is read back).
- Samplers and logits processors are per sequence (``mlx_sampling``).  One that raises fails its
  own sequence only: the error is recorded, the step goes on with a harmless stand-in, and the
  sequence is reported as failed.
- The prefix cache (``prefix_cache``) gets the KV of every finished or cancelled sequence, and a
  new sequence starts from the longest cached prefix of its prompt.
- What loading reads and measures (context window, defaults, fingerprint, KV bytes per token)
  is in ``mlx_load``.
- LoRA adapters (``serve --lora``, a derived model's carried one) sit beside the layers; each
  sequence's scales are set by its engine id, and its prefix-cache key is marked by its adapters
  (``mlx_adapters``).  While one runs, the one-pass mixed step and speculation stand aside.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import trim_prompt_cache

from .backend import PrefillProgress, SamplingParams, StepOutput
from .mlx_load import context_window, generation_defaults, kv_sizes, model_fingerprint
from .mlx_ggml import load_model, trim
from .lookup import Backoff, Lookup, Pace
from .pacing import JoinPacer
from .pipeline import pipeline
from .constraint import Matcher
from .mlx_sampling import Sampler, greedy, guard, make_processors, make_sampler, think_ids, top_logprobs
from .mlx_adapters import Adapter, attach, marked
from ..kernels.ops import kv_cache as kernels_cache
from .mlx_blocks import half_kv
from .mlx_draft import ModelDrafter, check_vocabularies
from .mlx_fused import Outside, can_fuse, can_fuse_outside, fusable, fused_next, fused_outside
from .mlx_joining import settle
from .mlx_kernels import install as install_kernels
from .mlx_kernels import serves as kernels_serve
from .mlx_speculate import speculative_step
from .mlx_vision import Seen, vision_side
from .prefix_cache import PrefixCache, trimmable
from .prompt_files import PromptFiles, tokenizer_digest
from .prompt_slots import slots_of
from .tokenizer import Tokenizer

__all__ = ["MlxBackend", "PrefixCache", "generation_defaults"]


@attrs.define
class _Running:
    uid: int  # the engine's id
    prompt: list[int]
    cached: int  # prompt tokens in its cache when it joined
    reused: int | None = None  # of which the prefix cache gave (None: all of them)
    key: list[int] | None = None  # its prompt as the prefix cache knows it (images: ``mlx_vision``)
    reading: bool = True  # still in prefill
    logprobs: int | None = None  # alternatives to report per token, when asked
    sampler: Sampler | None = None  # its own draws (None: greedy)
    drafter: Lookup | ModelDrafter | None = None  # where its drafts come from (None: it never speculates)
    matcher: Matcher | None = None  # its grammar's position, when its output is constrained
    pace: Pace = attrs.field(factory=Pace)


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
        group: mx.distributed.Group | None = None,
        shard: str = "tensor",
        prompt_cache_dir: Path | None = None,
        prompt_cache_bytes: int = 4 << 30,
        speculate_up_to: int | None = None,
        draft_path: Path | None = None,
        adapters: Sequence[Adapter] = (),
    ) -> None:
        self.model_id = model_id
        # tokenizers first, what their parsing freed given back before the weights (Gemma 3's: ~290 MB each)
        self.tokenizer = Tokenizer.from_dir(path)
        trim()
        self.tokenizer.grammars  # constrained decoding's (0.2-3 s holding the GIL): now, not in a step
        trim()
        self.stream = mx.new_thread_local_stream(mx.default_device())
        with mx.stream(self.stream):
            self.model, config = load_model(path, lazy=group is not None, group=group)
            self.layers: tuple[int, int] | None = None  # this rank's slice (pipeline sharding)
            if group is not None and shard == "pipeline":  # this rank's layers (``pipeline.py``)
                self.layers = pipeline(self.model, group)
            elif group is not None:  # this rank's tensor-parallel shard (``sharded.py``)
                if not hasattr(self.model, "shard"):
                    raise ValueError(f"the {config.get('model_type')} architecture cannot be sharded by tensors")
                self.model.shard(group)
            if group is not None:
                mx.random.seed(0)  # every rank samples alike
            mx.eval(self.model.parameters())
            self.kernels = install_kernels(self.model)  # which kernels serve it (startup lines)
            # LoRA adapters beside its layers, chosen row by row (``mlx_adapters``, ``SamplingParams.adapters``)
            self.adapters = list(adapters)
            self.route = attach(self.model, self.adapters)
            # the adapter a derived model carries (named ""): every request that chooses none
            self.carried = tuple((i, 1.0) for i, a in enumerate(self.adapters) if not a.name)
            self._kv_size = kv_sizes(self.model)
            self.kernels += f"; KV cache {self._kv_size(1000) / 1e6:.1f} MB per 1,000 tokens"
            if (asked := kernels_cache(asked=True)) in ("q8_0", "q4_0") and not half_kv(self.model):
                self.kernels += f" (--kv-cache {asked} needs the kernels' fused layers, not here)"
        # a vision tower beside the language model: images read between steps (``mlx_vision``)
        self.vision = vision_side(path, self)
        self.draft_model: Any = None  # --draft-model: drafts come from it instead of prompt lookup
        if draft_path is not None:
            check_vocabularies(self.tokenizer.vocab, Tokenizer.from_dir(draft_path).vocab, draft_path.name)
            with mx.stream(self.stream):
                self.draft_model, _ = load_model(draft_path)
                mx.eval(self.draft_model.parameters())
                install_kernels(self.draft_model)
        self.context_window = context_window(path, config)
        self.sampling_defaults = generation_defaults(path)
        kv = {"f16": "kv float16"}.get(kernels_cache(), f"kv {kernels_cache()}")
        self.fingerprint = model_fingerprint(path, *([kv] if half_kv(self.model) else []))
        on_gpu = mx.default_device().type == mx.gpu
        # Small chunks on CPU: a new arrival stalls the running streams, and a cancelled prompt
        # runs on, for one chunk at most.
        self.prefill_chunk = prefill_chunk or (512 if on_gpu else 128)
        self.max_batch = max_batch
        files = None
        if prompt_cache_dir is not None:  # entries persist across restarts (prompt_files)
            files = PromptFiles.for_model(prompt_cache_dir, self.fingerprint, tokenizer_digest(path), prompt_cache_bytes)
        self.prefix_cache = PrefixCache(cache_entries, cache_bytes, files=files)
        with mx.stream(self.stream):
            self.prefix_cache.restore()
        # Speculation runs while at most this many sequences decode (0: never); measured in
        # decision 0025: with MLX's own ops past 4 streams it costs the ones that have nothing to
        # draft, with the CPU kernels (whose steps cost by the row) past one.
        if speculate_up_to is None:
            speculate_up_to = 1 if kernels_serve(self.model) else 4
        self.speculate_up_to = speculate_up_to
        # A step that decodes and reads a prompt runs as one forward pass (``mlx_fused``).
        self.fuse = group is None and fusable(self.model)
        self.pacer = self.join_pacer()
        self.decode_steps = 0  # tokens decoded, all sequences together (tests, benchmarks)
        self.drafted = self.accepted = 0  # draft tokens checked and kept (benchmarks)
        self.looks = Backoff()  # when a step looks for drafts (a look is a sync: lookup.py)
        self.engine_steps = 0
        self.fused_steps = 0  # steps run as one pass with a prompt chunk or joining layers (tests)
        self._running: dict[int, _Running] = {}
        self._by_uid: dict[int, int] = {}
        self._failed: dict[int, BaseException] = {}
        self.engine = self._new_engine()

    def join_pacer(self) -> JoinPacer:
        """The prefill chunk's pacer.  In one pass with the decode rows a small chunk costs them
        little, so it may go down to 8 tokens; in a pass of its own it costs the whole pass
        whatever its size, so it stays at 16 or more."""
        return JoinPacer(self.prefill_chunk, least=8 if self.fuse else 16)

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

    def cached_prefix(self, prompt: list[int], images: Seen | None = None,
                      adapters: tuple[tuple[int, float], ...] = ()) -> int:
        if images is not None:
            return self.prefix_cache.peek(images.key)
        return self.prefix_cache.peek(marked(prompt, adapters or self.carried, self.adapters))

    def insert(self, seq: int, prompt: list[int], params: SamplingParams, images: Seen | None = None) -> int:
        if images is not None and self.vision is not None:  # its images are read first
            return self.vision.start(seq, prompt, params, images)
        params = params if params.adapters or not self.carried else attrs.evolve(params, adapters=self.carried)
        key = marked(prompt, params.adapters, self.adapters)  # an adapter's KV is its own
        cache, cached = self.prefix_cache.take(key)
        self._insert(seq, prompt, params, cache, cached, key=None if key is prompt else key)
        return cached

    def fork(self, seq: int, new: Mapping[int, SamplingParams]) -> bool:
        """Copies of ``seq``'s KV cache, trimmed to all but the last prompt token, start the new
        sequences: each feeds that token and samples its own way."""
        run = self._running[seq]
        with mx.stream(self.stream):
            (cache, tokens), = self.engine.extract_cache([run.uid]).values()
            mx.eval([c.state for c in cache])  # this sequence's KV only, not the batch's buffers
        keep = len(run.prompt) - 1
        if list(tokens[:keep]) != run.prompt[:keep] or (len(tokens) > keep and not trimmable(cache)):
            return False
        trim = len(tokens) - keep
        copies = [copy.deepcopy(cache) for _ in new]
        if trim and any(trim_prompt_cache(c, trim) != trim for c in copies):
            return False  # before any of them is inserted: the caller inserts them afresh
        for (sid, params), cache_copy in zip(new.items(), copies, strict=True):
            self._insert(sid, run.prompt, params, cache_copy, keep, key=run.key)
        return True

    def _insert(self, seq: int, prompt: list[int], params: SamplingParams, cache: list[Any] | None, cached: int,
                *, reused: int | None = None, key: list[int] | None = None) -> None:
        if not params.adapters and self.carried:
            params = attrs.evolve(params, adapters=self.carried)
        sampler = own = make_sampler(params)
        if sampler is not greedy:
            own = guard(self._failed, seq, sampler, greedy)
        matcher = None if params.grammar is None else self.tokenizer.grammars.matcher(params.grammar)
        steps = make_processors(params, len(prompt), self.tokenizer.stop_ids, matcher, think_ids(self.tokenizer.vocab))
        processors = [guard(self._failed, seq, p, lambda tokens, logits: logits) for p in steps]
        with mx.stream(self.stream):
            (uid,) = self.engine.insert(
                [prompt[cached:]],
                max_tokens=[params.max_tokens + 2],  # the model thread ends it, never the engine
                caches=[cache] if cache is not None else None,
                all_tokens=[prompt[:cached]],
                samplers=[own],
                logits_processors=[processors],
            )
        self._running[seq] = _Running(
            uid, prompt, cached, reused, key, logprobs=params.logprobs,
            sampler=sampler if isinstance(sampler, Sampler) else None,
            drafter=(Lookup() if self.draft_model is None else ModelDrafter(self.draft_model))
            if params.speculative else None,
            matcher=matcher,
        )
        self._by_uid[uid] = seq
        if self.route is not None:
            self.route.use(uid, params.adapters)
        self.looks.reset()

    def step(self) -> StepOutput:
        seen: dict[int, PrefillProgress] = {}
        outside = None  # a vision prompt chunk for this step's pass (``mlx_vision``, ``mlx_fused``)
        if self.vision is not None and self.vision.reading:  # a piece of a request's images first
            seen, lost = self.vision.advance(self.pacer.size(len(self.engine._generation_batch)),
                                             fuse=self.fuse and can_fuse_outside(self.engine)
                                             and not (self.route and self.route.active))  # fmt: skip
            self._failed.update(lost)
            outside = self.vision.take_chunk()
        out = (None if outside else self._speculate()) or self._step(outside)
        return attrs.evolve(out, progress={**out.progress, **seen}) if seen else out

    def _step(self, outside: Outside | None = None) -> StepOutput:
        prefilling = sum(r.reading for r in self._running.values())
        decoding = len(self.engine._generation_batch)
        # One chunk a step in all, shared by the prompts being read, sized by the pacer so the
        # streams decoding meanwhile wait at most about twice their usual gap.
        chunk = self.pacer.size(decoding)
        self.engine.prefill_step_size = max(8, chunk // max(1, prefilling))
        began = time.perf_counter()
        if outside is not None or (self.fuse and can_fuse(self.engine) and not (self.route and self.route.active)):
            self.fused_steps += 1
            with mx.stream(self.stream):
                prompt_responses, generation_responses = (
                    fused_next(self.engine) if outside is None else ([], fused_outside(self.engine, outside)))
            prefilling += outside is not None
        else:
            settle(self.engine._generation_batch)  # mlx-lm's own step knows only whole rectangles
            prompt_responses, generation_responses = self.engine.next()
        self.pacer.record(time.perf_counter() - began, decoding, prefilling)
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
            progress[seq] = PrefillProgress(run.cached + done, run.cached + total,
                                            run.cached if run.reused is None else run.reused)
        tokens: dict[int, int] = {}
        asked: list[tuple[int, mx.array, int, int]] = []
        for r in generation_responses:
            seq = self._by_uid.get(r.uid)
            if seq is not None:
                tokens[seq] = r.token
                self.decode_steps += 1
                if (k := self._running[seq].logprobs) is not None:
                    asked.append((seq, r.logprobs, r.token, k))
        logprobs = top_logprobs(asked)
        failed = self._drop_failed(tokens)
        return StepOutput(progress, tokens, failed=failed, logprobs={s: v for s, v in logprobs.items() if s in tokens})

    def _drop_failed(self, tokens: dict[int, int]) -> dict[int, BaseException]:
        failed, self._failed = self._failed, {}
        for seq in failed:
            self.remove(seq, keep_cache=False)
            tokens.pop(seq, None)
        return failed

    def _speculate(self) -> StepOutput | None:
        if self.route is not None and self.route.active:  # the engine's own step routes the rows' adapters
            return None
        return speculative_step(self)

    def remove(self, seq: int, *, keep_cache: bool = True) -> None:
        if self.vision is not None and self.vision.drop(seq):  # still reading its images
            return
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
                tokens = list(tokens) if run.key is None else run.key + list(tokens)[len(run.key):]
                self.prefix_cache.put(tokens, cache)
        del self._running[seq], self._by_uid[run.uid]
        if self.route is not None:
            self.route.drop(run.uid)

    def persist(self) -> None:
        """Write the prefix cache's entries to ``--prompt-cache-dir`` (unload, shutdown)."""
        with mx.stream(self.stream):
            self.prefix_cache.persist()

    def slot_command(self, action: str, slot: int | None, filename: str | None) -> Any:
        """llama.cpp's slot actions on the prefix cache (``prompt_slots``)."""
        slots = slots_of(self.prefix_cache, self.context_window, self.model_id, self.tokenizer.decode)
        with mx.stream(self.stream):
            return slots.run(action, slot, filename)

    def reset(self) -> None:
        old, self.engine = self.engine, self._new_engine()
        self._running.clear()
        self._by_uid.clear()
        self._failed.clear()
        if self.route is not None:
            self.route.scales.clear()
        if self.vision is not None:
            self.vision.reading.clear()
        old.close()
