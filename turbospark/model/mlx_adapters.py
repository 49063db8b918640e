"""LoRA and DoRA adapters beside a model's layers, chosen row by row in one batch (decision 0046).

``attach`` puts every adapter of a model (an ``Adapter``, read by ``store/adapter_files.py``)
beside the products it touches, never into their weights: the base products run once for every row of a step, and each
product an adapter touches adds, for all adapters together,

    delta = ((x @ A) * S) @ B

where ``A`` is every adapter's ``lora_a`` side by side (its input x every adapter's rank, a
product of several modules, a fused layer's q|k|v, the same for each), ``B`` their ``lora_b``
times their scale, block-diagonal, and ``S`` each row's scale for each adapter (0 where a row
does not use it).  DoRA's magnitude rescales a row's output where it uses that adapter:
``(y - bias + delta) * (m / |W + s B^T A^T|) + bias``, as mlx-lm's ``DoRALinear``.

A fused layer (``mlx_blocks``) adds the deltas of its joined products itself (``LayerLora``); a
module of an unfused layer changes class to one that adds its own after its product.  Which
adapter a row uses is the ``Route``'s: the model thread sets each sequence's scales by its
engine id (``scales``), and mlx-lm's batches (``GenerationBatch._step``,
``PromptProcessingBatch.prompt``) put their rows' scales in place for the model calls they make
(``rows``).  With no row using an adapter, nothing is added and every step runs as before.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
from mlx_lm.models.activations import swiglu

__all__ = ["Adapter", "AdapterError", "LayerLora", "Route", "attach", "lora_of", "marked"]


class AdapterError(ValueError):
    """An adapter that cannot be read, or is not for the model it is given to."""


@attrs.frozen(eq=False)
class Adapter:
    """A LoRA or DoRA adapter (``store/adapter_files.py`` reads them): for each module path it
    adapts, ``(lora_a (in, rank), lora_b (rank, out) times its scale, DoRA's m or None)``."""

    name: str
    kind: str  # "lora" or "dora"
    layers: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]
    digest: str  # of its weights: what the prefix cache's entries made with it are marked by


class Route:
    """A model's adapters and, for the model call being made, each row's scale for each."""

    def __init__(self, adapters: Sequence[Adapter]) -> None:
        self.adapters = list(adapters)
        self.dora = np.array([a.kind == "dora" for a in self.adapters], np.float32)
        self.scales: dict[int, np.ndarray] = {}  # engine uid -> scale per adapter
        self.current: mx.array | None = None  # (rows, adapters), while a call's rows use one
        self.only: int | None = None  # the one adapter every row uses, at scale 1 (``_Delta``'s short way)
        self.doras: mx.array | None = None  # (rows, adapters): 1 where a row uses a DoRA adapter
        self._columns: dict[tuple[int, int], mx.array] = {}

    def use(self, uid: int, adapters: Sequence[tuple[int, float]]) -> None:
        scales = np.zeros(len(self.adapters), np.float32)
        for index, scale in adapters:
            scales[index] += scale
        if scales.any():
            self.scales[uid] = scales

    def drop(self, uid: int) -> None:
        self.scales.pop(uid, None)

    @property
    def active(self) -> bool:
        """Whether a running sequence uses an adapter."""
        return bool(self.scales)

    @contextmanager
    def rows(self, uids: Sequence[int]) -> Iterator[None]:
        """Each of ``uids``'s scales in place for the model calls made meanwhile."""
        rows = [self.scales.get(uid) for uid in uids]
        if all(r is None for r in rows):
            yield
            return
        scales = np.stack([r if r is not None else np.zeros(len(self.adapters), np.float32) for r in rows])
        self.current = mx.array(scales)
        ones = np.flatnonzero(scales[0])
        if len(ones) == 1 and scales[0, ones[0]] == 1.0 and (scales == scales[0]).all():
            self.only = int(ones[0])
        self.doras = mx.array((scales != 0) * self.dora) if self.dora.any() else None
        self._columns.clear()
        try:
            yield
        finally:
            self.current = self.doras = self.only = None
            self._columns.clear()

    def columns(self, modules: int, rank: int) -> mx.array:
        """The rows' scales for ``A``'s columns: ``modules`` blocks of every adapter's ``rank``."""
        key = (modules, rank)
        if key not in self._columns:
            assert self.current is not None
            each = mx.repeat(self.current, rank, axis=1)
            self._columns[key] = mx.tile(each, (1, modules)) if modules > 1 else each
        return self._columns[key]


class _Delta:
    """What every adapter adds to one product (one module, or a fused layer's joined ones)."""

    def __init__(self, route: Route, modules: list[tuple[str, nn.Module]], ins: int) -> None:
        self.route = route
        try:
            outs = [_outputs(m, ins) for _, m in modules]
        except (ValueError, RuntimeError):  # its lora_a is not this module's input width
            names = ", ".join(a.name for a in route.adapters if any(p in a.layers for p, _ in modules))
            raise AdapterError(f"adapter {names}: {modules[0][0]} does not take {ins} inputs in this model") from None
        touched = [[a.layers.get(path) for a in route.adapters] for path, _ in modules]
        self.rank = max(t[0].shape[1] for ts in touched for t in ts if t is not None)
        K, R, M = len(route.adapters), self.rank, len(modules)
        A = np.zeros((ins, M * K * R), np.float32)
        B = np.zeros((M * K * R, sum(outs)), np.float32)
        G = np.zeros((K, sum(outs)), np.float32) if route.dora.any() else None
        bias = np.concatenate([_bias(m, o) for (_, m), o in zip(modules, outs, strict=True)])
        start = 0
        for i, ((path, module), out, ts) in enumerate(zip(modules, outs, touched, strict=True)):
            for k, t in enumerate(ts):
                if t is None:
                    continue
                a, b, m = t
                if a.shape[0] != ins or b.shape[1] != out:
                    raise AdapterError(f"adapter {route.adapters[k].name}: {path} is {ins} -> {out} in this model, "
                                       f"{a.shape[0]} -> {b.shape[1]} in the adapter")
                col = (i * K + k) * R
                A[:, col: col + a.shape[1]] = a
                B[col: col + a.shape[1], start: start + out] = b
                if m is not None and G is not None:
                    G[k, start: start + out] = m / _norms(module, ins, a, b, bias[start: start + out]) - 1.0
            start += out
        self.modules, self.A, self.B = M, mx.array(A), mx.array(B)
        self.G = mx.array(G) if G is not None and G.any() else None
        self.bias = mx.array(bias) if self.G is not None and bias.any() else None
        # each adapter's own columns of A and rows of B (None where it touches none of these
        # modules): a batch whose rows all use one adapter at scale 1 takes two products
        cols = [np.concatenate([np.arange((i * K + k) * R, (i * K + k + 1) * R) for i in range(M)]) for k in range(K)]
        self.each = [(mx.array(A[:, c]), mx.array(B[c])) if B[c].any() else None for c in cols]

    def __call__(self, y: mx.array, x: mx.array) -> mx.array:
        """``y``, the product of ``x`` (its bias in it), with the rows' adapters."""
        only = self.route.only
        if only is not None and (self.G is None or self.route.doras is None):
            if self.each[only] is None:
                return y
            a, b = self.each[only]
            t = x @ a
            return mx.addmm(y, t, b) if t.dtype == y.dtype else y + (t @ b).astype(y.dtype)
        t = (x @ self.A) * self.route.columns(self.modules, self.rank)[:, None, :]
        if self.G is None or self.route.doras is None:
            return mx.addmm(y, t, self.B) if t.dtype == y.dtype else y + (t @ self.B).astype(y.dtype)
        d = t @ self.B
        factor = 1.0 + (self.route.doras @ self.G)[:, None, :]
        base = y if self.bias is None else y - self.bias
        out = (base + d) * factor
        return (out if self.bias is None else out + self.bias).astype(y.dtype)


def _outputs(module: nn.Module, ins: int) -> int:
    return int(module(mx.zeros((1, 1, ins), mx.float32)).shape[-1])


def _bias(module: nn.Module, out: int) -> np.ndarray:
    bias = module.get("bias") if isinstance(module, dict) else None
    return np.zeros(out, np.float32) if bias is None else np.array(bias.astype(mx.float32))


def _norms(module: nn.Module, ins: int, a: np.ndarray, b: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """|W + s B^T A^T| for each output (DoRA's denominator), W read back through the module's own
    product (a quantized or GGUF block layer's too): 256 unit rows at a time."""
    sums = np.zeros(b.shape[1], np.float64)
    for start in range(0, ins, 256):
        rows = min(256, ins - start)
        eye = np.zeros((rows, ins), np.float32)
        eye[np.arange(rows), start + np.arange(rows)] = 1.0
        w = np.array(module(mx.array(eye)[None]).astype(mx.float32))[0] - bias  # rows of W^T
        sums += ((w + a[start: start + 256] @ b) ** 2).sum(axis=0)
    return np.sqrt(sums).astype(np.float32)


class LayerLora:
    """A fused layer's adapters: one ``_Delta`` for each joined product they touch."""

    def __init__(self, route: Route, deltas: dict[str, _Delta | None]) -> None:
        self.route = route
        self.qkv, self.o, self.gate_up, self.down = (deltas.get(n) for n in ("qkv", "o", "gate_up", "down"))

    def live(self) -> LayerLora | None:
        """Itself while the call's rows use an adapter."""
        return self if self.route.current is not None else None

    def add(self, name: str, y: mx.array, x: mx.array) -> mx.array:
        delta = getattr(self, name)
        return y if delta is None else delta(y, x)

    def gated(self, gate_up: Any, h: mx.array, norm: Any, geglu: bool = False) -> mx.array:
        """The MLP's gate|up product of ``h`` with the adapters, then its SwiGLU (or GeGLU)."""
        y = gate_up(h, norm=norm)
        y = self.add("gate_up", y, norm(h))
        gate, up = mx.split(y, 2, axis=-1)
        return nn.gelu_approx(gate) * up if geglu else swiglu(gate, up)


def lora_of(block: Any) -> LayerLora | None:
    """A fused layer's adapters, while the call's rows use one."""
    lora = getattr(block, "_turbospark_lora", None)
    return None if lora is None else lora.live()


def _adapted(cls: type) -> type:
    def __call__(self: Any, x: mx.array) -> mx.array:
        y = cls.__call__(self, x)
        delta = self._turbospark_delta
        return y if delta.route.current is None else delta(y, x)

    return type(f"Adapted{cls.__name__}", (cls,), {"__call__": __call__, "__module__": __name__})


def _ins(adapters: Sequence[Adapter], paths: list[str]) -> int:
    return next(a.layers[p][0].shape[0] for p in paths for a in adapters if p in a.layers)


def _groups(block: Any, prefix: str) -> dict[str, list[tuple[str, nn.Module]]]:
    """A fused layer's joined products, each as its modules' paths and modules."""
    parts = block._turbospark_parts
    named = {id(m): f"{prefix}.{n}" for n, m in block.named_modules()}

    def modules(product: Any) -> list[tuple[str, nn.Module]]:
        weights = product.products if hasattr(product, "products") else [product]
        return [(named[id(m)], m) for w in weights for m in w.modules]

    return {"qkv": modules(parts.qkv), "o": modules(parts.o), "gate_up": modules(parts.gate_up),
            "down": modules(parts.down)}


def attach(model: nn.Module, adapters: Sequence[Adapter]) -> Route | None:
    """``adapters`` beside ``model``'s layers (after the kernels fused them, ``mlx_kernels``);
    the route the model thread sets rows by, or None without adapters.

    Raises:
        AdapterError: an adapter touches a module this model does not have, or of another shape.
    """
    if not adapters:
        return None
    route = Route(adapters)
    modules = dict(model.named_modules())
    wanted = {path for a in adapters for path in a.layers}
    for a in adapters:
        if missing := sorted(p for p in a.layers if not isinstance(modules.get(p), (nn.Linear, nn.QuantizedLinear))
                             and not hasattr(modules.get(p), "in_features")):
            raise AdapterError(f"adapter {a.name} is not for this model: it adapts {missing[0]}, which this model "
                               "has not (or not as a linear layer)")
    done: set[str] = set()
    for i, block in enumerate(getattr(getattr(model, "model", None), "layers", None) or []):
        if not hasattr(block, "_turbospark_parts"):
            continue
        deltas: dict[str, _Delta | None] = {}
        for name, group in _groups(block, f"model.layers.{i}").items():
            paths = [p for p, _ in group]
            if wanted.intersection(paths):
                deltas[name] = _Delta(route, group, _ins(adapters, paths))
                done.update(paths)
        if any(deltas.values()):
            block._turbospark_lora = LayerLora(route, deltas)
    for path in sorted(wanted - done):
        module = modules[path]
        module._turbospark_delta = _Delta(route, [(path, module)], _ins(adapters, [path]))
        module.__class__ = _adapted(type(module))
    model._turbospark_route = route
    return route


def marked(prompt: list[int], chosen: Sequence[tuple[int, float]], adapters: Sequence[Adapter]) -> list[int]:
    """``prompt`` as the prefix cache knows it for a row using ``chosen`` adapters (index, scale):
    its first token marked by them (below any image's mark, above Qwen2-VL's shifts:
    ``mlx_vision``), so only a row with the same adapters at the same scales reuses its KV; the
    prompt itself where it uses none."""
    if not chosen or not prompt:
        return prompt
    tag = int.from_bytes(hashlib.sha256(repr(sorted((adapters[i].digest, s) for i, s in chosen)).encode()).digest()[:4]) >> 4
    return [-(1 << 61) - (tag << 32) - prompt[0], *prompt[1:]]


def _routed(method: Any) -> Any:
    """A batch's method that calls the model with its rows' adapters in place."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        route = getattr(self.model, "_turbospark_route", None)
        if route is None or not route.active:
            return method(self, *args, **kwargs)
        with route.rows(self.uids):
            return method(self, *args, **kwargs)

    call._turbospark_routed = True
    return call


if not getattr(GenerationBatch._step, "_turbospark_routed", False):
    GenerationBatch._step = _routed(GenerationBatch._step)
    PromptProcessingBatch.prompt = _routed(PromptProcessingBatch.prompt)
