"""Pipeline (layer) sharding: each rank of an ``mlx.distributed`` group holds a contiguous slice
of a model's layers (``serve --distributed --shard pipeline``).

Works on any mlx-lm model whose layers sit in ``model.layers`` and are called one after the
other with ``(h, mask, cache)`` (every architecture the store imports), without changing how
the model runs:

- the layers another rank holds become :class:`Skip`: the hidden state passes through, and the
  layer's cache grows in step with one-float keys (a mask is built from some layer's cache,
  which this rank may not hold: its offsets must stay right), so nothing of their weights is
  ever read;
- rank ``r`` > 0 receives the hidden state from rank ``r - 1`` before its first layer, and rank
  ``r`` < n - 1 sends it on to rank ``r + 1`` after its last one (neighbours: the ring backend);
- after the last layer every rank takes the last rank's hidden state (an all-gather), so every
  rank computes the same logits and samples the same token: the engines stay in lockstep, as
  ``sharded.py`` needs, and the embedding and output head are held by every rank.

A step therefore sends, per token of the batch, one hidden state along the pipeline and one
to every rank (``benchmarks/bench_distributed.py`` measures it).  The ranks run one after the other: what pipelining buys is
memory, a model larger than one host holds; tensor sharding (``model.shard``) buys speed where
the heads divide.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["Skip", "pipeline", "split"]


def split(layers: int, ranks: int) -> list[tuple[int, int]]:
    """Each rank's ``[start, end)`` of ``layers`` layers, contiguous and in rank order; the
    later ranks take the extra ones (rank 0 also serves HTTP)."""
    if layers < ranks:
        raise ValueError(f"it has {layers} layers, fewer than the {ranks} ranks")
    base, extra = divmod(layers, ranks)
    sizes = [base + (1 if r >= ranks - extra else 0) for r in range(ranks)]
    starts = [sum(sizes[:r]) for r in range(ranks)]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


class Skip(nn.Module):
    """A layer another rank holds: none of its weights, its plain attributes (what the model
    reads of its layers, such as llama's ``use_sliding``)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        for name, value in vars(layer).items():
            if not name.startswith("_"):
                object.__setattr__(self, name, value)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        if cache is not None and hasattr(cache, "update_and_fetch"):
            one = mx.zeros((x.shape[0], 1, x.shape[1], 1), dtype=x.dtype)
            cache.update_and_fetch(one, one)
        return x


def _wrapped(base: type, before: Any, after: Any) -> type:
    def call(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if before is not None:
            x = before(x)
        out = base.__call__(self, x, *args, **kwargs)
        return after(out) if after is not None else out

    # what the CPU kernels' fusing needs to wrap a fused layer the same way (``mlx_blocks``)
    return type(base.__name__, (base,), {"__call__": call, "_turbospark_base": base,
                                         "_turbospark_rewrap": staticmethod(lambda b: _wrapped(b, before, after))})


def _wrap(layer: nn.Module, before: Any = None, after: Any = None) -> None:
    """Give ``layer`` a step before and after its own (a subclass: its parameters and their
    names stay as they are)."""
    layer.__class__ = _wrapped(type(layer), before, after)


def _now(x: mx.array) -> mx.array:
    """``x``, evaluated as the forward pass is built.  A send or receive left in the lazy graph
    would run only when something that needs it is evaluated, and ranks need different things
    of the same pass (one rank evaluates its layers' cache, whose keys wait on a receive; the
    other its own, which need no send): it would wait for ever.  Evaluated now, every rank's
    send meets the receive of the same pass; what is left lazy, the last all-gather, only the
    logits need, and every rank evaluates those alike."""
    mx.eval(x)
    return x


#: the hidden state's possible types, by the number that says which
_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


class _Link:
    """One end of the hidden state's way between two neighbouring ranks.  Its type is what the
    sending rank's layers make of it (a float16 embedding and float32 norms give float32; the
    receiving rank's own stand-in may have another): the first pass sends it once, ahead."""

    def __init__(self, group: mx.distributed.Group, peer: int) -> None:
        self.group, self.peer = group, peer
        self.dtype: mx.Dtype | None = None

    def send(self, h: mx.array) -> mx.array:
        if self.dtype is None:
            self.dtype = h.dtype
            _now(mx.distributed.send(mx.array([_DTYPES.index(h.dtype)]), self.peer, group=self.group))
        return _now(mx.distributed.send(h, self.peer, group=self.group))

    def receive(self, h: mx.array) -> mx.array:
        if self.dtype is None:
            code = _now(mx.distributed.recv((1,), mx.int32, self.peer, group=self.group))
            self.dtype = _DTYPES[code.item()]
        return _now(mx.distributed.recv(h.shape, self.dtype, self.peer, group=self.group))


def _layer_list(model: nn.Module) -> list[Any]:
    """The list the model's layers are held in (``model.layers`` may be a property that
    returns a copy: Qwen 2's is a slice)."""
    for owner in (model.get("model"), model):
        layers = owner.get("layers") if isinstance(owner, nn.Module) else None
        if isinstance(layers, list) and layers:
            return layers
    raise ValueError("its layers cannot be found (model.layers)")


def pipeline(model: nn.Module, group: mx.distributed.Group) -> tuple[int, int]:
    """Keep this rank's slice of ``model``'s layers (before its weights are read) and link it to
    its neighbours'; this rank's ``[start, end)``."""
    layers = _layer_list(model)
    rank, size = group.rank(), group.size()
    start, end = split(len(layers), size)[rank]
    for i in range(len(layers)):
        if not start <= i < end:
            layers[i] = Skip(layers[i])
    if rank > 0:
        _wrap(layers[start], before=_Link(group, rank - 1).receive)
    if rank < size - 1:
        _wrap(layers[end - 1], after=_Link(group, rank + 1).send)

    last: list[mx.Dtype] = []  # the type of the last rank's hidden state, learnt in the first pass

    def last_ranks(h: mx.array) -> mx.array:
        if not last:
            codes = _now(mx.distributed.all_gather(mx.array([_DTYPES.index(h.dtype)]), group=group))
            last.append(_DTYPES[codes[-1].item()])
        n = h.shape[0]
        return mx.distributed.all_gather(h.astype(last[0]), group=group)[(size - 1) * n:]

    _wrap(layers[-1], after=last_ranks)
    return start, end
