"""GPU group allocation: `Topology.best_group` against its brute force and two baselines.

Topologies: every capture, plus two synthetic nodes: 16 GPUs on NVSwitch (all pairs NV6, as a
DGX-2) and 8 PCIe GPUs whose every pair is SYS, 0-3 on NUMA node 0 and 4-7 on node 1 (an 8x
RTX 4090 box: only the NUMA Affinity column tells the sockets apart).

(a) Time per call on the 8-GPU captures and the synthetic nodes:
    best_group cold (a fresh Topology, nothing memoized), warm (the same call again: memo hit),
    and `best_group_brute_force` on the same queries in the same run.
(b) Allocation quality on every topology: the same random sequences (fixed seeds) of 1-, 2-, 4-
    and 8-GPU requests (sizes <= GPU count, weighted 4:3:2:1 as inference asks mostly for one
    GPU) and releases, replayed against best_group, first-fit by index, and NVIDIA's
    go-gpuallocator best-effort policy (reimplemented here; see `GoBestEffort`).

Each sequence has 100 steps; 1000 sequences (300 with --quick). A request for more GPUs than are
free is *refused*: the free count evolves the same way under every policy (same requests, same
releases), so refusals are identical and are not failures. A placed request of k >= 2 GPUs is
*degraded* when its slowest link ranks below the best k-group of the idle machine (what the node
advertises); that is a failure, every other placed request is *satisfied*. Per topology and
policy, averaged over the sequences: requests satisfied before the first failure, degraded
groups, the mean slowest-link rank (`common.topology.link_rank`) of the groups of two
or more GPUs given, and avoidable splits: groups of two or more spanning NUMA nodes (those of
the topo-tree) while one NUMA node alone had enough free GPUs (links may justify a split, so
this is reported, not judged); then best_group minus each baseline over the same sequences,
with a 95% confidence interval. Verdict: on every topology best_group satisfies at least as
many requests before the first failure and has a mean slowest link at least as good as
either baseline.

The captures are read with the capture parser (`node_daemon.inventory.topo_file`).

    python -m bench.gpu_allocation [--quick] [--json FILE] [--captures DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.topology import TopoKind, Topology, best_group_brute_force
from node_daemon.inventory import Gpu, GpuSpec, Inventory, Link, LinkKind, inventory_from_capture
from tests.data import TOPOLOGIES

REQUEST_SIZES = {1: 4, 2: 3, 4: 2, 8: 1}
"""Request size -> weight in the random sequences."""
RELEASE_PROBABILITY = 0.45
"""Chance that a step releases a live allocation (when there is one) instead of requesting."""
STEPS = 100
"""Requests and releases per sequence."""

Policy = Callable[[int, frozenset[int]], tuple[int, ...]]


def nvswitch16() -> Inventory:
    """A 16-GPU NVSwitch node: every pair NV6 (as a DGX-2), GPUs 0-7 on NUMA 0, 8-15 on 1."""
    gpus = tuple(
        Gpu(index=i, uuid=f"GPU-nvswitch16-{i}", name="V100-SXM3-32GB", memory_total_mib=32768,
            numa_node=i // 8)
        for i in range(16)
    )  # fmt: skip
    links = {pair: Link(LinkKind.NV, 6) for pair in itertools.combinations(range(16), 2)}
    return Inventory(gpus=gpus, links=links)


def all_sys_two_sockets() -> Inventory:
    """8 PCIe GPUs, every pair SYS, GPUs 0-3 on NUMA 0 and 4-7 on NUMA 1."""
    gpus = tuple(
        Gpu(index=i, uuid=f"GPU-sys2numa-{i}", name="RTX 4090", memory_total_mib=24564,
            numa_node=i // 4)
        for i in range(8)
    )  # fmt: skip
    links = {pair: Link(LinkKind.SYS) for pair in itertools.combinations(range(8), 2)}
    return Inventory(gpus=gpus, links=links)


def load_topologies(captures: Path) -> dict[str, Topology]:
    """Each capture in `captures` (by file name without .txt), then the synthetic nodes."""
    spec = GpuSpec(name="capture", memory_mib=1)
    out = {
        path.stem: Topology.from_inventory(inventory_from_capture(path, spec))
        for path in sorted(captures.glob("*.txt"))
    }
    out["synthetic_16gpu_nv6_nvswitch"] = Topology.from_inventory(nvswitch16())
    out["synthetic_8gpu_sys_2numa"] = Topology.from_inventory(all_sys_two_sockets())
    return out


# --- (a) time per call ---------------------------------------------------------------------


def timing_queries(n: int, quick: bool, seed: int = 7) -> list[tuple[int, frozenset[int]]]:
    """Every k of the whole node, then random (k, free set) pairs."""
    rng = random.Random(seed)
    everything = frozenset(range(n))
    queries = [(k, everything) for k in range(1, n + 1) if not quick or k in REQUEST_SIZES]
    for _ in range(10 if quick else 40):
        free = frozenset(rng.sample(range(n), rng.randint(1, n)))
        queries.append((rng.randint(1, len(free)), free))
    return queries


def time_calls(topology: Topology, quick: bool) -> dict[str, object]:
    inventory = topology.inventory
    queries = timing_queries(len(inventory.gpus), quick)
    cold, warm, brute = [], [], []
    for k, free in queries:
        fresh = Topology.from_inventory(inventory)
        started = time.perf_counter()
        fast = fresh.best_group(k, free)
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        fresh.best_group(k, free)
        warm.append(time.perf_counter() - started)
        started = time.perf_counter()
        reference = best_group_brute_force(fresh, k, free)
        brute.append(time.perf_counter() - started)
        if fast != reference:
            raise AssertionError(f"best_group {fast} != brute force {reference} for {k}, {free}")
    return {
        "gpus": len(inventory.gpus),
        "queries": len(queries),
        "cold_mean_us": statistics.fmean(cold) * 1e6,
        "cold_max_us": max(cold) * 1e6,
        "warm_mean_us": statistics.fmean(warm) * 1e6,
        "brute_mean_us": statistics.fmean(brute) * 1e6,
        "brute_max_us": max(brute) * 1e6,
    }


# --- (b) allocation quality ----------------------------------------------------------------


def first_fit(k: int, free: frozenset[int]) -> tuple[int, ...]:
    return tuple(sorted(free)[:k])


@dataclass
class GoBestEffort:
    """NVIDIA go-gpuallocator's best-effort policy (gpuallocator/besteffort_policy.go).

    Pair score: cross-CPU 10, same CPU 20, host bridge 30, multiple switches 40, single switch
    50 (same board 60 never shows in a capture), plus 100 per NVLink. Our kinds map SYS -> 10,
    NODE -> 20, PHB -> 30, PXB -> 40, PIX -> 50. An NV<n> pair gets 100 * n plus a PCIe part
    the capture hides (it prints NV<n> instead): 20 (same CPU) when the topo-tree puts both
    GPUs in one NUMA node, else 10 (cross CPU), the weakest PCIe relation consistent with what
    the capture says (NVML would report at least that). The NVLink term dominates either way.

    For k GPUs it pads the free list with empty slots to a multiple of k, takes the partition
    of it into sets of k (complete, or holding all the padding) with the highest total score
    (first found on ties, in the Go enumeration order: the first free device with every
    combination of the rest, recursively), and returns the best-scoring set of that partition.
    Upstream the last step may pick the padded set, returning fewer GPUs than asked plus nil
    (go-gpuallocator PR #80: 3 out of 5 free with an NVLink pair panics the allocator); here it
    picks the best complete set, as that fix does, and counts the cases in `padded_picks`.
    k = 1 returns the first free GPU, as upstream does.
    """

    topology: Topology
    padded_picks: int = 0
    _pair: dict[tuple[int, int], int] = field(default_factory=dict)
    _memo: dict[tuple[int, int, tuple[int, ...], int], tuple[int, list[tuple[int, ...]]]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        pcie = {LinkKind.SYS: 10, LinkKind.NODE: 20, LinkKind.PHB: 30, LinkKind.PXB: 40,
                LinkKind.PIX: 50}  # fmt: skip
        numa = {
            gpu: node.label
            for node in self.topology.tree.children
            if node.kind is TopoKind.NUMA
            for gpu in node.gpus
        }
        for (a, b), link in self.topology.inventory.links.items():
            if link.kind is LinkKind.NV:
                self._pair[(a, b)] = 100 * link.nvlinks + (20 if numa[a] == numa[b] else 10)
            else:
                self._pair[(a, b)] = pcie[link.kind]

    def set_score(self, gpus: Sequence[int]) -> int:
        """Padding slots (-1) score 0 with everything."""
        return sum(
            self._pair[(a, b)] for a, b in itertools.combinations(sorted(gpus), 2) if a >= 0
        )

    def __call__(self, k: int, free: frozenset[int]) -> tuple[int, ...]:
        if k == 1:
            return (min(free),)
        padding = -len(free) % k
        _, partition = self._best_partition(k, padding, tuple(sorted(free)), padding)
        complete = [s for s in partition if -1 not in s]
        best = max(complete, key=self.set_score)  # first of the highest, as Go's strict >
        upstream = max(partition, key=self.set_score)
        if -1 in upstream:
            self.padded_picks += 1
        return tuple(sorted(best))

    def _best_partition(
        self, k: int, padding: int, devices: tuple[int, ...], pads: int
    ) -> tuple[int, list[tuple[int, ...]]]:
        """Highest-scoring partition of `devices` plus `pads` padding slots (first on ties)."""
        key = (k, padding, devices, pads)
        cached = self._memo.get(key)
        if cached is not None:
            return cached
        slots = (*devices, *([-1] * pads))
        if len(slots) == k:
            result = (self.set_score(slots), [slots])
        else:
            best: tuple[int, list[tuple[int, ...]]] | None = None
            for rest in itertools.combinations(range(1, len(slots)), k - 1):
                chosen = (slots[0], *(slots[i] for i in rest))
                used = chosen.count(-1)
                if used not in (0, padding):
                    continue
                left = tuple(d for d in devices if d not in chosen)
                score, partition = self._best_partition(k, padding, left, pads - used)
                score += self.set_score(chosen)
                if best is None or score > best[0]:
                    best = (score, [chosen, *partition])
            if best is None:
                raise AssertionError("padding leaves no partition")
            result = best
        self._memo[key] = result
        return result


def request_sequence(n: int, seed: int, steps: int) -> list[tuple[str, float]]:
    """("request", k) or ("release", u): u in [0, 1) picks the live allocation to release."""
    rng = random.Random(seed)
    sizes = [s for s in REQUEST_SIZES if s <= n]
    weights = [REQUEST_SIZES[s] for s in sizes]
    return [
        ("release", rng.random())
        if rng.random() < RELEASE_PROBABILITY
        else ("request", rng.choices(sizes, weights)[0])
        for _ in range(steps)
    ]


@dataclass(frozen=True, slots=True)
class Run:
    """One policy through one request sequence."""

    satisfied_before_failure: int
    degraded: int
    """Groups of k >= 2 given with a slowest link below the idle machine's best k-group."""
    refused: int
    """Requests for more GPUs than were free: the same under every policy."""
    mean_slowest: float | None
    """Mean slowest-link rank of the groups of k >= 2 given; None when there were none."""
    avoidable_splits: int
    """Groups of k >= 2 spanning NUMA nodes while one NUMA node had k free GPUs."""


def replay(
    topology: Topology, policy: Policy, events: list[tuple[str, float]], required: dict[int, int]
) -> Run:
    numa = [frozenset(node.gpus) for node in topology.tree.children]
    splits = 0
    free = frozenset(topology.graph.nodes)
    live: list[tuple[int, ...]] = []
    before_failure: int | None = None
    satisfied = refused = degraded = 0
    slowest: list[int] = []
    for kind, value in events:
        if kind == "release":
            if live:
                free |= frozenset(live.pop(int(value * len(live))))
            continue
        k = int(value)
        if k > len(free):
            refused += 1
            continue
        group = policy(k, free)
        if len(group) != k or not free.issuperset(group):
            raise AssertionError(f"policy gave {group} for k={k} out of free {sorted(free)}")
        spans = sum(1 for node in numa if node.intersection(group)) > 1
        if k > 1 and spans and any(len(node & free) >= k for node in numa):
            splits += 1
        free -= frozenset(group)
        live.append(group)
        if k > 1:
            worst = min(topology.rank(a, b) for a, b in itertools.combinations(group, 2))
            slowest.append(worst)
            if worst < required[k]:
                degraded += 1
                if before_failure is None:
                    before_failure = satisfied
                continue
        satisfied += 1
    return Run(
        satisfied_before_failure=satisfied if before_failure is None else before_failure,
        degraded=degraded,
        refused=refused,
        mean_slowest=statistics.fmean(slowest) if slowest else None,
        avoidable_splits=splits,
    )


def quality(topology: Topology, quick: bool) -> dict[str, dict[str, float | None]]:
    """Figures per policy, averaged over the sequences (see the module docstring)."""
    n = len(topology.graph)
    everything = frozenset(topology.graph.nodes)
    required = {
        k: topology.score(topology.best_group(k, everything), everything).slowest
        for k in REQUEST_SIZES
        if k <= n
    }
    go = GoBestEffort(topology)
    policies: dict[str, Policy] = {
        "best_group": topology.best_group,
        "first_fit": first_fit,
        "go_best_effort": go,
    }
    sequences = [request_sequence(n, seed, STEPS) for seed in range(300 if quick else 1000)]
    runs = {
        name: [replay(topology, policy, events, required) for events in sequences]
        for name, policy in policies.items()
    }
    out: dict[str, dict[str, float | None]] = {}
    for name, policy_runs in runs.items():
        means = [r.mean_slowest for r in policy_runs if r.mean_slowest is not None]
        out[name] = {
            "satisfied_before_failure": statistics.fmean(
                r.satisfied_before_failure for r in policy_runs
            ),
            "degraded": statistics.fmean(r.degraded for r in policy_runs),
            "refused": statistics.fmean(r.refused for r in policy_runs),
            "mean_slowest": statistics.fmean(means) if means else None,
            "avoidable_splits": statistics.fmean(r.avoidable_splits for r in policy_runs),
        }
        if name != "best_group":
            pairs = list(zip(runs["best_group"], policy_runs, strict=True))
            satisfied = [a.satisfied_before_failure - b.satisfied_before_failure for a, b in pairs]
            slowest = [
                a.mean_slowest - b.mean_slowest
                for a, b in pairs
                if a.mean_slowest is not None and b.mean_slowest is not None
            ]
            out[name]["ours_minus_satisfied"], out[name]["ours_minus_satisfied_ci95"] = _mean_ci(
                satisfied
            )
            out[name]["ours_minus_slowest"], out[name]["ours_minus_slowest_ci95"] = _mean_ci(
                slowest
            )
    out["go_best_effort"]["padded_picks"] = go.padded_picks
    return out


def _mean_ci(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and the half-width of its normal 95% confidence interval (None without data)."""
    if len(values) < 2:
        return None, None
    return statistics.fmean(values), 1.96 * statistics.stdev(values) / len(values) ** 0.5


def wins(figures: dict[str, dict[str, float | None]]) -> bool:
    """The verdict for one topology: best_group at least as good as each baseline."""
    ours = figures["best_group"]
    for baseline in ("first_fit", "go_best_effort"):
        theirs = figures[baseline]
        if (ours["satisfied_before_failure"] or 0) < (theirs["satisfied_before_failure"] or 0):
            return False
        ours_slowest, theirs_slowest = ours["mean_slowest"], theirs["mean_slowest"]
        if (
            ours_slowest is not None
            and theirs_slowest is not None
            and ours_slowest < theirs_slowest
        ):
            return False
    return True


# --- report --------------------------------------------------------------------------------


def _fmt(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(timing: dict[str, dict], results: dict[str, dict], captures: Path) -> None:
    print(f"captures: {captures} (read with node_daemon.inventory.topo_file)\n")
    print("(a) time per call, microseconds (cold: fresh Topology; warm: memo hit)")
    print(
        f"{'topology':<52} {'GPUs':>4} {'calls':>5} {'cold mean':>10} {'cold max':>9} "
        f"{'warm':>6} {'brute mean':>11} {'brute max':>10} {'speed-up':>8}"
    )
    for name, t in timing.items():
        print(
            f"{name:<52} {t['gpus']:>4} {t['queries']:>5} {t['cold_mean_us']:>10.0f} "
            f"{t['cold_max_us']:>9.0f} {t['warm_mean_us']:>6.1f} {t['brute_mean_us']:>11.0f} "
            f"{t['brute_max_us']:>10.0f} {t['brute_mean_us'] / t['cold_mean_us']:>7.1f}x"
        )
    print(
        "\n(b) allocation quality, mean over sequences, per policy: satisfied before the first "
        "failure | degraded groups | mean slowest-link rank (k >= 2) | avoidable NUMA "
        "splits;\n    refused: requests for more GPUs than free (the same under every policy)"
    )
    policies = ("best_group", "first_fit", "go_best_effort")
    print(
        f"{'topology':<52} {'GPUs':>4} {'refused':>7} "
        + " ".join(f"{p:>28}" for p in policies)
        + "  verdict"
    )
    for name, r in results.items():
        cells = " ".join(
            f"{_fmt(r[p]['satisfied_before_failure'], '.1f'):>6}"
            f" {_fmt(r[p]['degraded'], '.1f'):>5} {_fmt(r[p]['mean_slowest'], '.2f'):>9}"
            f" {_fmt(r[p]['avoidable_splits'], '.1f'):>5}"
            for p in policies
        )
        verdict = "ok" if r["wins"] else "WORSE"
        refused = r["best_group"]["refused"]
        print(f"{name:<52} {r['gpus']:>4} {refused:>7.1f} {cells}  {verdict}")
    print(
        "\nbest_group minus baseline, mean over the same sequences with a 95% confidence "
        "interval (topologies where any differ):"
    )
    for name, r in results.items():
        diffs = []
        for p in ("first_fit", "go_best_effort"):
            sat, sat_ci = r[p]["ours_minus_satisfied"], r[p]["ours_minus_satisfied_ci95"]
            slow, slow_ci = r[p]["ours_minus_slowest"], r[p]["ours_minus_slowest_ci95"]
            if sat_ci or slow_ci:
                diffs.append(
                    f"vs {p}: satisfied {sat:+.2f} ± {_fmt(sat_ci, '.2f')}, "
                    f"slowest {_fmt(slow, '+.3f')} ± {_fmt(slow_ci, '.3f')}"
                )
        if diffs:
            print(f"  {name}: " + "; ".join(diffs))
    padded = {n: r["go_best_effort"]["padded_picks"] for n, r in results.items()}
    print(
        "go_best_effort calls where upstream would return a padded set (nil GPU, PR #80): "
        + (", ".join(f"{n}: {c}" for n, c in padded.items() if c) or "none")
    )
    print(
        "\nverdict: best_group satisfies at least as many and its mean slowest link is at least "
        f"as good as both baselines on every topology: {all(r['wins'] for r in results.values())}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer queries and sequences")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument(
        "--captures",
        type=Path,
        default=TOPOLOGIES,
        help=f"directory of `nvidia-smi topo -m` captures (default {TOPOLOGIES})",
    )
    args = parser.parse_args(argv)
    if not args.captures.is_dir():
        parser.error(f"--captures {args.captures} is not a directory")
    topologies = load_topologies(args.captures)
    timing = {
        name: time_calls(topology, args.quick)
        for name, topology in topologies.items()
        if len(topology.graph) >= 8
    }
    results: dict[str, dict] = {}
    for name, topology in topologies.items():
        figures = quality(topology, args.quick)
        results[name] = {"gpus": len(topology.graph), **figures, "wins": wins(figures)}
    print_report(timing, results, args.captures)
    if args.json:
        machine = {"machine": platform.machine(), "python": platform.python_version()}
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "captures": str(args.captures),
                    "timing": timing,
                    "quality": results,
                    "verdict": all(r["wins"] for r in results.values()),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
