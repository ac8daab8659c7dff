"""The node's resource manager in the live system: a bursting critical deployment beside a
busy best-effort one on one node, under the `static`, `usage` and `gain` resize policies, in
one run.

Per arm a fresh cluster: the broker (heartbeat every 0.5 s: the node samples its replicas
and steps its resource manager at that interval) and one node daemon started with
`--resize-policy static|usage|gain`, on this machine's CPUs. Two deployments of the model on
it, as Docker containers with CPU quotas (where Docker is not usable: processes, each
limited by a cgroup of its own from the start, which needs a writable cgroup: root): a
critical one (`--crit-cpus`, 0.5 cores; floor half that, ceiling `--crit-max`, 1.75) and a
best-effort one (`--be-cpus`, 1.0; floor half that). The best-effort one is kept busy by a
closed loop (`--be-loops` requests always out); the critical one gets an open loop
(requests at a fixed rate whether or not earlier ones were answered, as independent devices
send them) that alternates a quiet spell (`--quiet` s at 2 requests/s) with a burst
(`--burst` s at `--burst-load` cores' worth of requests, measured against what it serves
alone, saturated, at its starting quota in the first arm: over that quota, so under
`static` its queue grows for the whole burst). Clients are `OffloadClient`s: the broker
path is the real one.

The figures, per arm: the critical deployment's p50/p99 latency of the requests sent during
bursts; the best-effort one's p50/p99 and throughput; failed requests; the resizes the node
reported to the broker (its ops API), with their reasons; and, against `static` from the
same run, the critical p99 as a ratio and the best-effort throughput as a ratio. Issue 13's
target: critical p99 at least 35 % lower than `static` while the best-effort deployment
stays within its SLO floor: at least its floor's share (cpus_min / cpus) of its `static`
throughput; zero failed requests.

    python -m bench.resize [--quick] [--model NAME] [--window S] [--burst S] [--quiet S]
        [--burst-load CORES] [--rounds N] [--policies P ...] [--runtime R] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

import modelzoo
from bench.loadgen import Series, closed_loop, open_loop
from edge_client.client import OffloadClient
from edge_client.demo.cluster import DEMO_NODES, LocalCluster
from edge_client.demo.run import pick_runtime
from node_daemon.runtimes.cgroup_limits import can_limit_cpu

CALIBRATION_S = 4.0
CALIBRATION_LOOPS = 4
QUIET_RATE_PER_S = 2.0
SETTLE_S = 3.0
"""Load before the window opens: the best-effort loop running, the first samples taken."""


@dataclass
class Arm:
    policy: str
    label: str
    burst: Series = field(default_factory=lambda: Series("critical"))
    """The critical deployment's requests sent during a burst."""
    quiet: Series = field(default_factory=lambda: Series("critical"))
    best_effort: Series = field(default_factory=lambda: Series("best-effort"))
    window_s: float = 0.0
    resizes: list[dict[str, Any]] = field(default_factory=list)
    deployments: dict[str, str] = field(default_factory=dict)
    """"critical" / "best-effort" -> its deployment id."""

    def failed(self) -> int:
        return self.burst.failed + self.quiet.failed + self.best_effort.failed


async def _bursts(
    client: OffloadClient,
    inputs: dict[str, Any],
    arm: Arm,
    stop: asyncio.Event,
    burst_rate: float,
    args: argparse.Namespace,
) -> None:
    """Quiet, burst, quiet, burst ... until `stop`; each request counted in the series of
    the phase it was sent in. Then waits for the ones still out."""
    cycle = args.quiet + args.burst

    def schedule(elapsed_s: float) -> tuple[Series, float]:
        if elapsed_s % cycle >= args.quiet:
            return arm.burst, burst_rate
        return arm.quiet, QUIET_RATE_PER_S

    await open_loop(client, inputs, stop, schedule)


async def _resizes(cluster: LocalCluster) -> list[dict[str, Any]]:
    async with (
        aiohttp.ClientSession(headers=cluster.ops_headers) as http,
        http.get(cluster.ops_url + "api/load", timeout=aiohttp.ClientTimeout(total=10)) as got,
    ):
        got.raise_for_status()
        body = await got.json()
    return list(body.get("resizes", []))


async def run_arm(
    policy: str, label: str, args: argparse.Namespace, image: str, node_cores: float
) -> Arm:
    arm = Arm(policy, label)
    root = Path(tempfile.mkdtemp(prefix=f"bench-resize-{policy}-"))
    plan = replace(DEMO_NODES[0], node_id="node-a", flags=("--resize-policy", policy))
    cluster = LocalCluster(
        root,
        runtime=args.runtime,
        image=image,
        nodes=(plan,),
        broker_flags=("--heartbeat-interval", "0.5", "--rebalance", "0"),
    )
    model = modelzoo.model_path(args.model)
    inputs = modelzoo.sample_inputs(model)
    try:
        await cluster.start(lambda line: None)
        async with (
            OffloadClient(cluster.broker_address, cluster.api_key) as critical,
            OffloadClient(cluster.broker_address, cluster.api_key) as best_effort,
        ):
            sha = await critical.upload_model(model)
            crit = await critical.deploy(
                sha, args.model, cpus=args.crit_cpus, cpus_min=args.crit_cpus / 2,
                cpus_max=min(args.crit_max, node_cores), priority="critical", site="site-a",
            )  # fmt: skip
            if args.burst_rate is None:
                # What it serves alone at its starting quota, kept saturated (the first
                # arm: `static`): a burst offers `--burst-load / --crit-cpus` times that.
                alone = Series("critical")
                stop = asyncio.Event()
                loops = [
                    asyncio.create_task(closed_loop(critical, inputs, alone, stop))
                    for _ in range(CALIBRATION_LOOPS)
                ]
                await asyncio.sleep(1.0)
                before, started = len(alone.latencies_ms), time.monotonic()
                await asyncio.sleep(CALIBRATION_S)
                capacity = (len(alone.latencies_ms) - before) / (time.monotonic() - started)
                stop.set()
                await asyncio.gather(*loops)
                args.burst_rate = capacity * args.burst_load / args.crit_cpus
                print(
                    f"   critical alone at {args.crit_cpus:g} cores: {capacity:.1f} requests/s; "
                    f"bursts at {args.burst_rate:.1f} requests/s ({args.burst_load:g} cores)",
                    flush=True,
                )
            be = await best_effort.deploy(
                sha, args.model, cpus=args.be_cpus, cpus_min=args.be_cpus / 2,
                priority="best-effort", site="site-a",
            )  # fmt: skip
            assert crit.node_id == be.node_id == "node-a"
            arm.deployments = {"critical": crit.deployment_id, "best-effort": be.deployment_id}
            stop = asyncio.Event()
            warmup = Series("best-effort")
            loops = [
                asyncio.create_task(closed_loop(best_effort, inputs, warmup, stop))
                for _ in range(args.be_loops)
            ]
            await asyncio.sleep(SETTLE_S)
            stop.set()
            await asyncio.gather(*loops)
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(closed_loop(best_effort, inputs, arm.best_effort, stop))
                for _ in range(args.be_loops)
            ]
            tasks.append(
                asyncio.create_task(_bursts(critical, inputs, arm, stop, args.burst_rate, args))
            )
            started = time.monotonic()
            await asyncio.sleep(args.window)
            stop.set()
            await asyncio.gather(*tasks)
            arm.window_s = time.monotonic() - started
            arm.best_effort.failed += warmup.failed
            arm.resizes = await _resizes(cluster)
    finally:
        await cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return arm


def summarise(arms: Sequence[Arm], args: argparse.Namespace) -> dict[str, Any]:
    print(
        f"\n{'arm':<9} {'crit burst p50':>14} {'p99 ms':>8} {'p99/static':>10} "
        f"{'be p50':>7} {'p99 ms':>8} {'be req/s':>8} {'be/static':>9} {'resizes':>7} "
        f"{'failed':>6}"
    )
    baseline: dict[str, tuple[float, float]] = {}
    for arm in arms:
        if arm.policy == "static":
            rnd = arm.label.rsplit("-", 1)[-1]
            _, p99 = arm.burst.percentiles()
            baseline[rnd] = (p99, len(arm.best_effort.latencies_ms) / arm.window_s)
    rows: list[dict[str, Any]] = []
    for arm in arms:
        rnd = arm.label.rsplit("-", 1)[-1]
        c50, c99 = arm.burst.percentiles()
        b50, b99 = arm.best_effort.percentiles()
        be_rate = len(arm.best_effort.latencies_ms) / arm.window_s if arm.window_s else 0.0
        static_p99, static_rate = baseline.get(rnd, (float("nan"), float("nan")))
        p99_ratio = c99 / static_p99 if static_p99 else float("nan")
        be_ratio = be_rate / static_rate if static_rate else float("nan")
        row = {
            "arm": arm.label,
            "policy": arm.policy,
            "critical_burst_requests": len(arm.burst.latencies_ms),
            "critical_burst_p50_ms": round(c50, 1),
            "critical_burst_p99_ms": round(c99, 1),
            "critical_p99_vs_static": round(p99_ratio, 3),
            "critical_quiet_requests": len(arm.quiet.latencies_ms),
            "best_effort_p50_ms": round(b50, 1),
            "best_effort_p99_ms": round(b99, 1),
            "best_effort_per_s": round(be_rate, 2),
            "best_effort_vs_static": round(be_ratio, 3),
            "failed": arm.failed(),
            "resizes": len(arm.resizes),
            "deployments": arm.deployments,
        }
        rows.append(row)
        print(
            f"{arm.label:<9} {c50:>14.0f} {c99:>8.0f} {p99_ratio:>10.2f} {b50:>7.0f} "
            f"{b99:>8.0f} {be_rate:>8.1f} {be_ratio:>9.2f} {len(arm.resizes):>7} "
            f"{arm.failed():>6}"
        )
    floor_share = 0.5  # cpus_min / cpus of the best-effort deployment
    failed = sum(arm.failed() for arm in arms)
    managed = [r for r in rows if r["policy"] != "static"]
    met = {
        r["arm"]: r["critical_p99_vs_static"] <= 0.65 and r["best_effort_vs_static"] >= floor_share
        for r in managed
    }
    for arm in arms:
        for r in arm.resizes[-4:]:
            print(
                f"  {arm.label}: {r['cpus_before']:.2f} -> {r['cpus_after']:.2f} cores "
                f"({r['deployment_id'][:12]}): {r['reason']}"
            )
    print(
        f"\ntarget (critical p99 <= 0.65 x static, best-effort >= {floor_share:.0%} of its "
        f"static throughput): "
        + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items())
        + f"; {failed} failed request(s)"
    )
    return {
        "model": args.model,
        "burst_rate_per_s": round(args.burst_rate or 0.0, 2),
        "rows": rows,
        "target_met": met,
        "failed_requests": failed,
        "resizes": {arm.label: arm.resizes for arm in arms},
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    runtime, image = await asyncio.to_thread(
        pick_runtime, args.runtime, lambda line: print(line, flush=True)
    )
    if runtime != "docker" and not can_limit_cpu():
        raise SystemExit(
            "bench.resize needs Docker, or a writable cgroup (root) for the process runtime "
            "to limit its replicas' CPU"
        )
    args.runtime = runtime
    node_cores = float(len(os.sched_getaffinity(0)))
    arms = []
    for round_ in range(args.rounds):
        for policy in args.policies:
            print(f"== round {round_ + 1}/{args.rounds}, --resize-policy {policy}", flush=True)
            started = time.monotonic()
            arms.append(await run_arm(policy, f"{policy}-{round_ + 1}", args, image, node_cores))
            print(f"   {time.monotonic() - started:.0f} s", flush=True)
    return summarise(arms, args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.resize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="one round, a 20 s window")
    parser.add_argument("--model", default="resnet18", help="a model zoo model (resnet18)")
    parser.add_argument("--window", type=float, default=40.0, help="seconds of load (40)")
    parser.add_argument("--burst", type=float, default=4.0, help="seconds a burst lasts (4)")
    parser.add_argument("--quiet", type=float, default=4.0, help="seconds between bursts (4)")
    parser.add_argument(
        "--burst-load",
        type=float,
        default=0.8,
        help="a burst's load on the critical deployment, in cores (0.8)",
    )
    parser.add_argument("--crit-cpus", type=float, default=0.5, help="critical's CPUs (0.5)")
    parser.add_argument(
        "--crit-max", type=float, default=1.75, help="critical's ceiling in cores (1.75)"
    )
    parser.add_argument("--be-cpus", type=float, default=1.0, help="best-effort's CPUs (1.0)")
    parser.add_argument(
        "--be-loops", type=int, default=2, help="best-effort requests always out (2)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every policy (2)")
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=("static", "usage", "gain"),
        default=["static", "usage", "gain"],
        help="the arms; static first: it is the baseline",
    )
    parser.add_argument(
        "--runtime",
        choices=("auto", "docker", "process"),
        default="auto",
        help="where replicas run: Docker when usable (auto), else processes in cgroups",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.window = 1, 20.0
    if (
        args.window <= 0
        or args.burst <= 0
        or args.quiet <= 0
        or args.rounds < 1
        or args.burst_load <= 0
        or args.be_loops < 1
        or args.policies[0] != "static"
    ):
        parser.error("positive --window/--burst/--quiet/--burst-load, --rounds >= 1, static first")
    args.burst_rate = None
    result = asyncio.run(run(args))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["failed_requests"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
