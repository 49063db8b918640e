"""The resolver's lifecycle policy (sans-io): which models are loaded, who holds them, and when
they go.

Theory of operation.  Every model the resolver was asked for is an ``Instance`` in one of four
states, kept by id in ``models`` (pending, loading, ready) or ``leaving``::

    pending --(room: Load)--> loading --ready()--> ready --(Stop)--> leaving --ended()--> gone
       |                         |                   (idle past keep_alive, evicted, told to)
       +-- last waiter left      +-- last waiter left: Stop ("cancelled")
           (forgotten)

- **Resolution slots** (``slots`` free): a lookup holds one (``take_slot``/``give_slot``); when
  it finds a model not loaded yet (``found``), its slot passes to the new instance and comes
  back when the model is ready, has ended, or its last waiter left while it was pending.
- **Waiters** wait on a load: they are granted together once it is ready, refused if it fails.
  A waiter that leaves (``abandon``) stops the load when it was the last.
- **Leases**: every grant carries a lease id, held until the actor calls ``release``; a model
  with a lease held is never stopped.  A grant the actor could not deliver (the asker left)
  goes back the same way.
- **keep_alive**: the latest request's value is the model's; a request that does not say gives
  the default, except to a pinned model (named on ``--model``), which keeps its own (forever).
  When the last lease goes: ``0`` stops it at once, forever never, otherwise a deadline
  (``next_deadline``, then ``expire``).
- **Eviction**: before a pending instance loads, ``lifecycle.evictions`` picks the idle ones to
  stop; when busy ones hold the room it stays pending, retried after every release and end.  A
  reload of an id waits until its previous instance has ended.

Events come in with ``now`` (any monotonic clock, the same for every call); decisions go out
as a list, in the order the actor carries them out: ``Load``, ``Stop`` (cancel its scope),
``Granted``, ``Refused``, ``Loaded``, ``Unloaded`` (the registry changed).  Waiters are opaque
(compared by identity): the actor does all the channel work.

Imports ``errors``, ``registry`` and ``lifecycle`` only: no Trio, no clock.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Iterable
from typing import Literal

import attrs

from ..errors import ModelLoadFailed, ShuttingDown, TurboSparkError
from .lifecycle import FOREVER, Loadable, Resident, evictions
from .registry import ModelEntry

__all__ = [
    "Decision",
    "Granted",
    "Instance",
    "Load",
    "Loaded",
    "Refused",
    "Residency",
    "Stop",
    "Unloaded",
]

State = Literal["pending", "loading", "ready", "leaving"]


@attrs.define(eq=False)
class Instance:
    """One model from the request that asked for it to its end (a reload is a new one)."""

    loadable: Loadable
    keep_alive: float
    state: State = "pending"
    entry: ModelEntry | None = None  # once ready
    waiters: dict[Hashable, float] = attrs.field(factory=dict)  # each with when it asked
    leases: set[int] = attrs.field(factory=set)
    holds_slot: bool = False  # the resolution slot of the lookup that created it
    began: float = 0.0  # when its load started
    last_used: float = 0.0
    expires: float = math.inf  # while idle
    reason: str = "shutdown"  # why it is leaving

    @property
    def id(self) -> str:
        return self.loadable.id


@attrs.frozen
class Load:
    instance: Instance


@attrs.frozen
class Stop:
    instance: Instance  # its reason says why


@attrs.frozen
class Granted:
    waiter: Hashable
    entry: ModelEntry
    lease: int
    waited: float  # how long it waited for the load


@attrs.frozen
class Refused:
    waiter: Hashable
    error: TurboSparkError


@attrs.frozen
class Loaded:
    instance: Instance
    seconds: float


@attrs.frozen
class Unloaded:
    instance: Instance
    reason: str  # expired, evicted, requested, failed, cancelled or shutdown


Decision = Load | Stop | Granted | Refused | Loaded | Unloaded


class Residency:
    def __init__(
        self, *, slots: int, keep_alive: float = 300.0, max_models: int = 3, max_memory: int = 1 << 62
    ) -> None:
        self.slots = slots  # free resolution slots
        self.keep_alive = keep_alive  # the default (--keep-alive)
        self.max_models = max_models
        self.max_memory = max_memory
        self.models: dict[str, Instance] = {}  # pending, loading or ready
        self.leaving: dict[str, Instance] = {}  # stopped, not ended yet
        self.leases: dict[int, Instance] = {}
        self._lease_ids = itertools.count(1)
        self.starting: set[Instance] = set()  # pinned loads at start-up
        self.start_error: BaseException | None = None  # the first of those that failed
        self.stopping = False  # shutdown: nothing loads any more

    # --- queries --------------------------------------------------------------------------

    def loaded(self) -> dict[str, ModelEntry]:
        """The ready models' entries, by id."""
        return {m.id: m.entry for m in self.models.values() if m.state == "ready" and m.entry is not None}

    def running(self) -> list[Instance]:
        """The ready models (``/api/ps``)."""
        return [m for m in self.models.values() if m.state == "ready" and m.entry is not None]

    def expires_in(self, model: Instance, now: float) -> float | None:
        """Seconds until an idle ready model goes (a busy one: its keep_alive); None: never."""
        if model.leases:
            return None if model.keep_alive == FOREVER else model.keep_alive
        return None if model.expires == math.inf else model.expires - now

    def next_deadline(self) -> float:
        return min((m.expires for m in self.models.values() if m.state == "ready" and not m.leases), default=math.inf)

    # --- resolution slots -----------------------------------------------------------------

    def take_slot(self) -> bool:
        if self.slots <= 0:
            return False
        self.slots -= 1
        return True

    def give_slot(self) -> None:
        self.slots += 1

    # --- events ---------------------------------------------------------------------------

    def pin(self, loadables: Iterable[Loadable], now: float) -> list[Decision]:
        """Start-up: load these now, without a slot, kept forever; ``starting`` until ready."""
        out: list[Decision] = []
        for loadable in loadables:
            model = self.models[loadable.id] = Instance(loadable, FOREVER)
            self.starting.add(model)
            self._start(model, now, out)
        return out

    def found(
        self, waiter: Hashable, loadable: Loadable, keep_alive: float | None, asked: float, now: float
    ) -> list[Decision]:
        """A lookup, holding a slot, found ``loadable`` for ``waiter`` (asked at ``asked``)."""
        out: list[Decision] = []
        model = self.models.get(loadable.id)
        if model is None:
            keep = FOREVER if loadable.pinned else self.keep_alive
            model = self.models[loadable.id] = Instance(loadable, keep, holds_slot=True)
        else:
            self.give_slot()
        if keep_alive is not None:
            model.keep_alive = keep_alive
        elif not loadable.pinned:
            model.keep_alive = self.keep_alive
        if model.state == "ready":
            self._grant(model, waiter, 0.0, now, out)
            return out
        model.waiters[waiter] = asked
        self._advance(now, out)
        return out

    def release(self, lease: int, now: float) -> list[Decision]:
        out: list[Decision] = []
        model = self.leases.pop(lease, None)
        if model is None:
            return out
        model.leases.discard(lease)
        model.last_used = now
        if not model.leases:
            self._idle(model, now, out)
        self._advance(now, out)
        return out

    def abandon(self, waiter: Hashable) -> list[Decision]:
        """``waiter`` left before its answer; the last waiter of a load leaving stops it."""
        out: list[Decision] = []
        for model in list(self.models.values()):
            if waiter in model.waiters:
                del model.waiters[waiter]
                if not model.waiters and not model.leases and model not in self.starting:
                    if model.state == "pending":
                        del self.models[model.id]
                        self._free_slot(model)
                    elif model.state == "loading":
                        self._stop(model, "cancelled", out)
                break
        return out

    def unload(self, model_id: str, now: float) -> list[Decision]:
        """Unload now if idle, else once its requests end (``keep_alive`` 0)."""
        out: list[Decision] = []
        model = self.models.get(model_id)
        if model is not None:
            model.keep_alive = 0.0
            if model.state == "ready" and not model.leases:
                self._stop(model, "requested", out)
                self._advance(now, out)
        return out

    def ready(self, model: Instance, entry: ModelEntry, now: float) -> list[Decision]:
        """``model``'s thread has loaded it: its waiters are granted."""
        out: list[Decision] = []
        if model.state != "loading":
            return out
        model.state, model.entry = "ready", entry
        out.append(Loaded(model, now - model.began))
        self._free_slot(model)
        self.starting.discard(model)
        waiters, model.waiters = model.waiters, {}
        for waiter, asked in waiters.items():
            self._grant(model, waiter, now - asked, now, out)
        if not model.leases:
            self._idle(model, now, out)
        return out

    def ended(self, model: Instance, error: BaseException | None, now: float) -> list[Decision]:
        """``model``'s actor has ended: stopped, failed, or the server is stopping."""
        out: list[Decision] = []
        was_ready = model.entry is not None
        if self.leaving.get(model.id) is model:
            del self.leaving[model.id]
        if self.models.get(model.id) is model:  # not stopped by us: it failed
            del self.models[model.id]
            model.reason = "failed"
        self._free_slot(model)
        for lease in model.leases:
            self.leases.pop(lease, None)
        if model in self.starting:
            self.starting.discard(model)
            self.start_error = self.start_error or error or ShuttingDown()
        if model.waiters:
            self._fail(model, ShuttingDown() if self.stopping else ModelLoadFailed(), out)
        if was_ready:
            out.append(Unloaded(model, "shutdown" if self.stopping else model.reason))
        self._advance(now, out)
        return out

    def expire(self, now: float) -> list[Decision]:
        """The deadline has passed: idle models past their keep_alive go."""
        out: list[Decision] = []
        for model in list(self.models.values()):
            if model.state == "ready" and not model.leases and model.expires <= now:
                self._stop(model, "expired", out)
        self._advance(now, out)
        return out

    # --- the machine ----------------------------------------------------------------------

    def _grant(self, model: Instance, waiter: Hashable, waited: float, now: float, out: list[Decision]) -> None:
        assert model.entry is not None
        lease = next(self._lease_ids)
        model.leases.add(lease)
        self.leases[lease] = model
        model.expires = math.inf
        model.last_used = now
        out.append(Granted(waiter, model.entry, lease, waited))

    def _idle(self, model: Instance, now: float, out: list[Decision]) -> None:
        if model.state != "ready":
            return
        if model.keep_alive <= 0:
            self._stop(model, "requested", out)
        else:
            model.expires = now + model.keep_alive

    def _residents(self, *, leaving: bool = True) -> list[Resident]:
        """The models that take room; with ``leaving``, those stopping too (busy until ended)."""
        out = [
            Resident(m.id, m.loadable.size, bool(m.leases) or m.state != "ready", m.loadable.pinned, m.last_used)
            for m in self.models.values() if m.state in ("loading", "ready")
        ]
        if leaving:
            out += [Resident(m.id, m.loadable.size, True, m.loadable.pinned, m.last_used) for m in self.leaving.values()]
        return out

    def _advance(self, now: float, out: list[Decision]) -> None:
        """Start the pending loads that fit, stopping idle models to make room."""
        for model in [m for m in self.models.values() if m.state == "pending"]:
            if self.stopping:
                self._fail(model, ShuttingDown(), out)
                continue
            if model.id in self.leaving:
                continue  # its previous instance is still stopping
            # the victims are chosen as if the models already stopping had gone (they will), so
            # that a load waiting for them does not stop more; it starts once they have ended
            size, limits = model.loadable.size, {"max_models": self.max_models, "max_memory": self.max_memory}
            victims = evictions(self._residents(leaving=False), size, **limits)
            if victims is None:
                continue
            for victim in victims:
                self._stop(self.models[victim], "evicted", out)
            if victims or evictions(self._residents(), size, **limits) != []:
                continue  # loads once they have ended
            self._start(model, now, out)

    def _start(self, model: Instance, now: float, out: list[Decision]) -> None:
        model.state = "loading"
        model.began = now
        out.append(Load(model))

    def _stop(self, model: Instance, reason: str, out: list[Decision]) -> None:
        model.reason = reason
        if self.models.get(model.id) is model:
            del self.models[model.id]
        model.state = "leaving"
        self.leaving[model.id] = model
        out.append(Stop(model))

    def _fail(self, model: Instance, error: TurboSparkError, out: list[Decision]) -> None:
        out.extend(Refused(waiter, error) for waiter in model.waiters)
        model.waiters.clear()
        if self.models.get(model.id) is model and model.state == "pending":
            del self.models[model.id]
            self._free_slot(model)

    def _free_slot(self, model: Instance) -> None:
        if model.holds_slot:
            model.holds_slot = False
            self.give_slot()
