"""Linear layers that keep their weights narrow and compute in float32, for the CPU.

MLX's CPU products are BLAS's in float32 only: a bfloat16 product there runs some 35 times slower
(4.3 against 160 GFLOP/s for a 1024x3840 by 3840x3840 product on two cores).  A pipeline too big to
hold in float32 (Z-Image-Turbo's 6B transformer and 4B text encoder, stored in bfloat16) keeps its
weights in bfloat16 and widens each one as its product runs: the memory of the narrow type and
float32's products, for a conversion of every weight each forward pass (MLX's x86 build converts
without SIMD: at Z-Image's widths on two cores about 0.7 s a layer, as much as the layer's
products at 256x256; docs/performance.md#images).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

__all__ = ["WideLinear", "compute_dtype", "widen"]


class WideLinear(nn.Module):
    """``nn.Linear``'s weights, in their own dtype; the product in float32."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        x = x.astype(mx.float32)
        w = self.weight.astype(mx.float32)
        if "bias" in self:
            return mx.addmm(self.bias.astype(mx.float32), x, w.T)
        return x @ w.T


def widen(model: nn.Module) -> int:
    """Swap each of ``model``'s ``nn.Linear`` layers whose weights are not float32 for a
    ``WideLinear``; how many were swapped."""
    swapped = 0

    def swap(module: nn.Module) -> nn.Module:
        nonlocal swapped
        if isinstance(module, nn.Linear) and module.weight.dtype != mx.float32:
            swapped += 1
            return WideLinear(module)
        return module

    model.update_modules(tree_map(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return swapped


def compute_dtype(linear: nn.Module) -> mx.Dtype:
    """The dtype ``linear`` computes in: float32 for a ``WideLinear``, else its weights'."""
    return mx.float32 if isinstance(linear, WideLinear) else linear.weight.dtype
