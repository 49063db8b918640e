"""Joins in one forward pass (``mlx_fused``) and caches merged a few layers a step
(``mlx_joining``), on mlx-lm's batch engine with a tiny random llama (no download): every
sequence gets exactly the tokens the engine's own two-pass steps give, whatever happens while a
newcomer's layers are still apart (another newcomer, a sequence leaving, two prompts at once, a
prompt cancelled mid-read), and a leaving sequence's KV is the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator

from turbospark.kernels import ops as kernels
from turbospark.model import mlx_joining, mlx_kernels
from turbospark.model.mlx_fused import can_fuse, fusable, fused_next
from turbospark.model.mlx_joining import JoiningKVCache, joining, settle
from turbospark.model.mlx_sampling import greedy

from ._support import tiny_llama

VOCAB = 32

MODEL = tiny_llama(VOCAB, layers=4, seed=1)
RUNNING = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [3, 1, 4, 1, 5, 9]]
NEWCOMER = [int(t) for t in np.random.default_rng(0).integers(1, VOCAB, 37)]
SECOND = [int(t) for t in np.random.default_rng(1).integers(1, VOCAB, 23)]

Event = Callable[[BatchGenerator, dict[str, Any]], None]

pytestmark = pytest.mark.usefixtures("fast_ops_restored")  # installs leave MLX's own ops to later tests


def drive(fused: bool, events: dict[int, Event], steps: int = 40, model: Any = MODEL) -> tuple[dict[int, list[int]], dict]:
    """The running prompts decode; ``events[n]`` acts on the engine before step ``n``.  Returns
    each sequence's tokens (by insertion order) and what the events kept."""
    engine = BatchGenerator(model, sampler=greedy, completion_batch_size=16, prefill_batch_size=16,
                            prefill_step_size=4)
    order: dict[int, int] = {}
    kept: dict = {"order": order}

    def insert(prompts: list[list[int]]) -> None:
        for uid in engine.insert(prompts, max_tokens=[200] * len(prompts)):
            order[uid] = len(order)

    kept["insert"] = insert
    insert(RUNNING)
    out: dict[int, list[int]] = {}
    fused_steps = joined_steps = 0
    for n in range(steps):
        if n in events:
            kept.setdefault("apart", {})[n] = joining(engine._generation_batch)
            events[n](engine, kept)
        if fused and can_fuse(engine):
            fused_steps += 1
            joined_steps += joining(engine._generation_batch)
            _, generated = fused_next(engine)
        else:
            settle(engine._generation_batch)
            _, generated = engine.next()
        for r in generated:
            out.setdefault(order[r.uid], []).append(r.token)
    kept["fused_steps"], kept["joined_steps"] = fused_steps, joined_steps
    kept["pieces"] = engine._prompt_batch.prefill_step_size
    engine.close()
    return out, kept


def join(prompt: list[int]) -> Event:
    return lambda engine, kept: kept["insert"]([prompt])


def leave(index: int) -> Event:
    def act(engine: BatchGenerator, kept: dict) -> None:
        uid = next(u for u, i in kept["order"].items() if i == index)
        (cache, tokens), = engine.remove([uid], return_prompt_caches=True).values()
        kept[f"left {index}"] = (list(tokens), [np.array(c.state[0]) for c in cache])

    return act


@pytest.fixture(autouse=True)
def one_layer_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Merge one layer a step, so the tests see layers apart for several steps."""
    monkeypatch.setattr(mlx_joining, "MERGE_BYTES", 1)


def same(events: dict[int, Event], **kw: Any) -> dict:
    """The same tokens for every sequence.  A prompt whose rest fits one chunk is read with its
    last token in one pass (the engine gives that token a step of its own), so a newcomer may
    be a token ahead after the same number of steps, never behind and never different."""
    plain, _ = drive(False, events, **kw)
    fused, kept = drive(True, events, **kw)
    assert fused.keys() == plain.keys()
    for seq, tokens in plain.items():
        assert fused[seq][: len(tokens)] == tokens
        assert len(tokens) <= len(fused[seq]) <= len(tokens) + 1
    assert kept["fused_steps"] > 3
    return kept


def test_the_tiny_model_is_one_this_pass_knows() -> None:
    assert fusable(MODEL)


def test_qwen2s_layer_stack_is_read_the_same_way() -> None:
    qwen2 = tiny_llama(VOCAB, layers=4, seed=2, arch="qwen2")  # biased q/k/v projections
    assert fusable(qwen2)
    same({3: join(NEWCOMER), 20: leave(0)}, model=qwen2)


@pytest.mark.skipif(not kernels.available(), reason=f"kernels: {kernels.describe()}")
def test_layers_the_cpu_kernels_fused_run_their_joined_products_in_the_pass_too(monkeypatch) -> None:
    """4-bit weights with x in 8 bits: a row's result does not depend on the rows beside it, so
    the one pass gives exactly the engine's own steps' tokens through the layers' fused
    products (q, k and v in one; gate and up in one, SwiGLU and the residuals in the products)."""
    import mlx.nn as nn

    model = tiny_llama(VOCAB, layers=4, seed=3, hidden=64)
    nn.quantize(model, group_size=32, bits=4)
    assert "4 of 4 decoder layers fused" in mlx_kernels.install(model)
    joined = []
    qkv = type(model.model.layers[0]._turbospark_parts.qkv)
    call = qkv.__call__
    monkeypatch.setattr(qkv, "__call__", lambda self, x, **kw: joined.append(x.shape[1]) or call(self, x, **kw))
    same({3: join(NEWCOMER), 20: leave(0)}, model=model)
    assert max(joined) > len(RUNNING)  # some passes held decode rows and a chunk of the prompt


def test_a_newcomer_read_in_one_pass_gives_every_sequence_the_same_tokens() -> None:
    def join_in_smaller_chunks(engine: BatchGenerator, kept: dict) -> None:
        engine.prefill_step_size = 3  # what the backend's pacer does
        kept["insert"]([NEWCOMER])

    kept = same({3: join_in_smaller_chunks})
    assert kept["joined_steps"] >= 2  # its layers were apart for some steps after it entered
    # the prompt batch mlx-lm reads later prompts with keeps its own pieces, not the step's chunk
    assert kept["pieces"] == 4


def test_a_second_newcomer_while_the_first_is_merged_and_sequences_leaving_then() -> None:
    # a short one enters while the first's layers are apart (three parts in the layers not
    # merged yet, two in the others); a running sequence leaves then; the first newcomer leaves
    # while a third one's layers are apart
    kept = same({3: join(NEWCOMER), 14: join(NEWCOMER[:3]), 16: leave(1), 18: join(SECOND), 24: leave(4)})
    assert kept["apart"] == {3: False, 14: True, 16: True, 18: True, 24: True}


def test_a_leaving_sequences_kv_is_the_same_while_layers_are_apart() -> None:
    events = {3: join(NEWCOMER), 15: leave(2)}
    _, plain = drive(False, events)
    _, fused = drive(True, events)
    assert fused["apart"][15]
    tokens, layers = plain["left 2"]
    assert fused["left 2"][0] == tokens
    for a, b in zip(layers, fused["left 2"][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_two_prompts_at_once_and_a_prompt_cancelled_mid_read() -> None:
    def cancel_newcomer(engine: BatchGenerator, kept: dict) -> None:
        uid = next(u for u, i in kept["order"].items() if i == 4)
        assert uid in engine._prompt_batch.uids  # still reading
        engine.remove([uid])

    same({3: join(NEWCOMER), 5: join(SECOND)})
    same({3: join(NEWCOMER), 5: cancel_newcomer, 8: join(SECOND)})


def test_joining_layers_answer_what_the_engine_asks_of_a_cache() -> None:
    events = {3: join(NEWCOMER)}
    seen: dict = {}

    def look(engine: BatchGenerator, kept: dict) -> None:
        caches = engine._generation_batch.prompt_cache
        apart = [c for c in caches if isinstance(c, JoiningKVCache)]
        seen["apart"] = len(apart)
        if apart:
            seen["rows"] = apart[0].rows()
            seen["bytes"] = engine.prompt_cache_nbytes
            seen["trimmable"] = apart[0].is_trimmable()

    for n in range(14, 20):
        events[n] = look
        _, _ = drive(True, events, steps=n + 1)
        if seen.get("apart"):
            break
    assert seen["apart"] and seen["rows"] == [4, 1]
    assert seen["bytes"] > 0 and seen["trimmable"] is False
