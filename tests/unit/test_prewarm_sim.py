"""Pre-warm in the policy simulator on hand-made cases whose figures are known: vehicles
driving one route, one after the other, so the transition model learns it from the first."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from broker.network import EdgeNetwork, NodeLocation, SiteLink
from broker.placement import NodeSnapshot
from edge_client.mobility.cluster import DEMO_CAPTURES, DEMO_SPECS, build_cluster, load_topologies
from edge_client.mobility.simulator import CostModel, Figures, SimOptions, simulate
from edge_client.mobility.traces import HandoverSettings, Link, MobilityTrace, Site, Vehicle
from migration.policy import Hysteresis, PrewarmSettings
from tests.unit.test_simulator import grid_of_sites

COSTS = CostModel(start_s=0.95, switch_s=0.005, drain_s=0.6)
OPTIONS = SimOptions(hysteresis=Hysteresis(), costs=COSTS, share_fraction=0.0)
LINE = ("A", "B", "C", "D")


@pytest.fixture(scope="module")
def four_gpus():  # the demo's 4-GPU PCIe server
    return load_topologies(DEMO_CAPTURES, {"24": DEMO_SPECS["24"]})[0]


def line(vehicles: list[Vehicle], sites: tuple[str, ...] = LINE) -> MobilityTrace:
    """Sites in a line, 10 ms apart."""
    return MobilityTrace(
        name="line",
        duration_s=5000.0,
        sites=tuple(Site(s, 500 * i, 0, 250, access_ms=1.0) for i, s in enumerate(sites)),
        links=tuple(Link(a, b, 10.0) for a, b in pairwise(sites)),
        vehicles=tuple(vehicles),
        handover=HandoverSettings(50, 2),
    )


def one_node_per_site(trace: MobilityTrace, topology) -> tuple[EdgeNetwork, list[NodeSnapshot]]:
    names = [s.name for s in trace.sites]
    network = EdgeNetwork.build(
        names,
        [SiteLink(link.a, link.b, link.latency_ms) for link in trace.links],
        {f"node-{s.lower()}": NodeLocation(s, 0.5) for s in names},
    )
    return network, [NodeSnapshot.idle(f"node-{s.lower()}", s, topology) for s in names]


def drive(name: str, start: float, sites: tuple[str, ...] = LINE, dwell: float = 100.0) -> Vehicle:
    steps = tuple((start + i * dwell, site) for i, site in enumerate(sites))
    return Vehicle(name, steps, start + len(sites) * dwell)


def prewarmed(results: list[Figures]) -> Figures:
    (run,) = [r for r in results if r.policy == "today's policy + pre-warm"]
    return run


def test_followers_of_a_learnt_route_hit_every_move(four_gpus) -> None:
    # v1 teaches the route A -> B -> C -> D: its 3 moves start cold. v2 and v3 drive it later:
    # each is warmed at B from its arrival at A (t0), at C from its switch to B (t0 + 100.005)
    # and at D from its switch to C; each of their moves is a hit. Nobody ever left D.
    trace = line([drive("v1", 0), drive("v2", 500), drive("v3", 1000)])
    network, nodes = one_node_per_site(trace, four_gpus)
    settings = PrewarmSettings(budget=5, min_probability=0.3, ttl_s=120)
    results = simulate(trace, network, nodes, OPTIONS, settings)
    today = next(r for r in results if r.policy == "today's policy")
    run = prewarmed(results)
    assert [r.policy for r in results] == [
        "never-migrate",
        "today's policy",
        "today's policy + pre-warm",
        "nearest node (oracle)",
    ]
    assert (today.migrations, run.migrations, run.prewarm_hits) == (9, 9, 6)
    assert run.prewarm_hit_rate == pytest.approx(6 / 9)
    assert (run.standbys_started, run.standbys_lapsed, run.standbys_expired) == (6, 0, 0)
    assert (run.standbys_preempted, run.standbys_declined, run.standbys_max_held) == (0, 0, 1)
    assert run.standby_gpu_s == pytest.approx(2 * (100 + 2 * (100 - COSTS.switch_s)))
    # from the handover to serving at the new node: a hit waits for the switch alone
    assert run.move_to_serving_hit_s == pytest.approx(COSTS.switch_s)
    assert run.move_to_serving_miss_s == pytest.approx(COSTS.start_s + COSTS.switch_s)
    assert run.move_to_serving_s == pytest.approx((6 * 0.005 + 3 * 0.955) / 9)
    assert today.move_to_serving_s == pytest.approx(COSTS.start_s + COSTS.switch_s)
    assert today.prewarm_hits is None and today.standbys_started is None
    # each hit serves at the nearer node 0.95 s sooner: 10 ms less for that long
    saved = 6 * COSTS.start_s * 10.0 / (3 * 400)
    assert today.latency_mean_ms - run.latency_mean_ms == pytest.approx(saved)


def test_standbys_expire_at_their_ttl(four_gpus) -> None:
    # Standbys live 50 s, the vehicles dwell 100 s at each site: every one expires unused.
    trace = line([drive("v1", 0), drive("v2", 500), drive("v3", 1000)])
    network, nodes = one_node_per_site(trace, four_gpus)
    settings = PrewarmSettings(budget=5, min_probability=0.3, ttl_s=50)
    run = prewarmed(simulate(trace, network, nodes, OPTIONS, settings))
    assert (run.migrations, run.prewarm_hits, run.standbys_started) == (9, 0, 6)
    assert (run.standbys_expired, run.standbys_lapsed) == (6, 0)
    assert run.standby_gpu_s == pytest.approx(6 * 50)


def test_a_standby_lapses_when_the_client_turns_elsewhere(four_gpus) -> None:
    # On the line X - A - B, v2 is warmed at B (everyone went A -> B) but turns to X: its
    # standby at B lapses at that handover, held 100 s.
    sites = ("X", "A", "B")
    trace = line([drive("v1", 0, ("A", "B")), drive("v2", 500, ("A", "X"))], sites)
    network, nodes = one_node_per_site(trace, four_gpus)
    settings = PrewarmSettings(budget=5, min_probability=0.3, ttl_s=500)
    run = prewarmed(simulate(trace, network, nodes, OPTIONS, settings))
    assert (run.standbys_started, run.standbys_lapsed, run.prewarm_hits) == (1, 1, 0)
    assert run.standby_gpu_s == pytest.approx(100)


def test_the_budget_caps_standbys_held_at_once(four_gpus) -> None:
    # v2 and v3 drive the learnt route together; with one standby allowed, v2 (first in the
    # trace) holds it all along and hits 3 times; v3 is refused at A, at B and at C.
    trace = line([drive("v1", 0), drive("v2", 500), drive("v3", 500)])
    network, nodes = one_node_per_site(trace, four_gpus)
    settings = PrewarmSettings(budget=1, min_probability=0.3, ttl_s=120)
    run = prewarmed(simulate(trace, network, nodes, OPTIONS, settings))
    assert run.standbys_max_held == 1
    assert (run.prewarm_hits, run.standby_refused_budget, run.standbys_started) == (3, 3, 3)
    roomy = prewarmed(simulate(trace, network, nodes, OPTIONS, PrewarmSettings(budget=2)))
    assert (roomy.standbys_max_held, roomy.prewarm_hits, roomy.standby_refused_budget) == (2, 6, 0)


def warmed_at_b(arrivals_at_b: int) -> MobilityTrace:
    """v1 teaches A -> B; v2 arrives at A at 200 and is warmed at B (node-b idle, so its
    standby holds node-b's best GPU); `arrivals_at_b` vehicles arrive at B at 250, before v2
    gets there at 300."""
    vehicles = [
        Vehicle("v1", ((0.0, "A"), (100.0, "B")), 150.0),
        Vehicle("v2", ((200.0, "A"), (300.0, "B")), 400.0),
    ]
    vehicles += [Vehicle(f"new{i}", ((250.0, "B"),), 400.0) for i in range(arrivals_at_b)]
    return line(vehicles, ("A", "B"))


def test_an_arriving_deployment_takes_the_gpus_a_standby_holds(four_gpus) -> None:
    # One vehicle arrives at B while node-b has 3 GPUs free besides v2's standby: placement
    # does not see the standby, chooses the GPU it holds (the best one) and evicts it. v2 then
    # reaches B with no standby: a cold move.
    trace = warmed_at_b(1)
    network, nodes = one_node_per_site(trace, four_gpus)
    options = replace(OPTIONS, check_every=1)
    run = prewarmed(simulate(trace, network, nodes, options, PrewarmSettings(budget=1)))
    assert (run.standbys_started, run.standbys_preempted, run.standbys_lapsed) == (1, 1, 0)
    assert run.standby_gpu_s == pytest.approx(50)
    assert (run.prewarm_hits, run.migrations, run.refused_deploy) == (0, 2, 0)  # v1's, v2's


def test_a_standby_never_sends_a_deployment_to_a_worse_node(four_gpus) -> None:
    # Four vehicles arrive at B, whose node has 4 GPUs, one of them held by v2's standby;
    # node-a, 10 ms farther, has room. With pre-warm as without, all four are served at
    # node-b (the standby is evicted), and v2 finds no room to move to at B.
    trace = warmed_at_b(4)
    network, nodes = one_node_per_site(trace, four_gpus)
    options = replace(OPTIONS, check_every=1)
    results = simulate(trace, network, nodes, options, PrewarmSettings(budget=1))
    today, run = next(r for r in results if r.policy == "today's policy"), prewarmed(results)
    assert run.latency_mean_ms == pytest.approx(today.latency_mean_ms)
    assert run.latency_p99_ms == pytest.approx(today.latency_p99_ms)
    assert (run.standbys_started, run.standbys_preempted) == (1, 1)
    assert (run.migrations, run.refused_move, run.refused_deploy) == (1, 1, 0)
    assert (today.migrations, today.refused_move, today.refused_deploy) == (1, 1, 0)


def test_the_cache_stays_exact_with_standbys_coming_and_going() -> None:
    # Vehicles circle the 8 border sites of a 3 x 3 grid, either way round and turning back
    # now and then, on a cluster with little room: standbys are warmed, hit, lapse, expire and
    # are preempted; every decision of both caches is also taken by `place` itself
    # (check_every=1), which raises on any disagreement, as does a drift between them.
    rng = random.Random(7)
    _, sites, links = grid_of_sites()
    ring = ["s00", "s01", "s02", "s12", "s22", "s21", "s20", "s10"]
    vehicles = []
    for i in range(80):
        way = rng.choice((1, -1))
        at, t, steps = rng.randrange(8), rng.uniform(0, 60), []
        while t < 500:
            steps.append((round(t, 1), ring[at]))
            if rng.random() < 0.1:
                way = -way
            at = (at + way) % 8
            t += rng.uniform(20, 60)
        vehicles.append(Vehicle(f"v{i}", tuple(steps), 600.0))
    trace = MobilityTrace("ring", 600.0, sites, links, tuple(vehicles), HandoverSettings(0, 0))
    cluster = build_cluster(trace, load_topologies(DEMO_CAPTURES, DEMO_SPECS), nodes=30, seed=2)
    options = SimOptions(
        hysteresis=Hysteresis(cooldown_s=10), fill=0.6, share_fraction=0.3, check_every=1
    )
    settings = PrewarmSettings(budget=20, min_probability=0.3, ttl_s=60)
    run = prewarmed(simulate(trace, cluster.network, cluster.nodes, options, settings))
    assert run.prewarm_hits and run.standbys_preempted and run.standbys_lapsed
    assert run.standbys_expired and run.standby_refused_budget and run.standby_refused_capacity
    assert run.standbys_max_held is not None and run.standbys_max_held <= settings.budget


def test_offload_simulate_with_prewarm(tmp_path, capsys) -> None:
    from edge_client.cli import main

    shipped = Path(__file__).resolve().parents[2] / "edge_client/demo/traces/streets.json"
    out = tmp_path / "figures.json"
    argv = ["simulate", "--trace", str(shipped), "--nodes", "12", "--check-every", "1"]
    assert main([*argv, "--prewarm-budget", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "today's policy + pre-warm" in printed and "standby GPU-seconds" in printed
    figures = json.loads(out.read_text())
    assert figures["options"]["prewarm"]["budget"] == 4
    policies = [r["policy"] for r in figures["results"]]
    assert policies[2] == "today's policy + pre-warm" and len(policies) == 4
    assert figures["results"][2]["prewarm_hit_rate"] is not None


def test_worker_processes_give_the_serial_figures(tmp_path, capsys) -> None:
    # The three policy runs in 2 worker processes and one after the other: the same figures
    # (all but the wall times), in the same order.
    from edge_client.cli import main

    shipped = Path(__file__).resolve().parents[2] / "edge_client/demo/traces/streets.json"
    argv = ["simulate", "--trace", str(shipped), "--nodes", "12", "--prewarm-budget", "4"]
    figures = []
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs-{jobs}.json"
        assert main([*argv, "--jobs", jobs, "--json", str(out)]) == 0
        results = json.loads(out.read_text())["results"]
        figures.append([{k: v for k, v in r.items() if k != "wall_s"} for r in results])
    assert "; 2 job(s)" in capsys.readouterr().out
    serial, parallel = figures
    assert [r["policy"] for r in serial][2] == "today's policy + pre-warm"
    assert serial[2]["standbys_started"] and serial[1]["migrations"]
    assert parallel == serial
