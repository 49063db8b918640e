"""GGUF's block types read as they are stored (decision 0041): the kernels' own packed products
for Q4_K, Q6_K, Q5_0 and Q5_1 (``k4_linear``, ``k6_linear``, ``k5_linear``), and ggml's own CPU
code for every type (``linear``, ``take_rows``).

``scripts/build-ggml`` (run by ``scripts/setup``) builds the pinned ggml's CPU library once per
instruction set the kernels choose from, into ``ggml/`` beside this file; the kernels open the
one for the set in use.  A product here is one of the kernels' (``RowsMatmul``: the norm before
it, the bias, residual or SwiGLU after it, the kernels' threads), with ggml's own row products in
the middle: x rounded as llama.cpp rounds it for that type (Q8_K, Q8_0 or Q8_1), then ggml's
``vec_dot`` for each output row, the same arithmetic as llama.cpp's products without its
repacking.  Types are GGUF's numbers (``gguf.GGMLQuantizationType``).

Optional: without ggml (not built, another platform) or on a GPU these types are widened at load
(``model.mlx_ggml``) and ``describe()`` says why.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from . import ops

__all__ = [
    "GGML_DIR", "available", "dequantize", "describe", "k4_linear", "k5_linear", "k6_linear", "k6_take_rows",
    "linear", "quantize", "reads_k4", "reads_k5", "reads_k6", "row_bytes", "serves", "take_rows", "type_name",
    "variant",
]

#: Where ``scripts/build-ggml`` writes ggml's libraries.
GGML_DIR = Path(__file__).with_name("ggml")


def _open() -> str | None:
    if ops.native is None:
        return ops.describe()  # why the kernels are not here
    return ops.native.ggml_open(str(GGML_DIR)) or None


_why_not = _open()


def available() -> bool:
    """Whether ggml serves the instruction set the kernels use now."""
    return _why_not is None and ops.native is not None and ops.native.ggml_ready()


def variant() -> str:
    """ggml's CPU variant in use (haswell, alderlake, icelake, x64...)."""
    return ops.native.ggml_variant() if available() else ""


def describe() -> str:
    """One line for the startup report."""
    if not available():
        return f"GGUF block types widened at load (ggml: {_why_not or 'no variant for this instruction set'})"
    return f"GGUF block types read by ggml ({variant()})"


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of a row of ``k`` values of ``ggml_type``; 0 where ggml has no product for it here."""
    return ops.native.ggml_row_bytes(int(ggml_type), k) if available() else 0


def serves(ggml_type: int, k: int) -> bool:
    """Whether products of ``ggml_type`` weights with rows of ``k`` values run here."""
    return row_bytes(ggml_type, k) > 0


def type_name(ggml_type: int) -> str:
    return ops.native.ggml_type_name(int(ggml_type))


def linear(x: mx.array, weight: mx.array, ggml_type: int, k: int, bias: mx.array | None = None, *,
           residual: mx.array | None = None, swiglu: bool = False, geglu: bool = False, norm: mx.array | None = None,
           eps: float = 0.0) -> mx.array:
    """``x @ dequantize(weight).T (+ bias)`` for ``weight`` (N, row bytes) uint8 in ``ggml_type``;
    ``residual``, ``swiglu``, ``geglu`` and ``norm`` as in ``ops.linear``: one op."""
    return ops.native.rows_ggml_matmul(x, weight, int(ggml_type), k, bias, residual=residual, swiglu=swiglu, geglu=geglu,
                                       norm=norm, eps=eps)


def reads_k4() -> bool:
    """Whether the kernels' instruction set in use reads Q4_K packed (``k4_linear``) as it is:
    the sets with integer products, x in 8 bits."""
    return ops.native is not None and ops.native.reads_k(4)


def reads_k6() -> bool:
    """The same for Q6_K (``k6_linear``)."""
    return ops.native is not None and ops.native.reads_k(6)


def reads_k5() -> bool:
    """The same for Q5_0, Q5_1 (``k5_linear``) and Q5_K (``k5k_linear``)."""
    return ops.native is not None and ops.native.reads_k(5)


def k4_linear(x: mx.array, weight: mx.array, fields: mx.array, bias: mx.array | None = None, *,
              residual: mx.array | None = None, swiglu: bool = False, geglu: bool = False, norm: mx.array | None = None,
              eps: float = 0.0) -> mx.array:
    """``x @ W.T (+ bias)`` for W in Q4_K super-blocks packed eight rows together by the kernels
    (``model.mlx_ggml.pack_k4``): the nibbles (N, K / 8) uint32 and each chunk's fields;
    ``residual``, ``swiglu``, ``geglu`` and ``norm`` as in ``ops.linear``.  Not ggml's: the kernels' own
    packed product (decision 0041)."""
    return ops.native.rows_k4_matmul(x, weight, fields, bias, residual=residual, swiglu=swiglu, geglu=geglu, norm=norm, eps=eps)


def k6_linear(x: mx.array, weight: mx.array, highs: mx.array, fields: mx.array, bias: mx.array | None = None, *,
              residual: mx.array | None = None, swiglu: bool = False, geglu: bool = False, norm: mx.array | None = None,
              eps: float = 0.0) -> mx.array:
    """``k4_linear`` for Q6_K packed by ``model.mlx_ggml.pack_k6``: the low nibbles (N, K / 8),
    the high bits (N, K / 16) uint32 and each chunk's fields; 6.5625 bits a weight, GGUF's own."""
    return ops.native.rows_k6_matmul(x, weight, highs, fields, bias, residual=residual, swiglu=swiglu, geglu=geglu, norm=norm,
                                     eps=eps)


def k5_linear(x: mx.array, weight: mx.array, highs: mx.array, fields: mx.array, bias: mx.array | None = None, *,
              residual: mx.array | None = None, swiglu: bool = False, geglu: bool = False, norm: mx.array | None = None,
              eps: float = 0.0) -> mx.array:
    """``k4_linear`` for Q5_0 or Q5_1 packed by ``model.mlx_ggml.pack_k5``: the low nibbles
    (N, K / 8), the fifth bits (N, K / 32) uint32 and each chunk's fields; 6 bits a weight."""
    return ops.native.rows_k5_matmul(x, weight, highs, fields, bias, residual=residual, swiglu=swiglu, geglu=geglu, norm=norm,
                                     eps=eps)


def k5k_linear(x: mx.array, weight: mx.array, highs: mx.array, fields: mx.array, bias: mx.array | None = None, *,
               residual: mx.array | None = None, swiglu: bool = False, geglu: bool = False, norm: mx.array | None = None,
               eps: float = 0.0) -> mx.array:
    """``k4_linear`` for Q5_K packed by ``model.mlx_ggml.pack_k5k``: Q4_K's nibbles and fields with
    the fifth bits (N, K / 32) uint32; 5.625 bits a weight (GGUF: 5.5).  ``reads_k5`` says where
    the set reads it so."""
    return ops.native.rows_k5k_matmul(x, weight, highs, fields, bias, residual=residual, swiglu=swiglu, geglu=geglu,
                                      norm=norm, eps=eps)


def k6_take_rows(weight: mx.array, highs: mx.array, fields: mx.array, ids: mx.array, dtype: mx.Dtype) -> mx.array:
    """Rows ``ids`` of Q6_K packed as ``k6_linear`` reads it, as ``dtype``: a tied embedding's lookup."""
    return ops.native.k6_take_rows(weight, highs, fields, ids, dtype)


def take_rows(table: mx.array, ids: mx.array, ggml_type: int, k: int, dtype: mx.Dtype) -> mx.array:
    """Rows ``ids`` of ``table`` (V, row bytes) in ``ggml_type``, as ``dtype``: an embedding's lookup."""
    return ops.native.ggml_take_rows(table, ids, int(ggml_type), k, dtype)


def quantize(values: mx.array, ggml_type: int) -> mx.array:
    """float (N, K) as (N, row bytes) uint8 blocks of ``ggml_type`` (ggml's own quantization)."""
    return ops.native.ggml_quantize(values, int(ggml_type))


def dequantize(blocks: mx.array, ggml_type: int, k: int) -> mx.array:
    """(N, row bytes) blocks of ``ggml_type`` as float32 (N, k) (ggml's own dequantization)."""
    return ops.native.ggml_dequantize(blocks, int(ggml_type), k)
