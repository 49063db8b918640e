"""A KV cache in llama.cpp's blocks of 32 (``serve --kv-cache q8_0|q4_0``, decision 0047):

- ``kv_write`` quantizes new rows byte for byte as llama.cpp does (gguf-py's reference of
  ``quantize_row_q8_0`` and ``quantize_row_q4_0``);
- the kernels' attention reads the blocks as the values they stand for: MLX's own attention on
  the dequantized keys and values, property-tested over shapes, heads and masks;
- a fused model's caches are made in blocks (int8 for q8_0, uint8 for q4_0) where the head size
  allows, grow and batch as mlx-lm's own, hold 34/64 and 18/64 of float16's bytes, and give
  nearly float16's logits; a sliding window's cache stays in float16.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from turbospark.kernels import ops as kernels


def tiny_llama(seed: int = 4) -> object:
    """A small random llama (mlx-lm's init, 4 heads of 32: a head size that blocks take)."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                                        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                        rms_norm_eps=1e-5, vocab_size=128))
    mx.eval(model.parameters())
    return model

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels: {kernels.describe()}")
pytestmark = [needs_kernels, pytest.mark.usefixtures("fast_ops_restored")]
FORMATS = {"q8_0": (mx.int8, 34), "q4_0": (mx.uint8, 18)}


@pytest.fixture
def kv_cache():  # type: ignore[no-untyped-def]
    before = kernels.kv_cache()

    def use(kind: str) -> None:
        kernels.set_kv_cache(kind)

    yield use
    kernels.set_kv_cache(before)


def dequantized(blocks: mx.array, kind: str, d: int) -> np.ndarray:
    raw = np.array(blocks).view(np.uint8).reshape(*blocks.shape[:-1], d // 32, FORMATS[kind][1])
    scale = raw[..., :2].copy().view(np.float16).astype(np.float32)
    if kind == "q8_0":
        q = raw[..., 2:].view(np.int8).astype(np.float32)
    else:
        q = np.concatenate([(raw[..., 2:] & 15).astype(np.float32) - 8, (raw[..., 2:] >> 4).astype(np.float32) - 8], -1)
    return (q * scale).reshape(*blocks.shape[:-1], d)


def written(kind: str, k: np.ndarray) -> mx.array:
    dtype, size = FORMATS[kind]
    B, H, L, D = k.shape
    empty = mx.zeros((B, H, L + 3, D // 32 * size), dtype)
    _, _, view, _ = kernels.kv_write(empty, empty, mx.array(k), mx.array(k), 0)
    return view


@pytest.mark.parametrize("kind", FORMATS)
def test_rows_are_quantized_byte_for_byte_as_llama_cpp_quantizes_them(kind) -> None:
    import gguf

    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 3, 5, 64)).astype(np.float32) * rng.uniform(0.01, 20, (2, 3, 5, 1)).astype(np.float32)
    k[0, 0, 0] = 0.0  # a block of zeros: scale 0
    k[0, 0, 1, :32] = 0.5  # ties
    ours = np.array(written(kind, k)).view(np.uint8)
    kind_type = gguf.GGMLQuantizationType.Q8_0 if kind == "q8_0" else gguf.GGMLQuantizationType.Q4_0
    theirs = gguf.quants.quantize(k.reshape(-1, 64), kind_type).reshape(ours.shape)
    assert np.array_equal(ours, theirs)


@given(kind=st.sampled_from(sorted(FORMATS)), batch=st.integers(1, 2), kv_heads=st.integers(1, 2),
       group=st.sampled_from([1, 3]), queries=st.integers(1, 9), keys=st.integers(1, 40),
       d=st.sampled_from([32, 64, 128]), mask=st.sampled_from(["none", "causal", "bool"]),
       merged=st.booleans())
@settings(max_examples=60, deadline=None)
def test_attention_reads_blocks_as_the_values_they_stand_for(kind, batch, kv_heads, group, queries, keys, d, mask,
                                                             merged) -> None:
    rng = np.random.default_rng(batch * 1000 + keys * 10 + d)
    queries = min(queries, keys)
    q = mx.array(rng.standard_normal((batch, kv_heads * group, queries, d)).astype(np.float32))
    k = written(kind, rng.standard_normal((batch, kv_heads, keys, d)).astype(np.float32))
    v = written(kind, rng.standard_normal((batch, kv_heads, keys, d)).astype(np.float32))
    given_mask: mx.array | str | None = None if mask == "none" else "causal"
    if mask == "bool":
        given_mask = mx.array(rng.random((batch, 1, queries, keys)) > 0.3)
    scale = d ** -0.5
    with kernels.mlx_own_ops():
        want = mx.fast.scaled_dot_product_attention(q, mx.array(dequantized(k, kind, d)), mx.array(dequantized(v, kind, d)),
                                                    scale=scale, mask=given_mask)
    if merged:
        got = kernels.merged_attention(q, k, v, scale=scale, mask=given_mask)
        want = want.transpose(0, 2, 1, 3).reshape(batch, queries, -1)
    else:
        got = kernels.attention(q, k, v, scale=scale, mask=given_mask)
    assert got.shape == want.shape
    assert np.allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_fused_model_keeps_its_cache_in_blocks_with_nearly_float16_s_logits(kind, kv_cache) -> None:
    from turbospark.model import mlx_kernels

    prompt = mx.array([[5, 17, 3, 88, 41, 9, 60, 2, 33, 71]])
    runs = {}
    for each in ("f16", kind):
        kv_cache(each)
        model = tiny_llama()
        assert "2 of 2 decoder layers fused" in mlx_kernels.install(model)
        cache = make_prompt_cache(model)
        logits = [model(prompt, cache=cache)[:, -1]]
        for token in (7, 19, 23):  # decode steps, each quantized as it is written
            logits.append(model(mx.array([[token]]), cache=cache)[:, -1])
        runs[each] = (np.array(mx.concatenate(logits)), cache)
    (half, half_cache), (blocks, cache) = runs["f16"], runs[kind]
    dtype, size = FORMATS[kind]
    assert cache[0].keys.dtype == dtype and half_cache[0].keys.dtype == mx.float16
    assert cache[0].nbytes / half_cache[0].nbytes == pytest.approx(size / 64)
    spread = np.abs(half).max()
    assert np.abs(blocks - half).max() < (0.02 if kind == "q8_0" else 0.15) * spread  # measured: 0.005, 0.067
    assert (blocks.argmax(-1) == half.argmax(-1)).mean() >= 0.75

    # a batch cache: rows of different lengths, their left padding, filtered as mlx-lm filters them
    kv_cache(kind)
    model = tiny_llama()
    mlx_kernels.install(model)
    batch = [BatchKVCache([2, 0]) for _ in model.layers]
    out = model(mx.array([[0, 0, 5, 17, 3], [9, 60, 2, 33, 71]]), cache=batch)
    mx.eval(out)
    assert batch[0].keys.dtype == dtype and batch[0].keys.shape[-1] == 32 // 32 * size
    for c in batch:
        c.filter([1])
    alone = make_prompt_cache(model)
    first = model(mx.array([[9, 60, 2, 33, 71]]), cache=alone)
    assert np.allclose(np.array(model(mx.array([[4]]), cache=batch)[0, -1]),
                       np.array(model(mx.array([[4]]), cache=alone)[0, -1]), atol=1e-4)
    assert first.shape == out[1:].shape


def test_a_layer_whose_attention_is_not_the_kernels_keeps_float16(kv_cache) -> None:
    """Gemma 2's soft-capped attention is its own ops on the heads: its caches stay float16."""
    from mlx_lm.models import gemma2

    from turbospark.model import mlx_kernels

    kv_cache("q8_0")
    mx.random.seed(2)
    model = gemma2.Model(gemma2.ModelArgs(
        model_type="gemma2", hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        head_dim=32, rms_norm_eps=1e-6, vocab_size=128, num_key_value_heads=2, query_pre_attn_scalar=32))
    mx.eval(model.parameters())
    assert "2 of 2 decoder layers fused" in mlx_kernels.install(model)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5, 17, 3, 88]]), cache=cache), model(mx.array([[7]]), cache=cache))
    assert {c.keys.dtype for c in cache} == {mx.float16}
