"""A decoder layer in a dozen ops (``model/mlx_blocks``) and the kernels' pieces it is made of.

- A product's residual epilogue gives exactly ``residual + product`` (the same two roundings).
- Its RMSNorm prologue gives exactly the product of the norm's own op's output.
- Its SwiGLU epilogue, over a gate's and an up projection's rows one after the other, gives
  exactly mlx-lm's ``swiglu`` of the two halves (MLX's own exp and roundings).
- Its GELU epilogue (Gemma's ``gelu_approx(gate) * up``) is within 16 units of float32's last
  place of the exact value (float64 from the same rounded halves), one of float16's and
  bfloat16's; MLX's own ops, rounding each of their steps, are thousands off in places.  It
  depends on the product only through the halves' rounded values.
- ``split_heads`` gives exactly the reshapes and transposes of mlx-lm's attention, as views.
- Attention with its heads side by side gives exactly the transposed result.
- Fused layers of llama, qwen2 (biased q/k/v), qwen3 (q and k norms), phi3 (q|k|v and gate|up
  one matrix each), gemma2 (soft-capped attention, GELU, four norms) and gemma3 (sliding
  windows: rotating caches, QK-norm), float and 4-bit: exactly the logits of the same model with
  its layers unfused, over a prompt and decode steps with a plain and a batch KV cache, and a
  decode step of 12 primitives a layer (29 unfused; Gemma 3's about 20, 50 unfused).
- ``kv_write`` gives exactly mlx-lm's caches' slice updates and slices.
"""

from __future__ import annotations

import collections
import math
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, make_prompt_cache

from turbospark.kernels import ops as kernels
from turbospark.model import mlx_blocks, mlx_kernels

from ._support import tiny_llama

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels: {kernels.describe()}")
floats = st.sampled_from([mx.float32, mx.bfloat16, mx.float16])
ours = settings(max_examples=30, deadline=None)

pytestmark = pytest.mark.usefixtures("fast_ops_restored")  # installs leave MLX's own ops to later tests


def weights(n: int, k: int, dtype, bits: int) -> tuple:
    w = (mx.random.normal((n, k)) / k**0.5).astype(dtype)
    return (w,) if not bits else mx.quantize(w, group_size=32, bits=bits)


def product(x, w, bias=None, bits=0, **epilogue):
    if not bits:
        return kernels.linear(x, w[0], bias, **epilogue)
    return kernels.quantized_linear(x, *w, bias, group_size=32, bits=bits, **epilogue)


@needs_kernels
@ours
@given(rows=st.integers(1, 40), dtype=floats, bits=st.sampled_from([0, 4, 8]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_residual_epilogue_is_exactly_the_add_after_the_product(rows, dtype, bits, bias, seed) -> None:
    mx.random.seed(seed)
    x = mx.random.normal((1, rows, 64)).astype(dtype)
    w = weights(24, 64, dtype, bits)
    b = mx.random.normal((24,)).astype(dtype) if bias else None
    r = mx.random.normal((1, rows, 24)).astype(dtype)
    got = product(x, w, b, bits, residual=r)
    assert got.dtype == dtype and got.shape == (1, rows, 24)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array((r + product(x, w, b, bits)).astype(mx.float32)))


@needs_kernels
@ours
@given(rows=st.integers(1, 40), dtype=floats, bits=st.sampled_from([0, 4, 8]), bias=st.booleans(),
       then=st.sampled_from(["", "residual", "swiglu"]), eps=st.sampled_from([1e-5, 1e-6]),
       seed=st.integers(0, 2**16))
def test_an_rms_norm_prologue_is_exactly_the_norm_before_the_product(rows, dtype, bits, bias, then, eps, seed) -> None:
    """A layer's norm and the product reading it, one op: the kernels' RmsNorm (MLX's arithmetic)
    then the product, the same bits, with any epilogue after."""
    mx.random.seed(seed)
    x = (mx.random.normal((1, rows, 64)) * 4).astype(dtype)
    norm = (1 + mx.random.normal((64,)) / 4).astype(dtype)
    w = weights(48, 64, dtype, bits)
    b = mx.random.normal((48,)).astype(dtype) if bias else None
    epilogue = {"residual": {"residual": mx.random.normal((1, rows, 48)).astype(dtype)},
                "swiglu": {"swiglu": True}}.get(then, {})
    got = product(x, w, b, bits, norm=norm, eps=eps, **epilogue)
    want = product(kernels.rms_norm(x, norm, eps), w, b, bits, **epilogue)
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


@needs_kernels
@ours
@given(rows=st.integers(1, 40), dtype=floats, bits=st.sampled_from([0, 4, 8]), seed=st.integers(0, 2**16))
def test_a_swiglu_epilogue_equals_mlx_lm_swiglu_of_the_two_halves(rows, dtype, bits, seed) -> None:
    mx.random.seed(seed)
    x = mx.random.normal((1, rows, 64)).astype(dtype)
    w = weights(48, 64, dtype, bits)
    got = product(x, w, None, bits, swiglu=True)
    assert got.dtype == dtype and got.shape == (1, rows, 24)
    y = product(x, w, None, bits)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)),
                                  np.array(swiglu(y[..., :24], y[..., 24:]).astype(mx.float32)))


def with_and_without(rows, dtype, bits, scale, seed, width, *, bias=False, **epilogue):  # type: ignore[no-untyped-def]
    """A product of ``rows`` random rows (times ``scale``) with ``epilogue`` (its output
    ``width`` wide, in x's type), and the same product without it."""
    mx.random.seed(seed)
    x = (mx.random.normal((1, rows, 64)) * scale).astype(dtype)
    w = weights(48, 64, dtype, bits)
    b = mx.random.normal((48,)).astype(dtype) if bias else None
    got = product(x, w, b, bits, **epilogue)
    assert got.dtype == dtype and got.shape == (1, rows, width)
    return got, product(x, w, b, bits)


@needs_kernels
@ours
@given(rows=st.integers(1, 40), dtype=floats, bits=st.sampled_from([0, 4, 8]), scale=st.sampled_from([0.1, 1.0, 4.0]),
       seed=st.integers(0, 2**16))
def test_a_gelu_epilogue_is_gemmas_gated_gelu_to_the_last_place(rows, dtype, bits, scale, seed) -> None:
    got, y = with_and_without(rows, dtype, bits, scale, seed, 24, geglu=True)
    gate, up = (np.array(h.astype(mx.float32)).astype(np.float64) for h in (y[..., :24], y[..., 24:]))
    exact = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3))) * up
    last_place = {mx.float32: 16 * 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
    bound = last_place * np.abs(exact) + 2.0**-24 * (np.abs(up) + 1)  # and float16's smallest steps, near 0
    assert np.all(np.abs(np.array(got.astype(mx.float32)) - exact) <= bound)
    # the same bits from the halves alone (an identity product: exact), as the unfused layers' GELU reads them
    halves = mx.concatenate([y[..., :24], y[..., 24:]], axis=-1)
    again = kernels.linear(halves, mx.eye(48, dtype=dtype), geglu=True)
    np.testing.assert_array_equal(np.array(again.astype(mx.float32)), np.array(got.astype(mx.float32)))


@needs_kernels
@ours
@given(rows=st.integers(1, 40), dtype=floats, bits=st.sampled_from([0, 4, 8]), scale=st.sampled_from([0.1, 1.0, 8.0]),
       seed=st.integers(0, 2**16))
def test_an_exact_gelu_epilogue_is_nn_gelu_to_the_last_place(rows, dtype, bits, scale, seed) -> None:
    got, y = with_and_without(rows, dtype, bits, scale, seed, 48, bias=True, gelu=True)
    g = np.array(y.astype(mx.float32)).astype(np.float64)
    exact = 0.5 * g * (1 + np.vectorize(math.erf)(g / np.sqrt(2)))
    last_place = {mx.float32: 4 * 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
    bound = last_place * np.abs(exact) + 1.5e-7 * np.abs(g) + 2.0**-24  # erf's 1.5e-7; float16's steps near 0
    assert np.all(np.abs(np.array(got.astype(mx.float32)) - exact) <= bound)
    if dtype == mx.float32:  # and Whisper's own nn.gelu of the same values (MLX's erf), twice the bound
        theirs = np.array(nn.gelu(y))  # (in half types MLX rounds each of its steps: further off than ours)
        assert np.all(np.abs(np.array(got) - theirs) <= 2 * bound)


def kernels_gelu(gate: mx.array, up: mx.array) -> mx.array:
    """``gelu_approx(gate) * up`` as the kernels' GELU epilogue computes it (an identity product
    of the two halves side by side: exact)."""
    halves = mx.concatenate([gate, up], axis=-1)
    return kernels.linear(halves, mx.eye(halves.shape[-1], dtype=halves.dtype), geglu=True)


@needs_kernels
@ours
@given(batch=st.integers(1, 3), length=st.integers(1, 9), heads=st.sampled_from([(4, 2), (9, 3), (2, 2)]),
       dim=st.sampled_from([8, 64]), evaluated=st.booleans())
def test_split_heads_gives_the_reshaped_and_transposed_heads_as_views(batch, length, heads, dim, evaluated) -> None:
    hq, hkv = heads
    qkv = mx.random.normal((batch, length, (hq + 2 * hkv) * dim))
    if evaluated:
        mx.eval(qkv)
    else:  # a lazy input that is not a product's output: made contiguous first
        qkv = qkv * 1.0
    q, k, v = kernels.split_heads(qkv, hq, hkv)
    a = np.array(qkv).reshape(batch, length, hq + 2 * hkv, dim).transpose(0, 2, 1, 3)
    for got, want in zip((q, k, v), (a[:, :hq], a[:, hq:hq + hkv], a[:, hq + hkv:]), strict=True):
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.array(got), want)


@needs_kernels
@ours
@given(batch=st.integers(1, 2), q_len=st.integers(1, 5), extra=st.integers(0, 6), dtype=floats,
       mask=st.sampled_from(["none", "causal", "bool", "additive"]))
def test_attention_with_heads_side_by_side_is_the_transposed_attention(batch, q_len, extra, dtype, mask) -> None:
    k_len = q_len + extra
    q = mx.random.normal((batch, 4, q_len, 16)).astype(dtype)
    k, v = (mx.random.normal((batch, 2, k_len, 16)).astype(dtype) for _ in range(2))
    m = {"none": None, "causal": "causal", "bool": mx.random.uniform(shape=(batch, 1, q_len, k_len)) > 0.3,
         "additive": mx.random.normal((batch, 1, q_len, k_len)).astype(dtype)}[mask]
    got = kernels.merged_attention(q, k, v, scale=0.25, mask=m)
    want = kernels.attention(q, k, v, scale=0.25, mask=m).transpose(0, 2, 1, 3).reshape(batch, q_len, -1)
    assert got.shape == (batch, q_len, 64)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


@needs_kernels
@ours
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), capacity=st.integers(1, 12), new=st.integers(1, 4),
       dtype=floats, held=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_kv_write_is_the_slice_updates_and_slices_of_mlx_lm_caches(batch, heads, capacity, new, dtype, held, strided,
                                                                   seed) -> None:
    """In place where the cache's buffers are donated; a copy where something still holds them
    (then they keep their old rows)."""
    rng = np.random.default_rng(seed)
    cap, at = capacity + new, capacity - rng.integers(0, capacity + 1) // 2
    old_k, old_v = (rng.standard_normal((batch, heads, cap, 8)).astype(np.float32) for _ in range(2))
    k = mx.array(rng.standard_normal((batch, heads, new, 8)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((batch, new, heads, 8)).astype(np.float32)).astype(dtype).transpose(0, 2, 1, 3)
    if not strided:
        v = mx.contiguous(v)
    keys, values = mx.array(old_k).astype(dtype), mx.array(old_v).astype(dtype)
    mx.eval(keys, values)
    before = np.array(keys.astype(mx.float32))
    if held:
        new_keys, new_values, k_view, v_view = kernels.kv_write(keys, values, k, v, at)
    else:  # nothing but the op holds them: donated
        args = [keys, values]
        del keys, values
        new_keys, new_values, k_view, v_view = kernels.kv_write(args.pop(0), args.pop(0), k, v, at)
    want_k, want_v = np.array(mx.array(old_k).astype(dtype).astype(mx.float32)), np.array(mx.array(old_v).astype(dtype).astype(mx.float32))
    want_k[:, :, at:at + new], want_v[:, :, at:at + new] = np.array(k.astype(mx.float32)), np.array(v.astype(mx.float32))
    for got, want in ((new_keys, want_k), (new_values, want_v), (k_view, want_k[:, :, :at + new]),
                      (v_view, want_v[:, :, :at + new])):
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
    if held:
        np.testing.assert_array_equal(np.array(keys.astype(mx.float32)), before)


@needs_kernels
@ours
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), capacity=st.integers(1, 12), new=st.integers(1, 4),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_kv_write_rounds_float32_rows_into_a_float16_cache_as_astype_does(batch, heads, capacity, new, strided,
                                                                          seed) -> None:
    """A half-precision cache (decision 0035) takes a layer's float32 rows: each rounded to
    float16 exactly as ``astype`` rounds it, over float16's whole range (subnormals, the
    largest, overflow to infinity)."""
    rng = np.random.default_rng(seed)
    cap, at = capacity + new, capacity - rng.integers(0, capacity + 1) // 2
    scale = np.float32(10.0) ** rng.integers(-9, 6, (batch, heads, new, 8))  # 1e-9 .. 1e5
    k = mx.array((rng.standard_normal((batch, heads, new, 8)) * scale).astype(np.float32))
    v = mx.array(rng.standard_normal((batch, new, heads, 8)).astype(np.float32)).transpose(0, 2, 1, 3)
    if not strided:
        v = mx.contiguous(v)
    keys, values = mx.zeros((batch, heads, cap, 8), mx.float16), mx.ones((batch, heads, cap, 8), mx.float16)
    new_keys, new_values, k_view, v_view = kernels.kv_write(keys, values, k, v, at)
    want_k, want_v = mx.zeros_like(keys), mx.ones_like(values)
    want_k[:, :, at:at + new] = k.astype(mx.float16)
    want_v[:, :, at:at + new] = v.astype(mx.float16)
    for got, want in ((new_keys, want_k), (new_values, want_v), (k_view, want_k[:, :, :at + new])):
        assert got.dtype == mx.float16
        np.testing.assert_array_equal(np.array(got).view(np.uint16), np.array(want).view(np.uint16))
    with pytest.raises(ValueError, match="cache's types"):
        kernels.kv_write(keys.astype(mx.bfloat16), values.astype(mx.bfloat16), k, v, at)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_a_decode_step_product_gives_the_same_bits_on_one_thread_or_the_whole_team(bits) -> None:
    """Chunks of output rows are taken by whichever thread comes (``pool.h``); each row is still
    summed whole by one thread, so the result does not depend on how many took part."""
    mx.random.seed(bits)
    x = mx.random.normal((1, 3, 576)).astype(mx.float16)
    w = weights(4099, 576, mx.float16, bits)  # past 64 KiB: split over the team
    before = kernels.native.step_threads()
    try:
        kernels.native.set_step_threads(1)
        one = np.array(product(x, w, None, bits).astype(mx.float32))
        kernels.native.set_step_threads(0)
        team = np.array(product(x, w, None, bits).astype(mx.float32))
    finally:
        kernels.native.set_step_threads(before if before != kernels.native.threads() else 0)
    np.testing.assert_array_equal(one, team)


#: Each architecture's own arguments past llama's (``tiny``): a sliding window of 4 for gemma3's
#: layers 0 and 1 of 3 (the prompt's 7 tokens and the decode steps rotate their caches).
_TINY_ARGS = {
    "qwen3": dict(max_position_embeddings=512, rope_theta=1e6, head_dim=16, tie_word_embeddings=True),
    "phi3": dict(rope_theta=1e4),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4, sliding_window_pattern=3),
}


def tiny(arch: str, seed: int, layers: int = 0):
    if arch not in _TINY_ARGS:
        return tiny_llama(vocab=64, layers=layers or 2, seed=seed, arch=arch, hidden=64)
    import importlib

    from mlx.utils import tree_map

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(
        model_type=arch, hidden_size=64, num_hidden_layers=layers or (3 if arch == "gemma3_text" else 2),
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=64,
        **_TINY_ARGS[arch]))
    if arch == "gemma3_text":  # tied, as Gemma 3's files are
        model.sanitize({})
    model.update(tree_map(lambda w: w * 3, model.parameters()))
    mx.eval(model.parameters())
    return model


def run(model, tokens: mx.array, cache, chunk: int = 0) -> list[np.ndarray]:
    """Logits of a prompt (read ``chunk`` tokens at a time where given), then of three decode
    steps (each fed the previous greedy token)."""
    if chunk:
        read = [model(tokens[:, i:i + chunk], cache=cache) for i in range(0, tokens.shape[1], chunk)]
        out = [mx.concatenate(read, axis=1)]
    else:
        out = [model(tokens, cache=cache)]
    for _ in range(3):
        out.append(model(out[-1][:, -1:].argmax(-1), cache=cache))
    return [np.array(o.astype(mx.float32)) for o in out]


class _RoundedToHalf:
    """A cache that holds float32 rows rounded to float16's values: what an unfused layer reads
    where a fused one reads its float16 cache."""

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(keys.astype(mx.float16).astype(keys.dtype),
                                        values.astype(mx.float16).astype(values.dtype))


class _RoundedKVCache(_RoundedToHalf, KVCache):
    pass


class _RoundedRotatingKVCache(_RoundedToHalf, RotatingKVCache):
    pass


class _RoundedBatchRotatingKVCache(_RoundedToHalf, BatchRotatingKVCache):
    pass


class _RoundedBatchKVCache(_RoundedToHalf, BatchKVCache):
    pass


def caches(model, batch_cache: bool, rounded: bool = False, lefts: tuple[int, ...] = (1, 0)) -> list:
    """A KV cache a layer, plain or batch (left padding ``lefts``), rounding its rows to
    float16's values where ``rounded``."""
    window = [getattr(layer.self_attn, "is_sliding", False) and model.args.sliding_window for layer in model.model.layers]
    if batch_cache:
        return [(_RoundedBatchRotatingKVCache if rounded else BatchRotatingKVCache)(w, list(lefts)) if w
                else (_RoundedBatchKVCache if rounded else BatchKVCache)(list(lefts)) for w in window]
    return [(_RoundedRotatingKVCache if rounded else RotatingKVCache)(w) if w
            else (_RoundedKVCache if rounded else KVCache)() for w in window]


@pytest.fixture(params=["float32", "float16"])
def kv(request: pytest.FixtureRequest):
    """The fused layers' KV caches in float32, or in float16 (decision 0035)."""
    before = kernels.kv_half()
    kernels.set_kv_half(request.param == "float16")
    yield request.param
    kernels.set_kv_half(before)


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("bits", [0, 4, "float16", "float16 embedding"])
@pytest.mark.parametrize("batch_cache", [False, True])
def test_fused_layers_give_the_unfused_layers_logits(arch, bits, batch_cache, kv, monkeypatch) -> None:
    """With a float16 cache, the unfused layers' rows are rounded to float16 where they are
    written: the same bits again (attention reads float16 rows as their float32 values).  A
    model in float16 computes in float16; one whose embedding alone is (a GGUF's: its norms
    float32) in float32 from the first norm on."""
    plain, fused = tiny(arch, seed=5), tiny(arch, seed=5)
    if bits == "float16":
        plain.set_dtype(mx.float16)
        fused.set_dtype(mx.float16)
    elif bits == "float16 embedding":
        plain.model.embed_tokens.set_dtype(mx.float16)
        fused.model.embed_tokens.set_dtype(mx.float16)
    elif bits:
        nn.quantize(plain, group_size=32, bits=bits)
        nn.quantize(fused, group_size=32, bits=bits)
    with monkeypatch.context() as patch:
        patch.setattr(mlx_blocks, "fuse", lambda model, ours: (0, len(model.model.layers)))
        assert "0 of " in mlx_kernels.install(plain)
    n = len(fused.model.layers)
    assert f"{n} of {n} decoder layers fused" in mlx_kernels.install(fused)
    assert all(type(layer).__name__ == "FusedTransformerBlock" for layer in fused.model.layers)
    if arch.startswith("gemma"):  # the unfused layers' GELU, as the fused layers' products compute it
        mlp = type(plain.model.layers[0].mlp)
        monkeypatch.setattr(mlp, "__call__", lambda self, x: self.down_proj(kernels_gelu(self.gate_proj(x), self.up_proj(x))))
    before = sum(a.nbytes for _, a in tree_flatten(plain.parameters()))
    assert sum(a.nbytes for _, a in tree_flatten(fused.parameters())) == before  # views, nothing twice
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2]] * (2 if batch_cache else 1))

    fused_cache = caches(fused, batch_cache)
    for got, want in zip(run(fused, tokens, fused_cache), run(plain, tokens, caches(plain, batch_cache, kv == "float16")),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    assert {c.keys.dtype for c in fused_cache} == {mx.float16 if kv == "float16" or bits == "float16" else mx.float32}


@needs_kernels
@pytest.mark.parametrize("kv", ["float16"], indirect=True)
@pytest.mark.parametrize("batch_cache", [False, True])
def test_a_float16_cache_keeps_its_type_as_it_grows(batch_cache, kv) -> None:
    """mlx-lm's caches grow 256 rows at a time by concatenation, in the new rows' type: a fused
    layer hands them float16 rows, so the cache stays float16 past its first 256 rows, and the
    logits stay those of an unfused model reading the same rounded rows, bit for bit: the prompt
    is read 16 rows at a time, so that both sides' float32 products are the kernels' own
    (``MAX_FLOAT32_ROWS``; past it MLX hands them to its BLAS, whose sums' order depends on the
    BLAS kernel the machine picks, e.g. OpenBLAS's Haswell or SkylakeX)."""
    plain, fused = tiny("llama", seed=9), tiny("llama", seed=9)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mlx_blocks, "fuse", lambda model, ours: (0, len(model.model.layers)))
        mlx_kernels.install(plain)
    mlx_kernels.install(fused)
    tokens = mx.array([[(7 * i) % 64 for i in range(254)]] * (2 if batch_cache else 1))
    fused_cache = caches(fused, batch_cache, lefts=(0, 3))
    plain_cache = caches(plain, batch_cache, rounded=True, lefts=(0, 3))
    chunk = kernels.MAX_FLOAT32_ROWS // tokens.shape[0]
    for got, want in zip(run(fused, tokens, fused_cache, chunk), run(plain, tokens, plain_cache, chunk), strict=True):
        np.testing.assert_array_equal(got, want)
    assert all(c.keys.dtype == mx.float16 and c.keys.shape[2] == 512 for c in fused_cache)


@needs_kernels
def test_a_fused_decode_step_is_12_primitives_a_layer(tmp_path) -> None:
    model = tiny_llama(vocab=64, layers=4, seed=6, hidden=64)
    mlx_kernels.install(model)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache), [c.state for c in cache])
    mx.export_to_dot(str(tmp_path / "step.dot"), model(mx.array([[4]]), cache=cache))
    ops = collections.Counter(re.findall(r'label ="([A-Za-z_]+)', (tmp_path / "step.dot").read_text()))
    assert ops["RowsMatmul"] == 4 * 4 + 1  # q|k|v, o, gate|up, down a layer, and the head
    assert ops["TurbosparkSplitHeads"] == 4 and ops["TurbosparkAttention"] == 4
    assert "Transpose" not in ops and "Add" not in ops
    assert ops["TurbosparkKvWrite"] == 2 * 4 and "SliceUpdate" not in ops
    assert ops["TurbosparkRmsNorm"] == 1  # the final norm; a layer's two are its products' prologues
    # a layer: 4 products (two of them with the norms), split, 2 RoPEs, the cache's 2 writes and 2
    # reads (slices: views), attention; then the embedding, the final norm and the head
    assert sum(ops.values()) <= 12 * 4 + 4


@needs_kernels
def test_a_quantized_kv_cache_takes_the_layers_own_ops() -> None:
    plain, fused = (tiny_llama(vocab=64, layers=2, seed=7, hidden=128) for _ in range(2))
    mlx_kernels.install(fused)
    tokens = mx.array([[2, 7, 1, 8]])
    with kernels.mlx_own_ops():
        want = plain(tokens, cache=[c.to_quantized(group_size=32, bits=8) for c in make_prompt_cache(plain)])
        mx.eval(want)
    got = fused(tokens, cache=[c.to_quantized(group_size=32, bits=8) for c in make_prompt_cache(fused)])
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-3, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
def test_heads_that_share_keys_are_read_together_and_give_mlxs_attention(mask) -> None:
    """A decode step of many sequences takes the query heads of one key/value head together (each
    key and value row read once for all of them); the same result as MLX's attention, and as the
    heads one at a time (one sequence: too few units to share them out)."""
    mx.random.seed(7)
    batch, kv_heads, group, keys = 8, 3, 3, 45  # 24 units of 3 heads: grouped on any team
    q = mx.random.normal((batch, kv_heads * group, 1, 64))
    k, v = mx.random.normal((batch, kv_heads, keys, 64)), mx.random.normal((batch, kv_heads, keys, 64))
    m = None
    if mask == "bool":
        m = mx.random.uniform(shape=(batch, 1, 1, keys)) > 0.3
        m[..., -1] = True
    elif mask == "additive":
        m = mx.random.normal((batch, 1, 1, keys))
    got = kernels.attention(q, k, v, scale=0.125, mask=m)
    want = kernels._MLX_FAST["scaled_dot_product_attention"](q, k, v, scale=0.125, mask=m)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    for b in (0, batch - 1):  # one sequence alone: a head a unit, the same bits as in the batch
        alone = kernels.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], scale=0.125,
                                  mask=None if m is None else m[b:b + 1])
        assert np.array_equal(np.array(alone), np.array(got[b:b + 1]))


@needs_kernels
@pytest.mark.parametrize("q_len", [1, 3])
def test_keys_a_batch_caches_left_padding_hides_are_skipped_with_the_same_bits(q_len) -> None:
    """A batch KV cache pads shorter sequences on the left and its boolean mask hides the
    padding: attention skips those keys (their weight is exactly 0), so each sequence gets the bits
    it gets over its own keys alone (where the mask starts its scores), and MLX's attention.  That
    the keys are skipped shows in the time only (docs/performance.md)."""
    mx.random.seed(11)
    pads, keys = [0, 37, 120], 200
    q = mx.random.normal((3, 9, q_len, 64))
    k, v = mx.random.normal((3, 3, keys, 64)), mx.random.normal((3, 3, keys, 64))
    cols, rows = mx.arange(keys), mx.arange(q_len)[:, None] + keys - q_len
    m = mx.stack([(cols >= p) & (cols <= rows) for p in pads])[:, None]  # (B, 1, q_len, keys)
    got = kernels.attention(q, k, v, scale=0.125, mask=m)
    want = kernels._MLX_FAST["scaled_dot_product_attention"](q, k, v, scale=0.125, mask=m)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    for b, p in enumerate(pads):
        alone = kernels.attention(q[b:b + 1], k[b:b + 1, :, p:], v[b:b + 1, :, p:], scale=0.125, mask=m[b:b + 1, ..., p:])
        assert np.array_equal(np.array(alone), np.array(got[b:b + 1]))
