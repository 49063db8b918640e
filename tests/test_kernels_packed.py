"""Quantized weights packed eight output rows together (``kernels.pack_quantized``, decision 0039):
the products read them within float32 rounding of the same products in MLX's layout, a row's
result does not depend on the rows beside it, every instruction set gives AVX2's bits, and where a
set cannot read them packed (x kept float32, no integer products) they are read unpacked, with the
unpacked product's bits.  Installed in a model, the layers and a tied head read them packed and the
embedding picks its rows out of the chunks."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from turbospark.kernels import ops as kernels
from turbospark.model import mlx_kernels

from ._support import tiny_llama
from .test_kernels import ISAS, VNNI_SETS, isa, needs_kernels, ours  # noqa: F401 (isa: a fixture)

pytestmark = pytest.mark.usefixtures("fast_ops_restored")  # installs leave MLX's own ops to later tests


def weights(n: int, k: int, group: int, bits: int, dtype, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(seed)
    wq, scales, biases = mx.quantize((mx.random.normal((n, k)) / k**0.5).astype(dtype), group_size=group, bits=bits)
    mx.eval(wq, scales, biases)
    return wq, scales, biases


def product(x: mx.array, w: tuple[mx.array, ...], group: int, bits: int, packed: bool = False) -> np.ndarray:
    return np.array(kernels.quantized_linear(x, *w, group_size=group, bits=bits, packed=packed))


def in_8_bits(on: bool) -> bool:
    before = kernels.native.activations_in_8_bits()
    kernels.native.set_activations_in_8_bits(on)
    return before


@needs_kernels
@ours
@given(rows=st.integers(1, 20), chunks=st.integers(1, 6), groups=st.integers(1, 4), bits=st.sampled_from([4, 8]),
       group=st.sampled_from([32, 64, 128]), dtype=st.sampled_from([mx.float32, mx.float16, mx.bfloat16]),
       seed=st.integers(0, 2**16))
def test_packed_weights_give_the_products_of_mlxs_layout(isa, rows, chunks, groups, bits, group, dtype, seed) -> None:
    """x rounded to 8 bits as before, each 32's integer sum the same: within float32 rounding of
    the sums in another order.  With x in 8 bits, each row alone is the same bits as in the batch."""
    k = max(64, group) * groups
    w = weights(8 * chunks, k, group, bits, dtype, seed)
    x = mx.random.normal((rows, k)) * 2
    packed = kernels.pack_quantized(*w, group, bits)
    assert [a.shape for a in packed] == [a.shape for a in w] and [a.dtype for a in packed] == [a.dtype for a in w]
    want, got = product(x, w, group, bits), product(x, packed, group, bits, packed=True)
    wf = np.array(mx.dequantize(*w, group_size=group, bits=bits).astype(mx.float32))
    size = np.abs(np.array(x)) @ np.abs(wf).T
    assert (np.abs(got - want) <= 1e-5 * size + 1e-6).all()
    for r in range(rows if kernels.x_in_8_bits() else 0):
        np.testing.assert_array_equal(product(x[r:r + 1], packed, group, bits, packed=True), got[r:r + 1])


@needs_kernels
@pytest.mark.skipif(not VNNI_SETS, reason="this CPU runs neither AVX-VNNI nor AVX-512 VNNI")
@ours
@given(rows=st.integers(1, 20), bits=st.sampled_from([4, 8]), group=st.sampled_from([32, 64, 128]),
       seed=st.integers(0, 2**16))
def test_packed_products_are_avx2s_bits_on_the_vnni_sets(rows, bits, group, seed) -> None:
    """The same integer sums (AVX2 takes 8-bit weights as |q - 128| and a sign, then adds
    128 * sum(x8) back), so a model's text does not depend on which set a CPU has."""
    w = kernels.pack_quantized(*weights(40, 384, group, bits, mx.float16, seed), group, bits)
    x = mx.random.normal((rows, 384)) * 3
    before, int8 = kernels.native.isa(), in_8_bits(True)
    got = {}
    try:
        for name in ("avx2+fma", *VNNI_SETS):
            assert kernels.native.use_isa(name)
            got[name] = product(x, w, group, bits, packed=True)
    finally:
        kernels.native.use_isa(before)
        in_8_bits(int8)
    for name in VNNI_SETS:
        np.testing.assert_array_equal(got[name], got["avx2+fma"])


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_where_a_set_cannot_read_them_packed_they_are_read_unpacked(bits) -> None:
    """x kept float32 (TURBOSPARK_KERNELS_EXACT) and the portable (NEON) set: the same bits as the
    same product on MLX's layout."""
    w = weights(64, 576, 32, bits, mx.float16, 7)
    packed = kernels.pack_quantized(*w, 32, bits)
    x = mx.random.normal((5, 576))
    before, int8 = kernels.native.isa(), kernels.native.activations_in_8_bits()
    try:
        for name in ISAS:
            assert kernels.native.use_isa(name)
            for on in (True, False):
                in_8_bits(on)
                reads = kernels.native.reads_packed(bits)
                assert reads == (on and name not in ("portable", "neon"))  # the sets with integer products
                if not reads:
                    np.testing.assert_array_equal(product(x, packed, 32, bits, packed=True), product(x, w, 32, bits))
    finally:
        kernels.native.use_isa(before)
        in_8_bits(int8)


@needs_kernels
def test_weights_that_cannot_be_packed_are_refused_with_a_plain_error() -> None:
    wq, scales, biases = weights(12, 64, 32, 4, mx.float32, 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.pack_quantized(wq, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="eight rows a chunk"):
        kernels.quantized_linear(mx.ones((1, 64)), wq, scales, biases, group_size=32, bits=4, packed=True)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_a_model_reads_its_layers_and_tied_head_packed(bits, monkeypatch) -> None:
    """The line says so; the embedding's rows are the unpacked ones exactly; the logits are the
    same model's with its weights left in MLX's layout (TURBOSPARK_KERNELS_PACKED=0): the same
    likeliest tokens, within x's rounding to 8 bits amplified through this tiny model's layers."""
    if not kernels.packs(8, bits, 32):
        pytest.skip(f"{kernels.native.isa()} does not read {bits}-bit weights packed")
    models = [tiny_llama(vocab=64, layers=2, seed=4, hidden=64) for _ in range(2)]
    for m in models:
        nn.quantize(m, group_size=32, bits=bits)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    rows = np.array(models[0].model.embed_tokens(tokens))
    line = mlx_kernels.install(models[0])
    assert "15 of 15 products' weights packed" in line and "2 of 2 decoder layers fused" in line
    assert models[0].model.embed_tokens._turbospark_packed
    np.testing.assert_array_equal(np.array(models[0].model.embed_tokens(tokens)), rows)
    monkeypatch.setenv("TURBOSPARK_KERNELS_PACKED", "0")
    assert "packed" not in mlx_kernels.install(models[1])
    got, want = np.array(models[0](tokens)), np.array(models[1](tokens))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() <= 0.1 * np.ptp(want)  # as test_a_quantized_model_is_read_by_the_kernels
