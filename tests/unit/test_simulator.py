"""The mobility simulator on hand-made cases whose figures are known, and its placement cache
against `place` itself."""

from __future__ import annotations

import math
import random

import pytest

from broker.network import EdgeNetwork, NodeLocation, SiteLink
from broker.placement import NodeSnapshot
from edge_client.mobility.cluster import DEMO_CAPTURES, DEMO_SPECS, build_cluster, load_topologies
from edge_client.mobility.simulator import CostModel, Figures, SimOptions, simulate
from edge_client.mobility.traces import HandoverSettings, Link, MobilityTrace, Site, Vehicle
from migration.policy import Hysteresis

COSTS = CostModel(start_s=0.95, switch_s=0.005, drain_s=0.6)


@pytest.fixture(scope="module")
def four_gpus():  # the demo's 4-GPU PCIe server
    return load_topologies(DEMO_CAPTURES, {"24": DEMO_SPECS["24"]})[0]


def two_sites(vehicles: list[Vehicle]) -> MobilityTrace:
    return MobilityTrace(
        name="hand-made",
        duration_s=200.0,
        sites=(Site("A", 0, 0, 500, access_ms=1.0), Site("B", 1000, 0, 500, access_ms=1.0)),
        links=(Link("A", "B", 10.0),),
        vehicles=tuple(vehicles),
        handover=HandoverSettings(50, 2),
    )


def network(nodes: dict[str, str]) -> EdgeNetwork:
    return EdgeNetwork.build(
        ["A", "B"],
        [SiteLink("A", "B", 10.0)],
        {node_id: NodeLocation(site, 0.5) for node_id, site in nodes.items()},
    )


def by_policy(results: list[Figures]) -> dict[str, Figures]:
    return {r.policy: r for r in results}


def test_a_move_that_pays_and_one_that_is_wasted(four_gpus) -> None:
    # Client 1 drives A -> B and stays: worth moving. Client 2 comes back to A 10 s after the
    # same move: the cooldown holds it on B, so the move is wasted.
    trace = two_sites(
        [
            Vehicle("one", ((0.0, "A"), (100.0, "B")), 200.0),
            Vehicle("two", ((0.0, "A"), (100.0, "B"), (110.0, "A")), 200.0),
        ]
    )
    nodes = {"node-a": "A", "node-b": "B"}
    snapshots = [NodeSnapshot.idle(n, site, four_gpus) for n, site in nodes.items()]
    options = SimOptions(hysteresis=Hysteresis(), costs=COSTS, share_fraction=0.0)
    results = by_policy(simulate(trace, network(nodes), snapshots, options))

    near, far = 1.0 + 0.5, 1.0 + 10.0 + 0.5  # access + path + node access, ms
    never = results["never-migrate"]
    assert never.migrations == 0
    # one: 100 s near, 100 s far; two: 100 near, 10 far, 90 near
    assert never.latency_mean_ms == pytest.approx((290 * near + 110 * far) / 400)

    today = results["today's policy"]
    assert today.migrations == 2
    assert today.wasted == 1
    switch = 100 + 0.95 + 0.005
    lag = switch - 100  # served far while the target starts
    one = (200 - lag) * near + lag * far
    two = (100 + (110 - switch)) * near + (lag + 90) * far  # back at A, held on B
    assert today.latency_mean_ms == pytest.approx((one + two) / 400)
    assert today.client_hours == pytest.approx(400 / 3600)
    assert today.migrations_per_client_hour == pytest.approx(2 / (400 / 3600))
    assert today.refused_deploy == today.refused_move == 0
    assert today.prewarm_hit_rate is None and today.standby_gpu_s is None

    oracle = results["nearest node (oracle)"]
    assert oracle.latency_mean_ms == pytest.approx(near)
    assert oracle.latency_p99_ms == pytest.approx(near)


def test_capacity_refusals(four_gpus) -> None:
    # One 4-GPU node at A and five clients of one GPU: the fifth is refused; the first one's
    # handover to B finds no other node.
    vehicles = [Vehicle("v0", ((0.0, "A"), (50.0, "B")), 100.0)]
    vehicles += [Vehicle(f"v{i}", ((0.0, "A"),), 100.0) for i in range(1, 5)]
    trace = two_sites(vehicles)
    snapshots = [NodeSnapshot.idle("node-a", "A", four_gpus)]
    options = SimOptions(costs=COSTS, share_fraction=0.0)
    results = by_policy(simulate(trace, network({"node-a": "A"}), snapshots, options))
    today, never = results["today's policy"], results["never-migrate"]
    assert (today.refused_deploy, today.refused_move, today.migrations) == (1, 1, 0)
    assert (never.refused_deploy, never.refused_move) == (1, 0)
    assert today.unserved_client_hours == pytest.approx(100 / 3600)
    assert today.client_hours == pytest.approx(500 / 3600)


def grid_of_sites() -> tuple[list[str], tuple[Site, ...], tuple[Link, ...]]:
    """A 3 x 3 grid of sites "s<row><column>", neighbours 4 ms apart: names, sites, links."""
    names = [f"s{r}{c}" for r in range(3) for c in range(3)]
    sites = tuple(Site(n, 0, 0, 1, 1.0) for n in names)
    links = tuple(
        Link(f"s{r}{c}", f"s{r + dr}{c + dc}", 4.0)
        for r in range(3)
        for c in range(3)
        for dr, dc in ((0, 1), (1, 0))
        if r + dr < 3 and c + dc < 3
    )
    return names, sites, links


def test_the_cache_agrees_with_place_and_runs_are_deterministic() -> None:
    # A random trace over a 3 x 3 grid of sites on 200 nodes: every decision is also taken
    # by `place` itself (check_every=1), which raises on any disagreement.
    rng = random.Random(7)
    names, sites, links = grid_of_sites()
    vehicles = []
    for i in range(60):
        t, site, steps = rng.uniform(0, 20), rng.choice(names), []
        while t < 500:
            steps.append((round(t, 1), site))
            site = rng.choice([n for n in names if n != site])
            t += rng.uniform(5, 60)
        vehicles.append(Vehicle(f"v{i}", tuple(steps), 600.0))
    trace = MobilityTrace("random", 600.0, sites, links, tuple(vehicles), HandoverSettings(0, 0))
    topologies = load_topologies(DEMO_CAPTURES, DEMO_SPECS)
    cluster = build_cluster(trace, topologies, nodes=200, seed=3)
    options = SimOptions(
        hysteresis=Hysteresis(cooldown_s=10), fill=0.6, share_fraction=0.3, check_every=1
    )
    first = simulate(trace, cluster.network, cluster.nodes, options)
    again = simulate(trace, cluster.network, cluster.nodes, options)
    strip = [(r.policy, r.migrations, r.wasted, r.latency_mean_ms, r.refused_move) for r in first]
    assert strip == [
        (r.policy, r.migrations, r.wasted, r.latency_mean_ms, r.refused_move) for r in again
    ]
    today = by_policy(first)["today's policy"]
    assert today.migrations > 0
    assert today.decisions > today.migrations
    never, oracle = by_policy(first)["never-migrate"], by_policy(first)["nearest node (oracle)"]
    assert oracle.latency_mean_ms <= today.latency_mean_ms < never.latency_mean_ms
    assert not math.isnan(today.latency_p99_ms)


def test_offload_simulate_prints_the_table(tmp_path, capsys) -> None:
    from pathlib import Path

    from edge_client.cli import main

    shipped = Path(__file__).resolve().parents[2] / "edge_client/demo/traces/streets.json"
    out = tmp_path / "figures.json"
    argv = ["simulate", "--trace", str(shipped), "--nodes", "12", "--check-every", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for label in ("never-migrate", "today's policy", "nearest node (oracle)", "pre-warm hit rate"):
        assert label in printed
    hit_rate = next(line for line in printed.splitlines() if line.startswith("pre-warm hit"))
    assert hit_rate.split()[3:] == ["-", "-", "-"]
    assert "results" in out.read_text()
