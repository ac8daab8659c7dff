"""The rebalancing policy on small hand-made clusters: 8-core nodes sampled every 2 s, whose
scores are worked out by hand from the module docstring's formula (default settings: hot at
0.80 for 10 s, targets at most 0.50, cooldown 120 s, one rebalance at a time)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import pytest

from migration.rebalance import (
    DeploymentView,
    MoveRecord,
    NodeView,
    Rebalance,
    RebalanceSettings,
    RebalanceVerdict,
    Trend,
    plan_rebalances,
    rate_trend,
)

NOW = 1000.0
STEP = 2.0
SETTINGS = RebalanceSettings()

Profile = Callable[[float], float]


def samples(
    profile: Profile | float, now: float = NOW, span: float = 60.0
) -> list[tuple[float, float]]:
    """A value every STEP seconds over the last `span` seconds up to `now`."""
    f = profile if callable(profile) else (lambda _t, v=profile: v)
    count = int(span / STEP)
    return [(now - STEP * i, f(now - STEP * i)) for i in range(count, -1, -1)]


def ramp(start: float, end: float, now: float = NOW, span: float = 60.0) -> Profile:
    return lambda t: start + (end - start) * (t - (now - span)) / span


def since(at: float, before: float, after: float) -> Profile:
    """`before` until `at`, `after` from then on."""
    return lambda t: after if t >= at else before


def node(node_id: str, load: Profile | float, now: float = NOW, ready: bool = True) -> NodeView:
    return NodeView(node_id, f"site-{node_id}", samples(load, now), ready=ready, cpu_cores=8.0)


def dep(
    deployment_id: str,
    node_id: str,
    priority: int = 1,
    rate: Profile | float = 4.0,
    cpu: float = 2.0,
    slo: float = 0.0,
    p99: float = 0.0,
    latency: Mapping[str, float] | None = None,
    fits: Mapping[str, bool] | Callable[[str], bool] | None = None,
    now: float = NOW,
) -> DeploymentView:
    nodes = ("n1", "n2", "n3", "n4")
    return DeploymentView(
        deployment_id,
        node_id,
        priority,
        samples(rate, now),
        latency if latency is not None else dict.fromkeys(nodes, 5.0),
        fits if fits is not None else dict.fromkeys(nodes, True),
        latency_slo_ms=slo,
        p99_ms=p99,
        cpu_used_cores=cpu,
    )


def moved(verdict: RebalanceVerdict) -> list[tuple[str, str, str]]:
    return [(m.deployment_id, m.source_node, m.target_node) for m in verdict.moves]


# --- when: sustained heat ----------------------------------------------------------------


def test_nothing_moves_when_no_node_is_hot() -> None:
    verdict = plan_rebalances(
        [node("n1", 0.75), node("n2", 0.1)], [dep("d-1", "n1")], SETTINGS, NOW
    )
    assert verdict.moves == ()
    assert verdict.hot_nodes == ()
    assert verdict.reason == "nothing moved: no node is hot (load >= 0.80 for 10 s)"


def test_heat_that_is_not_sustained_moves_nothing() -> None:
    # Hot for the last 6 s only.
    verdict = plan_rebalances(
        [node("n1", since(NOW - 6, 0.5, 0.95)), node("n2", 0.1)],
        [dep("d-1", "n1")],
        SETTINGS,
        NOW,
    )
    assert verdict.moves == ()
    assert "n1 load 0.95 for 6 s, not yet 10 s" in verdict.reason

    # One sample under the threshold restarts the run, however long it was.
    dip = NOW - 4
    verdict = plan_rebalances(
        [node("n1", lambda t: 0.7 if t == dip else 0.95), node("n2", 0.1)],
        [dep("d-1", "n1")],
        SETTINGS,
        NOW,
    )
    assert verdict.moves == ()
    assert "n1 load 0.95 for 2 s, not yet 10 s" in verdict.reason


def test_a_sustained_hot_node_sheds_a_deployment_with_its_reason() -> None:
    verdict = plan_rebalances(
        [node("n1", since(NOW - 14, 0.4, 0.93)), node("n2", 0.12)],
        [
            dep(
                "d-3",
                "n1",
                rate=ramp(6.0, 4.0),
                slo=50.0,
                p99=10.0,
                latency={"n1": 5.0, "n2": 8.2},
            )
        ],
        SETTINGS,
        NOW,
    )
    assert moved(verdict) == [("d-3", "n1", "n2")]
    assert verdict.hot_nodes == ("n1",)
    # relief 2/8 = 0.25; gain 0.93 - max(0.68, 0.37) = 0.25
    # cost 1 (best-effort) + 3.2/50 + 4/(4+10) + (clamp(-0.4) + 0.5)
    cost = 1 + 3.2 / 50 + 4 / 14 + 0.1
    assert verdict.moves[0].score == pytest.approx(0.25 / cost)
    assert verdict.moves[0].reason == (
        "node n1 load 0.93 for 14 s (threshold 0.80); moving d-3 (best-effort, 4.0 req/s, "
        "falling, 0.25 of the node's load) to n2 (load 0.12 -> 0.37, +3.2 ms network latency, "
        "SLO 50 ms: 8.2 ms network + 10.0 ms p99)"
    )
    assert verdict.reason == "rebalancing: d-3 n1 -> n2"


# --- which: priority and trend -------------------------------------------------------------


def test_the_lowest_priority_deployment_goes_before_a_critical_one() -> None:
    nodes = [node("n1", 0.93), node("n2", 0.1)]
    deployments = [dep("d-crit", "n1", priority=3), dep("d-be", "n1", priority=1)]
    verdict = plan_rebalances(nodes, deployments, SETTINGS, NOW)
    assert moved(verdict) == [("d-be", "n1", "n2")]
    # Equal gain 0.25; cost 1 + 4/14 + 0.5 against 4 + 4/14 + 0.5.
    assert verdict.moves[0].score == pytest.approx(0.25 / (1.5 + 4 / 14))
    assert (
        f"d-crit on n1: not chosen (its best option, n2, scores {0.25 / (4.5 + 4 / 14):.3f}; "
        "a better move or the cap came first)"
    ) in verdict.details


def test_a_falling_deployment_goes_before_a_fast_growing_one() -> None:
    # Both serve 4 req/s now; one came from 1 req/s, the other from 7.
    nodes = [node("n1", 0.93), node("n2", 0.1)]
    deployments = [
        dep("d-grow", "n1", rate=ramp(1.0, 4.0)),
        dep("d-fall", "n1", rate=ramp(7.0, 4.0)),
    ]
    verdict = plan_rebalances(nodes, deployments, SETTINGS, NOW)
    assert moved(verdict) == [("d-fall", "n1", "n2")]
    assert "falling" in verdict.moves[0].reason


def test_priority_outweighs_a_modest_growth() -> None:
    # A growing best-effort deployment still goes before a steady standard one.
    nodes = [node("n1", 0.93), node("n2", 0.1)]
    deployments = [
        dep("d-std", "n1", priority=2, rate=4.0),
        dep("d-be", "n1", priority=1, rate=ramp(3.0, 4.0)),
    ]
    assert moved(plan_rebalances(nodes, deployments, SETTINGS, NOW)) == [("d-be", "n1", "n2")]


def test_without_cpu_figures_relief_is_the_share_of_the_request_rate() -> None:
    # The node reports no cores: the busier deployment relieves more, but also costs more.
    nodes = [
        NodeView("n1", "a", samples(0.9), cpu_cores=0.0),
        NodeView("n2", "b", samples(0.1), cpu_cores=0.0),
    ]
    deployments = [dep("d-busy", "n1", rate=9.0, cpu=0.0), dep("d-idle", "n1", rate=1.0, cpu=0.0)]
    verdict = plan_rebalances(nodes, deployments, SETTINGS, NOW)
    # d-busy: relief 0.81, but n2 would go to 0.91 (hot); d-idle: relief 0.09.
    assert moved(verdict) == [("d-idle", "n1", "n2")]
    assert "d-busy on n1: no target: n2 would turn hot (load 0.10 -> 0.91)" in verdict.details


def test_rate_trend_is_a_least_squares_fit_over_the_window() -> None:
    trend = rate_trend(samples(ramp(2.0, 8.0)), NOW, 60.0)
    # slope 0.1 req/s per s, over 60 s, against a mean of 5 req/s
    assert (trend.rate_per_s, trend.growth) == pytest.approx((8.0, 1.2))
    assert trend.label == "fast-growing"
    steady = rate_trend(samples(4.0), NOW, 60.0)
    assert (steady.rate_per_s, steady.growth) == pytest.approx((4.0, 0.0))
    assert rate_trend(samples(ramp(6.0, 2.0)), NOW, 60.0).label == "falling"
    # Only the window counts: a ramp that ended 60 s ago is steady now.
    old_ramp = [(t - 60.0, r) for t, r in samples(ramp(0.0, 4.0))]
    assert rate_trend([*old_ramp, *samples(4.0)], NOW, 30.0).label == "steady"
    assert rate_trend([], NOW, 60.0) == Trend(0.0, 0.0)
    assert rate_trend([(NOW, 3.0)], NOW, 60.0) == Trend(3.0, 0.0)


# --- the SLO guard ---------------------------------------------------------------------------


def test_a_target_too_far_for_the_slo_is_refused_with_the_reason() -> None:
    nodes = [node("n1", 0.93), node("n2", 0.1)]
    far = dep("d-1", "n1", slo=50.0, p99=20.0, latency={"n1": 5.0, "n2": 40.0})
    verdict = plan_rebalances(nodes, [far], SETTINGS, NOW)
    assert verdict.moves == ()
    assert verdict.reason == (
        "nothing moved: node n1 load 0.93 for 60 s, but no deployment on it can move: "
        "d-1 on n1: no target: n2 too far for its SLO (40.0 ms network + 20.0 ms p99 = "
        "60.0 ms > 50 ms)"
    )

    # A nearer node, even a busier one, is taken instead.
    nodes.append(node("n3", 0.3))
    ok = dep("d-1", "n1", slo=50.0, p99=20.0, latency={"n1": 5.0, "n2": 40.0, "n3": 25.0})
    assert moved(plan_rebalances(nodes, [ok], SETTINGS, NOW)) == [("d-1", "n1", "n3")]


def test_a_target_no_farther_is_allowed_even_when_the_p99_alone_misses_the_slo() -> None:
    # Queueing on the hot node pushes the p99 past the SLO; a node as near cannot be worse.
    nodes = [node("n1", 0.93), node("n2", 0.1)]
    d = dep("d-1", "n1", slo=50.0, p99=60.0, latency={"n1": 5.0, "n2": 5.0})
    assert moved(plan_rebalances(nodes, [d], SETTINGS, NOW)) == [("d-1", "n1", "n2")]


def test_a_target_it_does_not_fit_on_is_refused_and_the_dry_run_asked_last() -> None:
    asked: list[str] = []

    def fits(node_id: str) -> bool:
        asked.append(node_id)
        return node_id == "n4"

    nodes = [node("n1", 0.93), node("n2", 0.1), node("n3", 0.7), node("n4", 0.2)]
    d = dep("d-1", "n1", fits=fits, latency={"n1": 5.0, "n2": 5.0, "n3": 5.0, "n4": 5.0})
    verdict = plan_rebalances(nodes, [d], SETTINGS, NOW)
    assert moved(verdict) == [("d-1", "n1", "n4")]
    assert asked == ["n2", "n4"]  # n3 has no headroom: never asked


# --- no oscillation -------------------------------------------------------------------------


def test_no_move_back_within_the_cooldown_when_the_target_turns_hot() -> None:
    """Rounds every 20 s: d-1 moves n1 -> n2, the move ends at 1005, then n2 turns hot and n1
    cools. d-1 stays on n2 until the cooldown (120 s after the move ended) is over."""
    verdict = plan_rebalances(
        [node("n1", 0.93), node("n2", 0.1)], [dep("d-1", "n1")], SETTINGS, NOW
    )
    assert moved(verdict) == [("d-1", "n1", "n2")]
    done = MoveRecord("d-1", "n1", "n2", at=NOW + 5)

    def round_at(now: float) -> RebalanceVerdict:
        return plan_rebalances(
            [
                node("n1", since(NOW + 5, 0.93, 0.1), now),
                node("n2", since(NOW + 6, 0.1, 0.95), now),
            ],
            [dep("d-1", "n2", now=now)],
            SETTINGS,
            now,
            recent=[done],
        )

    for now in (NOW + 20, NOW + 40, NOW + 60, NOW + 80, NOW + 100, NOW + 120):
        verdict = round_at(now)
        assert verdict.hot_nodes == ("n2",), now
        assert verdict.moves == (), now
        assert "d-1 on n2: cooling down (moved n1 -> n2" in verdict.reason
        assert "not moved again, nor back, within 120 s" in verdict.reason
    # The cooldown is over: it may go back now.
    assert moved(round_at(NOW + 126)) == [("d-1", "n2", "n1")]


def test_a_move_resets_the_heat_of_the_nodes_it_touched() -> None:
    """Heat measured before a move ended does not count afterwards, so two rounds do not
    move twice for the same heat; a node a move touched is no target for `sustain_s`."""
    # d-1 left n1 4 s ago: n1's earlier heat does not count, so d-2 stays for now...
    recent = [MoveRecord("d-1", "n1", "n3", at=NOW - 4), MoveRecord("d-7", "n4", "n2", at=NOW + 2)]

    def round_at(now: float) -> RebalanceVerdict:
        nodes = [node("n1", 0.93, now), node("n2", 0.1, now), node("n3", 0.2, now)]
        return plan_rebalances(nodes, [dep("d-2", "n1", now=now)], SETTINGS, now, recent=recent)

    verdict = round_at(NOW)
    assert verdict.moves == ()
    assert "n1 load 0.93 for 2 s, not yet 10 s" in verdict.reason  # samples after NOW - 4
    # ...until n1 has stayed hot 10 s since; then d-2 goes to n3, not to the idler n2, which
    # took d-7 6 s ago and is still settling.
    verdict = round_at(NOW + 8)
    assert moved(verdict) == [("d-2", "n1", "n3")]
    assert "n2 settling after a move 6 s ago" in verdict.details[0]


# --- the cap, and nowhere to go -----------------------------------------------------------


def test_the_concurrency_cap_holds_cluster_wide() -> None:
    nodes = [node("n1", 0.95), node("n2", 0.9), node("n3", 0.1), node("n4", 0.2)]
    deployments = [dep("d-1", "n1"), dep("d-2", "n2")]
    one = plan_rebalances(nodes, deployments, SETTINGS, NOW)
    assert moved(one) == [("d-1", "n1", "n3")]  # equal scores: the first id, the first node
    assert "d-2 on n2: not chosen (its best option, n3," in one.details[-1]

    # Both move, each to its own target: d-2's best, n3, is taken, so it gets its second.
    two = plan_rebalances(nodes, deployments, RebalanceSettings(max_concurrent=2), NOW)
    assert moved(two) == [("d-1", "n1", "n3"), ("d-2", "n2", "n4")]

    flying = [MoveRecord("d-9", "n5", "n6", at=NOW - 3)]
    full = plan_rebalances(nodes, deployments, SETTINGS, NOW, in_flight=flying)
    assert full.moves == ()
    assert full.reason.endswith("but 1 rebalance(s) in flight (cap 1)")
    assert full.hot_nodes == ("n1", "n2")

    # A move in flight leaves its nodes alone: n1's deployment waits, n2's goes to n4.
    flying = [MoveRecord("d-9", "n1", "n3", at=NOW - 3)]
    verdict = plan_rebalances(
        nodes, deployments, RebalanceSettings(max_concurrent=3), NOW, in_flight=flying
    )
    assert moved(verdict) == [("d-2", "n2", "n4")]


def test_no_target_with_headroom_moves_nothing_and_says_why() -> None:
    nodes = [node("n1", 0.93), node("n2", 0.7), node("n3", 0.1, ready=False)]
    verdict = plan_rebalances(nodes, [dep("d-1", "n1")], SETTINGS, NOW)
    assert verdict.moves == ()
    assert verdict.reason == (
        "nothing moved: node n1 load 0.93 for 60 s, but no node has headroom (load <= 0.50 "
        "for 10 s): n2 load 0.70; n3 not ready"
    )

    # A target that was busy within the last 10 s is no target either.
    busy = node("n2", since(NOW - 8, 0.7, 0.1))
    verdict = plan_rebalances([nodes[0], busy], [dep("d-1", "n1")], SETTINGS, NOW)
    assert verdict.moves == ()
    assert "n2 load 0.70" in verdict.reason


def test_a_move_that_would_heat_the_target_or_gain_too_little_is_refused() -> None:
    nodes = [node("n1", 0.93), node("n2", 0.3)]
    big = dep("d-big", "n1", cpu=6.0)  # 0.75 of n1: n2 would reach 1.05
    small = dep("d-small", "n1", cpu=0.2)  # 0.025 of n1: under min_improvement 0.05
    verdict = plan_rebalances(nodes, [big, small], SETTINGS, NOW)
    assert verdict.moves == ()
    assert "d-big on n1: no target: n2 would turn hot (load 0.30 -> 1.05)" in verdict.reason
    assert "d-small on n1: no target: n2 gains too little (0.03 < 0.05 load)" in verdict.reason


# --- determinism and inputs --------------------------------------------------------------------


def test_ties_are_broken_by_deployment_then_node_id_whatever_the_input_order() -> None:
    nodes = [node("n1", 0.93), node("n3", 0.1), node("n2", 0.1)]
    deployments = [dep("d-b", "n1"), dep("d-a", "n1"), dep("d-c", "n1")]
    expected = plan_rebalances(nodes, deployments, SETTINGS, NOW)
    assert moved(expected) == [("d-a", "n1", "n2")]
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(nodes)
        rng.shuffle(deployments)
        assert plan_rebalances(nodes, deployments, SETTINGS, NOW) == expected


def test_rebalancing_off_moves_nothing() -> None:
    verdict = plan_rebalances(
        [node("n1", 0.95), node("n2", 0.1)],
        [dep("d-1", "n1")],
        RebalanceSettings(max_concurrent=0),
        NOW,
    )
    assert verdict == RebalanceVerdict((), "rebalancing is off (max_concurrent 0)")


def test_a_hot_node_with_nothing_movable_says_so() -> None:
    verdict = plan_rebalances([node("n1", 0.95), node("n2", 0.1)], [], SETTINGS, NOW)
    assert verdict.moves == ()
    assert verdict.reason == (
        "nothing moved: node n1 load 0.95 for 60 s, but it runs nothing rebalancing may move"
    )
    assert verdict.render().splitlines()[0] == verdict.reason


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hot_load": 0.0},
        {"hot_load": 0.5, "target_max_load": 0.5},
        {"cooldown_s": -1.0},
        {"max_concurrent": -1},
        {"priority_weights": (1.0, 0.0, 2.0, 4.0)},
        {"trend_window_s": float("nan")},
    ],
)
def test_settings_out_of_range_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RebalanceSettings(**kwargs)  # type: ignore[arg-type]


def test_views_refuse_figures_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        NodeView("n1", "a", [(NOW, 1.5)])
    with pytest.raises(ValueError, match="finite"):
        NodeView("n1", "a", [(NOW, float("nan"))])
    with pytest.raises(ValueError, match="priority"):
        dep("d-1", "n1", priority=7)
    with pytest.raises(ValueError, match="latency_slo_ms"):
        dep("d-1", "n1", slo=-1.0)
    with pytest.raises(ValueError, match="negative request rate"):
        dep("d-1", "n1", rate=-1.0)


def test_a_rebalance_is_a_plain_value() -> None:
    move = Rebalance("d-1", "n1", "n2", "why", 0.5)
    assert (move.deployment_id, move.source_node, move.target_node) == ("d-1", "n1", "n2")
