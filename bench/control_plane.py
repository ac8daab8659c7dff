"""The scale of one control plane, measured as Kubernetes measures its own (kubemark): hollow
nodes (`node_daemon.hollow`: the real node daemon, agent, broker link and NodeAgent server,
over a runtime that runs nothing) registering and heartbeating into one real broker process
(`offload broker`, its real state), while clients deploy, migrate and delete. The hollow
nodes register on the broker's node port (`--node-listen`), as production's do, and are live
as `offload node` is: a liveness beacon (a UDP datagram, `common.beacons`) every second, a
lease renewal as often as the broker asks (every 24 s there at its defaults), its usage
sample and replicas when they change or every --sample-interval seconds; against a broker
from before leases, a full heartbeat every second. "Heartbeats" below count every message of
the Heartbeats streams, renewals and samples alike (not the beacons, whose cost is in the
broker's CPU beside them).

The cluster grows in steps (250, 500, 1,000, 2,000 hollow nodes; 100 and 250 with --quick)
against the same broker, each node one of five real 8-GPU servers (the `nvidia-smi topo -m`
captures `bench.placement` uses) at one of --sites edge sites. The hollow nodes live in
--hollow-processes child processes (each node with its own gRPC server on a loopback port and
its own connection to the broker). At each step, once every node has registered and
--settle seconds passed, --clients clients (each with its own API key, as distinct users)
run a closed loop for --window seconds: deploy (60 % of operations: 1 GPU at a random site,
answered once the broker has placed it, the node has fetched the model and started the
replica, and the deployment is recorded running), delete (30 %: their oldest deployment) and
migrate (10 %: a random one of theirs, make-before-break; answered once the move is decided
and recorded, the move itself runs on in the broker). Between steps nothing is cleaned: the
deployments stay, as in a cluster that grows. Before the window, --bursts (3) bursts:
--burst deploys (500) asked at once, as kube-scheduler's throughput test creates its pods in
a batch, then deleted at once; the burst of median pace is reported, with each one's.

Reported per step:
- heartbeat round trip p50/p99/max (ms) as the hollow nodes see it (the broker exposes no
  heartbeat metric), and heartbeats that failed;
- what the heartbeats alone cost the broker, over the second half of --settle or one
  --sample-interval when that is longer (nothing else asks it anything then): heartbeats
  answered per second, its CPU cores, and its CPU time per heartbeat in microseconds; and,
  after the last step (the broker stopped), the same figures for the same hollow nodes
  against `bench.null_registry`, which only parses each heartbeat and answers it (it gives
  no lease, so nodes send it a full heartbeat every second): the floor gRPC and asyncio in
  Python put under any broker's figure (--no-floor skips it);
- nodes falsely marked lost: the broker's "lost" log lines during the step (every hollow node
  heartbeats all along, so every one is false), and the nodes it shows lost (`/api/nodes`);
- Deploy throughput with the state committed: deployments answered `running` per second,
  end to end, with the Deploy latency p50/p99, and the deploys answered otherwise (pending,
  refused) by reason; migrations and deletes answered per second;
- the decisions behind them, from the broker's `offload_deploy_decision_seconds`: committed
  per second, the mean time each held the placement lock (cluster read, placement, the
  `starting` write to the store) and so the capacity of that lock, 1 / the mean: the deploy
  decisions the broker could commit per second were nothing else waiting (decisions run one
  at a time; the rest of a Deploy, the node's start, runs outside the lock), and every use
  of that lock (the decisions and the writes that settle them: a replica running, a delete,
  a move's steps): how often it was taken, the share of the window it was held (near 100 %
  it, not the CPU, bounds the deploys committed) and how long each user waited for it;
- the broker's CPU (cores, from /proc/<pid>/stat over the window) and its event loop's
  thread's (the main thread's: the rest is gRPC's own threads and the state's writer), its
  RSS and peak RSS (VmHWM), the hollow processes' CPU and the clients' (this process's; all
  share this machine's CPUs with the broker), how late the hollow processes' event loops wake
  (lag p99 over the window: the part of a heartbeat's round trip that is the hollow side's
  own; and the most over the whole step, bursts included: a stall of seconds there silences
  a hollow process's nodes, which the broker then rightly counts lost), and the
  machine's load average (other work on it shows there);
- how long a /metrics scrape takes at the step's end (the median of three, request to last
  byte): what a Prometheus server scraping this broker costs it as the cluster grows;
- hollow nodes stopped so far (all steps) by a refusal their broker link does not retry
  (an `offload node` would exit), with the reasons; the broker marks them lost for real, so
  they are not counted as falsely lost;
- the burst: deploy decisions committed per second (each decision's time from the broker's
  log line, written once its `starting` record is in the store: the decisions over the time
  from the first Deploy sent to the last of them; pods bound per second is the figure
  kube-scheduler's 300 pods/s is, not pods running), each decision's time under the lock,
  the deploys answered running per second with their latency, and the deletes per second;
- whether the step is saturated: heartbeat p99 over half the interval, a node marked lost,
  a heartbeat failed, or Deploy throughput under 80 % of the best earlier step's.

The table puts the anchors beside the figures: kube-scheduler about 300 pods/s, Godel about
1,000 pods/s at 30k nodes, Nomad 3,750 containers/s (C1M). Target (issue 15): 2,000 hollow
nodes with zero nodes falsely marked lost, and over 300 deploy decisions per second committed
on SQLite. The figures are reported, not asserted; the exit status is 1 when a node was
marked lost, a heartbeat failed, a hollow node stopped, a step did not register all its
nodes, or nothing deployed.

`--state VALUE` is passed to the broker as `--state VALUE` (its state's location: a
postgresql:// URL); without it the broker keeps its default SQLite state in its state dir.

    python -m bench.control_plane [--quick] [--steps N,N,...] [--window S] [--clients N]
        [--burst N] [--bursts N] [--hollow-processes N] [--sites N] [--state VALUE] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from prometheus_client.parser import text_string_to_metric_families

import modelzoo
from bench import null_registry
from bench.loopback import loopback_server
from bench.placement import CAPTURES
from bench.timing import percentiles
from broker.state.api_keys import new_api_key
from common import collector
from edge_client.client import OffloadClient
from edge_client.demo.cluster import ClusterError, LocalCluster
from node_daemon.broker_link import SAMPLE_INTERVAL_S
from node_daemon.hollow import FleetStatus, HollowFleet
from node_daemon.inventory import Inventory, inventory_from_capture
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from tests.data import TOPOLOGIES

HEARTBEAT_INTERVAL_S = 1.0
"""The broker's default, which the issue asks for."""
LOST_AFTER_S = 5.0
"""The broker's default."""
STEPS = (250, 500, 1000, 2000)
QUICK_STEPS = (100, 250)
OPERATIONS = {"deploy": 6, "delete": 3, "migrate": 1}
"""Operation -> weight in the clients' mix."""
ANCHORS = (
    ("kube-scheduler", 300.0, "pods/s (Kubernetes scheduling throughput SLO tests)"),
    ("Godel", 1000.0, "pods/s at 30k nodes (ByteDance, SoCC 2023)"),
    ("Nomad C1M", 3750.0, "containers/s (HashiCorp's million-container challenge)"),
)
TARGET_RATE = 300.0
"""Deploy decisions per second committed on SQLite (issue 15)."""
SATURATION_DROP = 0.8
"""A step whose Deploy throughput is under this share of the best earlier one's saturates."""
MODEL = "mlp"
LOST_LINE = re.compile(r"node=(\S+) lost: no heartbeat")
CALL_TIMEOUT_S = 120.0
LAG_PROBE_S = 0.1
BURST = 500
"""Deploys asked at once at each step before the window (`--burst`)."""
BURSTS = 3
"""Bursts at each step (`--bursts`): the one of median pace is reported."""
PLACED_LINE = re.compile(
    r"^(?P<at>\S+ \S+) INFO broker\.deployments: deployment=(?P<id>\S+) placed on node=", re.M
)
"""The broker's log line of a decision committed (`Deployments._reserve`)."""
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"
"""Its time (`logging`'s asctime, local time)."""
ANSWER_GRACE_S = 15.0
"""How long past the window the clients wait for their calls still out."""


def hollow_inventories() -> list[Inventory]:
    """The five 8-GPU servers of `bench.placement`, from their captures. Blocking."""
    return [
        inventory_from_capture(next(TOPOLOGIES.glob(f"{n}_*.txt")), spec)
        for n, spec in CAPTURES.items()
    ]


def cluster_yaml(sites: int) -> str:
    """An edge network of `sites` sites along a road, 5 ms apart."""
    names = [f"site-{i:02d}" for i in range(sites)]
    links = "".join(
        f"  - {{a: {a}, b: {b}, latency_ms: 5}}\n" for a, b in itertools.pairwise(names)
    )
    return f"sites: [{', '.join(names)}]\nlinks:\n" + (links or "  []\n")


# --- the hollow processes ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """What a hollow process needs (pickled to it)."""

    broker: str
    join_token: str
    root: Path
    sites: tuple[str, ...]
    prefix: str
    sample_interval_s: float = SAMPLE_INTERVAL_S
    """Each hollow node's `offload node --sample-interval`."""


def fleet_process(config: FleetConfig, conn: multiprocessing.connection.Connection) -> None:
    """A hollow process's main: a `HollowFleet` that answers the bench's commands on `conn`
    (("grow", count), ("heartbeats", None), ("status", None), ("worst lag", None),
    ("close", None)). Only errors are logged (a node that stops): thousands of nodes' retry
    and slow-sample warnings would bury the bench's output, and its figures count what they
    would say."""
    logging.basicConfig(
        level=logging.ERROR, format="%(processName)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(_serve_fleet(config, conn))


async def _serve_fleet(config: FleetConfig, conn: multiprocessing.connection.Connection) -> None:
    inventories = await asyncio.to_thread(hollow_inventories)
    # Thousands of nodes in one process: the heap of a broker's, the collector's settings too.
    collector.settle()
    fleet = HollowFleet(
        config.broker,
        config.join_token,
        config.root,
        config.sites,
        inventories,
        config.prefix,
        sample_interval_s=config.sample_interval_s,
    )
    lags: list[float] = []
    worst = [0.0]
    lagging = asyncio.create_task(_measure_lag(lags, worst), name="loop-lag")
    try:
        while True:
            command, argument = await asyncio.to_thread(conn.recv)
            if command == "grow":
                # Joining at 200 nodes a second, as a cluster's nodes join, not all at once.
                spread = max(1.0, (argument - fleet.status().nodes) / 200)
                try:
                    conn.send(await fleet.grow(argument, spread_s=spread))
                except (TimeoutError, OSError) as err:  # raised again in the bench
                    conn.send(err)
            elif command == "heartbeats":
                conn.send((fleet.heartbeats.take(), lags[:]))
                lags.clear()
            elif command == "status":
                conn.send(fleet.status())
            elif command == "worst lag":
                conn.send(worst[0])
                worst[0] = 0.0
            else:
                break
    finally:
        lagging.cancel()
        await fleet.close()
        conn.send(None)


async def _measure_lag(lags: list[float], worst: list[float]) -> None:
    """How late the hollow process's event loop wakes from a `LAG_PROBE_S` sleep, in ms,
    into `lags`, and the largest since the bench last asked into `worst[0]`: the part of the
    heartbeat round trips that is the hollow process's own (a stall of seconds here silences
    all of its nodes at once)."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(LAG_PROBE_S)
        lag = (loop.time() - asked - LAG_PROBE_S) * 1000
        lags.append(lag)
        worst[0] = max(worst[0], lag)


class FleetProcess:
    """One hollow process, driven from the bench's event loop."""

    def __init__(self, config: FleetConfig) -> None:
        context = multiprocessing.get_context("spawn")  # gRPC does not survive a fork
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=fleet_process, args=(config, child), name=config.prefix, daemon=True
        )
        self.process.start()
        child.close()

    async def ask(self, command: str, argument: object = None) -> Any:
        """Send a command and wait for its answer; an exception the process answered with
        is raised here. ConnectionError when the process has died."""

        def exchange() -> Any:
            self._conn.send((command, argument))
            if not self._conn.poll(CALL_TIMEOUT_S + 300):
                raise ConnectionError(f"{self.process.name} did not answer {command}")
            return self._conn.recv()

        try:
            answer = await asyncio.to_thread(exchange)
        except (EOFError, BrokenPipeError) as err:
            raise ConnectionError(f"{self.process.name} exited") from err
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(ConnectionError):
                await self.ask("close")
        await asyncio.to_thread(self.process.join, 30)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join)


# --- the broker process, from /proc --------------------------------------------------------


def cpu_seconds(pid: int, main_thread: bool = False) -> float:
    """User + system CPU time of a process so far (of its main thread alone: `main_thread`).
    OSError when it is gone."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat")
    fields = stat.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> tuple[float, float]:
    """(RSS, peak RSS) of a process in MiB. OSError when it is gone."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) / 1024
    return found["VmRSS"], found["VmHWM"]


# --- the clients -----------------------------------------------------------------------------


@dataclass
class Tally:
    """What the clients did in one window."""

    deploy_ms: list[float] = field(default_factory=list)
    """Latency of the deploys answered running."""
    outcomes: Counter[str] = field(default_factory=Counter)
    """Operation outcome ("deploy running", "deploy pending", "migrate RESOURCE_EXHAUSTED"
    ...) -> count."""
    unanswered: Counter[str] = field(default_factory=Counter)
    """Operation -> calls given up unanswered (`run_clients`)."""


@dataclass
class Client:
    """One client (its own API key and model upload) and the deployments it has."""

    stub: pb_grpc.EdgeBrokerStub
    metadata: tuple[tuple[str, str], ...]
    sha256: str
    sites: Sequence[str]
    rng: random.Random
    live: list[str] = field(default_factory=list)
    """Its deployments that run and no move holds, oldest first."""

    async def deploy(self) -> pb.Deployment:
        """One Deploy of the bench's model, 1 GPU at a random site; its answer."""
        reply: pb.Deployment = await self.stub.Deploy(
            pb.DeployRequest(
                model_sha256=self.sha256,
                model_name=MODEL,
                gpus=1,
                priority=pb.PRIORITY_CLASS_STANDARD,
                site=self.rng.choice(self.sites),
            ),
            metadata=self.metadata,
            timeout=CALL_TIMEOUT_S,
        )
        return reply

    async def delete(self, deployment_id: str) -> None:
        await self.stub.DeleteDeployment(
            pb.DeleteDeploymentRequest(deployment_id=deployment_id),
            metadata=self.metadata,
            timeout=CALL_TIMEOUT_S,
        )

    async def step(self, tally: Tally) -> None:
        """One operation of the mix (a deploy when there is nothing to delete or move)."""
        operation = self.rng.choices(list(OPERATIONS), list(OPERATIONS.values()))[0]
        if not self.live:
            operation = "deploy"
        outcome = "answered"
        started = time.perf_counter()
        try:
            if operation == "deploy":
                reply = await self.deploy()
                outcome = reply.state
                if reply.state == "running":
                    tally.deploy_ms.append((time.perf_counter() - started) * 1000)
                    self.live.append(reply.deployment_id)
            elif operation == "delete":
                await self.delete(self.live.pop(0))
            else:
                # Left out of `live` from now on: the move runs on after the answer.
                moved = self.live.pop(self.rng.randrange(len(self.live)))
                await self.stub.Migrate(
                    pb.MigrateRequest(deployment_id=moved),
                    metadata=self.metadata,
                    timeout=CALL_TIMEOUT_S,
                )
        except grpc.aio.AioRpcError as err:
            outcome = err.code().name
        except asyncio.CancelledError:
            tally.unanswered[operation] += 1
            raise
        tally.outcomes[f"{operation} {outcome}"] += 1


async def run_clients(clients: Sequence[Client], window_s: float) -> Tally:
    """Each client's closed loop for `window_s`, then up to `ANSWER_GRACE_S` more for the
    calls still out; those still unanswered then are given up (the broker finishes what
    it started regardless) and counted in `Tally.unanswered`."""
    tally = Tally()
    loop = asyncio.get_running_loop()
    end = loop.time() + window_s

    async def closed_loop(client: Client) -> None:
        while loop.time() < end:
            await client.step(tally)

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(
            asyncio.gather(*(closed_loop(c) for c in clients)), window_s + ANSWER_GRACE_S
        )
    return tally


async def run_burst(
    clients: Sequence[Client],
    total: int,
    http: aiohttp.ClientSession,
    cluster: LocalCluster,
    probe: CpuProbe,
    us_per_heartbeat: float,
) -> dict[str, Any]:
    """`total` deploys asked at once (spread over the clients, all in flight together), as
    kube-scheduler's throughput test creates its pods in a batch; then the running ones
    deleted, all at once too. When each decision was committed comes from the broker's log:
    it writes "deployment=... placed on node=..." once the `starting` record is in the
    store, with the time (read afterwards from the file: the broker is not asked anything
    meanwhile). Decided per second is the burst's decisions over the time from the first
    Deploy sent to the last of them.

    CPU from the first Deploy sent to the last answered: the broker's, the hollow nodes' and
    the clients' cores, and the broker's CPU per deploy beyond the heartbeats it answered
    meanwhile (each at `us_per_heartbeat`, measured alone before): what a rate of deploys
    costs it."""
    loop = asyncio.get_running_loop()
    log_offset = cluster.log("broker").stat().st_size
    counted, _ = await lock_counters(http, cluster)
    answers: list[tuple[Client, pb.Deployment | str, float]] = []
    await probe.heartbeats()  # count from here
    cpu_before = probe.cpu_seconds()
    started_wall, started = time.time(), loop.time()

    async def one(client: Client) -> None:
        try:
            answer: pb.Deployment | str = await client.deploy()
        except grpc.aio.AioRpcError as err:
            answer = err.code().name
        answers.append((client, answer, loop.time() - started))

    await asyncio.gather(*(one(clients[k % len(clients)]) for k in range(total)))
    broker_cpu, hollow_cpu, own_cpu = (
        now - before for now, before in zip(probe.cpu_seconds(), cpu_before, strict=True)
    )
    beats = await probe.heartbeats()
    after, _ = await lock_counters(http, cluster)
    log = cluster.log("broker").read_bytes()[log_offset:].decode(errors="replace")
    ids = {a.deployment_id for _, a, _ in answers if isinstance(a, pb.Deployment)}
    placed = {
        match["id"]: datetime.strptime(match["at"], LOG_TIME).timestamp() - started_wall
        for match in PLACED_LINE.finditer(log)
        if match["id"] in ids
    }
    running = [
        (c, a, t) for c, a, t in answers if isinstance(a, pb.Deployment) and a.state == "running"
    ]
    outcomes = Counter(a.state if isinstance(a, pb.Deployment) else a for _, a, _ in answers)
    decided_s = max(placed.values(), default=0.0)
    answered_s = max((t for _, _, t in answers), default=0.0)
    deleting = loop.time()
    await asyncio.gather(*(c.delete(a.deployment_id) for c, a, _ in running))
    deleted_s = loop.time() - deleting
    latency = (
        percentiles([t * 1000 for _, _, t in running]) if running else {"p50": 0.0, "p99": 0.0}
    )
    decisions = after[DECISIONS] - counted[DECISIONS]
    held_s = after[DECISIONS_HELD] - counted[DECISIONS_HELD]
    commits = after[COMMITS] - counted[COMMITS]
    calls = after[CALLS] - counted[CALLS]
    return {
        "burst": total,
        "burst_decided": len(placed),
        "burst_decided_s": round(decided_s, 2),
        "burst_decisions_per_s": round(len(placed) / decided_s, 1) if decided_s > 0 else 0.0,
        "burst_decision_ms_mean": round(held_s / decisions * 1000, 3) if decisions else 0.0,
        "burst_state_calls_per_commit": round(calls / commits, 2) if commits else 0.0,
        "burst_running": len(running),
        "burst_running_per_s": round(len(running) / answered_s, 1) if answered_s > 0 else 0.0,
        "burst_deploy_p50_ms": round(latency["p50"], 1),
        "burst_deploy_p99_ms": round(latency["p99"], 1),
        "burst_outcomes": dict(sorted(outcomes.items())),
        "burst_deletes_per_s": round(len(running) / deleted_s, 1) if deleted_s > 0 else 0.0,
        "burst_answered_s": round(answered_s, 3),
        "burst_broker_cpu_cores": round(broker_cpu / answered_s, 2),
        "burst_hollow_cpu_cores": round(hollow_cpu / answered_s, 2),
        "burst_clients_cpu_cores": round(own_cpu / answered_s, 2),
        "burst_heartbeats_per_s": round(beats / answered_s, 1),
        "burst_broker_ms_per_deploy": (
            round((broker_cpu - beats * us_per_heartbeat / 1e6) / len(placed) * 1000, 3)
            if placed
            else 0.0
        ),
    }


@dataclass(frozen=True)
class CpuProbe:
    """What a burst reads: the CPU of the broker, of the hollow processes, of this one, and
    the heartbeats the hollow nodes had answered."""

    broker: int
    fleets: Sequence[FleetProcess]

    def cpu_seconds(self) -> tuple[float, float, float]:
        """CPU seconds so far of the broker, of the hollow processes together, of this one."""
        hollow = (f.process.pid for f in self.fleets if f.process.pid is not None)
        return cpu_seconds(self.broker), sum(map(cpu_seconds, hollow)), cpu_seconds(os.getpid())

    async def heartbeats(self) -> int:
        """Heartbeats answered since the last ask (of any kind: "heartbeats" resets)."""
        logs = await asyncio.gather(*(f.ask("heartbeats") for f in self.fleets))
        return sum(len(log.round_trips_ms) for log, _ in logs)


# --- one step ------------------------------------------------------------------------------


@dataclass
class Step:
    """One step's figures (the JSON's `steps`) and whether it saturates."""

    nodes: int
    registered: int
    figures: dict[str, Any] = field(default_factory=dict)
    saturated: list[str] = field(default_factory=list)
    """Why the step counts as saturated; empty: it does not."""


async def lost_nodes(http: aiohttp.ClientSession, cluster: LocalCluster) -> list[str]:
    """The nodes the broker shows lost now."""
    async with http.get(f"{cluster.ops_url}api/nodes") as reply:
        reply.raise_for_status()
        return sorted(n["node_id"] for n in await reply.json() if n["state"] == "lost")


LOCK_COUNTERS = (
    "offload_deploy_decision_seconds_count",
    "offload_deploy_decision_seconds_sum",
    "offload_placement_lock_acquisitions_total",
    "offload_placement_lock_wait_seconds_total",
    "offload_placement_lock_held_seconds_total",
    "offload_state_commits_total",
    "offload_state_calls_total",
)
"""The broker's counters of its placement lock: the deploy decisions made so far and the
seconds they held it (cluster read, placement, the `starting` write queued), and every use
of the lock (decisions and the writes that settle them) with the seconds waited and held;
and its state store's commits and the calls they made durable."""


HELD_BY_USE = "offload_placement_lock_held_seconds_total"
DECISIONS = "offload_deploy_decision_seconds_count"
DECISIONS_HELD = "offload_deploy_decision_seconds_sum"
COMMITS = "offload_state_commits_total"
CALLS = "offload_state_calls_total"


SCRAPES = 3
"""/metrics scrapes timed at the end of each step (their median is reported)."""


async def scrape(http: aiohttp.ClientSession, cluster: LocalCluster) -> tuple[str, float]:
    """The broker's /metrics page, and how long it took, request to last byte, in ms."""
    started = time.perf_counter()
    async with http.get(f"{cluster.ops_url}metrics") as reply:
        reply.raise_for_status()
        text = await reply.text()
    return text, (time.perf_counter() - started) * 1000


async def lock_counters(
    http: aiohttp.ClientSession, cluster: LocalCluster
) -> tuple[dict[str, float], dict[str, float]]:
    """`LOCK_COUNTERS` now, from the broker's /metrics, summed over their labels (0 for one
    it does not show); and the lock's held seconds by use."""
    text, _ = await scrape(http, cluster)
    found = dict.fromkeys(LOCK_COUNTERS, 0.0)
    held: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
            if sample.name == HELD_BY_USE:
                use = sample.labels["use"]
                held[use] = held.get(use, 0.0) + sample.value
    return found, held


async def grow(fleets: Sequence[FleetProcess], nodes: int) -> list[str]:
    """Grow the fleets to `nodes` in all, spread evenly; what each fleet whose nodes did not
    all register in time said (the step saturates on it)."""
    shares = [len(range(k, nodes, len(fleets))) for k in range(len(fleets))]
    grown = await asyncio.gather(
        *(f.ask("grow", n) for f, n in zip(fleets, shares, strict=True)),
        return_exceptions=True,
    )
    for answer in grown:
        if isinstance(answer, BaseException) and not isinstance(answer, TimeoutError):
            raise answer
    return [str(answer) for answer in grown if isinstance(answer, TimeoutError)]


async def heartbeat_floor(
    nodes: int, args: argparse.Namespace, root: Path, sites: tuple[str, ...]
) -> dict[str, Any]:
    """The same hollow nodes, `nodes` of them in --hollow-processes processes, against
    `bench.null_registry` (a NodeRegistry that parses each heartbeat and answers it, no more):
    what gRPC and asyncio in Python cost per heartbeat, measured as `heartbeats_alone`
    measures the broker's."""
    async with loopback_server(
        null_registry.__name__,
        str(round(HEARTBEAT_INTERVAL_S * 1000)),
        str(round(LOST_AFTER_S * 1000)),
    ) as (address, process):
        fleets = [
            FleetProcess(
                FleetConfig(
                    address, "no-token", root / "floor", sites, f"f{k}", args.sample_interval
                )
            )
            for k in range(args.hollow_processes)
        ]
        try:
            late = await grow(fleets, nodes)
            figures = await heartbeats_alone(
                CpuProbe(process.pid, fleets), args.settle, args.sample_interval
            )
        finally:
            for fleet in fleets:
                await fleet.close()
    return {"nodes": nodes, **figures, **({"late": late} if late else {})}


async def heartbeats_alone(
    probe: CpuProbe, settle_s: float, sample_interval_s: float
) -> dict[str, float]:
    """Sleep `settle_s`, measuring over its second half, or over one `sample_interval_s`
    when that is longer (every node's sample once, beside its lease renewals), what the
    heartbeats alone cost the broker (nothing else asks it anything then): heartbeats
    answered per second (lease renewals and samples alike), the broker's CPU cores, and so
    its CPU time per heartbeat in microseconds (0 with no heartbeat)."""
    await asyncio.sleep(settle_s / 2)
    await probe.heartbeats()  # forget the joining
    cpu, started = cpu_seconds(probe.broker), time.monotonic()
    loop_cpu = cpu_seconds(probe.broker, main_thread=True)
    await asyncio.sleep(max(settle_s / 2, sample_interval_s))
    answered = await probe.heartbeats()
    took = time.monotonic() - started
    used = cpu_seconds(probe.broker) - cpu
    loop_used = cpu_seconds(probe.broker, main_thread=True) - loop_cpu
    return {
        "idle_heartbeats_per_s": round(answered / took, 1) if took > 0 else 0.0,
        "idle_broker_cpu_cores": round(used / took, 3) if took > 0 else 0.0,
        "idle_broker_loop_cores": round(loop_used / took, 3) if took > 0 else 0.0,
        "broker_us_per_heartbeat": round(used / answered * 1e6, 1) if answered else 0.0,
    }


async def run_step(
    nodes: int,
    args: argparse.Namespace,
    cluster: LocalCluster,
    fleets: Sequence[FleetProcess],
    clients: Sequence[Client],
    http: aiohttp.ClientSession,
    best_rate: float,
) -> Step:
    broker_pid = cluster.processes["broker"].pid
    log_offset = cluster.log("broker").stat().st_size
    joining = time.monotonic()
    late = await grow(fleets, nodes)
    joined_s = time.monotonic() - joining
    await asyncio.gather(*(f.ask("worst lag") for f in fleets))  # from here on
    probe = CpuProbe(broker_pid, fleets)
    idle = await heartbeats_alone(probe, args.settle, args.sample_interval)
    bursts = [
        await run_burst(clients, args.burst, http, cluster, probe, idle["broker_us_per_heartbeat"])
        for _ in range(args.bursts if args.burst else 0)
    ]
    # The burst of median pace stands for the step (its figures, one burst's, agree); each
    # burst's pace is kept beside it: on this shared machine one burst can be far off.
    ranked = sorted(bursts, key=lambda b: b["burst_decisions_per_s"])
    burst = {
        **(ranked[len(ranked) // 2] if ranked else {}),
        **({"bursts": bursts} if bursts else {}),
    }
    await probe.heartbeats()  # forget the bursts
    counting = time.monotonic()
    counted_before, held_before = await lock_counters(http, cluster)
    # CPU over the window alone (the scrapes around it are not the load's).
    cpu_before, loop_cpu = probe.cpu_seconds(), cpu_seconds(broker_pid, main_thread=True)
    started = time.monotonic()
    tally = await run_clients(clients, args.window)
    took = time.monotonic() - started
    broker_cores, hollow_cores, own_cores = (
        (now - before) / took for now, before in zip(probe.cpu_seconds(), cpu_before, strict=True)
    )
    loop_cores = (cpu_seconds(broker_pid, main_thread=True) - loop_cpu) / took
    counted_after, held_after = await lock_counters(http, cluster)
    counted = {name: counted_after[name] - counted_before[name] for name in LOCK_COUNTERS}
    held_by_use = {use: s - held_before.get(use, 0.0) for use, s in held_after.items()}
    decided, deciding_s, locked, waited_s, held_s, commits, calls = counted.values()
    beats = await asyncio.gather(*(f.ask("heartbeats") for f in fleets))
    counted_s = time.monotonic() - counting  # the window and the reads around it
    statuses: list[FleetStatus] = await asyncio.gather(*(f.ask("status") for f in fleets))
    round_trips = [ms for log, _ in beats for ms in log.round_trips_ms]
    failed_beats = sum(log.failed for log, _ in beats)
    lag = percentiles([ms for _, lags in beats for ms in lags] or [0.0])
    worst_lag = max(await asyncio.gather(*(f.ask("worst lag") for f in fleets)))
    rss, peak = memory_mib(broker_pid)
    scrapes = [(await scrape(http, cluster))[1] for _ in range(SCRAPES)]
    log = cluster.log("broker").read_bytes()[log_offset:].decode(errors="replace")
    # A node whose link stopped (see `FleetStatus.stopped`) is lost for real.
    stopped = {node: why for status in statuses for node, why in status.stopped}
    marked_lost = sorted(set(LOST_LINE.findall(log)) - set(stopped))
    lost_now = sorted(set(await lost_nodes(http, cluster)) - set(stopped))
    heartbeat = percentiles(round_trips) if round_trips else {"p50": 0.0, "p99": 0.0, "n": 0}
    deploy = percentiles(tally.deploy_ms) if tally.deploy_ms else {"p50": 0.0, "p99": 0.0}
    committed = len(tally.deploy_ms)
    rate = committed / took
    count = tally.outcomes
    step = Step(nodes, sum(s.registered for s in statuses))
    step.figures = {
        "nodes": nodes,
        "registered": step.registered,
        "join_s": round(joined_s, 1),
        "window_s": round(took, 1),
        "heartbeats": heartbeat["n"],
        "heartbeat_p50_ms": round(heartbeat["p50"], 2),
        "heartbeat_p99_ms": round(heartbeat["p99"], 2),
        "heartbeat_max_ms": round(max(round_trips, default=0.0), 2),
        "heartbeats_failed": failed_beats,
        "heartbeats_per_s": round(heartbeat["n"] / counted_s, 1),
        "hollow_loop_lag_p50_ms": round(lag["p50"], 1),
        "hollow_loop_lag_p99_ms": round(lag["p99"], 1),
        "hollow_loop_lag_max_ms": round(worst_lag, 1),
        "marked_lost": len(marked_lost),
        "marked_lost_nodes": marked_lost[:20],
        "lost_now": len(lost_now),
        "deploys_committed": committed,
        "deploys_per_s": round(rate, 1),
        "deploy_p50_ms": round(deploy["p50"], 1),
        "deploy_p99_ms": round(deploy["p99"], 1),
        "decisions_per_s": round(decided / took, 1),
        "decision_ms_mean": round(deciding_s / decided * 1000, 3) if decided else 0.0,
        "decision_capacity_per_s": round(decided / deciding_s) if deciding_s > 0 else 0,
        "lock_uses_per_s": round(locked / took, 1),
        "lock_busy": round(held_s / took, 2),
        "lock_busy_by_use": {
            use: round(seconds / took, 3)
            for use, seconds in sorted(held_by_use.items(), key=lambda kv: -kv[1])
            if seconds > 0
        },
        "lock_wait_ms_mean": round(waited_s / locked * 1000, 2) if locked else 0.0,
        "state_commits_per_s": round(commits / took, 1),
        "state_calls_per_commit": round(calls / commits, 2) if commits else 0.0,
        "migrations_per_s": round(count["migrate answered"] / took, 1),
        "deletes_per_s": round(count["delete answered"] / took, 1),
        "outcomes": dict(sorted(count.items())),
        "unanswered": dict(sorted(tally.unanswered.items())),
        "replicas_on_nodes": sum(s.replicas for s in statuses),
        "broker_cpu_cores": round(broker_cores, 2),
        "broker_loop_cpu_cores": round(loop_cores, 2),
        "broker_rss_mib": round(rss, 1),
        "broker_peak_rss_mib": round(peak, 1),
        "metrics_scrape_ms": round(statistics.median(scrapes), 1),
        "hollow_cpu_cores": round(hollow_cores, 2),
        "clients_cpu_cores": round(own_cores, 2),
        "load_average_1m": round(os.getloadavg()[0], 1),
        **idle,
        "stopped_nodes": len(stopped),
        "stopped_reasons": dict(Counter(stopped.values()).most_common(5)),
        **burst,
    }
    if late:
        step.saturated.append("; ".join(late))
    if heartbeat["p99"] > HEARTBEAT_INTERVAL_S * 1000 / 2:
        step.saturated.append(f"heartbeat p99 {heartbeat['p99']:.0f} ms > half the interval")
    if marked_lost or lost_now:
        step.saturated.append(f"{len(set(marked_lost) | set(lost_now))} node(s) marked lost")
    if failed_beats:
        step.saturated.append(f"{failed_beats} heartbeat(s) failed")
    if stopped:
        step.saturated.append(f"{len(stopped)} hollow node(s) stopped by a broker refusal")
    if best_rate and rate < SATURATION_DROP * best_rate:
        step.saturated.append(
            f"Deploy throughput {rate:.0f}/s < {SATURATION_DROP:.0%} of {best_rate:.0f}/s"
        )
    step.figures["saturated"] = step.saturated
    return step


# --- the run -------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-control-plane-"))
    (root / "cluster.yaml").write_text(cluster_yaml(args.sites))
    sites = tuple(f"site-{i:02d}" for i in range(args.sites))
    keys = [new_api_key(f"client-{i:03d}") for i in range(args.clients)]
    cluster = LocalCluster(
        root,
        runtime="process",
        nodes=(),
        cluster_file=root / "cluster.yaml",
        broker_flags=(
            "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
            "--lost-after", str(LOST_AFTER_S),
            "--max-deployments-per-client", "1000000",
            # No client watches the moved deployments: their moves need not wait 5 s for
            # an acknowledgement that never comes.
            "--drain-timeout", "0.5",
            *(("--state", args.state) if args.state else ()),
        ),
        client_id="bench",
        more_api_keys=keys,
    )  # fmt: skip
    fleets: list[FleetProcess] = []
    steps: list[Step] = []
    floor: dict[str, Any] = {}
    try:
        await cluster.start(lambda line: print(line, flush=True))
        join_token = cluster.join_token_file.read_text().strip()
        fleets = [
            FleetProcess(
                FleetConfig(
                    cluster.registry_address,
                    join_token,
                    root / "hollow",
                    sites,
                    f"h{k}",
                    args.sample_interval,
                )
            )
            for k in range(args.hollow_processes)
        ]
        model = modelzoo.model_path(MODEL)
        async with (
            grpc.aio.insecure_channel(cluster.broker_address) as channel,
            aiohttp.ClientSession(headers=cluster.ops_headers) as http,
        ):
            stub = pb_grpc.EdgeBrokerStub(channel)
            clients = []
            for index, key in enumerate(keys):
                async with OffloadClient(cluster.broker_address, key) as uploader:
                    sha = await uploader.upload_model(model)
                clients.append(
                    Client(
                        stub,
                        (("authorization", f"Bearer {key}"),),
                        sha,
                        sites,
                        random.Random(args.seed + index),
                    )
                )
            best = 0.0
            for nodes in args.steps:
                print(f"== {nodes} hollow nodes", flush=True)
                step = await run_step(nodes, args, cluster, fleets, clients, http, best)
                steps.append(step)
                best = max(best, step.figures["deploys_per_s"])
                _print_step(step)
        for fleet in fleets:
            await fleet.close()
        fleets = []
        await cluster.stop()
        if args.floor and steps:
            # With the broker gone: nothing else asks these two cores for anything.
            print(f"== the heartbeat floor: {steps[-1].nodes} hollow nodes", flush=True)
            floor = await heartbeat_floor(steps[-1].nodes, args, root, sites)
    finally:
        for fleet in fleets:
            await fleet.close()
        await cluster.stop()
        if args.keep:
            print(f"logs and state kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return summarise(steps, args, floor)


def _print_step(step: Step) -> None:
    f = step.figures
    by_use = ", ".join(f"{use} {share:.0%}" for use, share in f["lock_busy_by_use"].items())
    print(
        f"   joined in {f['join_s']} s; heartbeats p50 {f['heartbeat_p50_ms']} ms, p99 "
        f"{f['heartbeat_p99_ms']} ms ({f['heartbeats_per_s']}/s, {f['heartbeats_failed']} "
        f"failed); marked lost {f['marked_lost']}; deploys {f['deploys_per_s']}/s committed "
        f"(p50 {f['deploy_p50_ms']} ms); each decision held the placement lock "
        f"{f['decision_ms_mean']} ms (capacity {f['decision_capacity_per_s']}/s); the lock "
        f"taken {f['lock_uses_per_s']}/s in all, busy {f['lock_busy']:.0%} of the time "
        f"({by_use}), "
        f"waited for {f['lock_wait_ms_mean']} ms on average; state commits "
        f"{f['state_commits_per_s']}/s ({f['state_calls_per_commit']} calls each); broker "
        f"{f['broker_cpu_cores']} cores ({f['broker_loop_cpu_cores']} on its event loop's "
        f"thread), {f['broker_rss_mib']} MiB, a /metrics scrape {f['metrics_scrape_ms']} ms; "
        f"hollow nodes {f['hollow_cpu_cores']} cores, "
        f"loop lag p99 {f['hollow_loop_lag_p99_ms']} ms (the most over the whole step, bursts "
        f"included: {f['hollow_loop_lag_max_ms']} ms); clients {f['clients_cpu_cores']} "
        f"cores; load average {f['load_average_1m']}",
        flush=True,
    )
    print(
        "   heartbeats alone (the settle's second half, or a sample interval): "
        f"{f['idle_heartbeats_per_s']}/s, "
        f"broker {f['idle_broker_cpu_cores']} cores ({f['idle_broker_loop_cores']} on its "
        f"event loop's thread), {f['broker_us_per_heartbeat']} us of its CPU per heartbeat",
        flush=True,
    )
    print(f"   outcomes: {f['outcomes']}; unanswered: {f['unanswered'] or 'none'}", flush=True)
    for b in f.get("bursts", ()):
        print(
            f"   burst of {b['burst']} deploys at once: {b['burst_decided']} decisions "
            f"committed in {b['burst_decided_s']} s, {b['burst_decisions_per_s']}/s (each "
            f"held the lock {b['burst_decision_ms_mean']} ms; "
            f"{b['burst_state_calls_per_commit']} store calls per commit); "
            f"{b['burst_running']} running "
            f"at {b['burst_running_per_s']}/s (p50 {b['burst_deploy_p50_ms']} ms, p99 "
            f"{b['burst_deploy_p99_ms']} ms); {b['burst_outcomes']}; deleted at "
            f"{b['burst_deletes_per_s']}/s; CPU while it was answered: broker "
            f"{b['burst_broker_cpu_cores']} cores ({b['burst_broker_ms_per_deploy']} ms per "
            f"deploy beyond the {b['burst_heartbeats_per_s']} heartbeats/s it answered), "
            f"hollow nodes {b['burst_hollow_cpu_cores']}, "
            f"clients {b['burst_clients_cpu_cores']}",
            flush=True,
        )


def summarise(
    steps: Sequence[Step], args: argparse.Namespace, floor: dict[str, Any]
) -> dict[str, Any]:
    header = (
        f"{'nodes':>6} {'hb p50 ms':>9} {'hb p99 ms':>9} {'lost':>5} {'deploys/s':>9} "
        f"{'dep p50 ms':>10} {'dep p99 ms':>10} {'dec ms':>6} {'dec cap/s':>9} "
        f"{'lock busy':>9} {'lock wait ms':>12} "
        f"{'migr/s':>6} {'del/s':>6} "
        f"{'broker CPU':>10} {'loop CPU':>8} {'RSS MiB':>8} {'peak MiB':>8} {'scrape ms':>9} "
        f"{'hollow CPU':>10} {'lag p99 ms':>10} {'client CPU':>10}"
    )
    print(f"\n{header}")
    for step in steps:
        f = step.figures
        print(
            f"{f['nodes']:>6} {f['heartbeat_p50_ms']:>9} {f['heartbeat_p99_ms']:>9} "
            f"{f['marked_lost']:>5} {f['deploys_per_s']:>9} {f['deploy_p50_ms']:>10} "
            f"{f['deploy_p99_ms']:>10} {f['decision_ms_mean']:>6} "
            f"{f['decision_capacity_per_s']:>9} {f['lock_busy']:>9.0%} "
            f"{f['lock_wait_ms_mean']:>12} {f['migrations_per_s']:>6} "
            f"{f['deletes_per_s']:>6} "
            f"{f['broker_cpu_cores']:>10} {f['broker_loop_cpu_cores']:>8} "
            f"{f['broker_rss_mib']:>8} {f['broker_peak_rss_mib']:>8} "
            f"{f['metrics_scrape_ms']:>9} {f['hollow_cpu_cores']:>10} "
            f"{f['hollow_loop_lag_p99_ms']:>10} "
            f"{f['clients_cpu_cores']:>10}"
            + (f"  saturated: {'; '.join(step.saturated)}" if step.saturated else "")
        )
    if any("burst" in s.figures for s in steps):
        print(
            f"\nbursts: the one of median decisions/s (each burst's in brackets)\n"
            f"{'nodes':>6} {'burst':>6} {'decided/s':>9} {'dec ms':>6} {'running/s':>9} "
            f"{'dep p50 ms':>10} {'dep p99 ms':>10} {'deleted/s':>9}"
        )
        for step in steps:
            f = step.figures
            if "burst" in f:
                print(
                    f"{f['nodes']:>6} {f['burst']:>6} {f['burst_decisions_per_s']:>9} "
                    f"{f['burst_decision_ms_mean']:>6} {f['burst_running_per_s']:>9} "
                    f"{f['burst_deploy_p50_ms']:>10} {f['burst_deploy_p99_ms']:>10} "
                    f"{f['burst_deletes_per_s']:>9}  ("
                    + ", ".join(str(b["burst_decisions_per_s"]) for b in f["bursts"])
                    + ")"
                )
    for name, rate, what in ANCHORS:
        print(f"{'':>6} {name:<19} {rate:>15.0f} {what}")
    if floor:
        broker = next(s.figures for s in steps if s.nodes == floor["nodes"])
        ratio = (
            broker["broker_us_per_heartbeat"] / floor["broker_us_per_heartbeat"]
            if floor["broker_us_per_heartbeat"]
            else 0.0
        )
        print(
            f"\nHeartbeats alone at {floor['nodes']} nodes: the broker "
            f"{broker['broker_us_per_heartbeat']} us of CPU per heartbeat "
            f"({broker['idle_heartbeats_per_s']}/s, {broker['idle_broker_cpu_cores']} cores); "
            f"a registry that only parses and answers them (bench.null_registry) "
            f"{floor['broker_us_per_heartbeat']} us ({floor['idle_heartbeats_per_s']}/s, "
            f"{floor['idle_broker_cpu_cores']} cores): {ratio:.2f}x the floor"
        )
    for step in steps:
        if "burst" in step.figures:
            print(target_cost(step.figures))
    saturated = next((s.nodes for s in steps if s.saturated), None)
    largest = steps[-1].figures if steps else {}
    print(
        f"\nSaturation: {f'at {saturated} nodes' if saturated else 'not within these steps'}"
        f"; at {largest.get('nodes', 0)} nodes {largest.get('deploys_per_s', 0)} deploys/s "
        f"answered running under the mix, "
        + (
            f"{largest['burst_decisions_per_s']} deploy decisions/s committed in the burst "
            if "burst" in largest
            else ""
        )
        + f"(target over {TARGET_RATE:.0f} decisions/s committed on SQLite), "
        f"{sum(s.figures['marked_lost'] for s in steps)} node(s) marked lost"
        f" (state: {args.state or 'SQLite'})"
    )
    return {
        "state": args.state or "sqlite",
        "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
        "lost_after_s": LOST_AFTER_S,
        "clients": args.clients,
        "hollow_processes": args.hollow_processes,
        "sites": args.sites,
        "window_s": args.window,
        "steps": [s.figures for s in steps],
        "heartbeat_floor": floor,
        "saturated_at_nodes": saturated,
        "target_deploys_per_s": TARGET_RATE,
        "anchors": [{"name": n, "per_s": r, "what": w} for n, r, w in ANCHORS],
    }


def target_cost(f: dict[str, Any]) -> str:
    """What carrying `TARGET_RATE` deploys a second through to running would cost the broker
    at this step: the heartbeats' cores plus that many times the median burst's CPU per
    deploy (from its arrival to its answer; a decision is a part of it that does not
    separate from the rest in a burst), beside the CPU the machine has and what the nodes
    and clients took in that burst."""
    need = f["idle_broker_cpu_cores"] + TARGET_RATE * f["burst_broker_ms_per_deploy"] / 1000
    others = f["burst_hollow_cpu_cores"] + f["burst_clients_cpu_cores"]
    return (
        f"At {f['nodes']} nodes {TARGET_RATE:.0f} deploys/s carried to running would take "
        f"the broker {need:.2f} cores (heartbeats {f['idle_broker_cpu_cores']} + "
        f"{TARGET_RATE:.0f} x {f['burst_broker_ms_per_deploy']} ms per deploy), on one "
        f"interpreter; this machine has {os.cpu_count()} cores, of which the hollow nodes and "
        f"the clients took {others:.2f} in the median burst"
    )


def _steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 250,500,1000") from None
    if not steps or any(not 1 <= n <= 20_000 for n in steps) or list(steps) != sorted(steps):
        raise argparse.ArgumentTypeError(
            f"{text!r}: node counts must be 1..20000, in increasing order"
        )
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.control_plane",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="steps 100,250, a 10 s window (about a minute)"
    )
    parser.add_argument(
        "--steps",
        type=_steps,
        help=f"hollow node counts, increasing (default {','.join(map(str, STEPS))})",
    )
    parser.add_argument(
        "--window", type=float, default=30.0, help="seconds of client load per step (30)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="seconds between the last node registering and the window (5)",
    )
    parser.add_argument(
        "--clients", type=int, default=16, help="concurrent clients, each its own API key (16)"
    )
    parser.add_argument(
        "--hollow-processes",
        type=int,
        default=2,
        help="processes the hollow nodes are split over (2: one Python process of 2,000 "
        "hollow nodes saturates its core here and its nodes miss heartbeats, which the broker "
        "rightly counts lost)",
    )
    parser.add_argument(
        "--burst",
        type=int,
        default=BURST,
        help=f"deploys asked at once at each step before the window, then deleted ({BURST}; "
        "0: none)",
    )
    parser.add_argument(
        "--bursts",
        type=int,
        default=BURSTS,
        help=f"bursts at each step; the one of median pace is reported ({BURSTS})",
    )
    parser.add_argument("--sites", type=int, default=10, help="edge sites (10)")
    parser.add_argument(
        "--sample-interval",
        type=float,
        default=SAMPLE_INTERVAL_S,
        metavar="SECONDS",
        help="each hollow node's `offload node --sample-interval` (its default, "
        f"{SAMPLE_INTERVAL_S:g}): an unchanged usage sample goes this often, lease renewals "
        "between",
    )
    parser.add_argument(
        "--state",
        default="",
        metavar="VALUE",
        help="passed to the broker as --state VALUE (where its state is: a postgresql:// URL); "
        "default: none, the broker's SQLite state in its state dir",
    )
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--keep", action="store_true", help="keep the logs and state")
    parser.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the heartbeat floor: after the steps, the largest step's hollow nodes "
        "against bench.null_registry, which only parses and answers heartbeats (what gRPC "
        "and asyncio alone cost per heartbeat, beside the broker's)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.window = min(args.window, 10.0)
        args.steps = args.steps or QUICK_STEPS
    args.steps = args.steps or STEPS
    if not (
        0 < args.window <= 3600
        and 0 <= args.settle <= 600
        and 1 <= args.clients <= 256
        and 1 <= args.hollow_processes <= 64
        and 1 <= args.sites <= 100
        and 0 <= args.burst <= 100_000
        and 1 <= args.bursts <= 20
        and 0.05 <= args.sample_interval <= 3600
    ):
        parser.error(
            "--window 0..3600 s, --settle 0..600 s, --clients 1..256, --hollow-processes "
            "1..64, --sites 1..100, --burst 0..100000, --bursts 1..20, --sample-interval "
            "0.05..3600 s"
        )
    if args.state and not args.state.isprintable():
        parser.error("--state must be printable text")
    try:
        result = asyncio.run(run(args))
    except ClusterError as err:  # the broker did not start: its log's tail says why
        print(f"python -m bench.control_plane: {err}", file=sys.stderr)
        return 1
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    steps = result["steps"]
    ok = bool(steps) and all(
        s["registered"] == s["nodes"]
        and s["marked_lost"] == 0
        and s["lost_now"] == 0
        and s["heartbeats_failed"] == 0
        and s["stopped_nodes"] == 0
        for s in steps
    )
    return 0 if ok and any(s["deploys_committed"] > 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
