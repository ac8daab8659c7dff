"""Speculative rebalancing in the live system: a node kept hot, another idle, with the broker's
rebalancing off and on, in one run.

Two node daemons at one site, each pinned to its own CPU of this machine (`offload node
--cpuset`): two machines' worth of CPU that do not share. Per arm a fresh cluster: the
broker (`--rebalance 0`, off; or `--rebalance 1`, hot at load 0.7 for 3 s, a target at or
under 0.3), node-hot alone at first. Two deployments of the model are made there (it is the
only node), one critical and one best-effort; then node-idle joins. The critical
deployment's client first runs it alone, closed loop, for 5 s in the first arm: its median
latency there is what the SLO (--slo-x times it) is measured against, in every arm. The
offered load is measured against the model's compute time on one CPU (in this process,
pinned to node-hot's CPU, one intra-op thread as the replica has; timed before and after the
latency, the lesser taken, and no more than the latency), not against that latency: the
latency includes the client's and the transport's time, which on a slow host made the
offered load fall short of the policy's threshold. Then each deployment gets its own client
(`OffloadClient`, which follows a migration with no failed request) sending requests open
loop (at a fixed rate, whether or not earlier ones have been answered, as independent
devices do) for --window seconds, each at --load / the compute time: together 2 x --load of
node-hot's one CPU (0.8 by default), each --load (0.4) of a CPU once apart. Open loop
because a closed loop slows down with its server and hides the queueing an overloaded node
causes. The clients (this process, every thread) run on node-idle's CPU while they send:
on a 2-core machine they must share one, and this one counts against rebalancing (the moved
deployment shares its CPU with them). With rebalancing on, the policy moves one of them to
node-idle (make-before-break) once node-hot's load has stayed high; off, both share node-hot
to the end.

The figures, per arm and deployment: requests, p50 and p99 latency, SLO attainment (the share
of requests answered within the SLO, over the whole window: the time before the move counts
too), failed requests, and the migrations with their reason. Issue 13's target: the hot
node's deployments attain their SLO more often with rebalancing than without, with zero
failed requests, and nothing moves back.

    python -m bench.rebalance [--quick] [--model NAME] [--runtime process|docker]
        [--window S] [--slo-x F] [--load F] [--rounds N] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

import modelzoo
from bench import loadgen
from bench.loadgen import closed_loop, constant, open_loop
from edge_client.client import OffloadClient
from edge_client.demo.cluster import DEMO_NODES, LocalCluster
from edge_client.demo.run import pick_runtime
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from runtime.model import OnnxModel

REBALANCE_FLAGS = (
    "--rebalance", "1", "--rebalance-hot-load", "0.7", "--rebalance-sustain", "3",
    "--rebalance-target-max-load", "0.3", "--rebalance-cooldown", "600",
)  # fmt: skip
CALIBRATION_S = 5.0


@dataclass(kw_only=True)
class Series(loadgen.Series):
    """One deployment's load; `label` is its priority class."""

    deployment: str

    def figures(self, slo_ms: float) -> dict[str, Any]:
        lat = np.array(self.latencies_ms) if self.latencies_ms else np.array([np.nan])
        return {
            "priority": self.label,
            "requests": len(self.latencies_ms),
            "p50_ms": round(float(np.percentile(lat, 50)), 1),
            "p99_ms": round(float(np.percentile(lat, 99)), 1),
            "slo_attainment": round(float(np.mean(lat <= slo_ms)), 3),
            "failed": self.failed,
        }


@dataclass
class Arm:
    name: str
    slo_ms: float = 0.0
    rate_per_s: float = 0.0
    """Each deployment's offered request rate."""
    series: list[Series] = field(default_factory=list)
    migrations: list[dict[str, str]] = field(default_factory=list)


async def run_arm(
    name: str,
    rebalance: bool,
    args: argparse.Namespace,
    image: str,
    calibration: tuple[float, float] | None,
) -> Arm:
    """One arm; `calibration` is (SLO ms, rate per s) from an earlier arm, None for the
    first (it measures them)."""
    arm = Arm(name)
    root = Path(tempfile.mkdtemp(prefix=f"bench-rebalance-{name}-"))
    hot = replace(DEMO_NODES[0], node_id="node-hot", flags=("--cpuset", args.cpus[0]))
    idle = replace(DEMO_NODES[0], node_id="node-idle", flags=("--cpuset", args.cpus[1]))
    flags = REBALANCE_FLAGS if rebalance else ("--rebalance", "0")
    cluster = LocalCluster(
        root,
        runtime=args.runtime,
        image=image,
        nodes=(hot,),
        broker_flags=("--heartbeat-interval", "0.5", *flags),
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
            first = await critical.deploy(
                sha, args.model, gpus=1, priority="critical", site="site-a"
            )
            # Its latency alone on one CPU, measured in the first arm only: every arm then
            # offers the same rate against the same SLO.
            alone = Series(label="critical", deployment=first.deployment_id)
            computes: list[float] = []
            if calibration is None:
                computes.append(
                    await asyncio.to_thread(compute_alone_ms, model, inputs, int(args.cpus[0]))
                )
            stop = asyncio.Event()
            task = asyncio.create_task(closed_loop(critical, inputs, alone, stop))
            await asyncio.sleep(CALIBRATION_S if calibration is None else 1.0)
            stop.set()
            await task
            if calibration is None:
                median_ms = statistics.median(alone.latencies_ms[5:] or [1e9])
                computes.append(
                    await asyncio.to_thread(compute_alone_ms, model, inputs, int(args.cpus[0]))
                )
                # A shared vCPU slowed for a few seconds only inflates a median: the least of
                # the two timings, and never more than the latency the compute is part of (a
                # compute of 41.6 ms against a latency of 36.3 offered 0.6 of the CPU, not
                # 0.8, and the broker never found node-hot hot).
                compute_ms = min(*computes, median_ms)
                print(
                    f"   alone: median latency {median_ms:.1f} ms, compute on one CPU "
                    f"{' and '.join(f'{c:.1f}' for c in computes)} ms (before and after): "
                    f"{compute_ms:.1f} ms taken",
                    flush=True,
                )
                calibration = (args.slo_x * median_ms, args.load * 1000 / compute_ms)
            arm.slo_ms, arm.rate_per_s = calibration
            second = await best_effort.deploy(
                sha, args.model, gpus=1, priority="best-effort", site="site-a"
            )
            assert first.node_id == second.node_id == "node-hot"
            await cluster.start_node(idle)
            everywhere = _pin(_threads(), {int(args.cpus[1])})
            arm.series = [
                Series(label="critical", deployment=first.deployment_id),
                Series(label="best-effort", deployment=second.deployment_id),
            ]
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(
                    open_loop(client, inputs, stop, constant(series, arm.rate_per_s))
                )
                for client, series in zip((critical, best_effort), arm.series, strict=True)
            ]
            await asyncio.sleep(args.window)
            stop.set()
            await asyncio.gather(*tasks)
            _pin(_threads(), everywhere)
            arm.migrations = await _migrations(
                cluster, arm.name, [s.deployment for s in arm.series]
            )
            if rebalance and not arm.migrations:
                print(f"   no move in the window: {_last_verdict(cluster.log('broker'))}")
    finally:
        await cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return arm


def compute_alone_ms(model: Path, inputs: dict[str, np.ndarray], cpu: int) -> float:
    """The model's compute time in ms on `cpu` alone, in this thread, as a replica of a node
    with that one CPU runs it (one intra-op thread): the median of up to 40 inferences in 3
    s (a vCPU of this shared machine changes speed from minute to minute). Blocking."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # this thread only
    try:
        loaded = OnnxModel.load(model, model.stem, device="cpu", intra_op_threads=1)
        return loaded.warm_up(inputs, timed_runs=40, budget_s=3.0)
    finally:
        os.sched_setaffinity(0, before)


def _last_verdict(log: Path) -> str:
    """The broker's last logged rebalance verdict (it logs one only about hot nodes)."""
    lines = log.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if "rebalance: " in line]
    if not starts:
        return "the broker never found a node hot (see REBALANCE_FLAGS)"
    verdict = [lines[starts[-1]].split("rebalance: ", 1)[1]]
    details = itertools.takewhile(lambda line: line.startswith("  "), lines[starts[-1] + 1 :])
    verdict += [line.strip() for line in details]
    return "\n     ".join(verdict)


def _threads() -> list[int]:
    return [int(task.name) for task in Path("/proc/self/task").iterdir()]


def _pin(threads: list[int], cpus: set[int]) -> set[int]:
    """Move every thread of this process (gRPC's C threads included) to `cpus`; the CPUs
    they had before."""
    before = os.sched_getaffinity(0)
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)
    return before


async def _migrations(
    cluster: LocalCluster, arm: str, deployment_ids: list[str]
) -> list[dict[str, str]]:
    metadata = (("authorization", f"Bearer {cluster.api_key}"),)
    found: list[dict[str, str]] = []
    async with grpc.aio.insecure_channel(cluster.broker_address) as channel:
        stub = pb_grpc.EdgeBrokerStub(channel)
        for deployment_id in deployment_ids:
            listed = await stub.ListMigrations(
                pb.ListMigrationsRequest(deployment_id=deployment_id), metadata=metadata
            )
            found.extend(
                {
                    "arm": arm,
                    "deployment": m.deployment_id,
                    "trigger": m.trigger,
                    "route": f"{m.source_node} -> {m.target_node}",
                    "outcome": m.outcome or m.state,
                    "reason": m.reason,
                }
                for m in listed.migrations
            )
    return found


def summarise(arms: Sequence[Arm]) -> dict[str, Any]:
    rows = []
    print(
        f"\n{'arm':<8} {'deployment':<12} {'req/s':>6} {'requests':>8} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'SLO ms':>7} {'within SLO':>10} {'failed':>6}"
    )
    attainment: dict[str, list[float]] = {"off": [], "on": []}
    for arm in arms:
        for series in arm.series:
            f = series.figures(arm.slo_ms)
            rows.append(
                {
                    "arm": arm.name,
                    "slo_ms": round(arm.slo_ms, 1),
                    "rate_per_s": round(arm.rate_per_s, 1),
                    **f,
                }
            )
            attainment[arm.name.split("-")[0]].append(f["slo_attainment"])
            print(
                f"{arm.name:<8} {series.label:<12} {arm.rate_per_s:>6.1f} {f['requests']:>8} "
                f"{f['p50_ms']:>8} "
                f"{f['p99_ms']:>8} {arm.slo_ms:>7.1f} {f['slo_attainment']:>10.1%} "
                f"{f['failed']:>6}"
            )
        for m in arm.migrations:
            print(f"         {m['trigger']} {m['route']}: {m['outcome']}: {m['reason']}")
    off, on = (statistics.mean(attainment[k]) if attainment[k] else 0.0 for k in ("off", "on"))
    failed = sum(s.failed for arm in arms for s in arm.series)
    moves = [m for arm in arms for m in arm.migrations]
    back = [m for arm in arms for m in arm.migrations if m["route"] == "node-idle -> node-hot"]
    print(
        f"\nSLO attainment of node-hot's deployments: {off:.1%} without rebalancing, {on:.1%} "
        f"with ({on - off:+.1%}); {failed} failed request(s); {len(moves)} migration(s), "
        f"{len(back)} back to node-hot"
    )
    return {
        "rows": rows,
        "attainment_off": round(off, 3),
        "attainment_on": round(on, 3),
        "failed_requests": failed,
        "migrations": moves,
        "moved_back": len(back),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    runtime, image = await asyncio.to_thread(
        pick_runtime, args.runtime, lambda line: print(line, flush=True)
    )
    args.runtime = runtime
    arms: list[Arm] = []
    for round_ in range(args.rounds):
        for name, on in (("off", False), ("on", True)):
            print(
                f"== round {round_ + 1}/{args.rounds}, rebalancing {name} ({runtime})", flush=True
            )
            started = time.monotonic()
            calibration = (arms[0].slo_ms, arms[0].rate_per_s) if arms else None
            arms.append(await run_arm(f"{name}-{round_ + 1}", on, args, image, calibration))
            print(f"   {time.monotonic() - started:.0f} s", flush=True)
    return summarise(arms)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rebalance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="one round and a 30 s window, unless given"
    )
    parser.add_argument(
        "--model",
        default="ppocr_rec",
        help="a model zoo model (ppocr_rec: the pretrained OCR recognizer, whose 184 KB "
        "input costs the clients little beside its compute)",
    )
    parser.add_argument("--runtime", choices=("auto", "process", "docker"), default="process")
    parser.add_argument("--window", type=float, help="seconds of load (60; 30 with --quick)")
    parser.add_argument(
        "--slo-x", type=float, default=2.0, help="SLO = this x the median alone (2)"
    )
    parser.add_argument(
        "--load",
        type=float,
        default=0.4,
        help="each deployment's offered load, in CPUs: its rate = this / the model's compute "
        "time on one CPU (0.4)",
    )
    parser.add_argument("--rounds", type=int, help="off/on pairs (2; 1 with --quick)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.window is None:
        args.window = 30.0 if args.quick else 60.0
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.window <= 0 or args.slo_x <= 1 or args.rounds < 1 or not 0 < args.load < 1:
        parser.error("--window > 0, --slo-x > 1, --rounds at least 1, 0 < --load < 1")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        parser.error(f"needs two CPUs to give each node its own; this process has {len(cpus)}")
    args.cpus = (str(cpus[0]), str(cpus[1]))
    result = asyncio.run(run(args))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    # The attainment figures are reported, not asserted: a shared machine's noise is the
    # reader's to judge (run it again); what must hold every time is below.
    moved = {m["arm"] for m in result["migrations"]}
    ok = result["failed_requests"] == 0 and result["moved_back"] == 0
    return 0 if ok and not any(a.startswith("off") for a in moved) else 1


if __name__ == "__main__":
    sys.exit(main())
