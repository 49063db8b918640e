"""The resolver's lifecycle policy (``actors/_residency.py``) fed events directly, and the
registry's naming rules: no Trio, no clock, no threads.  Times are plain numbers."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from turbospark.actors import _residency
from turbospark.actors._residency import (
    Granted,
    Load,
    Loaded,
    Refused,
    Residency,
    Stop,
    Unloaded,
)
from turbospark.actors.lifecycle import FOREVER, Loadable
from turbospark.actors.registry import ModelEntry, Registry
from turbospark.errors import (
    ModelLoadFailed,
    ModelNotFound,
    NoModel,
    RequestInvalid,
    ShuttingDown,
)


def loadable(name: str, size: int = 100, pinned: bool = False) -> Loadable:
    return Loadable(id=name, make=lambda: None, capabilities=frozenset({"chat", "completion"}),
                    context_window=8192, size=size, pinned=pinned)


def entry(name: str) -> ModelEntry:
    return ModelEntry(name, 8192, frozenset({"chat", "completion"}))


class Asker:
    """A waiter: opaque to the policy, compared by identity."""

    def __init__(self, name: str = "") -> None:
        self.name = name


def ask(policy: Residency, model: Loadable, now: float, keep_alive: float | None = None, who: Asker | None = None):
    """A request: take a slot, look up, and hand what was found to the policy."""
    assert policy.take_slot()
    return policy.found(who or Asker(), model, keep_alive, now, now)


def load(decisions) -> _residency.Instance:
    (only,) = [d for d in decisions if isinstance(d, Load)]
    return only.instance


def lease(decisions) -> int:
    (only,) = [d for d in decisions if isinstance(d, Granted)]
    return only.lease


def serve(policy: Residency, model: Loadable, now: float, keep_alive: float | None = None):
    """Ask for ``model`` and load it: the instance and the lease granted."""
    instance = load(ask(policy, model, now, keep_alive))
    return instance, lease(policy.ready(instance, entry(model.id), now + 1))


def test_the_policy_module_is_sans_io() -> None:
    tree = ast.parse(Path(_residency.__file__).read_text(encoding="utf-8"))
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.split(".")[0] in {"trio", "time", "messages"} or m == "..messages"}


def test_concurrent_requests_share_one_load_holding_the_first_lookups_slot() -> None:
    policy = Residency(slots=3)
    alpha = loadable("alpha")
    first, second = Asker("first"), Asker("second")
    out = ask(policy, alpha, 10.0, who=first)
    instance = load(out)
    assert instance.state == "loading" and policy.slots == 2  # the lookup's slot went to the load
    assert ask(policy, alpha, 12.0, who=second) == []  # waits on the same load; its slot came back
    assert policy.slots == 2
    out = policy.ready(instance, entry("alpha"), 15.0)
    assert out[0] == Loaded(instance, 5.0)
    grants = [d for d in out if isinstance(d, Granted)]
    assert [(g.waiter, g.waited) for g in grants] == [(first, 5.0), (second, 3.0)]
    assert len({g.lease for g in grants}) == 2 and policy.slots == 3
    assert policy.loaded() == {"alpha": entry("alpha")}
    again = ask(policy, alpha, 16.0)  # loaded: granted at once
    assert [type(d) for d in again] == [Granted] and again[0].waited == 0.0 and policy.slots == 3


def test_slots_run_out_and_come_back() -> None:
    policy = Residency(slots=1)
    assert policy.take_slot() and not policy.take_slot()
    policy.give_slot()
    assert policy.take_slot()


def test_keep_alive_deadlines_after_the_last_lease() -> None:
    policy = Residency(slots=2, keep_alive=300.0)
    alpha = loadable("alpha")
    instance, first = serve(policy, alpha, 0.0)
    second = lease(ask(policy, alpha, 2.0, keep_alive=60.0))  # the latest request's keep_alive
    assert policy.next_deadline() == math.inf  # busy
    assert policy.expires_in(instance, 2.0) == 60.0
    assert policy.release(first, 3.0) == [] and policy.next_deadline() == math.inf
    assert policy.release(second, 4.0) == []
    assert policy.next_deadline() == 64.0 and policy.expires_in(instance, 10.0) == 54.0
    assert policy.expire(63.9) == []
    assert policy.expire(64.0) == [Stop(instance)] and instance.reason == "expired"
    assert policy.loaded() == {} and policy.next_deadline() == math.inf
    assert policy.ended(instance, None, 65.0) == [Unloaded(instance, "expired")]

    beta, _ = serve(policy, loadable("beta"), 100.0, keep_alive=FOREVER)
    assert policy.release(_, 101.0) == [] and policy.next_deadline() == math.inf
    assert policy.expires_in(beta, 101.0) is None


def test_keep_alive_zero_unloads_when_the_last_request_ends() -> None:
    policy = Residency(slots=2)
    alpha = loadable("alpha")
    instance, first = serve(policy, alpha, 0.0)
    second = lease(ask(policy, alpha, 1.0, keep_alive=0.0))
    assert policy.release(second, 2.0) == []  # another request still runs on it
    assert policy.release(first, 3.0) == [Stop(instance)] and instance.reason == "requested"
    assert policy.release(first, 3.0) == []  # a lease goes back once


def test_a_pinned_model_keeps_its_own_keep_alive_unless_a_request_says() -> None:
    policy = Residency(slots=1, keep_alive=300.0)
    scripted = loadable("scripted", pinned=True)
    instance = load(policy.pin([scripted], 0.0))
    assert policy.starting == {instance} and policy.slots == 1  # start-up loads take no slot
    assert policy.ready(instance, entry("scripted"), 1.0) == [Loaded(instance, 1.0)]
    assert policy.starting == set() and policy.next_deadline() == math.inf
    granted = lease(ask(policy, scripted, 2.0))
    assert instance.keep_alive == FOREVER
    assert policy.release(granted, 3.0) == [] and policy.next_deadline() == math.inf
    granted = lease(ask(policy, scripted, 4.0, keep_alive=0.0))
    assert policy.release(granted, 5.0) == [Stop(instance)]


def test_eviction_waits_for_busy_models_and_takes_the_least_recently_used() -> None:
    policy = Residency(slots=4, max_models=2)
    serve(policy, loadable("alpha"), 0.0)
    beta, b = serve(policy, loadable("beta"), 1.0)
    assert ask(policy, loadable("gamma"), 2.0) == []  # both busy: gamma waits, pending
    assert policy.models["gamma"].state == "pending" and policy.slots == 3
    assert policy.release(b, 3.0) == [Stop(beta)] and beta.reason == "evicted"
    out = policy.ended(beta, None, 5.0)
    gamma = load(out)
    assert out == [Unloaded(beta, "evicted"), Load(gamma)]
    assert policy.slots == 3 and set(policy.loaded()) == {"alpha"}

    idle = Residency(slots=4, max_models=2)
    _, a = serve(idle, loadable("alpha"), 0.0)
    beta, b = serve(idle, loadable("beta"), 1.0)
    idle.release(b, 3.0)
    idle.release(a, 4.0)  # alpha was used last
    assert ask(idle, loadable("gamma"), 5.0) == [Stop(beta)]

    budget = Residency(slots=2, max_memory=1000)
    one, held = serve(budget, loadable("one", size=600), 0.0)
    assert budget.release(held, 1.0) == []
    out = ask(budget, loadable("two", size=600), 2.0)
    assert out == [Stop(one)]  # the memory budget, not the count
    assert load(budget.ended(one, None, 3.0)).id == "two"


def test_a_load_that_needs_two_victims_stops_two_and_no_more_as_they_end() -> None:
    policy = Residency(slots=4, max_models=3)
    models = {}
    for i, name in enumerate(("alpha", "beta", "gamma")):
        models[name], held = serve(policy, loadable(name), float(i))
        policy.release(held, 10.0 + i)
    policy.max_models = 2  # three loaded (pinned at start) with room for two: one load needs two to go
    out = ask(policy, loadable("delta"), 20.0)
    assert out == [Stop(models["alpha"]), Stop(models["beta"])]
    assert policy.ended(models["alpha"], None, 21.0) == [Unloaded(models["alpha"], "evicted")]  # gamma stays
    out = policy.ended(models["beta"], None, 22.0)
    assert out == [Unloaded(models["beta"], "evicted"), Load(policy.models["delta"])]
    assert set(policy.loaded()) == {"gamma"}


def test_a_model_bigger_than_the_budget_loads_alone() -> None:
    policy = Residency(slots=1, max_memory=50)
    assert load(ask(policy, loadable("huge", size=500), 0.0)).id == "huge"


def test_unload_waits_for_the_requests_on_the_model() -> None:
    policy = Residency(slots=2)
    instance, held = serve(policy, loadable("alpha"), 0.0)
    assert policy.unload("alpha", 1.0) == [] and instance.keep_alive == 0.0
    assert policy.release(held, 2.0) == [Stop(instance)] and instance.reason == "requested"
    assert policy.unload("nothing", 3.0) == []
    idle, held = serve(policy, loadable("beta"), 4.0)
    policy.release(held, 5.0)
    assert policy.unload("beta", 6.0) == [Stop(idle)]


def test_a_reload_waits_until_the_previous_instance_has_ended() -> None:
    policy = Residency(slots=2)
    alpha = loadable("alpha")
    first, held = serve(policy, alpha, 0.0)
    policy.release(held, 1.0)
    assert policy.unload("alpha", 2.0) == [Stop(first)]
    assert ask(policy, alpha, 3.0) == []  # a new instance, pending behind the leaving one
    out = policy.ended(first, None, 4.0)
    second = load(out)
    assert second is not first and out == [Unloaded(first, "requested"), Load(second)]


def test_the_last_waiter_leaving_cancels_the_load_and_frees_its_slot() -> None:
    policy = Residency(slots=2)
    alpha = loadable("alpha")
    first, second = Asker(), Asker()
    instance = load(ask(policy, alpha, 0.0, who=first))
    ask(policy, alpha, 1.0, who=second)
    assert policy.abandon(first) == []  # another waits for it
    assert policy.abandon(second) == [Stop(instance)] and instance.reason == "cancelled"
    assert policy.slots == 1  # held until the load has ended
    assert policy.ended(instance, None, 2.0) == [] and policy.slots == 2  # never ready: no Unloaded

    policy = Residency(slots=2, max_models=1)
    serve(policy, loadable("busy"), 0.0)
    waiter = Asker()
    assert ask(policy, loadable("pending"), 1.0, who=waiter) == [] and policy.slots == 1
    assert policy.abandon(waiter) == [] and "pending" not in policy.models and policy.slots == 2
    assert policy.abandon(Asker()) == []


def test_a_failed_load_refuses_its_waiters() -> None:
    policy = Residency(slots=1)
    waiter = Asker()
    instance = load(ask(policy, loadable("alpha"), 0.0, who=waiter))
    (refused,) = policy.ended(instance, RuntimeError("bad weights"), 1.0)
    assert isinstance(refused, Refused) and refused.waiter is waiter and isinstance(refused.error, ModelLoadFailed)
    assert policy.models == {} and policy.slots == 1

    instance, held = serve(policy, loadable("alpha"), 2.0)
    assert policy.ended(instance, RuntimeError("thread died"), 3.0) == [Unloaded(instance, "failed")]
    assert policy.release(held, 4.0) == []  # its leases went with it


def test_shutdown_refuses_what_waits_and_unloads_with_reason_shutdown() -> None:
    policy = Residency(slots=3, max_models=1)
    busy, _ = serve(policy, loadable("busy"), 0.0)
    waiter = Asker()
    assert ask(policy, loadable("pending"), 1.0, who=waiter) == []
    policy.stopping = True
    out = policy.ended(busy, None, 2.0)
    assert out[0] == Unloaded(busy, "shutdown")
    (refused,) = out[1:]
    assert isinstance(refused, Refused) and refused.waiter is waiter and isinstance(refused.error, ShuttingDown)
    assert policy.models == {} and policy.slots == 3


def test_a_pinned_model_that_fails_at_start_up_is_the_start_error() -> None:
    policy = Residency(slots=1)
    instance = load(policy.pin([loadable("scripted", pinned=True)], 0.0))
    error = RuntimeError("no weights")
    policy.ended(instance, error, 1.0)
    assert policy.start_error is error and policy.starting == set()
    # a start-up load is never cancelled by a waiter leaving
    policy = Residency(slots=2)
    instance = load(policy.pin([loadable("scripted", pinned=True)], 0.0))
    waiter = Asker()
    assert ask(policy, loadable("scripted", pinned=True), 1.0, who=waiter) == []
    assert policy.abandon(waiter) == []


def test_a_grant_that_could_not_be_delivered_goes_back_without_stopping_the_others() -> None:
    """The actor releases the lease of a grant whose asker left; a keep_alive 0 model stays
    loaded for the requests that did get theirs."""
    policy = Residency(slots=2)
    alpha = loadable("alpha")
    gone, there = Asker(), Asker()
    instance = load(ask(policy, alpha, 0.0, keep_alive=0.0, who=gone))
    ask(policy, alpha, 0.5, keep_alive=0.0, who=there)
    grants = {g.waiter: g.lease for g in policy.ready(instance, entry("alpha"), 1.0) if isinstance(g, Granted)}
    assert policy.release(grants[gone], 1.0) == []
    assert policy.release(grants[there], 2.0) == [Stop(instance)]


def test_running_lists_ready_models_with_their_expiry() -> None:
    policy = Residency(slots=2, keep_alive=300.0)
    alpha, held = serve(policy, loadable("alpha"), 0.0)
    ask(policy, loadable("beta"), 1.0)  # loading: not listed
    assert policy.running() == [alpha]
    assert policy.expires_in(alpha, 5.0) == 300.0  # busy: a full keep_alive from its end
    policy.release(held, 10.0)
    assert policy.expires_in(alpha, 20.0) == 290.0


# --- the registry's naming rules ---------------------------------------------------------


def test_ollama_names_are_exact_with_latest_optional() -> None:
    chat = ModelEntry("llama", 8, frozenset({"chat", "completion"}), aliases=("claude-turbospark-llama",))
    embed = ModelEntry("bge", 8, frozenset({"embedding"}))
    registry = Registry((chat, embed))
    assert registry.find("llama") is chat and registry.find("llama:latest") is chat
    assert registry.find("claude-turbospark-llama") is chat
    assert registry.find("llama:7b") is None and registry.find("lla") is None
    assert registry.lookup("llama:latest") is None  # the OpenAI surface names exactly
    # as Ollama: a name that matches nothing as written is tried in lower case
    assert registry.find("Llama") is chat and registry.find("LLAMA:latest") is chat
    assert registry.resolve_exact("bge:latest", "embedding") is embed
    with pytest.raises(ModelNotFound):
        registry.resolve_exact("other", "chat")
    with pytest.raises(RequestInvalid, match="does not support embeddings"):
        registry.resolve_exact("llama", "embedding")
    with pytest.raises(RequestInvalid, match="does not support generate"):
        registry.resolve_exact("bge", "completion")


def test_several_capable_models_fall_back_to_the_one_loaded() -> None:
    a, b = entry("a"), entry("b")
    registry = Registry((a, b))
    with pytest.raises(ModelNotFound):
        registry.resolve("gpt-4o", "chat")
    assert registry.resolve("gpt-4o", "chat", {"b"}) is b
    assert registry.resolve("a", "chat", {"b"}) is a  # a name still wins
    with pytest.raises(ModelNotFound):
        registry.resolve(None, "chat", {"a", "b"})
    with pytest.raises(NoModel):
        registry.resolve("a", "embedding", {"a"})
    assert registry.only_loaded(None, "chat", {"a"}) is a


def test_a_registry_from_colliding_entries_keeps_the_first() -> None:
    a = ModelEntry("a", 8, frozenset({"chat"}), aliases=("x",))
    b = ModelEntry("x", 8, frozenset({"chat"}))
    c = ModelEntry("c", 8, frozenset({"chat"}))
    registry, left_out = Registry.first_come([a, b, c])
    assert registry.entries == (a, c) and left_out == [(b, ["x"])]
