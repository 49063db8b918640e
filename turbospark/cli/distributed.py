"""``serve --distributed``: one model sharded over the ranks ``mlx.launch`` started.

Sharded by tensors (each rank a part of every layer's heads: mlx-lm's ``shard``, for the
architectures that have it and heads that divide by the ranks) or by layers (each rank a slice
of them: ``model/pipeline.py``, any architecture); ``--shard`` chooses, else tensors where they
can, layers otherwise.  Rank 0 serves HTTP and runs the actors; its model thread drives the
sharded model and shares each engine call with the other ranks (``model/sharded.py``).  Every other rank loads its shard
and follows until rank 0 stops.  Rank 0 imports the model first (the ranks of one host share
a store), then the others find it.  Each follower keeps a heartbeat to rank 0
(``lifeline.py``): a rank that dies or cannot be reached makes rank 0 answer every request a
retryable 503 and exit with status 1, instead of waiting for a shard that will never answer;
``mlx.launch`` then stops the other ranks.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from ..config import Settings
from .attach import ModelSetupError, stored_model
from .interrupt import leaving
from .lifeline import Lifeline, beat, rank_zero_host

__all__ = ["distributed_group", "follow_rank", "sharded_spec"]


def distributed_group(settings: Settings) -> Any:
    """The group of ranks to shard over; a ``ModelSetupError`` when this is not a distributed
    run of one MLX model."""
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() < 2:
        raise ModelSetupError(
            "--distributed needs several ranks: start it with mlx.launch (or scripts/serve-distributed N)"
        )
    if len(settings.models) > 1 or settings.models[:1] == ("scripted",):
        raise ModelSetupError("--distributed shards one model: name at most one --model (not scripted)")
    return group


def _barrier(group: Any, value: int = 0) -> int:
    """Every rank waits here for the others; the sum of what they give (rank 0's lifeline port)."""
    import mlx.core as mx

    return int(mx.distributed.all_sum(mx.array(value), group=group).item())


def _load(path: Any, model_id: str, group: Any, mode: str) -> Any:
    from ..model.mlx_backend import MlxBackend

    try:
        return MlxBackend(path, model_id=model_id, group=group, shard=mode)
    except Exception as exc:
        raise ModelSetupError(f"cannot shard model '{model_id}' over {group.size()} ranks: {exc}") from exc


def sharded_spec(settings: Settings, group: Any) -> tuple[Any, Lifeline]:
    """Rank 0's pinned model (this rank's shard behind a ``ShardedBackend``) and its lifeline
    to the other ranks, every one connected."""
    from ..model.sharded import ShardedBackend
    from ..store.shelf import loadable_from

    stored = stored_model(_the_model(settings), whole=True)
    lifeline = Lifeline(group.size() - 1)
    _barrier(group, lifeline.port)  # the others may look the model up now, and connect
    mode = _agreed_mode(stored.path, group, settings.shard)
    lifeline.accept()

    def load(path: Any, model_id: str) -> Any:
        backend = _load(path, model_id, group, mode)
        print(f"turbospark: rank 0 of {group.size()} holds its shard of {model_id}: {shard_line(backend)}",
              file=sys.stderr, flush=True)
        return ShardedBackend(backend, group,
                              on_lost=lifeline.report_from_thread, on_close=lifeline.ending)

    return loadable_from(stored, load, pinned=True), lifeline


def follow_rank(settings: Settings, group: Any) -> int:
    """A rank other than 0: load this rank's shard and make rank 0's engine calls until it
    stops."""
    from ..model.sharded import follow, peer_lost

    # Ctrl-C reaches every rank of the terminal's process group: rank 0 shuts down and tells
    # this one to end; this one ends then, not before (it would leave rank 0 mid-step).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    port = _barrier(group)  # rank 0 has imported the model, and listens for our heartbeats
    stored = stored_model(_the_model(settings), whole=True)
    mode = _agreed_mode(stored.path, group, settings.shard)  # refused here as on rank 0
    host = rank_zero_host()
    try:
        beat(host, port)
    except OSError as exc:
        raise ModelSetupError(f"rank {group.rank()}: rank 0 ({host}:{port}) cannot be reached: "
                              f"{exc.strerror or exc}; it has stopped or refused the model") from None
    backend = _load(stored.path, stored.name, group, mode)
    print(f"turbospark: rank {group.rank()} of {group.size()} holds its shard of {stored.name} "
          f"(pid {os.getpid()}): {shard_line(backend)}", file=sys.stderr, flush=True)
    try:
        follow(backend, group)
    except RuntimeError as exc:  # one line, as on rank 0 (lifeline.py), not a traceback
        what = "lost another rank" if peer_lost(exc) else "failed"
        print(f"turbospark: rank {group.rank()} of {group.size()} {what} ({exc}), exiting", file=sys.stderr, flush=True)
        leaving()  # mlx.launch ends the ranks left once one has exited: quietly, mid-cleanup
        return 1
    return 0


def _agreed_mode(path: Any, group: Any, asked: str | None) -> str:
    """``shard_mode`` on every rank, each saying its refusal before any ends: a rank that ended
    first would have ``mlx.launch`` stop the others before they said theirs."""
    try:
        mode, refusal = shard_mode(path, group.size(), asked), None
    except ModelSetupError as exc:
        mode, refusal = "", exc
        print(f"turbospark: {exc}", file=sys.stderr, flush=True)
        exc.said = True
    if _barrier(group, refusal is not None):
        raise refusal or ModelSetupError(f"rank {group.rank()}: another rank refused the model")
    return mode


def _the_model(settings: Settings) -> str | None:
    """The one ``--model``; None: the default chat model."""
    return settings.models[0] if settings.models else None


def shard_line(backend: Any) -> str:
    """What this rank holds of the model, in words."""
    if backend.layers is None:
        return "a part of every layer's heads (tensor sharding)"
    start, end = backend.layers
    return f"layers {start} to {end - 1} (pipeline sharding)"


def shard_mode(path: Any, ranks: int, asked: str | None) -> str:
    """How a model is split over ``ranks`` ranks (``asked``, or the best that works), or a
    ``ModelSetupError`` saying why it cannot be, before any rank loads it."""
    import json

    config = json.loads((path / "config.json").read_text())
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads", heads)
    layers = config.get("num_hidden_layers")
    divides = bool(heads) and heads % ranks == 0 and (kv or heads) % ranks == 0
    can = _splits_by_tensors(config)
    if asked == "tensor" or (asked is None and divides and can):
        if not can:
            raise ModelSetupError(f"'{path.name}' is a {config.get('model_type')} model, which mlx-lm cannot shard "
                                  "by tensors (--shard pipeline can)")
        if not divides:
            raise ModelSetupError(
                f"'{path.name}' has {heads} attention heads and {kv} key/value heads, which do not split "
                f"evenly over {ranks} ranks: it cannot be sharded {ranks} ways by tensors (--shard pipeline can)"
            )
        return "tensor"
    if isinstance(layers, int) and layers < ranks:
        raise ModelSetupError(f"'{path.name}' has {layers} layers, fewer than the {ranks} ranks: "
                              f"it cannot be sharded {ranks} ways by layers")
    return "pipeline"


def _splits_by_tensors(config: dict[str, Any]) -> bool:
    """Whether mlx-lm can shard this architecture by tensors (its model has ``shard``)."""
    try:
        from mlx_lm.utils import _get_classes

        model_class, _ = _get_classes(config)
    except Exception:
        return False
    return hasattr(model_class, "shard")
