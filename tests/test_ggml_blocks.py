"""GGUF block types read as they are stored, through ggml's own CPU code (``kernels.blocks``,
decision 0041).

- ggml's dequantization of every type equals gguf's own (``gguf.quants.dequantize``, numpy:
  written apart from ggml), bit for bit;
- a product equals x @ W.T with W dequantized by gguf, within what rounding x to 8 bits per block
  (as llama.cpp's products do) can move it, on every instruction set the kernels choose from;
- a row's result does not depend on the rows beside it; the norm, residual and SwiGLU around the
  product are the float products' own; an embedding's rows are the dequantized rows;
- Q4_K packed for the kernels' own product (4.625 bits a weight) gives the bits of its float32
  affine re-lay's packed product; Q6_K (GGUF's 6.5625 bits), Q5_0 and Q5_1 (6 bits) packed are
  within x's rounding;
- a model imported ``native`` keeps the GGUF's blocks (its stored size is the GGUF's), its layers
  read them (fused where the layer's other products are the kernels'), its logits are the float32
  import's within that rounding; without ggml they are widened at load (Q4_K to MLX's affine
  layout).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.activations import swiglu

from turbospark.kernels import blocks
from turbospark.kernels import ops as kernels
from turbospark.model import mlx_ggml, mlx_kernels
from turbospark.store.card import count_parameters
from turbospark.store.gguf_import import convert_gguf
from turbospark.store.gguf_tensors import BLOCK_TYPES, NATIVE_TYPES

from .test_kernels import ISAS, isa, ours  # noqa: F401 (isa: a fixture)

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.usefixtures("fast_ops_restored")
needs_ggml = pytest.mark.skipif(not blocks.available(), reason=f"ggml: {blocks.describe()}")
#: What the products serve: every type the store keeps as blocks, and the ones it re-lays.
TYPES = sorted(t for t in BLOCK_TYPES | NATIVE_TYPES if t not in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ1_S, Q.IQ1_M))
#: ggml's quantization of these needs an importance matrix: random blocks are made for them instead.
IMATRIX = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ1_S, Q.IQ1_M)


def blocks_of(qtype: Q, n: int, k: int, seed: int) -> tuple[mx.array, np.ndarray]:
    """(N, row bytes) blocks of ``qtype`` from random weights, and gguf's dequantization of them."""
    w = mx.array(np.random.default_rng(seed).normal(size=(n, k)).astype(np.float32) / k**0.5)
    q = blocks.quantize(w, qtype)
    return q, gguf.quants.dequantize(np.array(q), qtype).reshape(n, k).astype(np.float32)


def bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What rounding x to 8 bits per block can move x @ w.T: each value by half its block's step
    (a block of 256 at most: its step is the largest), plus float32 sums."""
    blocks_256 = np.abs(x).reshape(x.shape[0], -1, 256).max(axis=-1, keepdims=True)
    step = np.broadcast_to(blocks_256 / 127, (x.shape[0], x.shape[1] // 256, 256)).reshape(x.shape)
    return 0.51 * step @ np.abs(w).T + 1e-5 * np.abs(x) @ np.abs(w).T + 1e-6


@needs_ggml
def test_the_types_sizes_are_ggufs() -> None:
    for qtype in TYPES:
        values, size = gguf.GGML_QUANT_SIZES[qtype]
        assert blocks.row_bytes(qtype, 4 * 256) == 4 * 256 // values * size, qtype.name
        assert blocks.type_name(qtype).lower() == qtype.name.lower()


@needs_ggml
@pytest.mark.parametrize("qtype", TYPES + list(IMATRIX), ids=lambda t: t.name)
def test_ggmls_dequantization_is_ggufs(qtype: Q) -> None:
    if qtype in IMATRIX:
        q = mx.array(np.random.default_rng(1).integers(0, 256, size=(3, gguf.GGML_QUANT_SIZES[qtype][1] * 2), dtype=np.uint8))
        q[:, :2] = mx.array(np.array([0x00, 0x20], np.uint8))  # a small float16 scale first: finite values
    else:
        q, _ = blocks_of(qtype, 3, 512, seed=1)
    want = gguf.quants.dequantize(np.array(q), qtype).reshape(3, 512)
    assert np.array_equal(np.array(blocks.dequantize(q, qtype, 512)), want)


@needs_ggml
@ours
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 20), n=st.integers(1, 40), k_blocks=st.integers(1, 3),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_products_are_xs_times_the_dequantized_weights(isa, qtype, rows, n, k_blocks, bias, seed) -> None:
    k = 256 * k_blocks
    q, w = blocks_of(qtype, n, k, seed)
    x = np.random.default_rng(seed + 1).normal(size=(rows, k)).astype(np.float32) * 2
    b = mx.array(np.random.default_rng(seed + 2).normal(size=(n,)).astype(np.float32)) if bias else None
    got = np.array(blocks.linear(mx.array(x), q, qtype, k, b))
    want = x @ w.T + (np.array(b) if bias else 0)
    assert (np.abs(got - want) <= bound(x, w)).all()
    for r in range(rows):  # alone, the same bits as in the batch
        assert np.array_equal(np.array(blocks.linear(mx.array(x[r:r + 1]), q, qtype, k, b)), got[r:r + 1])


@needs_ggml
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_the_norm_residual_and_swiglu_are_the_float_products(dtype) -> None:
    """Around ggml's rows, the kernels' own prologue and epilogues: the separate ops' bits."""
    k, n = 512, 64
    q, _ = blocks_of(Q.Q6_K, n, k, seed=3)
    x = (mx.random.normal((2, 5, k)) * 2).astype(dtype)
    r = mx.random.normal((2, 5, n)).astype(dtype)
    norm = (1 + mx.random.normal((k,)) * 0.1).astype(dtype)
    plain = blocks.linear(x, q, Q.Q6_K, k)
    assert plain.dtype == dtype and plain.shape == (2, 5, n)
    assert mx.array_equal(blocks.linear(x, q, Q.Q6_K, k, residual=r), r + plain)
    normed = kernels.native.rms_norm(x, norm, 1e-5)
    assert mx.array_equal(blocks.linear(x, q, Q.Q6_K, k, norm=norm, eps=1e-5), blocks.linear(normed, q, Q.Q6_K, k))
    halves = blocks.linear(x, q, Q.Q6_K, k, swiglu=True)
    gate, up = plain[..., : n // 2], plain[..., n // 2:]
    assert halves.shape == (2, 5, n // 2)
    assert np.allclose(np.array(halves.astype(mx.float32)), np.array((nn.silu(gate) * up).astype(mx.float32)),
                       atol=2e-2 if dtype != mx.float32 else 1e-5)


@needs_ggml
@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K, Q.Q5_0, Q.IQ4_XS], ids=lambda t: t.name)
def test_an_embeddings_rows_are_the_dequantized_rows(qtype: Q) -> None:
    q, w = blocks_of(qtype, 50, 256, seed=4)
    ids = mx.array([[3, 49, 0], [7, 7, 1]])
    for dtype in (mx.float32, mx.bfloat16):
        rows = blocks.take_rows(q, ids, qtype, 256, dtype)
        assert rows.dtype == dtype and rows.shape == (2, 3, 256)
        assert mx.array_equal(rows, mx.array(w[np.array(ids)]).astype(dtype))


@needs_ggml
@ours
@given(rows=st.integers(1, 20), chunks=st.integers(1, 5), supers=st.integers(1, 3), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_q4_k_packed_for_the_kernels_is_the_affine_products_bits(isa, rows, chunks, supers, bias, seed) -> None:
    """Q4_K's super-blocks packed eight rows together (``pack_k4``, 4.625 bits a weight): the
    kernels' product computes each 32's scale and bias from d, dmin, sc and m as the float32
    re-lay does, so it gives the packed affine product's bits where the set reads them packed;
    elsewhere each row is dequantized, within float32 rounding of x @ W.T."""
    n, k = 8 * chunks, 256 * supers
    q, w = blocks_of(Q.Q4_K, n, k, seed)
    weight, fields = mlx_ggml.pack_k4(np.array(q))
    assert weight.nbytes + fields.nbytes == n * k * 4.625 / 8
    x = mx.array(np.random.default_rng(seed + 1).normal(size=(rows, k)).astype(np.float32))
    b = mx.array(np.random.default_rng(seed + 2).normal(size=(n,)).astype(np.float32)) if bias else None
    got = blocks.k4_linear(x, weight, fields, b)
    if blocks.reads_k4():
        affine = kernels.pack_quantized(*(mx.array(a) for a in mlx_ggml.q4_k_affine(np.array(q))), 32, 4)
        assert mx.array_equal(got, kernels.quantized_linear(x, *affine, b, group_size=32, bits=4, packed=True))
    else:
        want = np.array(x) @ w.T + (np.array(b) if bias else 0)
        assert np.allclose(np.array(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@needs_ggml
@ours
@given(rows=st.integers(1, 20), chunks=st.integers(1, 5), supers=st.integers(1, 3), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_q6_k_packed_for_the_kernels_is_xs_times_the_dequantized_weights(isa, rows, chunks, supers, bias, seed) -> None:
    """Q6_K packed eight rows together (``pack_k6``: the low nibbles, the high bits, each 16's
    scale; GGUF's 6.5625 bits a weight): within x's rounding of x @ W.T, W dequantized by gguf;
    a row alone the same bits as in the batch; an embedding's rows are gguf's rows."""
    n, k = 8 * chunks, 256 * supers
    q, w = blocks_of(Q.Q6_K, n, k, seed)
    weight, highs, fields = mlx_ggml.pack_k6(np.array(q))
    assert weight.nbytes + highs.nbytes + fields.nbytes == np.array(q).nbytes
    x = np.random.default_rng(seed + 1).normal(size=(rows, k)).astype(np.float32)
    b = mx.array(np.random.default_rng(seed + 2).normal(size=(n,)).astype(np.float32)) if bias else None
    got = np.array(blocks.k6_linear(mx.array(x), weight, highs, fields, b))
    want = x @ w.T + (np.array(b) if bias else 0)
    assert (np.abs(got - want) <= bound(x, w)).all()
    for r in range(rows):
        assert np.array_equal(np.array(blocks.k6_linear(mx.array(x[r:r + 1]), weight, highs, fields, b)), got[r:r + 1])
    ids = mx.array([[0, n - 1], [n // 2, 3 % n]])
    assert mx.array_equal(blocks.k6_take_rows(weight, highs, fields, ids, mx.float32), mx.array(w[np.array(ids)]))


@needs_ggml
@ours
@given(qtype=st.sampled_from([Q.Q5_0, Q.Q5_1]), rows=st.integers(1, 20), chunks=st.integers(1, 5),
       blocks64=st.integers(1, 6), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_q5_packed_for_the_kernels_is_xs_times_the_dequantized_weights(isa, qtype, rows, chunks, blocks64, bias,
                                                                         seed) -> None:
    """Q5_0 and Q5_1 packed eight rows together (``pack_k5``: the low nibbles, the fifth bits, d
    and m): within x's rounding of x @ W.T, W dequantized by gguf; a row alone as in the batch."""
    n, k = 8 * chunks, 64 * blocks64
    q, w = blocks_of(qtype, n, k, seed)
    packed = mlx_ggml.pack_k5(np.array(q), qtype)
    assert sum(a.nbytes for a in packed) == n * k * 6 // 8
    x = np.random.default_rng(seed + 1).normal(size=(rows, k)).astype(np.float32)
    b = mx.array(np.random.default_rng(seed + 2).normal(size=(n,)).astype(np.float32)) if bias else None
    got = np.array(blocks.k5_linear(mx.array(x), *packed, b))
    want = x @ w.T + (np.array(b) if bias else 0)
    pad = np.pad(x, ((0, 0), (0, -k % 256)))  # ``bound`` reads blocks of 256
    assert (np.abs(got - want) <= bound(pad, np.pad(w, ((0, 0), (0, -k % 256))))).all()
    for r in range(rows):
        assert np.array_equal(np.array(blocks.k5_linear(mx.array(x[r:r + 1]), *packed, b)), got[r:r + 1])


@needs_ggml
@ours
@given(rows=st.integers(1, 20), chunks=st.integers(1, 5), supers=st.integers(1, 3), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_q5_k_packed_for_the_kernels_is_xs_times_the_dequantized_weights(isa, rows, chunks, supers, bias,
                                                                          seed) -> None:
    """Q5_K packed eight rows together (``pack_k5k``: Q4_K's nibbles and fields, Q5's fifth bits;
    5.625 bits a weight, GGUF's 5.5): within x's rounding of x @ W.T, W dequantized by gguf; a
    row alone as in the batch; its product in a fused layer's forms (norm, residual, SwiGLU) is
    the plain product's."""
    n, k = 8 * chunks, 256 * supers
    q, w = blocks_of(Q.Q5_K, n, k, seed)
    packed = mlx_ggml.pack_k5k(np.array(q))
    assert sum(a.nbytes for a in packed) == n * k * 45 // 64  # 5.625 bits
    x = np.random.default_rng(seed + 1).normal(size=(rows, k)).astype(np.float32)
    b = mx.array(np.random.default_rng(seed + 2).normal(size=(n,)).astype(np.float32)) if bias else None
    got = np.array(blocks.k5k_linear(mx.array(x), *packed, b))
    want = x @ w.T + (np.array(b) if bias else 0)
    assert (np.abs(got - want) <= bound(x, w)).all()
    for r in range(rows):
        assert np.array_equal(np.array(blocks.k5k_linear(mx.array(x[r:r + 1]), *packed, b)), got[r:r + 1])
    residual = mx.array(x[:, :n] + 1)
    assert mx.array_equal(blocks.k5k_linear(mx.array(x), *packed, b, residual=residual), residual + mx.array(got))
    norm = mx.array(1 + np.random.default_rng(seed + 3).normal(size=(k,)).astype(np.float32) * 0.1)
    normed = kernels.native.rms_norm(mx.array(x), norm, 1e-5)
    assert mx.array_equal(blocks.k5k_linear(mx.array(x), *packed, b, norm=norm, eps=1e-5),
                          blocks.k5k_linear(normed, *packed, b))
    plain = mx.array(got)
    gate, up = plain[:, : n // 2], plain[:, n // 2:]
    assert mx.array_equal(blocks.k5k_linear(mx.array(x), *packed, b, swiglu=True), swiglu(gate, up))


# -- models --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kquants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The K-quant tiny model (K-quants and IQ4_XS in every matrix, a Q6_K head), as a GGUF."""
    from tests.model.gguf_fixtures import llama_cpp_sources
    from tests.model.gguf_tiny_models import CASES, write_tiny

    path = tmp_path_factory.mktemp("kquants") / "m.gguf"
    write_tiny(CASES["llama-kquants"], path, llama_cpp_sources() / "models")
    return path


def _imported(gguf_path: Path, out: Path, dtype: str) -> Path:
    out.mkdir()
    convert_gguf(gguf_path, out, dtype=dtype, progress=False)
    return out


IDS = mx.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])


@needs_ggml
def test_a_k_quant_gguf_keeps_its_blocks_and_the_kernels_read_them(kquants: Path, tmp_path: Path) -> None:
    native = _imported(kquants, tmp_path / "native", "native")
    floats = _imported(kquants, tmp_path / "f32", "float32")
    config = json.loads((native / "config.json").read_text())
    assert config["ggml_types"]["lm_head"] == Q.Q6_K
    assert config["ggml_types"]["model.layers.1.mlp.down_proj"] == Q.IQ4_XS
    stored = sum(p.stat().st_size for p in native.glob("*.safetensors"))
    assert stored <= 1.02 * kquants.stat().st_size  # the GGUF's bytes, not widened
    params, by_type = count_parameters(sorted(native.glob("*.safetensors")), config.get("quantization"),
                                       config["ggml_types"])  # what /api/show reports
    assert params == count_parameters(sorted(floats.glob("*.safetensors")), None)[0]
    assert by_type["Q6_K"] == 2 * 256 * 128 + 32000 * 256 and by_type["IQ4_XS"] == 2 * 512 * 256
    reference, _ = mlx_ggml.load_model(floats)
    want = np.array(reference(IDS))
    model, _ = mlx_ggml.load_model(native)
    line = mlx_kernels.install(model)
    assert "2 of 2 decoder layers fused" in line and f"GGUF blocks read by ggml ({blocks.variant()})" in line
    if blocks.reads_k4():  # Q4_K, Q5_K and Q6_K packed for the kernels' own products; elsewhere ggml's
        assert "GGUF blocks packed for the kernels: 2 Q4_K, 2 Q5_K, 3 Q6_K" in line
        assert model.model.layers[0].self_attn.q_proj.packed_kind == "Q4_K"
        assert model.lm_head.packed_kind == "Q6_K"
    else:
        assert "2 Q4_K" in line and "2 Q5_K" in line and "3 Q6_K" in line
        assert isinstance(model.model.layers[0].self_attn.q_proj, mlx_ggml.GgmlLinear)
    assert "2 IQ4_XS" in line
    got = np.array(model(IDS))
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_where_the_kernels_do_not_serve_q4_k_is_affine_and_the_rest_widened(kquants: Path, tmp_path: Path) -> None:
    """A sharded model (as on a GPU): Q4_K in MLX's affine 4-bit layout (what MLX's GPU reads),
    the other block types bfloat16, of the same values."""
    native = _imported(kquants, tmp_path / "native", "native")
    model, _ = mlx_ggml.load_model(native, group=object())  # a sharded model's layers stay MLX's
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == mx.bfloat16
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is nn.QuantizedLinear and (q_proj.bits, q_proj.group_size) == (4, 32)
    assert q_proj.scales.dtype == mx.float32
    assert not mlx_ggml.block_layers(model)
    reference, _ = mlx_ggml.load_model(_imported(kquants, tmp_path / "f32", "float32"))
    want = np.array(reference(IDS))
    with kernels.mlx_own_ops():
        got = np.array(model(IDS).astype(mx.float32))
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def test_without_ggml_the_kernels_still_read_q4_k_and_q6_k(kquants: Path, tmp_path: Path, monkeypatch) -> None:
    """ggml not built: the types the kernels pack themselves stay packed, the others are widened."""
    native = _imported(kquants, tmp_path / "native", "native")
    monkeypatch.setattr(blocks, "available", lambda: False)
    model, _ = mlx_ggml.load_model(native)
    down = model.model.layers[0].mlp.down_proj  # IQ4_XS: ggml's alone
    assert type(down) is nn.Linear and down.weight.dtype == mx.bfloat16
    assert "GGUF block types widened at load (ggml: " in mlx_kernels.install(model)  # the startup line says so
    if blocks.reads_k4():
        assert model.lm_head.packed_kind == "Q6_K"
        assert model.model.layers[0].self_attn.q_proj.packed_kind == "Q4_K"


def test_legacy_quants_and_half_matrices_keep_their_bytes(tmp_path: Path) -> None:
    """Gemma 3 with Q8_0, Q4_1, Q5_0, Q5_1, F16, BF16 and Q4_0 matrices: stored near the GGUF's
    size (F16 and BF16 matrices in two bytes, not widened to float32), read by the kernels with
    float32 x, the float32 import's logits within x's rounding."""
    from tests.model.gguf_fixtures import llama_cpp_sources
    from tests.model.gguf_tiny_models import CASES, write_tiny

    path = tmp_path / "m.gguf"
    write_tiny(CASES["gemma3-legacy-quants"], path, llama_cpp_sources() / "models")
    native, floats = _imported(path, tmp_path / "native", "native"), _imported(path, tmp_path / "f32", "float32")
    assert sum(p.stat().st_size for p in native.glob("*.safetensors")) <= 1.05 * path.stat().st_size
    model, _ = mlx_ggml.load_model(native)
    layer = model.model.layers[0]
    assert layer.self_attn.o_proj.weight.dtype == mx.float16 and layer.mlp.gate_proj.weight.dtype == mx.bfloat16
    line = mlx_kernels.install(model)
    assert "42 of 42 linear layers" in line and "6 of 6 decoder layers fused" in line  # q|k|v of mixed kinds side by side
    reference, _ = mlx_ggml.load_model(floats)
    want, got = np.array(reference(IDS)), np.array(model(IDS))
    assert got.dtype == np.float32 and np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def test_ggml_is_built_where_the_kernels_are() -> None:
    """``scripts/setup`` builds ggml beside the kernels (``scripts/build-ggml``): where the kernels
    serve and ggml does not, the suite fails rather than widening every K-quant it tests."""
    if kernels.available():
        assert blocks.available(), blocks.describe()
