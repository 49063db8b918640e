"""turbospark's CPU kernels for MLX: custom primitives in C++ (``src/``), built by ``scripts/setup``.

MLX's x86 CPU backend multiplies one row by a weight matrix through a general GEMM, and its
bfloat16 and quantized products are scalar and single-threaded.  The primitives here compute
``x @ W.T`` for the few rows of a decode step (and any rows for bfloat16, float16 and quantized
weights) with the weights read once per step, SIMD chosen at run time by the CPU's features
(AVX2 + FMA + F16C on x86-64; otherwise portable code, NEON on aarch64), over every core the
process is given.  They are MLX primitives, so they sit in MLX's graph like its own ops: lazy,
on the model thread's stream, in order with everything else.

The module is optional.  Where it was not built (no compiler, another platform), was built
against another MLX than the one running (the C++ API is internal; scripts/setup rebuilds it),
or a model runs on a GPU, MLX's own ops serve and ``describe()`` says why.  ``TURBOSPARK_KERNELS=off``
turns them off.
"""

from __future__ import annotations

import os

import mlx.core as mx

__all__ = ["MAX_FLOAT32_ROWS", "available", "describe", "huge_pages", "linear", "native", "quantized_linear", "supports_quantized"]

#: Up to this many rows a float32 product is ours; past it, MLX's BLAS GEMM is as fast or faster.
MAX_FLOAT32_ROWS = 16


def _load():
    if os.environ.get("TURBOSPARK_KERNELS", "").lower() in ("off", "0", "mlx"):
        return None, "turned off (TURBOSPARK_KERNELS)"
    try:
        from . import _native
    except ImportError as exc:
        return None, f"not built ({exc}); scripts/setup builds it"
    want = "{}.{}.{}".format(*divmod(_native.mlx_version // 100, 100), _native.mlx_version % 100)
    if want != mx.__version__:
        return None, f"built against MLX {want}, running MLX {mx.__version__}; scripts/setup rebuilds it"
    return _native, None


native, _why_not = _load()


def available() -> bool:
    """Whether the kernels can serve in this process."""
    return native is not None


def describe() -> str:
    """One line for the startup report: which kernels, or why none."""
    if native is None:
        return f"MLX's own ops (turbospark's CPU kernels: {_why_not})"
    return f"turbospark's CPU kernels ({native.isa()}, {native.threads()} threads)"


def supports_quantized(group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether a quantized layout is one the kernels read."""
    return mode == "affine" and bits in (4, 8) and group_size in (32, 64, 128)


def huge_pages(arrays: list[mx.array]) -> int:
    """Back evaluated arrays' memory with transparent huge pages where Linux allows (a weight
    matrix read once a step streams ~1.8x faster); the bytes that now are."""
    return native.huge_pages(arrays)


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """``x @ weight.T (+ bias)``; weight (N, K) in float32, bfloat16 or float16, K a multiple of 8."""
    return native.rows_matmul(x, weight, bias)


def quantized_linear(
    x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bias: mx.array | None = None,
    *, group_size: int, bits: int,
) -> mx.array:
    """``x @ dequantize(weight).T (+ bias)`` for MLX's affine layout (transposed)."""
    return native.rows_quantized_matmul(x, weight, scales, biases, bias, group_size=group_size, bits=bits)
