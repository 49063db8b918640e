"""turbospark's CPU kernels (``turbospark.kernels``) against MLX's own ops on the same inputs.

Property tests over shapes, row counts, weight types, group sizes and bits, for every instruction
set this CPU runs (the AVX2 build and the portable one on x86-64).  The tolerances, relative to
``|x| @ |W|.T`` (the size of the sum each output is): float32 1e-5 (the summation order
differs: MLX calls BLAS, the kernels sum eight lanes and then the lanes); float16 output 2e-3 and
bfloat16 output 1e-2 (one rounding of the output, 2^-11 and 2^-8 relative, on either side).
Quantized weights are read as MLX defines them (``scale * q + bias``), in float32, where MLX
rounds each to the input's type first: for float16 and bfloat16 inputs the quantized tolerance is
twice the float one.

Then a model: ``install`` routes a tiny llama's products through the kernels and its logits stay
within float32 rounding of MLX's own; where the kernels are off, nothing changes and the line
says why.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbospark import kernels
from turbospark.model import mlx_kernels

from ._support import tiny_llama

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels: {kernels.describe()}")

TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}
ISAS = kernels.native.isas() if kernels.available() else []


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    before = kernels.native.isa()
    assert kernels.native.use_isa(request.param)
    yield request.param
    kernels.native.use_isa(before)


def check_close(got: mx.array, want: mx.array, x: mx.array, w: mx.array, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    size = np.abs(np.array(x.astype(mx.float32))) @ np.abs(np.array(w.astype(mx.float32))).T
    err = np.abs(np.array(got.astype(mx.float32)) - np.array(want.astype(mx.float32)))
    bound = tol * size.reshape(err.shape) + 1e-6
    worst = float((err / bound).max())
    assert worst <= 1, f"off by {worst:.2f}x the tolerance"


shapes = st.tuples(
    st.integers(1, 20),                     # rows (a step's batch, past MAX_FLOAT32_ROWS too)
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
    check_close(got, want, x, w, TOLERANCE[dtype])


@needs_kernels
@ours
@given(shape=shapes, bits=st.sampled_from([4, 8]), group=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from([mx.float32, mx.bfloat16, mx.float16]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_quantized_weights_equal_mlx_quantized_matmul(isa, shape, bits, group, dtype, bias, seed) -> None:
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
    check_close(got, want, x, w, TOLERANCE[dtype] * (1 if dtype == mx.float32 else 2) * (2 if bias else 1))


@needs_kernels
def test_large_products_split_across_threads_give_the_same_rows(isa) -> None:
    """Past 64 KiB of weights a product is split over the team; every share is the same as one
    thread's (each output row is computed whole by one thread)."""
    mx.random.seed(3)
    x = mx.random.normal((3, 576))
    w = mx.random.normal((4099, 576))
    split = np.array(kernels.linear(x, w))
    alone = np.concatenate([np.array(kernels.linear(x, w[i:i + 7])) for i in range(0, 4099, 7)], axis=1)
    np.testing.assert_array_equal(split, alone)


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
    want = model(tokens)
    last = model(tokens[:, -1:])
    line = mlx_kernels.install(model)
    assert line.startswith(kernels.describe() + ": 14 of 14 linear layers and the tied output head")
    assert all(type(m).__module__ == mlx_kernels.__name__
               for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    np.testing.assert_allclose(np.array(model(tokens)), np.array(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(model(tokens[:, -1:])), np.array(last), rtol=1e-4, atol=1e-4)


@needs_kernels
def test_a_quantized_model_is_read_by_the_kernels() -> None:
    model = tiny_llama(vocab=64, layers=2, seed=2)
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[3, 1, 4, 1, 5]])
    want = model(tokens)
    line = mlx_kernels.install(model)
    assert "14 of 14 linear layers and the tied output head" in line
    np.testing.assert_allclose(np.array(model(tokens)), np.array(want), rtol=1e-4, atol=1e-4)


def test_without_the_kernels_a_model_keeps_mlx_ops_and_the_line_says_why(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "native", None)
    monkeypatch.setattr(kernels, "_why_not", "not built (test)")
    model = tiny_llama(vocab=64, layers=1, seed=3)
    line = mlx_kernels.install(model)
    assert line == "MLX's own ops (turbospark's CPU kernels: not built (test))"
    assert all(type(m).__module__.startswith("mlx.") for _, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.Embedding)))
