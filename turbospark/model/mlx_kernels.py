"""A loaded MLX model's matrix products through turbospark's CPU kernels (``turbospark.kernels``).

``install`` changes the class of each ``nn.Linear``, ``nn.QuantizedLinear`` and (for a tied
output head, ``as_linear``) ``nn.Embedding`` and ``nn.QuantizedEmbedding`` whose weights the
kernels read to a subclass that sends its product there, keeping the module's parameters as they
are, except that 4- and 8-bit weights are packed eight output rows together where the kernels
read them so (``_pack``, decision 0039): the same bytes, in the order their products read
fastest.  Float32 weights go to the kernels for the few rows of a decode step
(``MAX_FLOAT32_ROWS``) and to MLX's BLAS GEMM for a prompt chunk; bfloat16, float16 and 4- and
8-bit weights go to the kernels for any number of rows (MLX's own products for them are scalar on
x86).  Layers of other classes (a sharded model's, an adapter's) and layouts the kernels do not
read keep MLX's ops.

It also makes ``mx.fast``'s RMSNorm, RoPE and attention one op each on the CPU
(``kernels.serve_fast_ops``), for the rest of the process: what a server wants.  ``installed``
does the same for a ``with`` block and then puts MLX's own back, so that what runs after it
(a comparison's reference) is MLX's; ``kernels.mlx_own_ops`` gives MLX's own on one thread while
a model is served on another.

Only on the CPU: on a GPU, or where the kernels are not built, nothing changes and the line that
``install`` returns says so.

On the CPU, built or not, it also bounds the buffers MLX keeps for reuse once freed
(``CPU_CACHE_BYTES``): by default MLX keeps them all, and a server that holds KV caches of recent
prompts (the prefix cache) and grows others (a cache grows by copying) kept ~30 MB more at its
peak, for no speed a step measures (decision 0033).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..kernels import blocks
from ..kernels import ops as kernels
from . import mlx_blocks
from .mlx_ggml import PACKED, GgmlEmbedding, GgmlLinear, K6Embedding, PackedLinear, block_layers, trim

__all__ = ["CPU_CACHE_BYTES", "Linear", "QuantizedLinear", "install", "installed", "serves"]

#: Freed buffers MLX keeps for reuse on the CPU: a decode step's own (what it allocates is reused
#: by the next) fit; a freed KV cache does not, and goes back to the allocator.
CPU_CACHE_BYTES = 16 << 20


def _float_product(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array | None:
    """The kernels' product, or None where MLX's own op serves better (or alone)."""
    if not kernels.serves_float(x, weight):
        return None
    return kernels.linear(x, weight, bias)


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        y = _float_product(x, self["weight"], self.get("bias"))
        return super().__call__(x) if y is None else y


class _Embedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        y = _float_product(x, self["weight"], None)
        return super().as_linear(x) if y is None else y


def _quantized(module: Any, x: mx.array, bias: mx.array | None) -> mx.array:
    return kernels.quantized_linear(
        x, module["weight"], module["scales"], module["biases"], bias,
        group_size=module.group_size, bits=module.bits, packed=getattr(module, "_turbospark_packed", False),
    )


class QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        return _quantized(self, x, self.get("bias"))


def _packed_rows(arrays: list[mx.array], ids: mx.array) -> list[mx.array]:
    """Rows ``ids`` of matrices packed eight rows together (``kernels.pack_quantized``: chunk
    ``i // 8`` holds its rows' columns side by side, lane ``i % 8``), in MLX's layout."""
    chunks, lanes = ids // 8, (ids % 8)[..., None, None]  # the lanes broadcast over the columns
    return [mx.take_along_axis(a.reshape(a.shape[0] // 8, a.shape[1], 8)[chunks], lanes, axis=-1).squeeze(-1)
            for a in arrays]


class _QuantizedEmbedding(nn.QuantizedEmbedding):
    def __call__(self, x: mx.array) -> mx.array:
        if not getattr(self, "_turbospark_packed", False):
            return super().__call__(x)
        w, scales, biases = _packed_rows([self["weight"], self["scales"], self["biases"]], x)
        return mx.dequantize(w, scales=scales, biases=biases, group_size=self.group_size, bits=self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return _quantized(self, x, None)


def _pack(module: Any) -> None:
    """A quantized layer's weights packed eight output rows together where the kernels read them
    so (``kernels.pack_quantized``, decision 0039): its product reads them packed, and a tied
    embedding picks its rows out of the chunks (``_packed_rows``)."""
    if module.get("biases") is None or not kernels.packs(module["weight"].shape[0], module.bits, module.group_size):
        return
    packed = kernels.pack_quantized(module["weight"], module["scales"], module["biases"], module.group_size, module.bits)
    module["weight"], module["scales"], module["biases"] = packed
    module._turbospark_packed = True


def _readable(module: Any) -> bool:
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return (kernels.supports_quantized(module.group_size, module.bits, getattr(module, "mode", "affine"))
                and module.get("biases") is not None)
    weight = module["weight"]
    return weight.dtype in (mx.float32, mx.bfloat16, mx.float16) and weight.shape[-1] % 8 == 0


_OURS = {nn.Linear: Linear, nn.Embedding: _Embedding,
         nn.QuantizedLinear: QuantizedLinear, nn.QuantizedEmbedding: _QuantizedEmbedding}


def install(model: nn.Module) -> str:
    """Send ``model``'s matrix products through the kernels where they serve; a line saying
    which kernels serve it (for the startup report)."""
    if mx.default_device().type != mx.cpu:
        return "MLX's own ops (on the GPU)"
    mx.set_cache_limit(CPU_CACHE_BYTES)
    if not kernels.available():
        return kernels.describe()
    kernels.serve_fast_ops()
    ours = linear = 0
    head = False  # a tied output head (the embedding's as_linear) went to the kernels
    for _, module in model.named_modules():
        if isinstance(module, (GgmlLinear, GgmlEmbedding, PackedLinear, K6Embedding)):  # GGUF blocks: ours already
            table = isinstance(module, (GgmlEmbedding, K6Embedding))
            linear += not table
            ours += not table
            head = head or table
            continue
        cls = _OURS.get(type(module))
        if cls is None:
            continue
        is_linear = isinstance(module, (nn.Linear, nn.QuantizedLinear))
        linear += is_linear
        if _readable(module):
            module.__class__ = cls
            ours += is_linear
            head = head or not is_linear
    # a tied head: the args say so (llama, qwen), or the model itself once it loaded without one (gemma 3)
    tied = head and (getattr(getattr(model, "args", None), "tie_word_embeddings", False)
                     or getattr(model, "tie_word_embeddings", False) is True)
    for _, module in model.named_modules():
        if type(module) is QuantizedLinear or (tied and type(module) is _QuantizedEmbedding):
            _pack(module)
    fused, layers = mlx_blocks.fuse(model, (Linear, QuantizedLinear, GgmlLinear, PackedLinear))
    trim()  # the copies fusing freed, back to the system
    packed = sum(getattr(m, "_turbospark_packed", False) for _, m in model.named_modules())
    huge = kernels.huge_pages([a for _, a in tree_flatten(model.parameters())])
    return (f"{kernels.describe()}: {ours} of {linear} linear layers" + (" and the tied output head" if tied else "")
            + f", RMSNorm, RoPE and attention; {fused} of {layers} decoder layers fused"
            + (f", their KV cache in {_KV_NAMES[kernels.kv_cache()]}" if mlx_blocks.half_kv(model) else "")
            + (f"; {packed} of {ours + tied} products' weights packed" if packed else "")
            + _blocks_line(model)
            + f"; weights in huge pages: {huge >> 20} MiB")


_KV_NAMES = {"f16": "float16", "q8_0": "q8_0 blocks (float16 in sliding windows)",
             "q4_0": "q4_0 blocks (float16 in sliding windows)"}


def _blocks_line(model: nn.Module) -> str:
    """What reads the model's GGUF block tensors (``mlx_ggml``), by type, and where ggml is not
    here, that its types were widened and why."""
    counts = block_layers(model)
    packed = ", ".join(f"{counts.pop(f'{t} packed')} {t}" for t in PACKED if f"{t} packed" in counts)
    each = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
    ggml = f"; {blocks.describe()}" if not blocks.available() else \
        f"; GGUF blocks read by ggml ({blocks.variant()}): {each}" if each else ""
    return (f"; GGUF blocks packed for the kernels: {packed}" if packed else "") + ggml


@contextmanager
def installed(model: nn.Module) -> Iterator[str]:
    """``install(model)`` for a ``with`` block, yielding its line: afterwards ``mx.fast``'s
    functions and ``mx.logsumexp`` are what they were before (the model's own layers keep the
    kernels' products)."""
    with kernels.fast_ops_restored():
        yield install(model)


def serves(model: nn.Module) -> bool:
    """Whether ``install`` sent any of ``model``'s matrix products to the kernels."""
    return any(isinstance(m, (Linear, QuantizedLinear)) for _, m in model.named_modules())

