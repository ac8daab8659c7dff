"""The node's resource manager (`node_daemon.resources`): the policies' plans on samples, and
the manager's history (shrink hold, Unsupported, events)."""

from __future__ import annotations

import pytest

from node_daemon.errors import ReplicaNotFound, Unsupported
from node_daemon.resources import (
    EVENT_WINDOW,
    MAX_REASON,
    ResizeSettings,
    ResourceManager,
    plan_cpus,
)
from node_daemon.telemetry import NodeSample, ReplicaSample, RequestFigures

CRITICAL, STANDARD, BEST_EFFORT, STANDBY = 3, 2, 1, 0


def replica(
    replica_id: str,
    *,
    priority: int = BEST_EFFORT,
    cpus: float = 1.0,
    limit: float | None = None,
    used: float = 0.0,
    throttled: float = 0.0,
    cpus_min: float | None = None,
    cpus_max: float = 2.0,
    latency_ms: float = 0.0,
    compute_ms: float = 0.0,
    queued: int = 0,
) -> ReplicaSample:
    requests = None
    if compute_ms:
        requests = RequestFigures(10.0, 0.0, latency_ms, latency_ms, compute_ms, 1, queued, 0, 0)
    return ReplicaSample(
        replica_id=replica_id,
        deployment_id=f"dep-{replica_id}",
        priority=priority,
        cpus=cpus,
        cpus_min=cpus / 2 if cpus_min is None else cpus_min,
        cpus_max=cpus_max,
        cpu_limit=cpus if limit is None else limit,
        cpu_used_cores=used,
        throttled_ratio=throttled,
        memory_used_mib=100,
        requests=requests,
    )


def node(*replicas: ReplicaSample, cores: float = 2.0, interval_s: float = 1.0) -> NodeSample:
    return NodeSample(
        at=1000.0, interval_s=interval_s, cpu_cores=cores, gpus=(), replicas=tuple(replicas)
    )


def bursting(limit: float = 0.5) -> ReplicaSample:
    """The critical replica in a burst: using all of its quota, throttled, requests queueing."""
    return replica(
        "crit", priority=CRITICAL, cpus=0.5, limit=limit, used=limit, throttled=0.8,
        cpus_min=0.25, cpus_max=1.75, latency_ms=400, compute_ms=80, queued=6,
    )  # fmt: skip


def busy_best_effort(limit: float = 1.0) -> ReplicaSample:
    """The best-effort replica under a closed loop: all of its quota, throttled."""
    return replica(
        "be", priority=BEST_EFFORT, cpus=1.0, limit=limit, used=limit, throttled=0.6,
        cpus_min=0.5, cpus_max=2.0, latency_ms=100, compute_ms=90,
    )  # fmt: skip


def quiet_critical(limit: float) -> ReplicaSample:
    """The critical replica between bursts: a trickle of requests."""
    return replica(
        "crit", priority=CRITICAL, cpus=0.5, limit=limit, used=0.05, cpus_min=0.25,
        cpus_max=1.75, latency_ms=80, compute_ms=80,
    )  # fmt: skip


def after(plan: dict[str, tuple[float, str]], sample: NodeSample) -> dict[str, float]:
    """Every managed replica's quota once the plan is applied."""
    return {
        r.replica_id: plan[r.replica_id][0] if r.replica_id in plan else r.cpu_limit
        for r in sample.replicas
        if r.cpus > 0
    }


@pytest.mark.parametrize("policy", ["usage", "gain"])
def test_a_burst_gives_the_critical_replica_more_cpu_within_node_and_bounds(policy: str) -> None:
    sample = node(bursting(), busy_best_effort())
    plan = plan_cpus(policy, sample)
    quotas = after(plan, sample)
    assert quotas["crit"] > 0.5
    assert 0.25 <= quotas["crit"] <= 1.75
    assert 0.5 <= quotas["be"] <= 2.0
    assert sum(quotas.values()) <= 2.0 + 1e-9
    reason = plan["crit"][1]
    assert "throttled 80%" in reason and "critical" in reason
    assert len(reason) <= MAX_REASON and reason.isprintable()


@pytest.mark.parametrize("policy", ["usage", "gain"])
def test_repeated_bursts_grow_the_critical_replica_up_to_its_ceiling_not_beyond(
    policy: str,
) -> None:
    crit, be = 0.5, 1.0
    for _ in range(20):
        sample = node(bursting(crit), busy_best_effort(be))
        quotas = after(plan_cpus(policy, sample), sample)
        assert sum(quotas.values()) <= 2.0 + 1e-9
        assert quotas["be"] >= 0.5 - 1e-9
        crit, be = quotas["crit"], quotas["be"]
    assert crit <= 1.75
    assert crit >= 1.2  # most of the node goes to the critical one while it is throttled


def test_usage_weights_by_priority_when_the_node_is_short() -> None:
    # Two identical replicas wanting 1.5 cores each on a 2-core node: the critical one gets
    # more, the best-effort one less, both over their floor.
    twins = [
        replica(name, priority=prio, cpus=1.0, used=1.0, throttled=0.5, cpus_min=0.25)
        for name, prio in (("high", CRITICAL), ("low", BEST_EFFORT))
    ]
    sample = node(*twins)
    quotas = after(plan_cpus("usage", sample), sample)
    assert quotas["high"] > 1.0 > quotas["low"] >= 0.25
    assert sum(quotas.values()) == pytest.approx(2.0, abs=0.02)
    # Standby weighs less than best-effort.
    pair = [
        replica(name, priority=prio, cpus=1.0, used=1.0, throttled=0.5, cpus_min=0.25)
        for name, prio in (("be", BEST_EFFORT), ("sb", STANDBY))
    ]
    sample = node(*pair)
    quotas = after(plan_cpus("usage", sample), sample)
    assert quotas["be"] > quotas["sb"]


def test_usage_gives_every_demand_and_the_spare_cores_to_the_throttled() -> None:
    # A throttled replica beside an idle one: the idle one is cut to its use plus headroom,
    # but not under its floor; the throttled one gets its demand and what is left over.
    sample = node(
        replica("busy", cpus=0.5, used=0.5, throttled=0.5, cpus_min=0.25),
        replica("idle", cpus=1.0, used=0.0, cpus_min=0.5),
    )
    quotas = after(plan_cpus("usage", sample), sample)
    assert quotas["idle"] == pytest.approx(0.5)
    assert quotas["busy"] == pytest.approx(1.5)
    # With room to spare, an unthrottled replica gets just its use plus headroom.
    sample = node(replica("calm", cpus=1.0, used=0.4, cpus_min=0.25), cores=4.0)
    assert plan_cpus("usage", sample)["calm"][0] == pytest.approx(0.65)


def test_floor_and_ceiling_hold_even_when_the_floors_do_not_fit() -> None:
    # Floors summing over the node's cores: no one goes under its floor.
    sample = node(
        replica("a", cpus=1.0, used=1.0, throttled=0.9, cpus_min=1.0),
        replica("b", cpus=1.0, used=1.0, throttled=0.9, cpus_min=1.0),
        cores=1.5,
    )
    for policy in ("usage", "gain"):
        quotas = after(plan_cpus(policy, sample), sample)
        assert quotas == {"a": 1.0, "b": 1.0}
    # An idle replica with a high floor stays at it; a busy one stops at its ceiling.
    sample = node(
        replica("idle", cpus=1.0, used=0.0, cpus_min=0.8),
        replica("busy", cpus=0.5, used=0.5, throttled=1.0, cpus_min=0.25, cpus_max=0.6),
        cores=8.0,
    )
    for policy in ("usage", "gain"):
        quotas = after(plan_cpus(policy, sample), sample)
        assert quotas["idle"] >= 0.8
        assert quotas["busy"] <= 0.6


def test_unmanaged_replicas_are_never_resized_and_their_use_is_left_to_them() -> None:
    sample = node(
        replica("free", cpus=0.0, limit=0.0, used=1.0),
        bursting(),
        busy_best_effort(),
    )
    for policy in ("usage", "gain"):
        plan = plan_cpus(policy, sample)
        assert "free" not in plan
        quotas = after(plan, sample)
        assert sum(quotas.values()) <= 1.0 + 1e-9  # 2 cores less the 1 the free one uses


def test_static_never_changes_anything() -> None:
    for sample in (node(bursting(), busy_best_effort()), node(quiet_critical(1.75))):
        assert plan_cpus("static", sample) == {}


@pytest.mark.parametrize("policy", ["usage", "gain"])
def test_the_first_sample_changes_nothing(policy: str) -> None:
    assert plan_cpus(policy, node(bursting(), busy_best_effort(), interval_s=0.0)) == {}


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown resize policy"):
        plan_cpus("fastest", node(bursting()))
    with pytest.raises(ValueError, match="unknown resize policy"):
        ResourceManager("fastest", apply=_never)


async def _never(replica_id: str, cores: float) -> None:
    raise AssertionError("not expected to resize")


@pytest.mark.parametrize("policy", ["usage", "gain"])
def test_hysteresis_no_change_under_a_tenth_of_a_core_or_ten_percent(policy: str) -> None:
    # Using 0.7 of 1.0 unthrottled: it wants 0.95 (use + 0.25): a 0.05 change, not made.
    sample = node(replica("a", cpus=1.0, used=0.7, cpus_min=0.5))
    assert plan_cpus(policy, sample) == {}
    # A larger gap is closed.
    sample = node(replica("a", cpus=1.0, used=0.2, cpus_min=0.25))
    assert plan_cpus(policy, sample)["a"][0] == pytest.approx(0.45)
    # Ten percent of a large quota: 3.8 -> 3.55 (use + headroom) is under 0.38, not made.
    settings = ResizeSettings(min_change_cores=0.1, min_change_ratio=0.1)
    sample = node(replica("a", cpus=3.8, used=3.3, cpus_min=1.0, cpus_max=8.0), cores=8.0)
    assert plan_cpus(policy, sample, settings) == {}


@pytest.mark.parametrize("policy", ["usage", "gain"])
def test_the_cpu_goes_back_after_the_burst(policy: str) -> None:
    # The critical one at 1.75 cores, the burst over; the best-effort one squeezed to 0.5.
    sample = node(quiet_critical(1.75), busy_best_effort(0.25 + 0.25))
    quotas = after(plan_cpus(policy, sample), sample)
    assert quotas["crit"] <= 0.35
    assert quotas["be"] >= 1.5


def test_gain_favours_the_throttled_critical_replica() -> None:
    # Both throttled the same and queueing the same: the critical one gets the node's cores
    # first, the best-effort one what is left over its floor.
    crit = replica(
        "crit", priority=CRITICAL, cpus=1.0, used=1.0, throttled=0.5, cpus_min=0.25,
        cpus_max=1.75, latency_ms=200, compute_ms=100,
    )  # fmt: skip
    be = replica(
        "be", priority=BEST_EFFORT, cpus=1.0, used=1.0, throttled=0.5, cpus_min=0.5,
        cpus_max=2.0, latency_ms=200, compute_ms=100,
    )  # fmt: skip
    sample = node(crit, be)
    quotas = after(plan_cpus("gain", sample), sample)
    assert quotas["crit"] >= 1.4
    assert 0.5 <= quotas["be"] <= 0.6
    # A replica using clearly less than its quota gains nothing past its use + headroom:
    # it gives back even with nobody else asking.
    idle = replica("idle", priority=CRITICAL, cpus=1.5, used=0.3, cpus_min=0.25)
    assert plan_cpus("gain", node(idle))["idle"][0] == pytest.approx(0.55)


def test_gain_grows_a_queueing_replica_more_than_one_that_is_only_throttled() -> None:
    common = dict(cpus=1.0, used=1.0, throttled=0.4, cpus_min=0.25, priority=STANDARD)
    queueing = replica("q", latency_ms=500, compute_ms=100, queued=8, **common)  # type: ignore[arg-type]
    plain = replica("p", latency_ms=100, compute_ms=100, **common)  # type: ignore[arg-type]
    sample = node(queueing, plain)
    quotas = after(plan_cpus("gain", sample), sample)
    assert quotas["q"] > quotas["p"]


class Recorder:
    def __init__(self, fail: dict[str, BaseException] | None = None) -> None:
        self.calls: list[tuple[str, float]] = []
        self.fail = fail or {}

    async def __call__(self, replica_id: str, cores: float) -> None:
        self.calls.append((replica_id, cores))
        if replica_id in self.fail:
            raise self.fail[replica_id]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_the_manager_applies_and_records_each_change() -> None:
    apply, clock = Recorder(), Clock()
    manager = ResourceManager("usage", apply=apply, clock=clock)
    assert manager.policy == "usage"
    assert await manager.step(node(bursting(), busy_best_effort(), interval_s=0)) == []
    made = await manager.step(node(bursting(), busy_best_effort()))
    assert {e.replica_id for e in made} == {"crit", "be"} or {e.replica_id for e in made} == {
        "crit"
    }
    crit = next(e for e in made if e.replica_id == "crit")
    assert (crit.cpus_before, crit.deployment_id, crit.policy, crit.at) == (
        0.5,
        "dep-crit",
        "usage",
        1000.0,
    )
    assert ("crit", crit.cpus_after) in apply.calls
    assert manager.events() == made
    # Event ids are unique, across managers too (a daemon restarted).
    other = ResourceManager("usage", apply=Recorder(), clock=clock)
    again = await other.step(node(bursting(), busy_best_effort()))
    assert {e.event_id for e in made}.isdisjoint(e.event_id for e in again)


async def test_the_manager_holds_a_shrink_until_the_last_change_settles() -> None:
    apply, clock = Recorder(), Clock()
    manager = ResourceManager("usage", apply=apply, clock=clock)
    grown = await manager.step(node(bursting(0.5), busy_best_effort(1.0)))
    crit = next(e for e in grown if e.replica_id == "crit").cpus_after
    # The burst ends at once: the critical one keeps its CPU for now...
    clock.now += 1.0
    made = await manager.step(node(quiet_critical(crit), busy_best_effort(2.0 - crit)))
    assert "crit" not in {e.replica_id for e in made}
    # ... and gives it back once its last change is `shrink_after_s` old.
    clock.now += ResizeSettings().shrink_after_s
    made = await manager.step(node(quiet_critical(crit), busy_best_effort(2.0 - crit)))
    back = next(e for e in made if e.replica_id == "crit")
    assert back.cpus_after < crit
    assert "used 0.05 cores" in back.reason


async def test_static_manager_never_applies() -> None:
    manager = ResourceManager("static", apply=_never)
    for _ in range(3):
        assert await manager.step(node(bursting(), busy_best_effort())) == []
    assert manager.events() == []


async def test_an_unsupported_replica_is_left_alone_after_the_first_try(
    caplog: pytest.LogCaptureFixture,
) -> None:
    apply = Recorder(fail={"crit": Unsupported("the process runtime cannot limit CPU here")})
    manager = ResourceManager("usage", apply=apply)
    for _ in range(3):
        made = await manager.step(node(bursting(), busy_best_effort()))
        assert "crit" not in {e.replica_id for e in made}
    assert len([c for c in apply.calls if c[0] == "crit"]) == 1
    assert sum("not resizable" in r.message for r in caplog.records) == 1
    # Its quota (0.5) is left to it: the best-effort one gets the rest of the node.
    assert apply.calls[-1] == ("be", 1.5)


async def test_another_error_is_retried_at_the_next_step(caplog: pytest.LogCaptureFixture) -> None:
    apply = Recorder(fail={"crit": ReplicaNotFound("gone meanwhile")})
    manager = ResourceManager("usage", apply=apply)
    for _ in range(2):
        assert await manager.step(node(bursting())) == []
    assert [c[0] for c in apply.calls] == ["crit", "crit"]
    assert sum("failed" in r.message for r in caplog.records) == 2
    del apply.fail["crit"]
    assert [e.replica_id for e in await manager.step(node(bursting()))] == ["crit"]


async def test_the_event_window_is_bounded_newest_last() -> None:
    clock = Clock()
    manager = ResourceManager("usage", apply=Recorder(), clock=clock)
    limit = 0.5
    for _ in range(EVENT_WINDOW + 10):
        clock.now += 10
        limit = 1.0 if limit == 0.5 else 0.5
        # Alternate between a burst and a quiet spell: a change every step.
        sample = node(bursting(limit) if limit == 0.5 else quiet_critical(limit))
        await manager.step(sample)
    events = manager.events()
    assert len(events) == EVENT_WINDOW
    assert [e.at for e in events] == sorted(e.at for e in events)
    assert events[-1].at == clock.now


async def test_a_new_replica_is_not_shrunk_on_its_first_figures() -> None:
    # A replica's first CPU figure reads 0 (nothing to take a difference from): it keeps its
    # quota until it has been sampled for `shrink_after_s`.
    clock = Clock()
    manager = ResourceManager("usage", apply=Recorder(), clock=clock)
    idle = replica("new", cpus=1.0, used=0.0, cpus_min=0.25)
    assert await manager.step(node(idle)) == []
    clock.now += 1.0
    assert await manager.step(node(idle)) == []
    clock.now += ResizeSettings().shrink_after_s
    assert [e.cpus_after for e in await manager.step(node(idle))] == [0.25]


async def test_a_held_shrink_gives_way_to_a_critical_burst_but_not_to_a_lower_class() -> None:
    clock = Clock()
    manager = ResourceManager("gain", apply=Recorder(), clock=clock)
    clock.now += 10
    # The best-effort one was just grown into the whole node between bursts...
    await manager.step(node(quiet_critical(0.5), busy_best_effort(1.0)))
    be_quota = next(e.cpus_after for e in manager.events() if e.replica_id == "be")
    assert be_quota > 1.0
    # ... and a burst starts a moment later: its cores go to the critical one at once.
    clock.now += 0.5
    made = {
        e.replica_id: e.cpus_after
        for e in await manager.step(node(bursting(0.25), busy_best_effort(be_quota)))
    }
    assert made["crit"] >= 1.0 and made["be"] < be_quota
    # The burst over, the critical one's shrink is held: the best-effort one waits for it.
    clock.now += 0.5
    made = {
        e.replica_id: e.cpus_after
        for e in await manager.step(
            node(quiet_critical(made["crit"]), busy_best_effort(made["be"]))
        )
    }
    assert made == {}


def test_gain_does_not_take_from_a_replica_the_cores_it_uses() -> None:
    # The critical one uses 0.77 of its 1.5 cores, unthrottled; the best-effort one is
    # throttled: the critical one gives back only down to its use plus headroom.
    crit = replica(
        "crit", priority=CRITICAL, cpus=0.5, limit=1.5, used=0.77, cpus_min=0.25,
        cpus_max=1.75,
    )  # fmt: skip
    sample = node(crit, busy_best_effort(0.5))
    quotas = after(plan_cpus("gain", sample), sample)
    assert quotas["crit"] == pytest.approx(0.77 + 0.25, abs=0.06)  # its headroom too
    assert quotas["be"] >= 0.9


@pytest.mark.parametrize("policy", ["usage", "gain"])
def test_a_replica_with_a_figure_that_is_not_a_number_is_left_alone(policy: str) -> None:
    odd = replica("odd", cpus=1.0, used=float("nan"), throttled=0.5)
    sample = node(odd, bursting())
    plan = plan_cpus(policy, sample)
    assert "odd" not in plan
    assert plan["crit"][0] <= 1.0 + 1e-9  # its 1.0 core stays counted
