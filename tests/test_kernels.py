"""turbospark's CPU kernels (``turbospark.kernels``) against MLX's own ops on the same inputs.

Property tests over shapes, row counts, weight types, group sizes and bits, for every instruction
set this CPU runs (the AVX2 build and the portable one on x86-64).  The tolerances, relative to
``|x| @ |W|.T`` (the size of the sum each output is): float32 1e-5 (the summation order
differs: MLX calls BLAS, the kernels sum eight lanes and then the lanes); float16 output 2e-3 and
bfloat16 output 1e-2 (one rounding of the output, 2^-11 and 2^-8 relative, on either side).
Quantized weights are read as MLX defines them (``scale * q + bias``), in float32, where MLX
rounds each to the input's type first: for float16 and bfloat16 inputs the quantized tolerance is
twice the float one.  Where the instruction set has integer dot products (AVX2), rows of x times
affine weights with K a multiple of 64 are computed with x rounded to 8 bits per 32 values
(llama.cpp's Q8_1: the weights' biases meet the rounded values' sum, as its ``s``, so a product
reads x's rounded values alone); each such value is off by at most half its 32's step
(max |x| / 254), so the products may differ from MLX's by up to ``|W| @ half-steps`` more,
exactly that bound (``TURBOSPARK_KERNELS_EXACT=1`` keeps x in float32: the float tolerance alone,
tested too).

A SwiGLU epilogue's exp (eight at a time where the set has FMA) is MLX's own: the same bits; so
is ``logsumexp`` over a last axis (the engine's normalization of a step's logits).

Then a model: ``install`` routes a tiny llama's products through the kernels and its logits stay
within float32 rounding of MLX's own; where the kernels are off, nothing changes and the line
says why.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mlx_lm.models.activations import swiglu

from turbospark.kernels import ops as kernels
from turbospark.model import mlx_kernels

from ._support import tiny_llama

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels: {kernels.describe()}")

TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}
ISAS = kernels.native.isas() if kernels.available() else []

pytestmark = pytest.mark.usefixtures("fast_ops_restored")  # installs leave MLX's own ops to later tests


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    before = kernels.native.isa()
    assert kernels.native.use_isa(request.param)
    yield request.param
    kernels.native.use_isa(before)


@pytest.fixture(params=["int8", "float32"])
def activations(request: pytest.FixtureRequest):
    """x rounded to 8 bits in quantized products where the instruction set can, or kept float32."""
    before = kernels.native.activations_in_8_bits()
    kernels.native.set_activations_in_8_bits(request.param == "int8")
    yield request.param
    kernels.native.set_activations_in_8_bits(before)


def rounding_of_x(x: mx.array, w: mx.array) -> np.ndarray:
    """The most rounding x to 8 bits per 32 values moves each output: |W| @ (max |x| / 254)."""
    xf = np.array(x.astype(mx.float32))
    xf = xf.reshape(-1, xf.shape[-1])
    step = np.abs(xf.reshape(len(xf), -1, 32)).max(-1, keepdims=True) / 254
    return np.broadcast_to(step, (*step.shape[:2], 32)).reshape(xf.shape) @ np.abs(np.array(w.astype(mx.float32))).T


def check_close(got: mx.array, want: mx.array, x: mx.array, w: mx.array, tol: float, more: np.ndarray | float = 0.0,
                b: mx.array | None = None) -> None:
    """``got`` within ``tol`` (relative to |x| @ |w|, plus ``more``) of MLX's ``want``, or, where
    MLX's own half-precision product strays further, of the exact product (x @ w.T + b in float64:
    MLX's bfloat16 quantized matmul is now and then 2e-2 off it, ten times the kernels)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    xf, wf = np.array(x.astype(mx.float32)), np.array(w.astype(mx.float32))
    size = np.abs(xf) @ np.abs(wf).T
    mine = np.array(got.astype(mx.float32))
    err = np.abs(mine - np.array(want.astype(mx.float32)))
    product = xf.astype(np.float64) @ wf.astype(np.float64).T
    if b is not None:
        product = product + np.array(b.astype(mx.float32)).astype(np.float64)
    exact = np.abs(mine - product.reshape(err.shape))
    bound = tol * size.reshape(err.shape) + (np.reshape(more, err.shape) if np.ndim(more) else more) * 1.001 + 1e-6
    worst = float((np.minimum(err, exact) / bound).max())
    assert worst <= 1, f"off by {worst:.2f}x the tolerance"


shapes = st.tuples(
    st.integers(1, 40),                     # rows: a step's batch, past MAX_FLOAT32_ROWS, a prompt chunk (GEMM)
    st.integers(1, 13),                     # output rows in fours and a remainder
    st.sampled_from([8, 16, 64, 136, 576]),  # inner dimension (multiples of 8)
)

ours = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@needs_kernels
@ours
@given(shape=shapes, dtype=st.sampled_from([mx.float32, mx.bfloat16, mx.float16]), bias=st.booleans(),
       batch=st.booleans(), seed=st.integers(0, 2**16))
def test_float_weights_equal_mlx_matmul(isa, shape, dtype, bias, batch, seed) -> None:
    rows, out_fours, k = shape
    n = 4 * out_fours + seed % 4
    mx.random.seed(seed)
    x = mx.random.normal((rows, 1, k) if batch else (rows, k)).astype(dtype)
    w = (mx.random.normal((n, k)) / k**0.5).astype(dtype)
    b = mx.random.normal((n,)).astype(dtype) if bias else None
    want = mx.addmm(b, x, w.T) if bias else x @ w.T
    got = kernels.linear(x, w, b)
    check_close(got, want, x, w, TOLERANCE[dtype], b=b)


@needs_kernels
@ours
@given(shape=shapes, bits=st.sampled_from([4, 8]), group=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from([mx.float32, mx.bfloat16, mx.float16]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
@example(shape=(11, 5, 16), bits=8, group=32, dtype=mx.bfloat16, bias=False, seed=289)  # MLX's own 2e-2 off
def test_quantized_weights_equal_mlx_quantized_matmul(isa, activations, shape, bits, group, dtype, bias, seed) -> None:
    rows, out_fours, groups = shape[0], shape[1], shape[2] // 8 % 5 + 1
    k, n = group * groups, 4 * out_fours + seed % 4
    mx.random.seed(seed)
    x = mx.random.normal((rows, k)).astype(dtype)
    wq, scales, biases = mx.quantize((mx.random.normal((n, k)) / k**0.5).astype(dtype), group_size=group, bits=bits)
    b = mx.random.normal((n,)).astype(dtype) if bias else None
    want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits)
    if bias:
        want = want + b
    got = kernels.quantized_linear(x, wq, scales, biases, b, group_size=group, bits=bits)
    w = mx.dequantize(wq, scales, biases, group_size=group, bits=bits)
    more = 0.0
    if kernels.x_in_8_bits() and k % 64 == 0:
        more = rounding_of_x(x, w)
    check_close(got, want, x, w, TOLERANCE[dtype] * (1 if dtype == mx.float32 else 2) * (2 if bias else 1), more, b=b)


SPLIT = """
import mlx.core as mx, numpy as np
from turbospark.kernels import ops as kernels
assert kernels.native.threads() == 3
mx.random.seed(3)
x = mx.random.normal((3, 576))
w = mx.random.normal((4099, 576))
wq, s, b = mx.quantize(w, group_size=64, bits=4)
for isa in kernels.native.isas():
    for int8 in (True, False):
        kernels.native.use_isa(isa)
        kernels.native.set_activations_in_8_bits(int8)
        split = np.array(kernels.linear(x, w))
        alone = [np.array(kernels.linear(x, w[i:i + 7])) for i in range(0, 4099, 7)]
        np.testing.assert_array_equal(split, np.concatenate(alone, axis=1))
        split = np.array(kernels.quantized_linear(x, wq, s, b, group_size=64, bits=4))
        alone = [np.array(kernels.quantized_linear(x, wq[i:i + 7], s[i:i + 7], b[i:i + 7], group_size=64, bits=4))
                 for i in range(0, 4099, 7)]
        np.testing.assert_array_equal(split, np.concatenate(alone, axis=1))
        for bits in (4, 8):  # packed weights, eight rows a chunk
            wq8, s8, b8 = mx.quantize(w[:4096], group_size=64, bits=bits)
            pw, ps, pb = kernels.pack_quantized(wq8, s8, b8, 64, bits)
            split = np.array(kernels.quantized_linear(x, pw, ps, pb, group_size=64, bits=bits, packed=True))
            alone = [np.array(kernels.quantized_linear(x, *kernels.pack_quantized(wq8[i:i + 8], s8[i:i + 8], b8[i:i + 8], 64, bits),
                                                       group_size=64, bits=bits, packed=True)) for i in range(0, 4096, 8)]
            np.testing.assert_array_equal(split, np.concatenate(alone, axis=1))
"""


@needs_kernels
def test_large_products_split_across_threads_give_the_same_rows() -> None:
    """Past 64 KiB of weights a product is split over the team (a team of three here, whatever
    this machine's cores); every share is the same as one thread's (each output row is computed
    whole by one thread), float and quantized, with x in 8 bits or float32."""
    import subprocess
    import sys

    env = {**os.environ, "TURBOSPARK_KERNEL_THREADS": "3"}
    done = subprocess.run([sys.executable, "-c", SPLIT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_kernels
@ours
@given(rows=st.integers(2, 40), bits=st.sampled_from([4, 8]), group=st.sampled_from([32, 64, 128]),
       seed=st.integers(0, 2**16))
def test_with_x_in_8_bits_a_row_is_the_same_bits_whatever_rows_it_comes_with(rows, bits, group, seed) -> None:
    """A decode row gives the same result alone, in a step's batch or beside a prompt chunk (so
    greedy text does not depend on what else the engine is running)."""
    if not kernels.x_in_8_bits():
        pytest.skip("x stays float32 here")
    mx.random.seed(seed)
    x = mx.random.normal((rows, 640))
    wq, scales, biases = mx.quantize(mx.random.normal((13, 640)) / 24, group_size=group, bits=bits)
    together = np.array(kernels.quantized_linear(x, wq, scales, biases, group_size=group, bits=bits))
    for r in range(rows):
        alone = np.array(kernels.quantized_linear(x[r:r + 1], wq, scales, biases, group_size=group, bits=bits))
        np.testing.assert_array_equal(together[r:r + 1], alone)


VNNI_SETS = [isa for isa in ("avx2+vnni", "avx2+avx512vnni") if isa in ISAS]


@needs_kernels
@pytest.mark.skipif(not VNNI_SETS, reason="this CPU runs neither AVX-VNNI nor AVX-512 VNNI")
@ours
@given(rows=st.integers(1, 20), bits=st.sampled_from([4, 8]), group=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from([mx.float32, mx.float16, mx.bfloat16]), seed=st.integers(0, 2**16))
def test_vnni_products_are_avx2s_bits(rows, bits, group, dtype, seed) -> None:
    """AVX-VNNI's and AVX-512 VNNI's one instruction adds the same integers as AVX2's two, so a
    model's text does not depend on which of the sets a CPU has."""
    before, int8 = kernels.native.isa(), kernels.native.activations_in_8_bits()
    mx.random.seed(seed)
    x = mx.random.normal((rows, 384)) * 3
    wq, scales, biases = mx.quantize(mx.random.normal((37, 384)).astype(dtype), group_size=group, bits=bits)
    got = {}
    try:
        kernels.native.set_activations_in_8_bits(True)
        for isa in ("avx2+fma", *VNNI_SETS):
            assert kernels.native.use_isa(isa)
            got[isa] = np.array(kernels.quantized_linear(x, wq, scales, biases, group_size=group, bits=bits))
    finally:
        kernels.native.use_isa(before)
        kernels.native.set_activations_in_8_bits(int8)
    for isa in VNNI_SETS:
        np.testing.assert_array_equal(got[isa], got["avx2+fma"])


@needs_kernels
def test_inputs_the_kernels_cannot_read_are_refused_with_a_plain_error() -> None:
    x = mx.ones((1, 12))
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.linear(x, mx.ones((4, 12)))
    with pytest.raises(ValueError, match="last dimension"):
        kernels.linear(mx.ones((1, 16)), mx.ones((4, 8)))
    wq, s, b = mx.quantize(mx.ones((8, 64)), group_size=64, bits=4)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        kernels.quantized_linear(mx.ones((1, 64)), wq, s, b, group_size=64, bits=3)


@needs_kernels
def test_a_strided_input_is_read_as_its_values() -> None:
    mx.random.seed(5)
    x = mx.random.normal((16, 6))[:, :4].T  # (4, 16), not contiguous
    w = mx.random.normal((8, 16))
    check_close(kernels.linear(x, w), x @ w.T, x, w, TOLERANCE[mx.float32])


@needs_kernels
def test_a_model_through_the_kernels_gives_mlx_logits_within_rounding() -> None:
    model = tiny_llama(vocab=64, layers=2, seed=1)
    tokens = mx.array([[1, 5, 9, 2, 7]])
    with kernels.mlx_own_ops():
        want, last = model(tokens), model(tokens[:, -1:])
        mx.eval(want, last)
    before = mx.fast.rms_norm, mx.logsumexp
    with mlx_kernels.installed(model) as line:
        assert line.startswith(kernels.describe() + ": 14 of 14 linear layers and the tied output head")
        assert mx.fast.rms_norm is kernels.rms_norm and mx.logsumexp is kernels.logsumexp  # every caller's
        assert all(type(m).__module__ == mlx_kernels.__name__
                   for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding)))
        np.testing.assert_allclose(np.array(model(tokens)), np.array(want), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(model(tokens[:, -1:])), np.array(last), rtol=1e-4, atol=1e-4)
    assert (mx.fast.rms_norm, mx.logsumexp) == before  # as they were before: MLX's own, unless a server's


@needs_kernels
def test_mlx_own_ops_are_mlxs_on_their_thread_while_the_kernels_serve_another(tmp_path) -> None:
    """A comparison's reference is MLX's own op even where the kernels' are in place for the
    process (a model served on another thread keeps the kernels')."""
    import threading

    x = mx.random.normal((2, 3, 8))
    with kernels.fast_ops_restored():
        kernels.serve_fast_ops()
        with kernels.mlx_own_ops():
            assert "Turbospark" not in primitives(mx.fast.rms_norm(x, None, 1e-5), tmp_path)
            assert "Turbospark" not in primitives(mx.logsumexp(x, axis=-1), tmp_path)
            elsewhere = []
            thread = threading.Thread(target=lambda: elsewhere.append(mx.fast.rms_norm(x, None, 1e-5)))
            thread.start()
            thread.join()
            assert "TurbosparkRmsNorm" in primitives(elsewhere[0], tmp_path)
        assert "TurbosparkRmsNorm" in primitives(mx.fast.rms_norm(x, None, 1e-5), tmp_path)
        assert kernels.fast_ops_served()


@needs_kernels
def test_a_quantized_model_is_read_by_the_kernels(activations) -> None:
    """Within float32 rounding of MLX's logits with x kept float32.  With x rounded to 8 bits per
    32 values (each product within its bound, tested above), the same likeliest token at every
    position and logits within 10% of their range (measured 5.6%: this tiny model's weights are
    scaled up, so its activations are large and its rounding is amplified through the layers)."""
    model = tiny_llama(vocab=64, layers=2, seed=2, hidden=64)
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[3, 1, 4, 1, 5]])
    with kernels.mlx_own_ops():
        want = np.array(model(tokens))
    with mlx_kernels.installed(model) as line:
        assert "14 of 14 linear layers and the tied output head" in line
        got = np.array(model(tokens))
    if activations == "float32":
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    else:
        assert (got.argmax(-1) == want.argmax(-1)).all()
        assert np.abs(got - want).max() <= 0.1 * np.ptp(want)


def test_the_kernels_are_built_where_this_machine_can_build_them() -> None:
    """``scripts/setup`` builds them on Linux with cmake and a C++ compiler: where it could and
    they are not here (a build that failed, a build against another MLX), the suite fails rather
    than skipping every test of the engine that serves (unless they were turned off)."""
    from ._skips import kernels_buildable

    why = kernels.describe()
    if kernels_buildable() and "TURBOSPARK_KERNELS" not in why:
        assert kernels.available(), f"this machine can build the kernels (scripts/setup): {why}"


def test_without_the_kernels_a_model_keeps_mlx_ops_and_the_line_says_why(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "native", None)
    monkeypatch.setattr(kernels, "_why_not", "not built (test)")
    model = tiny_llama(vocab=64, layers=1, seed=3)
    line = mlx_kernels.install(model)
    assert line == "MLX's own ops (turbospark's CPU kernels: not built (test))"
    assert all(type(m).__module__.startswith("mlx.") for _, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.Embedding)))



def test_on_the_cpu_mlx_keeps_few_freed_buffers_kernels_or_not(monkeypatch) -> None:
    """A freed KV cache goes back to the allocator rather than into MLX's cache for reuse."""
    monkeypatch.setattr(kernels, "native", None)
    monkeypatch.setattr(kernels, "_why_not", "not built (test)")
    before = mx.set_cache_limit(1 << 40)
    try:
        mlx_kernels.install(tiny_llama(vocab=64, layers=1, seed=3))
        big = mx.zeros((16 << 20,))  # 64 MiB
        mx.eval(big)
        del big
        assert mx.get_cache_memory() <= mlx_kernels.CPU_CACHE_BYTES
    finally:
        mx.set_cache_limit(before)

# --- RMSNorm, RoPE and attention against mx.fast's own (MLX's fallbacks on the CPU) -----------
# Tolerances, absolute on outputs of size ~1: float32 1e-5 (sums in another order; the sines and
# cosines of another libm), float16 and bfloat16 one unit in the last place of the output
# (2^-10 and 2^-7 of its size: a product rounded on the other side).

FAST_TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def check_fast(got: mx.array, want: mx.array, dtype, more: float = 0.0) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    np.testing.assert_allclose(g, w, rtol=FAST_TOLERANCE[dtype], atol=FAST_TOLERANCE[dtype] + more)


floats = st.sampled_from([mx.float32, mx.bfloat16, mx.float16])


@needs_kernels
@ours
@given(rows=st.integers(1, 9), dims=st.sampled_from([8, 64, 576]), dtype=floats, weight=st.booleans(),
       batch=st.booleans(), seed=st.integers(0, 2**16))
def test_rms_norm_equals_mlx(rows, dims, dtype, weight, batch, seed) -> None:
    mx.random.seed(seed)
    x = mx.random.normal((rows, 1, dims) if batch else (rows, dims)).astype(dtype) * 3
    w = (1 + mx.random.normal((dims,)) / 4).astype(dtype) if weight else None
    check_fast(kernels.native.rms_norm(x, w, 1e-5), kernels._MLX_FAST["rms_norm"](x, w, 1e-5), dtype)


@needs_kernels
@ours
@given(batch=st.integers(1, 3), heads=st.integers(1, 4), length=st.integers(1, 9),
       head_dim=st.sampled_from([16, 64]), part=st.booleans(), traditional=st.booleans(), dtype=floats,
       per_row=st.booleans(), freqs=st.booleans(), transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_equals_mlx(batch, heads, length, head_dim, part, traditional, dtype, per_row, freqs, transposed,
                         seed) -> None:
    """Offsets shared or one per row (a batch's), the plain base or given frequencies (Llama 3,
    YaRN and long RoPE pass theirs), all or part of each head, and the layout attention uses (a
    transposed view)."""
    mx.random.seed(seed)
    x = mx.random.normal((batch, length, heads, head_dim)).astype(dtype)
    x = x.transpose(0, 2, 1, 3) if transposed else x.reshape(batch, heads, length, head_dim)
    dims = head_dim // 2 if part else head_dim
    offset = mx.array([seed % 50 + 7 * b for b in range(batch)]) if per_row else seed % 300
    args = dict(traditional=traditional, scale=0.5 + (seed % 3) / 4, offset=offset)
    if freqs:
        args.update(base=None, freqs=mx.random.uniform(1, 1e4, (dims // 2,)))
    else:
        args.update(base=10000.0)
    # float32: the angle (position x scale x frequency, up to ~450 radians here) is rounded to
    # float32 in another order than MLX's, by up to two units in its last place (2 * 2^-24 of its
    # size), which moves the output by that much times |x|
    largest = (max(np.array(offset).reshape(-1).tolist()) + length) * args["scale"]
    angle = 2 * 2.0**-24 * largest * float(mx.abs(x).max()) if dtype == mx.float32 else 0.0
    check_fast(kernels.rope(x, dims, **args), kernels._MLX_FAST["rope"](x, dims, **args), dtype, angle)


@needs_kernels
@ours
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 3]),
       q_len=st.integers(1, 20), extra=st.integers(0, 40), head_dim=st.sampled_from([16, 64]), dtype=floats,
       mask=st.sampled_from([None, "causal", "bool", "additive"]), sinks=st.booleans(), sliced=st.booleans(),
       seed=st.integers(0, 2**16))
def test_attention_equals_mlx(batch, kv_heads, group, q_len, extra, head_dim, dtype, mask, sinks, sliced,
                              seed) -> None:
    """Grouped heads, decode (one query row) and prefill rows, no mask, causal, a batch's boolean
    padding mask or an additive one, attention sinks, and keys read as a cache hands them out (a
    slice of a longer buffer)."""
    mx.random.seed(seed)
    heads, k_len = kv_heads * group, q_len + extra
    q = mx.random.normal((batch, heads, q_len, head_dim)).astype(dtype)
    room = k_len + (16 if sliced else 0)
    k = mx.random.normal((batch, kv_heads, room, head_dim)).astype(dtype)[:, :, :k_len]
    v = mx.random.normal((batch, kv_heads, room, head_dim)).astype(dtype)[:, :, :k_len]
    m = mask
    if mask == "bool":
        m = mx.random.uniform(shape=(batch, 1, 1, k_len)) > 0.3
        m[..., -1] = True
    elif mask == "additive":
        m = mx.random.normal((batch, 1, q_len, k_len)).astype(dtype)
    s = mx.random.normal((heads,)).astype(dtype) if sinks else None
    args = dict(scale=head_dim**-0.5, mask=m, sinks=s)
    check_fast(kernels.attention(q, k, v, **args), kernels._MLX_FAST["scaled_dot_product_attention"](q, k, v, **args),
               dtype)


@needs_kernels
@ours
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 3]),
       q_len=st.integers(1, 20), extra=st.integers(0, 40), head_dim=st.sampled_from([12, 16, 64]),
       mask=st.sampled_from([None, "causal", "bool", "additive"]), sliced=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_over_a_float16_cache_is_its_float32_values_bits(isa, batch, kv_heads, group, q_len, extra,
                                                                   head_dim, mask, sliced, seed) -> None:
    """float32 queries over float16 keys and values (a half-precision KV cache, decision 0035)
    read them as they are: the same bits as over the same values in float32, and MLX's attention
    (which widens them first) within float32's tolerance."""
    mx.random.seed(seed)
    heads, k_len = kv_heads * group, q_len + extra
    q = mx.random.normal((batch, heads, q_len, head_dim))
    room = k_len + (16 if sliced else 0)
    k = mx.random.normal((batch, kv_heads, room, head_dim)).astype(mx.float16)[:, :, :k_len]
    v = mx.random.normal((batch, kv_heads, room, head_dim)).astype(mx.float16)[:, :, :k_len]
    m = mask
    if mask == "bool":
        m = mx.random.uniform(shape=(batch, 1, 1, k_len)) > 0.3
        m[..., -1] = True
    elif mask == "additive":
        m = mx.random.normal((batch, 1, q_len, k_len))
    got = kernels.attention(q, k, v, scale=head_dim**-0.5, mask=m)
    wide = kernels.attention(q, k.astype(mx.float32), v.astype(mx.float32), scale=head_dim**-0.5, mask=m)
    assert got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got), np.array(wide))
    want = kernels._MLX_FAST["scaled_dot_product_attention"](q, k, v, scale=head_dim**-0.5, mask=m)
    check_fast(got, want, mx.float32)
    merged = kernels.merged_attention(q, k, v, scale=head_dim**-0.5, mask=m)
    np.testing.assert_array_equal(np.array(merged), np.array(got.transpose(0, 2, 1, 3).reshape(batch, q_len, -1)))


def primitives(out: mx.array, tmp_path) -> str:
    mx.export_to_dot(str(tmp_path / "graph.dot"), out)
    return (tmp_path / "graph.dot").read_text()


@needs_kernels
def test_fast_ops_are_one_op_on_the_cpu_and_mlx_own_where_the_kernels_do_not_serve(tmp_path) -> None:
    """The default CPU stream gets one primitive each; an explicit stream (and a GPU, which this
    machine has none of) gets MLX's own fallback graph."""
    x = mx.random.normal((1, 2, 3, 8))
    assert "TurbosparkRmsNorm" in primitives(kernels.rms_norm(x, None, 1e-5), tmp_path)
    assert "TurbosparkRope" in primitives(kernels.rope(x, 8, traditional=False, base=1e4, scale=1.0, offset=3), tmp_path)
    assert "TurbosparkAttention" in primitives(kernels.attention(x, x, x, scale=0.3, mask="causal"), tmp_path)
    half = x.astype(mx.float16)
    mx.eval(half)  # a float16 cache is read as it is: no widening op before attention
    graph = primitives(kernels.attention(x, half, half, scale=0.3, mask="causal"), tmp_path)
    assert "TurbosparkAttention" in graph and "AsType" not in graph
    given = kernels.rms_norm(x, None, 1e-5, stream=mx.cpu)
    assert "Turbospark" not in primitives(given, tmp_path) and "Rsqrt" in primitives(given, tmp_path)
    np.testing.assert_array_equal(np.array(given), np.array(kernels._MLX_FAST["rms_norm"](x, None, 1e-5)))


@needs_kernels
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_the_swiglu_epilogue_takes_mlxs_exp_over_its_whole_range(isa, dtype) -> None:
    """The gate's exp, eight at a time and in a row's tail, is MLX's own on every instruction
    set: the same bits from -100 to 100 and at the clamps (+-88)."""
    h = 13  # 8 at a time, then 5 one by one
    gate = np.concatenate([np.linspace(-100, 100, 4001), [88.0, 88.00001, -88.0, -88.00001, 0.0, -0.0, 1e-30]])
    gate = np.concatenate([gate, np.zeros((-len(gate)) % h)]).astype(np.float32).reshape(1, -1, h)
    x = mx.array(gate).astype(dtype)
    eye = mx.eye(h, 16)  # the inner dimension a multiple of 8: x's last 3 columns are 0
    w = mx.concatenate([eye, eye]).astype(dtype)  # gate and up are x itself
    got = kernels.linear(mx.pad(x, [(0, 0), (0, 0), (0, 3)]), w, swiglu=True)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(swiglu(x, x).astype(mx.float32)))


@needs_kernels
@ours
@given(rows=st.integers(1, 17), width=st.sampled_from([1, 7, 8, 513, 4096]), batch=st.booleans(),
       transposed=st.booleans(), keepdims=st.booleans(), seed=st.integers(0, 2**16))
def test_logsumexp_over_the_last_axis_is_mlxs_own_bits(isa, rows, width, batch, transposed, keepdims, seed) -> None:
    """The engine's normalization of a step's logits: MLX's maximum, its exp (eight at a time,
    then the tail) and its in-order sum, so the same bits, for rows side by side or strided."""
    mx.random.seed(seed)
    x = mx.random.normal((width, rows)).T if transposed else mx.random.normal((rows, width))
    x = (x * 20).reshape(1, rows, width) if batch else x * 20
    got = kernels.logsumexp(x, axis=-1, keepdims=keepdims)
    want = kernels._MLX_LOGSUMEXP(x, axis=-1, keepdims=keepdims)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.array(got), np.array(want))


@needs_kernels
def test_logsumexp_keeps_mlxs_answers_at_the_edges_and_its_own_op_elsewhere(tmp_path) -> None:
    """A vocabulary's width, rows of -inf (every token masked), +inf and NaN as MLX answers them;
    another axis, another type or an explicit stream take MLX's own op, and an empty row is
    MLX's own error."""
    mx.random.seed(1)
    vocab = mx.random.normal((3, 49152)) * 30
    np.testing.assert_array_equal(np.array(kernels.logsumexp(vocab, axis=-1)),
                                  np.array(kernels._MLX_LOGSUMEXP(vocab, axis=-1)))
    inf = float("inf")
    edges = mx.array([[-inf] * 9, [1.0] * 8 + [inf], [float("nan")] + [1.0] * 8, [-inf] * 8 + [2.0]])
    got, want = kernels.logsumexp(edges, axis=1, keepdims=True), kernels._MLX_LOGSUMEXP(edges, axis=1, keepdims=True)
    np.testing.assert_array_equal(np.array(got), np.array(want))
    assert "TurbosparkLogSumExp" in primitives(kernels.logsumexp(vocab, axis=[-1]), tmp_path)
    for other in (kernels.logsumexp(vocab, axis=0), kernels.logsumexp(vocab.astype(mx.bfloat16), axis=-1),
                  kernels.logsumexp(vocab, axis=-1, stream=mx.cpu), kernels.logsumexp(vocab)):
        assert "Turbospark" not in primitives(other, tmp_path)
    with pytest.raises(ValueError, match="empty"):
        kernels.logsumexp(mx.zeros((2, 0)), axis=-1)
