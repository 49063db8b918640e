"""The kernels as Python sees them: loading ``_native``, and the functions the model code calls.

See the package's docstring (``turbospark/kernels/__init__.py``) for what they are."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

__all__ = [
    "KV_BLOCKS", "KV_CACHES", "MAX_FLOAT32_ROWS", "available", "describe", "fast_ops_restored", "fast_ops_served",
    "huge_pages", "kv_blocks", "kv_cache", "kv_half", "kv_write", "linear", "logsumexp", "merged_attention",
    "mlx_own_ops", "native", "pack_quantized", "packs", "quantized_linear", "serve_fast_ops", "serves_float",
    "set_kv_cache", "set_kv_half", "split_heads", "supports_quantized", "x_in_8_bits",
]

#: Up to this many rows a float32 product is ours; past it, MLX's BLAS GEMM is as fast or faster.
MAX_FLOAT32_ROWS = 16


def serves_float(x: mx.array, weight: mx.array) -> bool:
    """Whether ``linear`` serves ``x @ weight.T`` better than MLX's own op: x in the weight's type
    (or float32 x beside float16 or bfloat16 weights: a GGUF's F16 matrices, kept so, in a model
    that computes in float32; the result float32, as MLX's promotion gives), and for float32
    weights only the few rows of a decode step (past them MLX's BLAS GEMM)."""
    if weight.dtype == mx.float32:
        return x.dtype == mx.float32 and x.size <= MAX_FLOAT32_ROWS * x.shape[-1]
    return x.dtype == weight.dtype or (x.dtype == mx.float32 and weight.dtype in (mx.float16, mx.bfloat16))


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
    isa = os.environ.get("TURBOSPARK_KERNELS_ISA", "")
    if isa and not _native.use_isa(isa):
        return None, f"TURBOSPARK_KERNELS_ISA={isa} is not one this CPU runs ({', '.join(_native.isas())})"
    return _native, None


native, _why_not = _load()


#: The KV cache types (``serve --kv-cache``), the arrays a cache in blocks of 32 is held in.
KV_CACHES = ("f16", "q8_0", "q4_0")
KV_BLOCKS = {"q8_0": mx.int8, "q4_0": mx.uint8}


def _kv_cache_by_default() -> str:
    want = os.environ.get("TURBOSPARK_KV_CACHE", "").lower()
    if want in ("float16", "f16", "half"):
        return "f16"
    if want in ("float32", "f32") or os.environ.get("TURBOSPARK_KERNELS_EXACT", "") not in ("", "0"):
        return "f32"
    return want if want in KV_BLOCKS else "f16"


_kv_cache = _kv_cache_by_default()


def kv_half() -> bool:
    """Whether the layers the kernels fuse (``mlx_blocks``) keep their KV caches in float16, as
    llama.cpp does by default: half the bytes to hold and for attention to read (decision
    0035), where they are not in blocks (``kv_blocks``).  Off with ``TURBOSPARK_KV_CACHE=float32``
    or ``TURBOSPARK_KERNELS_EXACT=1``."""
    return native is not None and _kv_cache != "f32"


def kv_blocks() -> mx.Dtype | None:
    """The array type of the fused layers' KV caches in blocks of 32 (llama.cpp's q8_0: int8,
    q4_0: uint8; ``serve --kv-cache``, ``TURBOSPARK_KV_CACHE``, decision 0047), None for float16
    (or float32) ones."""
    return KV_BLOCKS.get(_kv_cache) if native is not None else None


def kv_cache(asked: bool = False) -> str:
    """The fused layers' KV cache type: "f32", "f16", "q8_0" or "q4_0" (``asked``: the one set,
    whether or not the kernels are here to keep it)."""
    return _kv_cache if native is not None or asked else "f32"


def set_kv_cache(kind: str) -> None:
    """For caches made from now on (``serve --kv-cache``, tests); a cache keeps the type it was
    made in."""
    global _kv_cache
    if kind not in (*KV_CACHES, "f32"):
        raise ValueError(f"KV cache type {kind!r} is not one of {', '.join(KV_CACHES)}")
    _kv_cache = kind


def set_kv_half(on: bool) -> None:
    """For caches made from now on (tests); a cache keeps the type it was made in."""
    set_kv_cache("f16" if on else "f32")


def available() -> bool:
    """Whether the kernels can serve in this process."""
    return native is not None


def describe() -> str:
    """One line for the startup report: which kernels, or why none."""
    if native is None:
        return f"MLX's own ops (turbospark's CPU kernels: {_why_not})"
    x8 = ", x in 8 bits for 4- and 8-bit weights" if x_in_8_bits() else ""
    n, step = native.threads(), native.step_threads()
    threads = f"{n} thread{'' if n == 1 else 's'}" + (f", {step} in decode steps" if step != n else "")
    return f"turbospark's CPU kernels ({native.isa()}, {threads}{x8})"


def x_in_8_bits() -> bool:
    """Whether quantized products round x to 8 bits per 32 values (llama.cpp's Q8_0), as they do
    where the instruction set has integer dot products (AVX2) unless ``TURBOSPARK_KERNELS_EXACT=1``."""
    return native is not None and native.x_in_8_bits()


def supports_quantized(group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether a quantized layout is one the kernels read."""
    return mode == "affine" and bits in (4, 8) and group_size in (32, 64, 128)


def huge_pages(arrays: list[mx.array]) -> int:
    """Back evaluated arrays' memory with transparent huge pages where Linux allows (a weight
    matrix read once a step streams ~1.8x faster); the bytes that now are."""
    return native.huge_pages(arrays)


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None, *, residual: mx.array | None = None,
           swiglu: bool = False, geglu: bool = False, gelu: bool = False, norm: mx.array | None = None,
           eps: float = 0.0) -> mx.array:
    """``x @ weight.T (+ bias)``; weight (N, K) in float32, bfloat16 or float16, K a multiple of 8.
    Then ``residual + y`` (rounded as the two ops would), or, for a gate's and an up
    projection's rows one after the other, ``swiglu(y[..., :N/2], y[..., N/2:])``, or with
    ``geglu`` Gemma's ``gelu_approx(gate) * up`` (in float32, within a few units of the last place
    of MLX's ops, which round each step to x's type), or with ``gelu`` ``nn.gelu(y)`` (exact GELU,
    erf within 1.5e-7); with ``norm``, x is first ``rms_norm(x, norm, eps)`` (the same bits): one op."""
    return native.rows_matmul(x, weight, bias, residual=residual, swiglu=swiglu, geglu=geglu, gelu=gelu, norm=norm,
                              eps=eps)


def quantized_linear(
    x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bias: mx.array | None = None,
    *, group_size: int, bits: int, residual: mx.array | None = None, swiglu: bool = False, geglu: bool = False,
    gelu: bool = False, norm: mx.array | None = None, eps: float = 0.0, packed: bool = False,
) -> mx.array:
    """``x @ dequantize(weight).T (+ bias)`` for MLX's affine layout (transposed); ``residual``,
    ``swiglu``, ``geglu``, ``gelu`` and ``norm`` as in ``linear``; ``packed``: weights
    ``pack_quantized`` packed."""
    return native.rows_quantized_matmul(x, weight, scales, biases, bias, group_size=group_size, bits=bits,
                                        residual=residual, swiglu=swiglu, geglu=geglu, gelu=gelu, norm=norm, eps=eps,
                                        packed=packed)


def packs(rows: int, bits: int, group_size: int) -> bool:
    """Whether 4- or 8-bit weights of ``rows`` output rows are worth packing (``pack_quantized``):
    the instruction set in use reads them packed, eight rows a chunk (``TURBOSPARK_KERNELS_PACKED=0``
    keeps MLX's layout, for comparisons)."""
    return (native is not None and bits in (4, 8) and rows % 8 == 0 and group_size in (32, 64, 128)
            and native.reads_packed(bits) and os.environ.get("TURBOSPARK_KERNELS_PACKED", "").lower() not in ("0", "off"))


def pack_quantized(weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                   bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """4- or 8-bit weights packed eight output rows together (decision 0039): new arrays of the
    same shapes and bytes, in the layout the kernels' products read fastest.  Only
    ``quantized_linear(..., packed=True)`` reads them."""
    w, s, b = native.pack_quantized(weight, scales, biases, group_size, bits)
    return w, s, b


def split_heads(qkv: mx.array, heads: int, kv_heads: int) -> tuple[mx.array, mx.array, mx.array]:
    """A ``(B, L, (heads + 2 kv_heads) D)`` product of q, k and v as ``(B, H, L, D)`` q, k and v:
    views of its buffer, one op (in place of three reshapes and three transposes)."""
    q, k, v = native.split_heads(qkv, heads, kv_heads)
    return q, k, v


_MLX_FAST = {name: getattr(mx.fast, name) for name in ("rms_norm", "rope", "scaled_dot_product_attention")}
_MLX_LOGSUMEXP = mx.logsumexp
_FLOATS = (mx.float32, mx.bfloat16, mx.float16)
_thread = threading.local()  # ``mlx_own_ops`` on this thread


@contextmanager
def mlx_own_ops() -> Iterator[None]:
    """MLX's own ``mx.fast`` functions and ``mx.logsumexp`` on this thread for the duration,
    whether or not ``serve_fast_ops`` put the kernels' in place: what a comparison with MLX's own
    ops computes its reference with.  Other threads (a model thread serving) keep what they have."""
    before = getattr(_thread, "mlx_own", False)
    _thread.mlx_own = True
    try:
        yield
    finally:
        _thread.mlx_own = before


def _on_cpu(stream: object) -> bool:
    return stream is None and not getattr(_thread, "mlx_own", False) and mx.default_device() == mx.cpu


def _kv_fits(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Keys and values the kernels' attention reads for ``q``: of q's type, or under float32
    queries a float16 cache or one in blocks (read as it is, widened as it is read)."""
    return k.dtype == v.dtype and (k.dtype == q.dtype or (q.dtype == mx.float32 and (
        k.dtype == mx.float16 or (k.dtype in (mx.int8, mx.uint8) and q.shape[-1] % 32 == 0))))


def rms_norm(x: mx.array, weight: mx.array | None, eps: float, *, stream: object = None) -> mx.array:
    if _on_cpu(stream) and x.dtype in _FLOATS and (weight is None or weight.dtype in _FLOATS):
        return native.rms_norm(x, weight, eps)
    return _MLX_FAST["rms_norm"](x, weight, eps, stream=stream)


def rope(
    a: mx.array, dims: int, *, traditional: bool, base: float | None, scale: float, offset: int | mx.array,
    freqs: mx.array | None = None, stream: object = None,
) -> mx.array:
    if _on_cpu(stream) and a.dtype in _FLOATS and a.ndim >= 3:
        if not isinstance(offset, mx.array):
            offset = mx.array([offset], mx.int32)  # one dimension: no reshape op in the graph
        return native.rope(a, dims, traditional, base, scale, offset, freqs)
    return _MLX_FAST["rope"](a, dims, traditional=traditional, base=base, scale=scale, offset=offset,
                             freqs=freqs, stream=stream)


def attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: mx.array | str | None = None,
    sinks: mx.array | None = None, stream: object = None,
) -> mx.array:
    if _on_cpu(stream) and q.dtype in _FLOATS and _kv_fits(q, k, v):
        if mask is None or isinstance(mask, str) and mask == "causal":
            return native.attention(q, k, v, scale, mask or "", None, sinks)
        if isinstance(mask, mx.array) and (mask.dtype == mx.bool_ or mask.dtype == q.dtype):
            return native.attention(q, k, v, scale, "array", mask, sinks)
    return _MLX_FAST["scaled_dot_product_attention"](q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)


def kv_write(keys: mx.array, values: mx.array, k: mx.array, v: mx.array, at: int) -> tuple[mx.array, ...]:
    """A KV cache's ``keys[..., at:at + L, :] = k`` (and values'), in place where the buffers can
    be donated as MLX's slice update does, and its first ``at + L`` rows as views (slices), from
    one call: the new keys and values buffers and the two views.  Float32 rows go into a float16
    cache rounded as ``astype`` rounds them."""
    new_keys, new_values, k_view, v_view = native.kv_write(keys, values, k, v, at)
    return new_keys, new_values, k_view, v_view


def merged_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                     mask: mx.array | str | None = None) -> mx.array:
    """``attention``'s result as ``(B, L, H * D)``, the heads side by side as the output
    projection reads them (one op where the kernels take it, else MLX's with a transpose)."""
    if q.dtype in _FLOATS and _kv_fits(q, k, v) and mx.default_device() == mx.cpu:
        if mask is None or isinstance(mask, str) and mask == "causal":
            return native.attention(q, k, v, scale, mask or "", None, None, merged=True)
        if isinstance(mask, mx.array) and (mask.dtype == mx.bool_ or mask.dtype == q.dtype):
            return native.attention(q, k, v, scale, "array", mask, None, merged=True)
    out = _MLX_FAST["scaled_dot_product_attention"](q, k, v, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)


def logsumexp(a: mx.array, axis: int | list[int] | tuple[int, ...] | None = None, keepdims: bool = False, *,
              stream: object = None) -> mx.array:
    """``mx.logsumexp``, over the last axis of float32 ``a`` as one op with MLX's bits (its
    exp 8 values at a time: the engine's normalization of every step's logits); MLX's own
    otherwise."""
    last = a.ndim - 1 if isinstance(a, mx.array) else None
    if isinstance(axis, (list, tuple)) and len(axis) == 1:
        axis = axis[0]
    if (_on_cpu(stream) and last is not None and a.dtype == mx.float32 and a.ndim >= 1
            and (axis in (-1, last) or (axis is None and last == 0))):
        out = native.logsumexp(a)
        return out if keepdims else out.squeeze(-1)
    return _MLX_LOGSUMEXP(a, axis=axis, keepdims=keepdims, stream=stream)


_OURS_FAST = {"rms_norm": rms_norm, "rope": rope, "scaled_dot_product_attention": attention}


def serve_fast_ops() -> None:
    """Make ``mx.fast.rms_norm``, ``rope`` and ``scaled_dot_product_attention`` one op each on the
    CPU, and ``mx.logsumexp`` over a last axis, for every caller in this process (idempotent;
    inside ``fast_ops_restored`` for a while; ``mlx_own_ops`` for MLX's own on one thread).
    Needs the kernels."""
    for name, fn in _OURS_FAST.items():
        setattr(mx.fast, name, fn)
    mx.logsumexp = logsumexp


def fast_ops_served() -> bool:
    """Whether ``mx.fast``'s functions and ``mx.logsumexp`` are the kernels' now."""
    return mx.logsumexp is logsumexp or any(getattr(mx.fast, name) is fn for name, fn in _OURS_FAST.items())


@contextmanager
def fast_ops_restored() -> Iterator[None]:
    """After the block, ``mx.fast``'s functions and ``mx.logsumexp`` are again what they were
    before it, whatever ``serve_fast_ops`` did in it (MLX's own, unless the kernels' were in
    place already)."""
    before = {name: getattr(mx.fast, name) for name in _OURS_FAST}, mx.logsumexp
    try:
        yield
    finally:
        for name, fn in before[0].items():
            setattr(mx.fast, name, fn)
        mx.logsumexp = before[1]
