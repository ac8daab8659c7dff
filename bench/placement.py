"""Placement at scale: `broker.placement.place` against a first-fit baseline, in one run.

The cluster: 10,000 nodes (1,000 with --quick) of 8 GPUs, each one of the real 8-GPU captures
12 (DGX A100 NV12), 15 (A800 NV8), 21 (DGX-1 V100 hybrid cube-mesh NV1/NV2), 28 (A100 NV12)
and 29 (H100 NV18), read with the capture parser, spread over 50 edge sites joined by a random
connected network (a random tree plus 25 more links, 2-20 ms each); every node has its own
access latency (0.2-2 ms), runtimes, CUDA version and load. Requests come from a seeded stream:
1, 2, 4 or 8 GPUs (weights 4:3:2:1), half of the multi-GPU ones needing P2P, a quarter of
the 1-GPU ones a memory share, priorities best-effort/standard/critical 50/35/15 %, 30 % of the
clients at 5 busy sites, some with a latency SLO, a runtime or a minimum CUDA version, 20 %
asking to spread; releases of random live deployments in between.

(a) Speed. Each policy fills the cluster to 70 % of its GPUs from the stream, then takes the
    timed decisions (20,000; 5,000 with --quick) while a release follows 45 % of the steps and
    a node reports a new load every 10th step. `place` is timed alone (p50/p99), and the
    throughput counts each decision with its snapshot update (`ClusterSnapshot.commit`).
    Preemptions are carried out (the evicted are dropped). Every 100th decision is also taken
    by `place_brute_force` (every node scored) and must agree.
    First-fit: the first node by id with enough free GPUs (whole, or GPUs with room for the
    share), the first such GPUs by index; it ignores sites, P2P, SLOs, runtimes and CUDA. It is
    indexed by free-GPU count, so its time is the baseline's best, not a linear scan.
(b) Quality. Both policies from an empty cluster on the same stream of best-effort requests
    (no SLO, runtime or CUDA constraint, so both face the same problem) with releases (30 % of
    the steps), until each has failed a multi-GPU request: not placed, or placed on a group
    that is not P2P-capable (NVLink, PIX or PXB) when it asked for P2P. Reported over those
    steps: multi-GPU requests satisfied before the first failure, multi-GPU failures, the
    P2P requests given non-P2P groups, the mean slowest link rank
    (`common.topology.link_rank`) of the multi-GPU groups given, the mean client latency.

Target (issue 4): p99 under 2 ms per decision and over 1,000 decisions/s at 10,000 nodes.

    python -m bench.placement [--quick] [--json FILE] [--captures DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import itertools
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from broker.network import EdgeNetwork, SiteLink
from broker.placement import (
    ClusterSnapshot,
    Decision,
    PlacementRequest,
    PriorityClass,
    Strategy,
    place,
    place_brute_force,
)
from common.inventory import P2P_KINDS
from common.topology import Topology, link_rank
from edge_client.mobility.cluster import SimCluster, random_nodes
from node_daemon.inventory import GpuSpec, inventory_from_capture
from tests.data import TOPOLOGIES

CAPTURES = {
    "12": GpuSpec("A100-SXM4-40GB", 40960),
    "15": GpuSpec("A800-SXM4-80GB", 81920),
    "21": GpuSpec("V100-SXM2-16GB", 16384),
    "28": GpuSpec("A100-SXM4-80GB", 81920),
    "29": GpuSpec("H100-SXM5-80GB", 81920),
}
"""Capture number -> the GPUs it has (captures do not say)."""
SITES = 50
BUSY_SITES = 5
SIZES = {1: 4, 2: 3, 4: 2, 8: 1}
"""Request size -> weight."""
PRIORITIES = {
    PriorityClass.BEST_EFFORT: 50,
    PriorityClass.STANDARD: 35,
    PriorityClass.CRITICAL: 15,
}
FILL = 0.70
"""GPU utilization the speed phase fills to before timing."""
TARGET_P99_MS = 2.0
TARGET_RATE = 1000.0


def build_cluster(captures: Path, nodes: int, seed: int) -> SimCluster:
    """`nodes` nodes of the 8-GPU captures over `SITES` sites with a random network."""
    rng = random.Random(seed)
    topologies = [
        Topology.from_inventory(inventory_from_capture(next(captures.glob(f"{n}_*.txt")), spec))
        for n, spec in CAPTURES.items()
    ]
    sites = [f"site-{i:02d}" for i in range(SITES)]
    links = [
        SiteLink(sites[i], sites[rng.randrange(i)], round(rng.uniform(2, 20), 1))
        for i in range(1, SITES)
    ]
    linked = {frozenset((link.a, link.b)) for link in links}
    while len(links) < SITES - 1 + 25:
        a, b = rng.sample(sites, 2)
        if frozenset((a, b)) not in linked:
            linked.add(frozenset((a, b)))
            links.append(SiteLink(a, b, round(rng.uniform(2, 20), 1)))
    snapshots, locations = random_nodes(rng, sites, topologies, nodes)
    return SimCluster(EdgeNetwork.build(sites, links, locations), tuple(snapshots))


@dataclass(frozen=True, slots=True)
class Step:
    """One step of the stream: a request; else a load report (`load` for the node at `pick`
    (0..1) of the node list); else a release (of the live deployment at `pick` of the list)."""

    release: bool
    pick: float
    request: PlacementRequest | None
    load: float | None = None


def stream(cluster: SimCluster, seed: int, release_p: float, constrained: bool) -> Iterator[Step]:
    """The endless request stream (see the module docstring); the same for every policy."""
    rng = random.Random(seed)
    sites = cluster.network.sites
    busy = sites[:BUSY_SITES]
    for n in itertools.count():
        if n % 10 == 9 and constrained:
            yield Step(False, rng.random(), None, round(rng.uniform(0.0, 0.9), 2))
            continue
        if rng.random() < release_p:
            yield Step(True, rng.random(), None)
            continue
        gpus = rng.choices(list(SIZES), list(SIZES.values()))[0]
        share = rng.choice([4096, 8192, 16384]) if gpus == 1 and rng.random() < 0.25 else 0
        site = rng.choice(busy) if rng.random() < 0.3 else rng.choice(sites)
        constraints = constrained and rng.random() < 0.5
        yield Step(
            False,
            0.0,
            PlacementRequest(
                deployment_id=f"d{n}",
                site=site,
                gpus=gpus,
                gpu_memory_mib=share,
                p2p_required=gpus > 1 and rng.random() < 0.5,
                priority=(
                    rng.choices(list(PRIORITIES), list(PRIORITIES.values()))[0]
                    if constrained
                    else PriorityClass.BEST_EFFORT
                ),
                latency_slo_ms=15.0 if constraints and rng.random() < 0.4 else None,
                runtime="docker" if constraints and rng.random() < 0.2 else None,
                min_cuda="12.4" if constraints and rng.random() < 0.2 else None,
                strategy=Strategy.SPREAD if rng.random() < 0.2 else Strategy.PACK,
            ),
        )


# --- the policies --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    node_id: str | None
    gpus: tuple[int, ...]
    evicted: tuple[str, ...]
    decide_s: float
    """Time to decide, in seconds."""
    update_s: float
    """Time to record the decision in the policy's state, in seconds."""


class Policy(Protocol):
    name: str

    def place(self, request: PlacementRequest, check: bool) -> Outcome:
        """Decide and record; `check`: compare with a reference (where there is one)."""
        ...

    def release(self, node_id: str, deployment_id: str) -> None: ...

    def topology(self, node_id: str) -> Topology: ...


class Placer:
    """`place` over a `ClusterSnapshot`, committing each decision (`ClusterSnapshot.commit`)."""

    name = "place"

    def __init__(self, cluster: SimCluster) -> None:
        self.network = cluster.network
        self.snapshot = ClusterSnapshot.of(cluster.nodes)
        self.node_ids = [node.node_id for node in cluster.nodes]
        self.scored: list[int] = []
        self.updates: list[float] = []
        self.checked = 0

    def place(self, request: PlacementRequest, check: bool) -> Outcome:
        started = time.perf_counter()
        decision = place(self.snapshot, request, self.network)
        decided = time.perf_counter()
        self.scored.append(decision.explanation.scored)
        if check:
            self._check(request, decision)
        if decision.node_id is None:
            return Outcome(None, (), (), decided - started, 0.0)
        updating = time.perf_counter()
        self.snapshot = self.snapshot.commit(request, decision)
        updated = time.perf_counter()
        self.updates.append(updated - updating)
        return Outcome(
            decision.node_id,
            decision.gpus,
            decision.preempt,
            decided - started,
            updated - updating,
        )

    def _check(self, request: PlacementRequest, decision: Decision) -> None:
        reference = place_brute_force(self.snapshot, request, self.network)
        if (reference.node_id, reference.gpus, reference.preempt) != (
            decision.node_id,
            decision.gpus,
            decision.preempt,
        ):
            raise AssertionError(
                f"place chose {decision.node_id} {decision.gpus}, the brute force "
                f"{reference.node_id} {reference.gpus}, for {request}"
            )
        self.checked += 1

    def release(self, node_id: str, deployment_id: str) -> None:
        self.snapshot = self.snapshot.release(node_id, deployment_id)

    def report_load(self, pick: float, load: float) -> None:
        node = self.snapshot.node(self.node_ids[int(pick * len(self.node_ids))])
        self.snapshot = self.snapshot.with_node(dataclasses.replace(node, load=load))

    def topology(self, node_id: str) -> Topology:
        return self.snapshot.node(node_id).topology


@dataclass
class _FfNode:
    topology: Topology
    memory: dict[int, int]
    """GPU index -> total MiB."""
    held: dict[int, str] = field(default_factory=dict)
    """GPU index -> the deployment holding it whole."""
    shares: dict[int, dict[str, int]] = field(default_factory=dict)
    """GPU index -> deployment -> MiB."""

    def free(self) -> int:
        return sum(1 for g in self.memory if g not in self.held and not self.shares.get(g))

    def open(self) -> int:
        return sum(1 for g in self.memory if g not in self.held)


class FirstFit:
    """First node by id with enough free GPUs, first GPUs by index (see the module docstring).

    Indexed: for each count c, the sorted positions of the nodes with exactly c free GPUs (and
    with c GPUs not held whole, for shares), so a whole-GPU decision looks at the heads of at
    most 9 lists instead of scanning every node."""

    name = "first-fit"

    def __init__(self, cluster: SimCluster) -> None:
        self.ids = [node.node_id for node in cluster.nodes]
        self.position = {node_id: i for i, node_id in enumerate(self.ids)}
        self.nodes = [
            _FfNode(n.topology, {g.index: g.memory_total_mib for g in n.topology.inventory.gpus})
            for n in cluster.nodes
        ]
        most = max(len(n.memory) for n in self.nodes)
        self.by_free: list[list[int]] = [[] for _ in range(most + 1)]
        self.by_open: list[list[int]] = [[] for _ in range(most + 1)]
        for i, node in enumerate(self.nodes):
            self.by_free[node.free()].append(i)
            self.by_open[node.open()].append(i)
        self.where: dict[str, tuple[int, tuple[int, ...], int]] = {}

    def place(self, request: PlacementRequest, check: bool) -> Outcome:
        started = time.perf_counter()
        found = self._decide(request)
        decided = time.perf_counter()
        if found is None:
            return Outcome(None, (), (), decided - started, 0.0)
        i, gpus = found
        self._reindex(i, request.deployment_id, gpus, request.gpu_memory_mib, hold=True)
        self.where[request.deployment_id] = (i, gpus, request.gpu_memory_mib)
        return Outcome(self.ids[i], gpus, (), decided - started, time.perf_counter() - decided)

    def _decide(self, request: PlacementRequest) -> tuple[int, tuple[int, ...]] | None:
        k, share = request.gpus, request.gpu_memory_mib
        if share == 0:
            heads = [lst[0] for lst in self.by_free[k:] if lst]
            if not heads:
                return None
            node = self.nodes[min(heads)]
            free = [
                g for g in sorted(node.memory) if g not in node.held and not node.shares.get(g)
            ]
            return min(heads), tuple(free[:k])
        for i in heapq.merge(*self.by_open[k:]):
            node = self.nodes[i]
            room = [
                g
                for g in sorted(node.memory)
                if g not in node.held
                and sum(node.shares.get(g, {}).values()) + share <= node.memory[g]
            ]
            if len(room) >= k:
                return i, tuple(room[:k])
        return None

    def release(self, node_id: str, deployment_id: str) -> None:
        i, gpus, share = self.where.pop(deployment_id)
        self._reindex(i, deployment_id, gpus, share, hold=False)

    def topology(self, node_id: str) -> Topology:
        return self.nodes[self.position[node_id]].topology

    def _reindex(
        self, i: int, deployment_id: str, gpus: tuple[int, ...], share: int, hold: bool
    ) -> None:
        node = self.nodes[i]
        for lists, count in ((self.by_free, node.free()), (self.by_open, node.open())):
            del lists[count][bisect.bisect_left(lists[count], i)]
        for g in gpus:
            if share and hold:
                node.shares.setdefault(g, {})[deployment_id] = share
            elif share:
                del node.shares[g][deployment_id]
            elif hold:
                node.held[g] = deployment_id
            else:
                del node.held[g]
        bisect.insort(self.by_free[node.free()], i)
        bisect.insort(self.by_open[node.open()], i)


# --- the runs ------------------------------------------------------------------------------


@dataclass
class Live:
    """Deployments alive in one policy's run."""

    items: list[tuple[str, str, int]] = field(default_factory=list)
    """(deployment id, node id, GPUs held whole)."""
    index: dict[str, int] = field(default_factory=dict)
    gpus: int = 0

    def add(self, deployment_id: str, node_id: str, gpus: int) -> None:
        self.index[deployment_id] = len(self.items)
        self.items.append((deployment_id, node_id, gpus))
        self.gpus += gpus

    def remove(self, deployment_id: str) -> None:
        at = self.index.pop(deployment_id)
        item = self.items[at]
        last = self.items.pop()
        if last[0] != deployment_id:
            self.items[at] = last
            self.index[last[0]] = at
        self.gpus -= item[2]

    def release_one(self, policy: Policy, u: float) -> None:
        """Release the live deployment at `u` (0..1) of the list, if any."""
        if self.items:
            deployment_id, node_id, _ = self.items[int(u * len(self.items))]
            self.remove(deployment_id)
            policy.release(node_id, deployment_id)


def held_gpus(request: PlacementRequest) -> int:
    """GPUs a deployment holds whole (a share leaves its GPU open to other shares)."""
    return 0 if request.gpu_memory_mib else request.gpus


def speed(cluster: SimCluster, seed: int, decisions: int) -> dict[str, dict[str, float]]:
    out = {}
    for policy in policies(cluster):
        live = Live()
        decide_s: list[float] = []
        total_s = 0.0
        evicted = not_placed = 0
        filling = True
        for step in stream(cluster, seed, release_p=0.45, constrained=True):
            filling = filling and live.gpus < FILL * cluster.gpus
            if step.load is not None:
                if isinstance(policy, Placer):
                    policy.report_load(step.pick, step.load)
                continue
            if step.request is None:
                if not filling:
                    live.release_one(policy, step.pick)
                continue
            request = step.request
            outcome = policy.place(request, check=not filling and len(decide_s) % 100 == 0)
            for deployment_id in outcome.evicted:
                live.remove(deployment_id)
            if outcome.node_id is not None:
                live.add(request.deployment_id, outcome.node_id, held_gpus(request))
            if filling:
                continue
            decide_s.append(outcome.decide_s)
            total_s += outcome.decide_s + outcome.update_s
            evicted += len(outcome.evicted)
            not_placed += outcome.node_id is None
            if len(decide_s) == decisions:
                break
        figures = {
            "decisions": len(decide_s),
            "decisions_per_s": len(decide_s) / total_s,
            "p50_us": percentile(decide_s, 50) * 1e6,
            "p99_us": percentile(decide_s, 99) * 1e6,
            "max_us": max(decide_s) * 1e6,
            "not_placed": not_placed,
            "evicted": evicted,
            "utilization": live.gpus / cluster.gpus,
        }
        if isinstance(policy, Placer):
            scored = [float(n) for n in policy.scored[-len(decide_s) :]]
            figures["scored_mean"] = statistics.fmean(scored)
            figures["scored_p99"] = percentile(scored, 99)
            figures["brute_force_agreed"] = policy.checked
            figures["update_p99_us"] = percentile(policy.updates[-len(decide_s) :], 99) * 1e6
        out[policy.name] = figures
    return out


@dataclass
class QualityRun:
    """One policy's run in the quality phase (see the module docstring)."""

    policy: Policy
    site_of: dict[str, str]
    network: EdgeNetwork
    live: Live = field(default_factory=Live)
    satisfied: int = 0
    """Multi-GPU requests satisfied before the first failure."""
    failed: int = 0
    """Multi-GPU requests failed, in all."""
    placed: int = 0
    p2p_violations: int = 0
    ranks: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def step(self, step: Step) -> None:
        if step.request is None:
            self.live.release_one(self.policy, step.pick)
            return
        request = step.request
        outcome = self.policy.place(request, check=False)
        ok = outcome.node_id is not None
        if outcome.node_id is not None:
            self.placed += 1
            self.live.add(request.deployment_id, outcome.node_id, held_gpus(request))
            site = self.site_of[outcome.node_id]
            self.latencies.append(self.network.latency_ms(request.site, site, outcome.node_id))
            if len(outcome.gpus) > 1:
                topology = self.policy.topology(outcome.node_id)
                links = [
                    topology.inventory.link(a, b)
                    for a, b in itertools.combinations(outcome.gpus, 2)
                ]
                self.ranks.append(min(link_rank(link) for link in links))
                if request.p2p_required and any(x.kind not in P2P_KINDS for x in links):
                    self.p2p_violations += 1
                    ok = False
        if request.gpus > 1:
            if not ok:
                self.failed += 1
            elif not self.failed:
                self.satisfied += 1


def quality(cluster: SimCluster, seed: int) -> dict[str, dict[str, float]]:
    """Both policies on the same stream, until each has failed a multi-GPU request."""
    site_of = {node.node_id: node.site for node in cluster.nodes}
    runs = [QualityRun(policy, site_of, cluster.network) for policy in policies(cluster)]
    steps = 0
    for step in stream(cluster, seed + 1, release_p=0.30, constrained=False):
        for run in runs:
            run.step(step)
        steps += 1
        if all(run.failed for run in runs):
            break
    return {
        run.policy.name: {
            "steps": steps,
            "multi_gpu_satisfied": run.satisfied,
            "multi_gpu_failed": run.failed,
            "placed": run.placed,
            "mean_slowest_link_rank": statistics.fmean(run.ranks),
            "mean_latency_ms": statistics.fmean(run.latencies),
            "p2p_violations": run.p2p_violations,
            "utilization": run.live.gpus / cluster.gpus,
        }
        for run in runs
    }


def policies(cluster: SimCluster) -> tuple[Placer, FirstFit]:
    return Placer(cluster), FirstFit(cluster)


def percentile(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def print_report(nodes: int, figures: dict[str, dict[str, dict[str, float]]]) -> bool:
    fast, ff = figures["speed"]["place"], figures["speed"]["first-fit"]
    good, base = figures["quality"]["place"], figures["quality"]["first-fit"]
    print(f"placement: {nodes:,} nodes x 8 GPUs (captures {', '.join(CAPTURES)}), {SITES} sites\n")
    sections = [
        (
            "(a) speed, from 70 % of the GPUs in use",
            fast,
            ff,
            [
                ("decisions/s (with snapshot update)", "decisions_per_s", ",.0f"),
                ("p50 decision, us", "p50_us", ",.0f"),
                ("p99 decision, us", "p99_us", ",.0f"),
                ("max decision, us", "max_us", ",.0f"),
                ("p99 snapshot update (commit), us", "update_p99_us", ",.0f"),
                ("nodes scored per decision, mean", "scored_mean", ".1f"),
                ("nodes scored per decision, p99", "scored_p99", ".0f"),
                ("not placed", "not_placed", ",.0f"),
                ("evicted by preemption", "evicted", ",.0f"),
                ("GPU utilization at the end", "utilization", ".1%"),
            ],
        ),
        (
            f"(b) quality, from empty, {good['steps']:,.0f} steps (until both failed)",
            good,
            base,
            [
                ("multi-GPU requests satisfied before a failure", "multi_gpu_satisfied", ",.0f"),
                ("multi-GPU requests failed", "multi_gpu_failed", ",.0f"),
                ("P2P requests given non-P2P groups", "p2p_violations", ",.0f"),
                ("mean slowest link rank, multi-GPU groups", "mean_slowest_link_rank", ".2f"),
                ("mean client latency, ms", "mean_latency_ms", ".2f"),
                ("GPU utilization at the end", "utilization", ".1%"),
            ],
        ),
    ]
    print(f"{'':<46} {'place':>12} {'first-fit':>12}")
    for title, ours, theirs, rows in sections:
        print(title)
        for label, key, spec in rows:
            cells = [format(f[key], spec) if key in f else "-" for f in (ours, theirs)]
            print(f"  {label:<44} {cells[0]:>12} {cells[1]:>12}")
    print(f"\nbrute force agreed on {fast['brute_force_agreed']:.0f} sampled decisions")
    p99_ms = fast["p99_us"] / 1000
    ok = p99_ms < TARGET_P99_MS and fast["decisions_per_s"] > TARGET_RATE
    scale = "" if nodes >= 10_000 else f" (at {nodes:,} nodes; the target is for 10,000)"
    print(
        f"verdict{scale}: p99 {p99_ms:.2f} ms {'<' if p99_ms < TARGET_P99_MS else '>='} "
        f"{TARGET_P99_MS:g} ms, {fast['decisions_per_s']:,.0f} decisions/s "
        f"{'>' if fast['decisions_per_s'] > TARGET_RATE else '<='} {TARGET_RATE:,.0f}: "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1,000 nodes, fewer decisions")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--seed", type=int, default=1, help="seed of the cluster and stream")
    parser.add_argument(
        "--captures",
        type=Path,
        default=TOPOLOGIES,
        help=f"directory of `nvidia-smi topo -m` captures (default {TOPOLOGIES})",
    )
    args = parser.parse_args(argv)
    if not args.captures.is_dir():
        parser.error(f"--captures {args.captures} is not a directory")
    nodes = 1_000 if args.quick else 10_000
    cluster = build_cluster(args.captures, nodes, args.seed)
    figures = {
        "speed": speed(cluster, args.seed, 5_000 if args.quick else 20_000),
        "quality": quality(cluster, args.seed),
    }
    ok = print_report(nodes, figures)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": {
                        "machine": platform.machine(),
                        "python": platform.python_version(),
                    },
                    "nodes": nodes,
                    "sites": SITES,
                    **figures,
                    "verdict": ok,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
