"""The raw engine's decode speed (``MlxBackend``, no HTTP), for the benchmarks that compare its
configurations (``bench_lora.py``, ``bench_kv_cache.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def decode_rate(backend: Any, prompts: list[list[int]], steps: int,
                adapters: Callable[[int], tuple[tuple[int, float], ...]] = lambda i: ()) -> float:
    """Tokens a second of ``prompts`` decoding together once all are read, greedy, prompt lookup
    off, ``steps`` tokens each (``adapters(i)``: sequence i's LoRA adapters)."""
    from turbospark.model.backend import SamplingParams

    for i, prompt in enumerate(prompts):
        backend.insert(i, prompt, SamplingParams(max_tokens=steps + 8, temperature=0.0, speculative=False,
                                                 adapters=adapters(i)))
    counts = dict.fromkeys(range(len(prompts)), 0)
    began, start = None, 0
    while min(counts.values()) < steps:
        out = backend.step()
        if began is None and len(out.tokens) == len(prompts):  # every prompt read: the decode's first step
            began, start = time.perf_counter(), sum(counts.values()) + len(prompts)
        for seq in out.tokens:
            counts[seq] += 1
    rate = (sum(counts.values()) - start) / (time.perf_counter() - began)
    for i in range(len(prompts)):
        backend.remove(i, keep_cache=False)
    return rate
