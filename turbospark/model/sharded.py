"""One model sharded over the ranks of an ``mlx.distributed`` group (``serve --distributed``).

Every rank holds a shard of the same model: a part of every layer's heads (mlx-lm's own
``shard()``), or a slice of its layers (``pipeline.py``), so every forward pass runs on all
ranks at once: its all-sums, or its sends and receives, pair up across them.  Rank 0 serves HTTP
and owns the actors; its model thread drives a ``ShardedBackend``, which shares every call that
changes the engine (``insert``, ``fork``, ``step``, ``remove``, ``reset``) with the other ranks
before making it itself.  The other ranks ``follow``: they make the same calls, in the same
order, on their own shard, and discard the results.  The engines therefore stay in lockstep:
the same sequences, the same prefix cache, the same random state (each rank seeds it alike), so
each rank samples the same token from the same (all-summed) logits.  A client that leaves is a
``remove`` like any other, on every rank, within the step.

Sharing is mlx-lm's own way (its server's ``_share_object``): rank 0 pickles the call and
all-sums its length and then its bytes; the others add zeros.  Synchronous, MLX only.

A collective that fails (a peer is gone) is not one batch's failure but the whole server's:
``on_lost`` is told (``cli/lifeline.py``: every request is answered 503 and the process exits)
before anything else can answer the batch's jobs.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

import mlx.core as mx

__all__ = ["EXIT", "ShardedBackend", "follow", "peer_lost", "share"]

log = logging.getLogger("turbospark")

#: the call that ends the followers (rank 0 is stopping)
EXIT = ("exit", (), {})

#: the calls that change the engine, shared with every rank
SHARED = frozenset({"insert", "fork", "step", "remove", "reset"})


def share(group: mx.distributed.Group, obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank (the others pass nothing)."""
    if group.rank() == 0:
        data = mx.array(bytearray(pickle.dumps(obj)), dtype=mx.uint8)
        mx.eval(mx.distributed.all_sum(mx.array(data.size), group=group))
        mx.eval(mx.distributed.all_sum(data, group=group))
        return obj
    size = mx.distributed.all_sum(mx.array(0), group=group).item()
    data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=group)
    return pickle.loads(bytes(memoryview(data)))


class ShardedBackend:
    """Rank 0's backend: ``backend``'s calls, each engine-changing one shared first."""

    def __init__(
        self,
        backend: Any,
        group: mx.distributed.Group,
        on_lost: Callable[[str], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._backend = backend
        self._group = group
        self._on_lost, self._on_close = on_lost, on_close

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._backend, name)
        if name not in SHARED:
            return value

        def shared(*args: Any, **kwargs: Any) -> Any:
            try:
                with mx.stream(self._backend.stream):
                    share(self._group, (name, args, kwargs))
                return value(*args, **kwargs)
            except RuntimeError as exc:
                if self._on_lost is not None and peer_lost(exc):
                    self._on_lost(f"a collective failed: {exc}")
                raise

        return shared

    def close(self) -> None:
        """Tell the followers to end (the server is stopping)."""
        if self._on_close is not None:
            self._on_close()
        with mx.stream(self._backend.stream):
            share(self._group, EXIT)


def peer_lost(exc: RuntimeError) -> bool:
    """A collective's failure (MLX's ring backend says so in its message)."""
    text = str(exc)
    return "[ring]" in text or "peer" in text


def follow(backend: Any, group: mx.distributed.Group) -> None:
    """A rank other than 0: make rank 0's engine calls on this rank's shard until it says
    ``EXIT``.  A call that fails here but not there would part the ranks: it ends this one."""
    while True:
        with mx.stream(backend.stream):
            name, args, kwargs = share(group)
        if name == "exit":
            return
        getattr(backend, name)(*args, **kwargs)
