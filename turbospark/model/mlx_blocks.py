"""A decoder layer of mlx-lm's llama, qwen2, qwen3 and phi3 stacks in 12 ops on the CPU kernels, not 29;
gemma2's and gemma3's in about 20, not 50.

mlx-lm's layer is ~29 ops on the CPU even with the kernels' products, RMSNorm, RoPE and
attention (``mlx_kernels``): seven products, six reshapes and four transposes, the SwiGLU and
two residual adds.  Each costs MLX ~3-6 us to dispatch and Python ~1-2 us to build, a step's
fixed cost beside its products.  ``fuse`` changes the class of each such layer to one that
computes the same thing in 12 (13 with a batch cache, whose offsets move by an add):

    norm and q|k|v product -> split heads (views) -> RoPE q, RoPE k -> the cache's writes (in
    place) and reads (views) -> attention, heads side by side -> o product + residual
    -> norm and gate|up product with SwiGLU -> down product + residual

q, k and v's weights become one matrix (rows one after the other), and so do gate's and up's:
x is read and rounded to 8 bits once for each, and the layer's modules keep their weights as
views of those matrices (no byte is held twice).  The two norms run inside the products that
read them, and the residual adds and the SwiGLU after them, each rounding where the separate
ops round (``kernels.linear``), so the layer's arithmetic is the unfused one's (decision 0033).

Phi-3's q|k|v and gate|up are one matrix each already (``qkv_proj``, ``gate_up_proj``): its
layer is llama's.  Gemma 2 and 3 (``_gemma_call``) norm each product's output too, take their
norms' weights as 1 + weight and gate with GELU: the input norms run inside the products, the
output norms and residual adds after them, the GELU on the joined gate|up's halves; Gemma 2's
soft-capped attention is its own ops on the split heads, Gemma 3's (QK-norm, sliding windows)
the kernels' attention.  A sliding window's rotating cache is written by mlx-lm's own method, in
float16 where the fused layers' caches are.

Anything the kernels do not take goes the module's own way: a quantized KV cache, layers of
other classes (an adapter's, a sharded model's), another architecture.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from ..kernels import blocks
from ..kernels import ops as kernels
from .mlx_adapters import lora_of
from .mlx_ggml import packed_product, trim
from .mlx_kv import kv_update

__all__ = ["fuse", "half_kv"]

_GEMMA = {"mlx_lm.models.gemma2", "mlx_lm.models.gemma3_text"}
_LAYOUTS = {"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3", "mlx_lm.models.phi3", *_GEMMA}
_NORMS = {False: ("input_layernorm", "post_attention_layernorm"),
          True: ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")}


#: Weights are copied into buffers of about this size (a few layers each): one span of memory that
#: Linux can back with huge pages, and no more than this held twice while a model is fused.
_BUFFER_BYTES = 64 << 20


class _Weights:
    """The weights of one product, held outside the module tree (not among ``parameters()``:
    the modules hold the same buffers as views)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        first = modules[0]
        self.modules = modules
        self.quantized = isinstance(first, nn.QuantizedLinear)
        self.group_size, self.bits = getattr(first, "group_size", 0), getattr(first, "bits", 0)
        self.names = [n for n in ("weight", "scales", "biases", "highs", "fields", "bias") if n in first]
        self.weight = self.scales = self.biases = self.highs = self.fields = self.bias = None
        self.packed_kind = getattr(first, "packed_kind", None)  # GGUF blocks packed (``mlx_ggml.PackedLinear``)
        self.packed = getattr(first, "_turbospark_packed", False)  # each module's part is packed: so is the whole
        self.ggml_type = getattr(first, "ggml_type", None)  # GGUF blocks (``mlx_ggml.GgmlLinear``)
        self.in_features = getattr(first, "in_features", 0)

    def place(self, flats: dict[Any, mx.array], at: dict[Any, int]) -> None:
        """Takes this product's matrices from the buffers ``flats`` (by type, ``at`` the next
        element of each): the joined matrix and each module's part are views of it."""
        for name in self.names:
            pieces = [m[name] for m in self.modules]
            flat, start = flats[pieces[0].dtype], at[pieces[0].dtype]
            rows, size = sum(p.shape[0] for p in pieces), sum(p.size for p in pieces)
            setattr(self, name, flat[start:start + size].reshape(rows, *pieces[0].shape[1:]))
            for m, piece in zip(self.modules, pieces, strict=True):
                m[name] = flat[start:start + piece.size].reshape(piece.shape)
                start += piece.size
            at[pieces[0].dtype] = start

    def __call__(self, x: mx.array, *, residual: mx.array | None = None, swiglu_halves: bool = False,
                 geglu_halves: bool = False, norm: nn.RMSNorm | None = None) -> mx.array:
        """The product, after ``norm`` (a layer's RMSNorm: in the same op where the kernels take
        x, with the same bits as the norm's own op)."""
        weight = None if norm is None else norm.weight_for(x.dtype) if isinstance(norm, _OnePlus) else norm.weight
        if weight is not None and weight.dtype != x.dtype:  # not the prologue's case: the norm's own op
            x, norm, weight = norm(x), None, None
        eps = norm.eps if norm is not None else 0.0
        if self.packed_kind is not None:
            return packed_product(x, self.packed_kind, self.weight, self.highs, self.fields, self.bias,
                                  residual=residual, swiglu=swiglu_halves, geglu=geglu_halves, norm=weight, eps=eps)
        if self.ggml_type is not None:
            return blocks.linear(x, self.weight, self.ggml_type, self.in_features, self.bias, residual=residual,
                                 swiglu=swiglu_halves, geglu=geglu_halves, norm=weight, eps=eps)
        if self.quantized:
            return kernels.quantized_linear(x, self.weight, self.scales, self.biases, self.bias,
                                            group_size=self.group_size, bits=self.bits, packed=self.packed,
                                            residual=residual, swiglu=swiglu_halves, geglu=geglu_halves,
                                            norm=weight, eps=eps)
        if kernels.serves_float(x, self.weight):
            return kernels.linear(x, self.weight, self.bias, residual=residual, swiglu=swiglu_halves,
                                  geglu=geglu_halves, norm=weight, eps=eps)
        if norm is not None:
            x = norm(x)
        y = x @ self.weight.T if self.bias is None else mx.addmm(self.bias, x, self.weight.T)
        if swiglu_halves or geglu_halves:
            gate, up = mx.split(y, 2, axis=-1)
            return swiglu(gate, up) if swiglu_halves else nn.gelu_approx(gate) * up
        return y if residual is None else residual + y


def _into_buffers(products: list[_Weights]) -> None:
    """Copies the products' weights into buffers of about ``_BUFFER_BYTES`` (one a type), in
    order, each product's modules one after the other; the old arrays are then freed."""
    batch: list[_Weights] = []
    size = 0
    for i, product in enumerate(products):
        batch.append(product)
        size += sum(m[n].nbytes for n in product.names for m in product.modules)
        if size < _BUFFER_BYTES and i + 1 < len(products):
            continue
        by_type: dict[Any, list[mx.array]] = {}
        for p in batch:
            for name in p.names:
                for m in p.modules:
                    by_type.setdefault(m[name].dtype, []).append(m[name].reshape(-1))
        flats = {dtype: mx.concatenate(parts) for dtype, parts in by_type.items()}
        mx.eval(list(flats.values()))
        at = dict.fromkeys(flats, 0)
        for p in batch:
            p.place(flats, at)
        mx.eval([m.parameters() for p in batch for m in p.modules], [getattr(p, n) for p in batch for n in p.names])
        batch, size = [], 0
        del flats
        trim()  # the old arrays' memory back to the system: a model is never held twice


class _Side:
    """Products of different kinds (a GGUF file's q and k in Q4_K, its v in Q6_K) side by side:
    x normalized once, each product alone, their outputs joined (what one joined product gives)."""

    def __init__(self, products: list[_Weights]) -> None:
        self.products = products

    def __call__(self, x: mx.array, *, norm: nn.RMSNorm | None = None, swiglu_halves: bool = False) -> mx.array:
        if norm is not None:
            x = norm(x)
        ys = [p(x) for p in self.products]
        return swiglu(*ys) if swiglu_halves else mx.concatenate(ys, axis=-1)

    def halves(self, x: mx.array, norm: Any) -> list[mx.array]:
        """Gate's and up's outputs apart (Gemma's GELU takes them so)."""
        x = norm(x)
        return [p(x) for p in self.products]


class _OnePlus:
    """A Gemma RMSNorm, its weight ``1.0 + weight`` taken once, in the type its own op computes
    in for x's type (the kernels' norm casts both to their result type each call: the same
    bits): one op, and one a products' prologue reads where that type is x's (``_Weights``)."""

    def __init__(self, norm: Any) -> None:
        self.norm, self.eps = norm, norm.eps
        self._weights: dict[Any, mx.array] = {}

    def weight_for(self, dtype: Any) -> mx.array:
        weight = self._weights.get(dtype)
        if weight is None:
            one_plus = 1.0 + self.norm.weight
            weight = self._weights[dtype] = one_plus.astype((mx.zeros((), dtype) + one_plus[:1]).dtype)
            mx.eval(weight)
        return weight

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight_for(x.dtype), self.eps)


class _Parts:
    """A fused layer's joined products and its two others (a plain object: no parameters)."""

    def __init__(self, block: Any, ours: tuple[type, ...]) -> None:
        attn, mlp = block.self_attn, block.mlp
        qkv, gate_up = _qkv(attn), _gate_up(mlp)
        self.qkv = _Weights(qkv) if _same_kind(qkv, ours) else _Side([_Weights([m]) for m in qkv])
        self.o = _Weights([attn.o_proj])
        self.gate_up = _Weights(gate_up) if _same_kind(gate_up, ours) else _Side([_Weights([m]) for m in gate_up])
        self.down = _Weights([mlp.down_proj])
        self.qk_norm = hasattr(attn, "q_norm")
        # the norms the attention half reads (``_heads``): a Gemma layer's are ``_OnePlus`` below
        self.input_norm = block.input_layernorm
        self.q_norm, self.k_norm = (attn.q_norm, attn.k_norm) if self.qk_norm else (None, None)
        # where the joined q, k and v product splits into q, k and v (``mlx_fused``)
        dim = sum(m["weight"].shape[0] for m in qkv) // (attn.n_heads + 2 * attn.n_kv_heads)
        self.qkv_splits = [attn.n_heads * dim, (attn.n_heads + attn.n_kv_heads) * dim]
        module = sys.modules[_unwrapped(type(block)).__module__]
        if module.__name__ in _GEMMA:
            self.norms = {n: _OnePlus(block[n]) for n in _NORMS[True]}
            self.input_norm = self.norms["input_layernorm"]
            self.q_norm, self.k_norm = (_OnePlus(attn.q_norm), _OnePlus(attn.k_norm)) if self.qk_norm else (None, None)
            self.residual = getattr(module, "clip_residual", mx.add)  # gemma3's clips float16's sums
            self.softcap = getattr(attn, "attn_logit_softcapping", None)  # gemma2's attention

    def products(self) -> list[_Weights]:
        return [w for p in (self.qkv, self.o, self.gate_up, self.down)
                for w in (p.products if isinstance(p, _Side) else [p])]


def _heads(attn: Any, parts: _Parts, x: mx.array, cache: Any, lora: Any = None) -> tuple[mx.array, mx.array, mx.array]:
    """A fused layer's q, k and v for attention: the input norm and the q|k|v product (with the
    rows' adapters, ``lora``: ``mlx_adapters``), the heads split (views), QK-norm where the layer
    has it, RoPE, and the cache written and read."""
    qkv = parts.qkv(x, norm=parts.input_norm)
    if lora is not None and lora.qkv is not None:
        qkv = lora.qkv(qkv, parts.input_norm(x))
    q, k, v = kernels.split_heads(qkv, attn.n_heads, attn.n_kv_heads)
    if parts.qk_norm:
        q, k = parts.q_norm(q), parts.k_norm(k)
    if cache is None:
        return attn.rope(q), attn.rope(k), v
    q, k = attn.rope(q, offset=cache.offset), attn.rope(k, offset=cache.offset)
    k, v = kv_update(cache, k, v, blocks=getattr(parts, "softcap", None) is None)  # Gemma 2's reads floats
    return q, k, v


def _call(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    parts: _Parts = self._turbospark_parts
    if hasattr(cache, "bits") or x.ndim != 3:  # a quantized KV cache: the layer's own ops
        return self._turbospark_plain(x, mask, cache)
    attn, lora = self.self_attn, lora_of(self)
    q, k, v = _heads(attn, parts, x, cache, lora)
    attended = kernels.merged_attention(q, k, v, scale=attn.scale, mask=mask)
    if lora is not None:  # the rows' adapters after each product
        h = x + lora.add("o", parts.o(attended), attended)
        gated = lora.gated(parts.gate_up, h, self.post_attention_layernorm)
        return h + lora.add("down", parts.down(gated), gated)
    h = parts.o(attended, residual=x)
    return parts.down(parts.gate_up(h, swiglu_halves=True, norm=self.post_attention_layernorm), residual=h)


def _gemma_call(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    parts: _Parts = self._turbospark_parts
    if hasattr(cache, "bits") or x.ndim != 3:  # a quantized KV cache: the layer's own ops
        return self._turbospark_plain(x, mask, cache)
    attn, norms, lora = self.self_attn, parts.norms, lora_of(self)
    q, k, v = _heads(attn, parts, x, cache, lora)
    if parts.softcap is None:
        attended = kernels.merged_attention(q, k, v, scale=attn.scale, mask=mask)
    else:
        attended = _softcapped(attn, q, k, v, mask)
    o = parts.o(attended) if lora is None else lora.add("o", parts.o(attended), attended)
    h = parts.residual(x, norms["post_attention_layernorm"](o))
    if lora is not None and lora.gate_up is not None:
        gated = lora.gated(parts.gate_up, h, norms["pre_feedforward_layernorm"], geglu=True)
    elif isinstance(parts.gate_up, _Side):  # MLX's own GELU, its ops' roundings
        gate, up = parts.gate_up.halves(h, norms["pre_feedforward_layernorm"])
        gated = nn.gelu_approx(gate) * up
    else:  # the kernels' GELU in the product
        gated = parts.gate_up(h, geglu_halves=True, norm=norms["pre_feedforward_layernorm"])
    down = parts.down(gated) if lora is None else lora.add("down", parts.down(gated), gated)
    return parts.residual(h, norms["post_feedforward_layernorm"](down))


def _softcapped(attn: Any, q: mx.array, k: mx.array, v: mx.array, mask: Any) -> mx.array:
    """mlx-lm gemma2's attention (its logits soft-capped) on split heads, as ``(B, L, H * D)``."""
    B, _, L, D = q.shape
    q = q * attn.scale
    if attn.repeats > 1:
        q = q.reshape(B, attn.n_kv_heads, attn.repeats, L, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    scores = mx.tanh(scores / attn.attn_logit_softcapping)
    scores *= attn.attn_logit_softcapping
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, precise=True, axis=-1) @ v
    return out.reshape(B, attn.n_heads, L, D).transpose(0, 2, 1, 3).reshape(B, L, -1)


_CLASSES: dict[type, type] = {}


def _unwrapped(cls: type) -> type:
    """The layer's own class under a pipeline rank's wrappers (``pipeline._wrap``)."""
    while "_turbospark_base" in vars(cls):
        cls = vars(cls)["_turbospark_base"]
    return cls


def _fused_class(cls: type) -> type:
    """The fused class for a layer of class ``cls``; a pipeline rank's wrappers (a step before
    or after the layer's) wrap the fused layer as they wrapped the plain one."""
    if "_turbospark_rewrap" in vars(cls):
        return vars(cls)["_turbospark_rewrap"](_fused_class(vars(cls)["_turbospark_base"]))
    if cls not in _CLASSES:
        call = _gemma_call if cls.__module__ in _GEMMA else _call
        _CLASSES[cls] = type(f"Fused{cls.__name__}", (cls,), {"__call__": call, "__module__": __name__,
                                                               "_turbospark_plain": cls.__call__})
    return _CLASSES[cls]


def _same_kind(modules: list[Any], ours: tuple[type, ...]) -> bool:
    first = modules[0]
    if type(first) not in ours or any(type(m) is not type(first) for m in modules):
        return False
    if any(("bias" in m) != ("bias" in first) for m in modules):
        return False
    if hasattr(first, "ggml_type") or hasattr(first, "packed_kind"):  # GGUF blocks (``mlx_ggml``)
        return all(getattr(m, a, None) == getattr(first, a, None) for a in ("ggml_type", "packed_kind") for m in modules)
    if isinstance(first, nn.QuantizedLinear):
        packed = getattr(first, "_turbospark_packed", False)
        return all(m.bits == first.bits and m.group_size == first.group_size and m["scales"].dtype == first["scales"].dtype
                   and getattr(m, "_turbospark_packed", False) == packed for m in modules)
    return all(m["weight"].dtype == first["weight"].dtype for m in modules)


def _qkv(attn: Any) -> list[Any]:
    return [attn.qkv_proj] if "qkv_proj" in attn else [attn.q_proj, attn.k_proj, attn.v_proj]


def _gate_up(mlp: Any) -> list[Any]:
    return [mlp.gate_up_proj] if "gate_up_proj" in mlp else [mlp.gate_proj, mlp.up_proj]


def _fusable(block: Any, ours: tuple[type, ...]) -> bool:
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    kind = _unwrapped(type(block))
    if kind.__module__ not in _LAYOUTS or kind.__name__ != "TransformerBlock" or attn is None or mlp is None:
        return False
    gemma = kind.__module__ in _GEMMA
    norms = [getattr(block, n, None) for n in _NORMS[gemma]]
    if not all(isinstance(n, nn.RMSNorm) if not gemma else type(n).__name__ == "RMSNorm" and "weight" in n
               for n in norms):
        return False
    if type(attn).__call__.__qualname__ != "Attention.__call__":  # its own attention, not a wrapper's
        return False
    try:
        products = [*_qkv(attn), attn.o_proj, *_gate_up(mlp), mlp.down_proj]
        return all(_same_kind([m], ours) for m in products) and type(mlp).__call__.__qualname__ == "MLP.__call__"
    except AttributeError:
        return False


def fuse(model: nn.Module, ours: tuple[type, ...]) -> tuple[int, int]:
    """Fuse every layer of ``model`` that ``_fusable`` takes, ``ours`` the classes of the linear
    layers the kernels read (``mlx_kernels`` changed theirs first); (fused, layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    fused = [block for block in layers if _fusable(block, ours)]
    parts = [_Parts(block, ours) for block in fused]
    _into_buffers([w for p in parts for w in p.products()])
    for block, p in zip(fused, parts, strict=True):
        block._turbospark_parts = p
        block.__class__ = _fused_class(type(block))
    return len(fused), len(layers)


def half_kv(model: nn.Module) -> bool:
    """Whether ``model``'s fused layers make their KV caches in float16 or in blocks (``mlx_kv``)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return kernels.kv_half() and any(hasattr(block, "_turbospark_parts") for block in layers)
