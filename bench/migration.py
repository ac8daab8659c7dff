"""Repeated migrations under a steady client load: make-before-break against stop-start.

This process runs a broker (real gRPC on loopback, a temporary state dir, a cluster file with
two sites 20 ms apart) and two node daemons joined to it, one per site (topology-file
inventories; Docker replicas when an engine is reachable and the runtime image builds, else
local processes). The load comes from another process, as it would from an edge device
(`bench.migration_client`): per test model an `OffloadClient` there uploads and deploys it at
site-a and runs closed-loop inference loops on it with its own timing, and sends back the
completion time of each successful response. The broker moves the deployment back and forth
between the two nodes (`Migrations.migrate`, the operator's path), rotating through the arms
in the same run: make-before-break with the target started at background CPU priority, the
same with the target at normal priority (`Migrations.background_targets`, set before each
migration: the A/B of that priority, with the same noise on both), and stop-start (the
baseline). After each migration the bench waits for the client's observation to reach the
record, then lets the load settle.

Per model and arm:
  - gap: the longest gap between successful responses across the switch, as the client
    observed it and reported it to the broker (ReportObservation, kept in the record), beside
    the same measure over windows of the same length with no migration (the load's own
    jitter: a migration cannot look better than that);
  - failed: requests that raised, from the migrate call until the load settled again;
  - the server timeline of the record: start (target_started -> target_ready), switch
    (target_ready -> switched), drain (switched -> old_stopped; stop-start stops the old
    replica first, decided -> old_stopped, shown in the same column), total (decided ->
    completed).
The published anchor is AVEC's under 5 s downtime for stateless migration; the target for
make-before-break (issue 5) is zero failed requests and a gap p99 under 50 ms.

The span figures decide issue 12's target, per make-before-break arm: the worst span gap may
exceed the quiet p99 by at most 10 ms (p99) for the MLP, by at most 25 % of the quiet p99 for
the other models.

With `--pin-nodes` each node's replicas run on half of this machine's CPUs (`offload node
--cpuset`): two sites that do not share cores, as two machines do not.

Everything talks over loopback. Unless `--network host` (or where it cannot: not root, no
`unshare` or `ip`, Docker replicas), the run happens in a network namespace of its own whose
loopback has an Ethernet MTU, 1500, as a device's link to a node has: over this machine's
loopback (MTU 65536, BBR congestion control) 602 KB requests stalled now and then, up to
170 ms, in quiet windows and spans alike, and not at MTU 1500 (`bench.private_net`). The
report's `network:` line says which loopback the run had.

Ctrl-C or SIGTERM stops the run: the replicas it started and its load client are stopped
first, then it exits with status 130.

    python -m bench.migration [--quick] [--json FILE] [--runtime docker|process]
        [--targets alternate|background|foreground] [--pin-nodes]
        [--network auto|private|host]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import modelzoo
from bench import private_net
from bench.timing import p99_is_the_maximum, percentiles
from broker.server import BrokerConfig, RunningBroker, start_broker
from broker.state import MigrationRecord, MigrationState
from common.node_identity import load_or_create_secret
from edge_client.demo.run import install_stop_signals
from edge_client.observer import DEFAULT_WINDOW_S
from images.build import ImageBuildError, build_image
from migration.mechanism import Strategy, phase_at, span_allowance_ms, worst_gap
from node_daemon.broker_link import BrokerLink
from node_daemon.inventory import GpuSpec
from node_daemon.server import NodeSettings, split_cpus, start_node
from tests.data import TOPOLOGIES

NODES = (
    ("site-a", "21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt",
     GpuSpec("Tesla V100-SXM2-16GB", 16384)),
    ("site-b", "12_dgx-a100-8gpu-nv12-10nic-nps4.txt", GpuSpec("A100-SXM4-40GB", 40960)),
)  # fmt: skip
SITE_LATENCY_MS = 20
CLUSTER_YAML = f"""\
sites: [site-a, site-b]
links:
  - {{a: site-a, b: site-b, latency_ms: {SITE_LATENCY_MS}}}
"""
_REPO_ROOT = Path(__file__).resolve().parents[1]
JOIN_TOKEN = "bench-migration-join-token-0123456789"
CLIENT_ID = "bench-migration"
API_KEY = f"{CLIENT_ID}.bench-migration-secret-0123456789"


@dataclass(frozen=True, slots=True)
class Arm:
    """One way of migrating that the run compares."""

    name: str
    strategy: Strategy
    background: bool = False
    """The target starts at background CPU priority (make-before-break only)."""


MBB_BACKGROUND = Arm("mbb-background", Strategy.MAKE_BEFORE_BREAK, background=True)
MBB_FOREGROUND = Arm("mbb-foreground", Strategy.MAKE_BEFORE_BREAK)
STOP_START = Arm("stop-start", Strategy.STOP_START)
ARMS = {
    "alternate": (MBB_BACKGROUND, MBB_FOREGROUND, STOP_START),
    "background": (MBB_BACKGROUND, STOP_START),
    "foreground": (MBB_FOREGROUND, STOP_START),
}
"""`--targets`: the arms of a run."""
ENDED = (MigrationState.COMPLETED, MigrationState.ROLLED_BACK, MigrationState.FAILED)
ANCHOR_MS = 5000.0
"""AVEC: under 5 s downtime for stateless migration."""
TARGET_GAP_P99_MS = 50.0
SETTLE_REQUESTS = 20
"""Successful requests the load completes before the first and after each migration."""
STEP_TIMEOUT_S = 120.0


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` until it holds; TimeoutError naming `what` after STEP_TIMEOUT_S."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {STEP_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def cluster(
    runtime: str, tmp: Path, cpusets: Sequence[frozenset[int]] = ()
) -> AsyncIterator[tuple[RunningBroker, list[str]]]:
    """A broker and one node per site joined to it; yields the broker and the node ids.
    `cpusets`: one per node, the CPUs its replicas run on (`offload node --cpuset`); empty:
    every node on every CPU. On exit every replica is stopped (the agents close with
    stop_replicas=True)."""
    (tmp / "cluster.yaml").write_text(CLUSTER_YAML)
    broker = await start_broker(
        BrokerConfig(
            listen="127.0.0.1:0",
            ops_listen="127.0.0.1:0",
            state_dir=tmp / "broker",
            cluster=tmp / "cluster.yaml",
            join_token=JOIN_TOKEN,
            api_keys=(API_KEY,),
        )
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(broker.stop)
        # Unique ids: a daemon adopts the containers labelled with its node id.
        run_id = secrets.token_hex(3)
        node_ids = [
            await join_node(
                stack, broker, runtime, tmp, f"bench-{site}-{run_id}", site, capture, gpu_spec,
                cpusets[i] if cpusets else frozenset(),
            )
            for i, (site, capture, gpu_spec) in enumerate(NODES)
        ]  # fmt: skip
        yield broker, node_ids


async def join_node(
    stack: contextlib.AsyncExitStack,
    broker: RunningBroker,
    runtime: str,
    tmp: Path,
    node_id: str,
    site: str,
    capture: str,
    gpu_spec: GpuSpec,
    cpuset: frozenset[int] = frozenset(),
) -> str:
    """Start a node daemon and join it to the broker, as `offload node --broker` does; its
    clean-up (every replica stopped) goes on `stack`. Returns the node id once registered."""
    ours = os.sched_getaffinity(0)
    server, port, agent = await start_node(
        NodeSettings(
            listen="127.0.0.1:0",
            site=site,
            node_id=node_id,
            state_dir=tmp / node_id,
            topology_file=TOPOLOGIES / capture,
            gpu_spec=gpu_spec,
            runtime=runtime,
            cpuset=cpuset,
        )
    )
    # A daemon pins the thread that starts it to its CPUs; this process (and the load
    # client it starts) keeps every CPU.
    os.sched_setaffinity(0, ours)
    stack.push_async_callback(agent.close, stop_replicas=True)
    stack.push_async_callback(server.stop, 1.0)
    link = BrokerLink(
        f"127.0.0.1:{broker.port}",
        JOIN_TOKEN,
        agent,
        f"127.0.0.1:{port}",
        node_secret=load_or_create_secret(tmp / node_id),
    )
    agent.fetch_model = link.fetch_model
    stack.push_async_callback(link.close)
    task = asyncio.create_task(link.run(), name=f"broker-link-{node_id}")
    stack.push_async_callback(cancel, task)
    await until(lambda: link.registered.is_set() or task.done(), f"{node_id} joining")
    if task.done():
        await task  # raises why the broker refused the node
    return node_id


async def cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@dataclass(slots=True)
class Load:
    """The closed-loop load of one `bench.migration_client` process (its protocol is in that
    module's docstring): the completion times it sends, as they arrive."""

    process: asyncio.subprocess.Process
    ok_at: list[float] = field(default_factory=list)
    """time.monotonic() of each successful response, in completion order (the client's
    clock: CLOCK_MONOTONIC, shared by every process on the host)."""
    failed: int = 0
    deployed: dict[str, str] | None = None
    stats: dict[str, Any] | None = None
    """The client's own `stats()`, once it stopped."""
    ended: bool = False

    @classmethod
    async def spawn(cls, address: str, model: str, concurrency: int) -> Load:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.migration_client", "--broker", address,
            "--api-key", API_KEY, "--model", model, "--concurrency", str(concurrency),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            cwd=_REPO_ROOT, limit=1 << 24,
        )  # fmt: skip
        return cls(process)

    async def read(self) -> None:
        """Take in the client's lines until it exits."""
        assert self.process.stdout is not None
        try:
            async for line in self.process.stdout:
                message = json.loads(line)
                self.ok_at.extend(message.get("ok", ()))
                self.failed += message.get("failed", 0)
                self.deployed = message.get("deployed", self.deployed)
                self.stats = message.get("stats", self.stats)
        finally:
            self.ended = True

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        """`until`, failing at once (RuntimeError) when the client exited."""

        def check() -> bool:
            if condition():
                return True
            if self.ended:
                raise RuntimeError(f"{what}: the load client exited")
            return False

        await until(check, what)

    async def stop(self) -> dict[str, Any]:
        """Stop the loops; the client's stats once it exited."""
        assert self.process.stdin is not None
        with contextlib.suppress(ConnectionError):
            self.process.stdin.write(b"stop\n")
            await self.process.stdin.drain()
            self.process.stdin.close()
        await until(lambda: self.ended, "the load client stopping")
        code = await self.process.wait()
        if code != 0 or self.stats is None:
            raise RuntimeError(f"the load client exited with code {code}")
        return self.stats

    @property
    def ok(self) -> int:
        return len(self.ok_at)

    def worst_gap(self, start: float, end: float) -> tuple[float, float]:
        """The longest gap between successful responses over `[start, end]` as the load saw
        it, as (its start, its end): from the last response by `start` through the first one
        at or after `end` (a gap that straddles either edge counts whole)."""
        return worst_gap(self.ok_at, start, end)

    def worst_gap_ms(self, start: float, end: float) -> float:
        a, b = self.worst_gap(start, end)
        return (b - a) * 1000

    def longest_gap_ms(self, start: float, end: float) -> float:
        """The longest gap between successful responses from the last one before `start`
        to the last one by `end` (as the client's observer measures a migration's window)."""
        first = max(0, bisect.bisect_right(self.ok_at, start) - 1)
        inside = self.ok_at[first : bisect.bisect_right(self.ok_at, end)]
        return max(b - a for a, b in itertools.pairwise(inside)) * 1000


async def finished_record(
    running: RunningBroker, deployment_id: str, migration_id: str
) -> MigrationRecord:
    """The record once the migration succeeded and the client's observation reached it.
    RuntimeError when it rolled back or failed."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        records = await running.broker.moves.list_migrations(deployment_id)
        record = next(m for m in records if m.migration_id == migration_id)
        if record.state in ENDED and record.state is not MigrationState.COMPLETED:
            raise RuntimeError(f"migration {migration_id} {record.state}: {record.reason}")
        if record.state is MigrationState.COMPLETED and record.downtime_ms is not None:
            return record
        await asyncio.sleep(0.05)
    raise TimeoutError(f"migration {migration_id}: no observation within {STEP_TIMEOUT_S:.0f} s")


def phases_ms(at: dict[str, float]) -> dict[str, float]:
    """The server timeline's phases, from its events (name -> time in seconds)."""
    # Make-before-break stops the old replica after the switch; stop-start before anything.
    drain_from = "switched" if at["old_stopped"] > at["switched"] else "decided"
    spans = {
        "start": ("target_started", "target_ready"),
        "switch": ("target_ready", "switched"),
        "drain": (drain_from, "old_stopped"),
        "total": ("decided", "completed"),
    }
    return {name: (at[end] - at[begin]) * 1000 for name, (begin, end) in spans.items()}


async def bench_model(
    running: RunningBroker,
    address: str,
    name: str,
    migrations: int,
    concurrency: int,
    arms: tuple[Arm, ...],
) -> dict:
    """Start a load client on `name` (it deploys it), migrate the deployment `migrations`
    times per arm; the figures."""
    runs: list[dict] = []
    steady: list[float] = []
    load = await Load.spawn(address, name, concurrency)
    reader = asyncio.create_task(load.read(), name=f"load-{name}")
    try:
        await load.until(lambda: load.ok >= SETTLE_REQUESTS, f"{name}: first responses")
        assert load.deployed is not None
        deployment_id, node = load.deployed["deployment_id"], load.deployed["node_id"]
        for i in range(migrations):
            steady.append(await steady_gap_ms(load))
            # Rotating the order every round puts each arm after each other one, and moves
            # each both ways.
            for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:
                moved = await migrate_once(running, load, deployment_id, node, arm)
                runs.append(moved)
                node = moved["target"]
        stats = await load.stop()
    finally:
        if load.process.returncode is None:
            load.process.kill()
            await load.process.wait()
        await reader
    await running.broker.deployments.delete(CLIENT_ID, deployment_id)
    observed = {o["migration_id"]: o for o in stats["migrations"]}
    for moved in runs:
        moved["requests_in_window"] = observed[moved["migration_id"]]["requests"]
        moved["retried_in_window"] = observed[moved["migration_id"]]["retried_requests"]
    return {
        "model": name,
        "load": {
            "concurrency": concurrency,
            "requests": stats["requests"],
            "failures": stats["failures"],
            "latency_p50_ms": stats["latency_p50_ms"],
            "latency_p99_ms": stats["latency_p99_ms"],
        },
        "steady_gap_ms": {**percentiles(steady), "max": max(steady)},
        "arms": {arm.name: summary([r for r in runs if r["arm"] == arm.name]) for arm in arms},
        "migrations": runs,
    }


async def steady_gap_ms(load: Load) -> float:
    """The baseline: the longest gap over an observation window with no migration."""
    start = time.monotonic()
    await asyncio.sleep(DEFAULT_WINDOW_S)
    end = time.monotonic()
    await load.until(lambda: load.ok > 0 and load.ok_at[-1] >= end, "steady window")
    return load.longest_gap_ms(start, end)


async def migrate_once(
    running: RunningBroker, load: Load, deployment_id: str, source: str, arm: Arm
) -> dict:
    """Move the deployment from `source` to the other node, wait for the record and the
    client's observation, let the load settle; the migration's figures."""
    target = next(n for n in running.broker.nodes if n != source)
    failed_before = load.failed
    cpu_before, host_before = time.process_time(), host_cpu()
    running.migrations.background_targets = arm.background
    migration_id = await running.migrations.migrate(deployment_id, target, arm.strategy)
    record = await finished_record(running, deployment_id, migration_id)
    cpu_span, host_span = time.process_time() - cpu_before, busy(host_before, host_cpu())
    settled = load.ok + SETTLE_REQUESTS
    await load.until(lambda: load.ok >= settled, f"{deployment_id}: load after {migration_id}")
    assert record.downtime_ms is not None
    events = timeline_of(record.timeline_json)
    begin = events["decided"]
    end = max(events.get("old_stopped", events["completed"]), events["completed"])
    span_s = end - begin
    worst = load.worst_gap(begin, end)
    span_gap = (worst[1] - worst[0]) * 1000
    # The baseline of the span: the same load over a quiet window of the same length.
    quiet, cpu_before, host_before = time.monotonic(), time.process_time(), host_cpu()
    await asyncio.sleep(span_s)
    cpu_quiet, host_quiet = time.process_time() - cpu_before, busy(host_before, host_cpu())
    await load.until(lambda: load.ok > 0 and load.ok_at[-1] >= quiet + span_s, "quiet window")
    moved: dict[str, Any] = {
        "migration_id": migration_id,
        "arm": arm.name,
        "strategy": str(arm.strategy),
        "background": arm.background,
        "source": source,
        "target": target,
        "gap_ms": record.downtime_ms,
        "span_gap_reported_ms": record.span_gap_ms,
        "span_gap_ms": span_gap,
        "worst_gap_phase": phase_at(events, worst[1]),
        # Where it fell: its start and end, and the timeline's events, in ms from the decision.
        "worst_gap_at_ms": [(worst[0] - begin) * 1000, (worst[1] - begin) * 1000],
        "events_ms": {event: (at - begin) * 1000 for event, at in events.items()},
        "span_s": span_s,
        "quiet_gap_ms": load.worst_gap_ms(quiet, quiet + span_s),
        "failed": load.failed - failed_before,
        "failed_in_window": record.failed_requests,
        "phases_ms": phases_ms(events),
        # Where the CPUs went: this process (broker and nodes) and the host's busy share,
        # over the migration (to its record) and over the quiet window.
        "bench_cpu_pct": {"span": 100 * cpu_span / span_s, "quiet": 100 * cpu_quiet / span_s},
        "host_busy_pct": {"span": host_span, "quiet": host_quiet},
    }
    print(
        f"  {deployment_id} {arm.name:<14} -> {target}: gap {moved['gap_ms']:8.1f} ms, "
        f"span gap {span_gap:8.1f} ms in {moved['worst_gap_phase']:<8} "
        f"({moved['worst_gap_at_ms'][0]:.0f} to {moved['worst_gap_at_ms'][1]:.0f} ms from the "
        f"decision; switched at {moved['events_ms']['switched']:.0f}; reported "
        f"{_ms(record.span_gap_ms)}, quiet {moved['quiet_gap_ms']:.1f}) over {span_s:.2f} s, "
        f"{moved['failed']} failed, total {moved['phases_ms']['total']:7.1f} ms; bench cpu "
        f"{moved['bench_cpu_pct']['span']:.0f}%/{moved['bench_cpu_pct']['quiet']:.0f}%, host "
        f"busy {host_span:.0f}%/{host_quiet:.0f}% (span/quiet)",
        file=sys.stderr,
    )
    return moved


def host_cpu() -> tuple[int, int]:
    """The host's (busy, total) CPU time in clock ticks since boot, from /proc/stat."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


def busy(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The host's busy share between two `host_cpu` readings, in percent of all its CPUs."""
    return 100 * (after[0] - before[0]) / max(1, after[1] - before[1])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def timeline_of(timeline_json: str) -> dict[str, float]:
    """The record's events in time.monotonic() (the timeline is in Unix seconds; the broker
    runs on this host, so one offset converts it)."""
    offset = time.time() - time.monotonic()
    return {e["event"]: float(e["at"]) - offset for e in json.loads(timeline_json)}


def summary(runs: list[dict]) -> dict:
    gaps = [r["gap_ms"] for r in runs]
    spans = [r["span_gap_ms"] for r in runs]
    quiet = [r["quiet_gap_ms"] for r in runs]
    quiet_p99 = percentiles(quiet)["p99"]
    excess = [g - quiet_p99 for g in spans]
    paired = [g - q for g, q in zip(spans, quiet, strict=True)]
    return {
        "n": len(runs),
        "gap_ms": {**percentiles(gaps), "max": max(gaps)},
        "span_gap_ms": {**percentiles(spans), "max": max(spans)},
        "quiet_gap_ms": {**percentiles(quiet), "max": max(quiet)},
        "span_excess_ms": {**percentiles(excess), "max": max(excess)},
        "paired_excess_ms": {**percentiles(paired), "max": max(paired)},
        "worst_gap_phases": dict(Counter(r["worst_gap_phase"] for r in runs)),
        "strategy": runs[0]["strategy"],
        "failed_total": sum(r["failed"] for r in runs),
        "failed_per_migration": [r["failed"] for r in runs],
        "phases_ms": {
            phase: {
                "p50": statistics.median(r["phases_ms"][phase] for r in runs),
                "max": max(r["phases_ms"][phase] for r in runs),
            }
            for phase in ("start", "switch", "drain", "total")
        },
    }


def verdict(result: dict) -> dict[str, dict[str, object]]:
    """Per make-before-break arm: issue 5's target (no failed request, gap p99 under 50 ms),
    issue 12's (the span excess within `span_allowance_ms`), and whether every arm's worst
    gap is under the anchor."""
    worst = max(s["gap_ms"]["max"] for s in result["arms"].values())
    verdicts: dict[str, dict[str, object]] = {}
    for arm, s in result["arms"].items():
        if s["strategy"] != Strategy.MAKE_BEFORE_BREAK:
            continue
        allowed = span_allowance_ms(result["model"], s["quiet_gap_ms"]["p99"])
        verdicts[arm] = {
            "target_met": s["failed_total"] == 0 and s["gap_ms"]["p99"] < TARGET_GAP_P99_MS,
            "span_allowance_ms": allowed,
            "span_target_met": s["failed_total"] == 0 and s["span_excess_ms"]["p99"] <= allowed,
            "under_anchor": worst < ANCHOR_MS,
        }
    return verdicts


async def run(args: argparse.Namespace, runtime: str) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-migration-") as tmp:
        async with cluster(runtime, Path(tmp), node_cpusets(args.pin_nodes)) as (
            running,
            node_ids,
        ):
            print(f"nodes {' and '.join(node_ids)} joined ({runtime})", file=sys.stderr)
            for name in args.models:
                print(f"benchmarking {name} ...", file=sys.stderr)
                result = await bench_model(
                    running,
                    f"127.0.0.1:{running.port}",
                    name,
                    args.migrations,
                    args.concurrency,
                    ARMS[args.targets],
                )
                result["verdict"] = verdict(result)
                results.append(result)
    return results


async def _stoppable(args: argparse.Namespace, runtime: str) -> list[dict] | None:
    """`run`, cancelled by the first SIGINT or SIGTERM so that it stops the replicas it
    started (they run in sessions of their own) and its load client; None then."""
    task = asyncio.create_task(run(args, runtime))
    install_stop_signals(task, lambda message: print(message, file=sys.stderr, flush=True))
    try:
        return await task
    except asyncio.CancelledError:
        return None


def node_cpusets(pin: bool) -> list[frozenset[int]]:
    """With `pin`, this process's CPUs split in two halves, one per node (site-a takes the
    first); else none. Two sites are two machines: their replicas never share a core."""
    if not pin:
        return []
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        raise ValueError(f"--pin-nodes needs at least 2 CPUs, this process may use {len(cpus)}")
    return split_cpus(cpus, 2)


def pick_runtime(requested: str | None) -> tuple[str, str]:
    """The replicas' runtime and why: Docker when asked for or, unasked, when an engine is
    reachable and the runtime image builds; else local processes. ImageBuildError when
    Docker was asked for and cannot be had."""
    if requested == "process":
        return "process", "as asked"
    try:
        image = build_image("cpu", progress=lambda line: print(line, file=sys.stderr))
    except ImageBuildError as err:
        if requested == "docker":
            raise
        return "process", f"Docker is not usable: {err}"
    return "docker", f"image {image}"


def print_report(
    results: list[dict],
    runtime: str,
    why: str,
    network: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    print(f"runtime: {runtime} ({why})")
    where = "a private namespace's" if network["private_namespace"] else "the host's"
    print(
        f"network: {where} loopback, MTU {network['loopback_mtu']}, TCP congestion control "
        f"{network['tcp_congestion_control']}" + (f" ({network['why']})" if network["why"] else "")
    )
    print(
        f"cluster: site-a and site-b, {SITE_LATENCY_MS} ms apart, one node each; load: "
        f"{args.concurrency} closed-loop inference loop(s) per model in a client process of "
        f"its own; {args.migrations} migrations per arm, arms rotating, back and forth"
    )
    print(
        f"\n{'model':<12} {'arm':<15} {'n':>2} {'gap p50':>8} {'p99':>8} {'max':>8} "
        f"{'failed':>6} {'max/mig':>7} {'start':>7} {'switch':>7} {'drain':>7} {'total':>7}"
    )
    for r in results:
        gap = r["steady_gap_ms"]
        print(
            f"{r['model']:<12} {'(no migration)':<15} {gap['n']:>2} {gap['p50']:>8.1f} "
            f"{gap['p99']:>8.1f} {gap['max']:>8.1f}"
        )
        for arm, s in r["arms"].items():
            gap, ph = s["gap_ms"], s["phases_ms"]
            print(
                f"{r['model']:<12} {arm:<15} {s['n']:>2} {gap['p50']:>8.1f} "
                f"{gap['p99']:>8.1f} {gap['max']:>8.1f} {s['failed_total']:>6} "
                f"{max(s['failed_per_migration']):>7} {ph['start']['p50']:>7.1f} "
                f"{ph['switch']['p50']:>7.1f} {ph['drain']['p50']:>7.1f} "
                f"{ph['total']['p50']:>7.1f}"
            )
    print(
        "gap: longest gap between successful responses across the switch, as the client "
        "observed and reported it (its window: from the last response before the update to "
        f"{DEFAULT_WINDOW_S:.0f} s after it); (no migration): the bench's measure of the same, "
        "over windows of the same length with no migration; failed: requests that raised "
        "from the migrate call until the load settled; start/switch/drain/total: server "
        "timeline, p50 (drain for stop-start: stopping the old replica before the start). "
        "Arms: mbb-background/-foreground: make-before-break, the target started at "
        "background/normal CPU priority. Times in ms."
    )
    print(
        f"\n{'model':<12} {'arm':<15} {'n':>2} {'span p50':>8} {'p99':>8} {'max':>8} "
        f"{'client p99':>10} {'quiet p99':>9} {'excess p99':>10} {'allowed':>7} "
        f"{'paired p50':>10} {'span s':>6}  worst gap in"
    )
    for r in results:
        for arm, s in r["arms"].items():
            span, quiet, excess = s["span_gap_ms"], s["quiet_gap_ms"], s["span_excess_ms"]
            span_s = statistics.median(m["span_s"] for m in r["migrations"] if m["arm"] == arm)
            reported = [
                m["span_gap_reported_ms"]
                for m in r["migrations"]
                if m["arm"] == arm and m["span_gap_reported_ms"] is not None
            ]
            client = f"{percentiles(reported)['p99']:>10.1f}" if reported else f"{'-':>10}"
            v = r["verdict"].get(arm)
            allowed = f"{v['span_allowance_ms']:>7.1f}" if v else f"{'':>7}"
            where = " ".join(f"{k} {n}" for k, n in sorted(s["worst_gap_phases"].items()))
            print(
                f"{r['model']:<12} {arm:<15} {s['n']:>2} {span['p50']:>8.1f} "
                f"{span['p99']:>8.1f} {span['max']:>8.1f} {client} {quiet['p99']:>9.1f} "
                f"{excess['p99']:>10.1f} {allowed} {s['paired_excess_ms']['p50']:>10.1f} "
                f"{span_s:>6.2f}  {where}"
            )
    print(
        "span: the worst gap between successful responses over the whole migration, from the "
        "broker's decision to the old replica stopped, measured by the bench from the "
        "client's completion times; client p99: the same as the client measured and "
        "reported it (ReportObservation); quiet: the same load's worst gap over a window of "
        "the same length with no migration (right after each one); excess: span gap minus "
        "the quiet p99; allowed: issue 12's bound on it; paired p50: the median of each "
        "migration's span gap minus its own quiet window's (robust to a noisy host, where "
        "one outlier sets a p99 of 10); worst gap in: the phase in which "
        "each migration's worst gap ended (prep: decision to the target's start; start; "
        "ready: target ready to the broker's switch; switched: from there to the old replica "
        "stopped, where the client switches). Times in ms."
    )
    print("\nsteady load (the same client over the whole run, migrations included):")
    for r in results:
        load = r["load"]
        print(
            f"{r['model']:<12} {load['requests']:>6} requests, {load['failures']} failed, "
            f"latency p50 {load['latency_p50_ms']:.2f} ms, p99 {load['latency_p99_ms']:.2f} ms"
        )
    print(
        f"\nanchor (AVEC): stateless migration downtime under {ANCHOR_MS / 1000:.0f} s; target "
        f"(issue 5) for make-before-break: 0 failed requests, gap p99 under "
        f"{TARGET_GAP_P99_MS:.0f} ms"
    )
    for r in results:
        for arm, v in r["verdict"].items():
            s = r["arms"][arm]
            print(
                f"{r['model']:<12} {arm:<15} gap p99 {s['gap_ms']['p99']:.1f} ms, "
                f"{s['failed_total']} failed: {'target met' if v['target_met'] else 'NOT MET'}"
                f"; span excess p99 {s['span_excess_ms']['p99']:.1f} ms over the quiet p99 "
                f"{s['quiet_gap_ms']['p99']:.1f} ms (allowed {v['span_allowance_ms']:.1f} ms, "
                f"issue 12): {'target met' if v['span_target_met'] else 'NOT MET'}; "
                f"{'every arm under' if v['under_anchor'] else 'OVER'} the anchor"
            )
    print(verdict_line(results))
    if note := p99_note(results):
        print(note)


def verdict_line(results: list[dict]) -> str:
    """Both targets of make-before-break, each met or the arms that missed it."""

    def missed(target: str) -> str:
        arms = [
            f"{r['model']} {a}" for r in results for a, v in r["verdict"].items() if not v[target]
        ]
        return f"missed for {', '.join(arms)}" if arms else "met"

    return (
        f"verdict: make-before-break: issue 5's target {missed('target_met')}; issue 12's "
        f"span bound {missed('span_target_met')}"
    )


def p99_note(results: list[dict]) -> str | None:
    """What a p99 of so few migrations is, when it is their maximum; None otherwise."""
    few = {s["n"] for r in results for s in r["arms"].values() if p99_is_the_maximum(s["n"])}
    if not few:
        return None
    counts = " and ".join(str(n) for n in sorted(few))
    return (
        f"note: a p99 of {counts} migrations is their maximum (bench.timing.percentiles, up "
        "to 51), so one migration sets it; --migrations 60 or more for one it cannot"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 migrations per arm, the MLP alone (CI smoke run)"
    )
    parser.add_argument(
        "--migrations",
        type=int,
        help="migrations per arm and model (default 10, --quick 2); a p99 of up to 51 is "
        "their maximum, so take 60 or more for a p99 one migration cannot set",
    )
    parser.add_argument("--models", nargs="+", choices=modelzoo.ALL, metavar="MODEL")
    parser.add_argument(
        "--concurrency", type=int, default=2, help="closed-loop inference loops (default 2)"
    )
    parser.add_argument(
        "--runtime",
        choices=["docker", "process"],
        help="replicas' runtime (default: docker when usable, else process)",
    )
    parser.add_argument(
        "--targets",
        choices=sorted(ARMS),
        default="alternate",
        help="make-before-break arms: targets started at background CPU priority, at normal "
        "priority, or alternating between the two in one run (default; issue 12's A/B)",
    )
    parser.add_argument(
        "--foreground-targets",
        action="store_const",
        dest="targets",
        const="foreground",
        help="the same as --targets foreground",
    )
    parser.add_argument(
        "--pin-nodes",
        action="store_true",
        help="give each node half of this machine's CPUs (`offload node --cpuset`), as two "
        "sites are two machines: a migration's target then starts on CPUs the serving "
        "replica does not use (the load client keeps every CPU)",
    )
    parser.add_argument(
        "--network",
        choices=["auto", "private", "host"],
        default="auto",
        help="private: run in a network namespace of its own whose loopback has an Ethernet "
        f"MTU ({private_net.ETHERNET_MTU}), as between an edge device and a node (the "
        "loopback's 65536 stalls large requests under BBR; bench/private_net.py); needs "
        "root, unshare, ip and the process runtime; host: this machine's loopback; auto "
        "(default): private where it can be",
    )
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.pin_nodes and len(os.sched_getaffinity(0)) < 2:
        parser.error("--pin-nodes needs at least 2 CPUs")
    if args.migrations is None:
        args.migrations = 2 if args.quick else 10
    if args.models is None:
        # Quick: the MLP alone. ResNet-18's arms took 4 of the quick run's 6.6 minutes under
        # load; its figures are the full run's, and the MLP takes the same code path.
        args.models = ["mlp"] if args.quick else list(modelzoo.BUILT)
    if args.migrations < 1 or args.concurrency < 1:
        parser.error("--migrations and --concurrency must be at least 1")
    try:
        runtime, why = pick_runtime(args.runtime)
    except ImageBuildError as err:
        print(f"--runtime docker: {err}", file=sys.stderr)
        return 1
    network_why = "as asked" if args.network == "host" else ""
    if args.network != "host" and not private_net.inside():
        cannot = private_net.unavailable_reason()
        if cannot is None and runtime == "docker":
            cannot = "a Docker replica's published port is in the host's namespace"
        if cannot is None:
            # The same run in a namespace of its own, its runtime settled.
            own = list(sys.argv[1:] if argv is None else argv)
            command = [sys.executable, "-m", "bench.migration", *own, "--runtime", runtime]
            return private_net.run_in_private_network(command)
        if args.network == "private":
            parser.error(f"--network private: {cannot}")
        network_why = f"no private one: {cannot}"
    network = {**private_net.network_description(), "why": network_why}
    results = asyncio.run(_stoppable(args, runtime))
    if results is None:
        return 130
    print_report(results, runtime, why, network, args)
    if args.json:
        machine = {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        }
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "runtime": runtime,
                    "network": network,
                    "arms": [arm.name for arm in ARMS[args.targets]],
                    "migrations_per_strategy": args.migrations,
                    "site_latency_ms": SITE_LATENCY_MS,
                    "anchor_ms": ANCHOR_MS,
                    "target_gap_p99_ms": TARGET_GAP_P99_MS,
                    "results": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
