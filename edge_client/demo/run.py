"""The demo's run: a cluster up, a model deployed, a client moving, a report.

1. The runtime: Docker when an engine is reachable (the runtime image is built first, with
   progress, or found up to date), otherwise local processes, and the demo says so.
2. `LocalCluster`: the broker and three node daemons (`cluster.DEMO_NODES`) in a fresh
   folder under the system temp dir.
3. An `OffloadClient` uploads the model, deploys it (one GPU) at the trace's first site and
   sends inferences at a steady rate, checking every answer against in-process ONNX
   Runtime.
4. It walks the trace: after each stay it reports its next site (ReportLocation), and the
   broker migrates the deployment when the gain passes the hysteresis; the next move waits
   until that migration has finished.
5. The report: placements with their explanations, each migration's timeline and the
   client-observed downtime, latency percentiles, failed requests, the dashboard URL.

Everything started is stopped in `finally`, on success, failure or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import onnxruntime as ort
from rich.console import Console
from rich.live import Live

import modelzoo
from broker.state import new_api_key
from edge_client.client import OffloadClient
from edge_client.commands import CommandError, login_link_line, request_login_link
from edge_client.demo.cluster import DEMO_NODES, ClusterError, LocalCluster, NodePlan
from edge_client.demo.trace import Trace
from edge_client.demo.view import (
    LoadStats,
    MoveKind,
    Report,
    Snapshot,
    live_view,
    move_kind,
    print_report,
    standby_wait_ms,
)
from edge_client.errors import OffloadError
from images.build import ImageBuildError, build_image
from node_daemon.runtimes import RuntimeUnavailable
from node_daemon.runtimes.docker_runtime import connect_docker, require_images, weighed_parent
from node_daemon.server import format_cpuset, split_cpus
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

BROKER_FLAGS = (
    "--heartbeat-interval", "0.5", "--lost-after", "5", "--orphan-grace", "10",
    # The trace moves the client every few seconds; the default 30 s cooldown would hold
    # every move after the first.
    "--cooldown", "1",
)  # fmt: skip
MIGRATION_TIMEOUT_S = 120.0
TRAFFIC_CLIENT = "city-traffic"
"""The prefix of the clients that report the trace's other vehicles' handovers under
--prewarm, one client each (`city-traffic-0`, ...)."""
MAX_TEACHING_VEHICLES = 64
"""The other vehicles the demo teaches with, at most: each is a client with an API key, which
the broker hashes at its start and checks at the first report (scrypt, about 35 ms each)."""


@dataclass(frozen=True, slots=True)
class DemoOptions:
    trace: Trace
    trace_file: Path
    model: str
    runtime: str
    """"auto", "docker" or "process"."""
    rate: float
    """Inferences per second."""
    keep: bool
    live: bool
    """Draw the live view (a terminal); otherwise print a status line now and then."""
    prewarm: int = 0
    """The broker's standby budget (`--prewarm-budget`); 0: no pre-warm."""
    background_fetch_mb_s: float = 0.0
    """Each node's `--background-fetch-rate`: a migration's target fetches its model at
    this rate (MB/s); 0: as fast as it comes."""
    replica_shares: int = 0
    """Each node's `--replica-cpu-shares` (Docker, where it can be had); 0: none."""
    share_cpus: bool = False
    """Every node on every CPU, even where each could have CPUs of its own."""


class DemoFailed(Exception):
    """The demo could not run; the message says why and what to do."""


class Narrator:
    """Timestamped lines, printed above the live view when there is one."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.started = time.monotonic()

    def say(self, message: str) -> None:
        self.console.print(
            f"[{time.monotonic() - self.started:6.1f}s] {message}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def pick_runtime(choice: str, say: Callable[[str], None]) -> tuple[str, str]:
    """("docker", image tag) when Docker is usable (building the image if needed), else
    ("process", ""), saying why; DemoFailed when --runtime docker cannot be had."""
    if choice == "process":
        return "process", ""
    try:
        image = build_image("cpu", progress=lambda line: say(f"image: {line}"))
        with contextlib.closing(connect_docker()) as client:
            require_images(client, [image])
        return "docker", image
    except (ImageBuildError, RuntimeUnavailable) as err:
        if choice == "docker":
            raise DemoFailed(f"--runtime docker: {err}") from err
        say(
            f"Docker is not usable here ({err}). Running the replicas as local processes "
            "instead (the same runtime server, no container isolation). `make docker-engine` "
            "installs and starts Debian's engine."
        )
        return "process", ""


def weigh_flags(runtime: str, shares: int, say: Callable[[str], None]) -> list[str]:
    """The nodes' `--replica-cpu-shares`: `shares` when the Docker runtime can weigh its
    replicas' cgroup here (root, the engine's cgroupfs driver), else none, saying why."""
    if runtime != "docker" or not shares:
        return []
    try:
        with contextlib.closing(connect_docker()) as client:
            weighed_parent(client, shares)
    except RuntimeUnavailable as err:
        say(f"replicas at the engine's default CPU weight: {err}")
        return []
    return ["--replica-cpu-shares", str(shares)]


def site_plans(
    plans: Sequence[NodePlan], cpus: Iterable[int], share: bool
) -> tuple[tuple[NodePlan, ...], str]:
    """The demo's nodes, each on CPUs of its own (`offload node --cpuset`, a run of `cpus`)
    where there is at least one per node and not `share`, and a line that says which. Each
    node is a site, and sites are separate machines: a migration's target then starts on
    CPUs the replica serving the client does not run on, as it would between machines. A
    node's replica gets one ONNX Runtime thread per CPU it has."""
    cpus = sorted(set(cpus))
    if share:
        return tuple(plans), f"every site on all {len(cpus)} CPUs (--share-cpus)"
    if len(cpus) < len(plans):
        return tuple(plans), (
            f"the {len(plans)} sites share {len(cpus)} CPU(s): a migration's target starts "
            f"on the CPUs serving the client (a CPU of its own per site needs {len(plans)})"
        )
    runs = [format_cpuset(run) for run in split_cpus(cpus, len(plans))]
    pairs = list(zip(plans, runs, strict=True))
    pinned = tuple(replace(plan, flags=(*plan.flags, "--cpuset", run)) for plan, run in pairs)
    owned = ", ".join(f"{plan.node_id} {run}" for plan, run in pairs)
    return pinned, f"each site on CPUs of its own, as separate machines: {owned}"


async def run_demo(options: DemoOptions, console: Console) -> int:
    """Run the demo; 0 when every request succeeded and every migration too, else 1."""
    narrator = Narrator(console)
    say = narrator.say
    say(f"model: building or loading {options.model!r} from the model zoo")
    model = await asyncio.to_thread(modelzoo.model_path, options.model)
    runtime, image = await asyncio.to_thread(pick_runtime, options.runtime, say)
    weighed = await asyncio.to_thread(weigh_flags, runtime, options.replica_shares, say)
    nodes, cpus = site_plans(DEMO_NODES, os.sched_getaffinity(0), options.share_cpus)
    say(f"CPUs: {cpus}")
    root = Path(tempfile.mkdtemp(prefix="offload-demo-"))
    say(f"runtime: {runtime}; cluster folder {root} (removed at the end)")
    cluster = LocalCluster(
        root,
        runtime=runtime,
        image=image,
        broker_flags=(*BROKER_FLAGS, "--prewarm-budget", str(options.prewarm)),
        more_api_keys=tuple(new_api_key(c) for c in traffic_clients(options.trace))
        if options.prewarm
        else (),
        nodes=nodes,
        node_flags=("--background-fetch-rate", f"{options.background_fetch_mb_s:g}", *weighed),
    )
    deployments: list[str] = []
    failed = True
    try:
        await cluster.start(say)
        report = await _offload(options, cluster, model, runtime, narrator, deployments)
        report.cpus = cpus
        print_report(console, report)
        failed = not report.succeeded
        if options.keep:
            try:
                login: tuple[str, float] | None = await request_login_link(
                    cluster.ops_url, cluster.ops_headers
                )
            except CommandError as err:
                say(f"no one-time login link: {err}")
                login = None
            say(kept_message(cluster, login))
            # Ctrl-C now ends a finished demo: its result stands.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
        return 1 if failed else 0
    except asyncio.CancelledError:
        failed = False  # stopped by the user: nothing to investigate
        raise
    except ClusterError as err:
        raise DemoFailed(f"the cluster did not come up: {err}") from err
    except OffloadError as err:
        raise DemoFailed(f"the client failed: {err}") from err
    except grpc.aio.AioRpcError as err:
        raise DemoFailed(f"the broker refused: {err.code().name} {err.details()}") from err
    finally:
        say("stopping: node daemons (each stops its replicas), then the broker")
        leftovers = await cluster.stop(deployments)
        for leftover in leftovers:
            say(f"WARNING: had to kill a leftover {leftover}")
        if failed:
            kept = await asyncio.to_thread(keep_logs, root)
            say(f"the run failed: the logs of the broker and the nodes are kept in {kept}")
        await asyncio.to_thread(shutil.rmtree, root, True)
        say(f"stopped; {root} removed")


def kept_message(cluster: LocalCluster, login: tuple[str, float] | None) -> str:
    """What `--keep` says once the demo is done: how to reach the cluster, and how to log in
    to its dashboard: `login`, a one-time link and how long it is valid, or, without one,
    where the ops token is."""
    door = (
        login_link_line(*login)
        if login is not None
        else f"log in with the ops token in {cluster.ops_token_file}"
    )
    return (
        f"cluster kept running. Try: export OFFLOAD_BROKER={cluster.broker_address} "
        f"OFFLOAD_OPS={cluster.ops_url} OFFLOAD_API_KEY_FILE={cluster.api_key_file} "
        f"OFFLOAD_OPS_TOKEN_FILE={cluster.ops_token_file}; offload status. Dashboard: "
        f"{door}. Ctrl-C stops it."
    )


def keep_logs(root: Path, prefix: str = "offload-demo-logs-") -> Path:
    """Copy the cluster's logs out of `root` (which is removed) for a failed run, into a new
    folder (named with `prefix`) under the system temp dir; returns it."""
    kept = Path(tempfile.mkdtemp(prefix=prefix))
    for log in root.glob("*.log"):
        shutil.copy2(log, kept / log.name)
    return kept


async def _offload(
    options: DemoOptions,
    cluster: LocalCluster,
    model: Path,
    runtime: str,
    narrator: Narrator,
    deployments: list[str],
) -> Report:
    say = narrator.say
    inputs = modelzoo.sample_inputs(model, seed=1)
    expected = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(
        None, inputs
    )
    trace = options.trace
    snapshot = Snapshot(title=f"{options.model} on {runtime} replicas")
    async with (
        OffloadClient(cluster.broker_address, cluster.api_key) as client,
        grpc.aio.insecure_channel(cluster.broker_address) as channel,
        aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=5), headers=cluster.ops_headers
        ) as http,
    ):
        broker = _BrokerCalls(pb_grpc.EdgeBrokerStub(channel), cluster.api_key)
        size_mb = (await asyncio.to_thread(model.stat)).st_size / 1e6
        say(f"client: uploading {model.name} ({size_mb:.1f} MB)")
        sha = await client.upload_model(model)
        first = trace.waypoints[0].site
        snapshot.client_site, snapshot.step = first, f"waypoint 1/{len(trace.waypoints)}"
        if options.prewarm:
            await _teach(channel, cluster, trace, options.prewarm, say)
        say(f"client: deploying {options.model} (1 GPU) for a device at {first}")
        deployment = await client.deploy(sha, options.model, gpus=1, site=first)
        deployments.append(deployment.deployment_id)
        explanations = [await broker.explanation(deployment.deployment_id, "first placement")]
        say(f"deployed {deployment.deployment_id} on {deployment.node_id}: {deployment.endpoint}")
        load = snapshot.load
        started = time.monotonic()
        tasks = [
            asyncio.create_task(_steady_load(client, inputs, expected, options.rate, load, say)),
            asyncio.create_task(_watch(cluster, http, snapshot, client, narrator, options.live)),
        ]
        try:
            for index, waypoint in enumerate(trace.waypoints):
                snapshot.step = f"waypoint {index + 1}/{len(trace.waypoints)}"
                if index > 0:
                    snapshot.client_site = waypoint.site
                    migration_id = await client.report_location(waypoint.site)
                    if migration_id is None:
                        say(f"client at {waypoint.site}: no migration (not worth it)")
                    else:
                        say(f"client at {waypoint.site}: migration {migration_id} started")
                        outcome = await broker.wait_finished(
                            deployment.deployment_id, migration_id
                        )
                        say(f"migration {migration_id}: {outcome}")
                        explanations.append(
                            await broker.explanation(
                                deployment.deployment_id, f"after {migration_id}"
                            )
                        )
                await _stay(waypoint.dwell_s, tasks)
            await _wait_observations(client, broker, deployment.deployment_id, say)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        stats = client.stats()
        migrations = await broker.migrations(deployment.deployment_id)
        return Report(
            runtime=runtime,
            model=f"{options.model} ({size_mb:.1f} MB, sha256 {sha[:12]})",
            model_name=options.model,
            trace=f"{trace.name} ({options.trace_file}): "
            + " → ".join(f"{w.site} {w.dwell_s:g}s" for w in trace.waypoints),
            seconds=time.monotonic() - started,
            load=load,
            period_ms=1000 / options.rate,
            retried=stats.retried,
            migrations=migrations,
            gaps_ms={o.migration_id: o.longest_gap_ms for o in stats.migrations},
            failed_in_window={o.migration_id: o.failed_requests for o in stats.migrations},
            span_gaps_ms={
                o.migration_id: o.span_gap_ms
                for o in stats.migrations
                if o.span_gap_ms is not None
            },
            explanations=explanations,
            dashboard=cluster.ops_url,
            kept=options.keep,
            moved_to_served_ms={
                o.migration_id: o.moved_to_served_ms
                for o in stats.migrations
                if o.moved_to_served_ms is not None
            },
            prewarm=options.prewarm,
        )


def traffic_clients(trace: Trace) -> tuple[str, ...]:
    """The clients of the teaching step: one per other vehicle of the trace, for the first
    MAX_TEACHING_VEHICLES of them."""
    count = min(len(trace.others), MAX_TEACHING_VEHICLES)
    return tuple(f"{TRAFFIC_CLIENT}-{i}" for i in range(count))


def teaching_reports(trace: Trace, clients: Sequence[str]) -> list[tuple[str, str]]:
    """(client, site) of each report of the teaching step, in order: each vehicle's site
    sequence as a client of its own (`clients`, one per vehicle, the first vehicles first).
    Reported back to back by one client, the broker would learn each join between two
    vehicles (the last site of one, the first of the next) as a transition."""
    vehicles = trace.others[: len(clients)]
    return [
        (client, site) for client, sites in zip(clients, vehicles, strict=True) for site in sites
    ]


async def _teach(
    channel: grpc.aio.Channel,
    cluster: LocalCluster,
    trace: Trace,
    budget: int,
    say: Callable[[str], None],
) -> None:
    """Report the trace's other vehicles' handovers (the city's traffic), each vehicle as a
    client of its own, so the broker has learned where vehicles go next before the client
    moves."""
    if not trace.others:
        say(
            f"pre-warm: budget {budget} standbys; the trace has no other vehicles to learn "
            "from, so the broker learns from the client's own moves only"
        )
        return
    keys = {key.partition(".")[0]: key for key in cluster.more_api_keys}
    clients = traffic_clients(trace)
    stub = pb_grpc.EdgeBrokerStub(channel)
    reports = teaching_reports(trace, clients)
    for client, site in reports:
        await stub.ReportLocation(
            pb.ReportLocationRequest(site=site),
            metadata=(("authorization", f"Bearer {keys[client]}"),),
            timeout=10,
        )
    some = (
        f"the first {len(clients)} of the trace's {len(trace.others)} other vehicles"
        if len(clients) < len(trace.others)
        else f"the trace's {len(trace.others)} other vehicle(s)"
    )
    say(
        f"pre-warm: budget {budget} standbys; reported the handovers of {some} "
        f"({len(reports)} reports), each as a client of its own, so the broker has learned "
        "where vehicles go next"
    )


async def _stay(seconds: float, tasks: list[asyncio.Task[None]]) -> None:
    """Sleep, but end at once with the error of a background task that died."""
    done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        task.result()


async def _steady_load(
    client: OffloadClient,
    inputs: Mapping[str, np.ndarray],
    expected: list[np.ndarray],
    rate: float,
    load: LoadStats,
    say: Callable[[str], None],
) -> None:
    """One inference every 1/rate seconds (never two at once); each answer is checked."""
    period = 1.0 / rate
    next_at = time.monotonic()
    while True:
        started = time.perf_counter()
        try:
            outputs = await client.infer(inputs)
        except OffloadError as err:
            load.failed += 1
            say(f"request {load.sent} FAILED: {err}")
        else:
            got = list(outputs.values())
            if not all(
                np.allclose(g, e, rtol=1e-4, atol=1e-5) for g, e in zip(got, expected, strict=True)
            ):
                load.failed += 1
                say(f"request {load.sent} answered WRONG: differs from in-process ONNX Runtime")
            else:
                load.record_ok((time.perf_counter() - started) * 1000)
        next_at += period
        delay = next_at - time.monotonic()
        if delay < 0:
            next_at = time.monotonic()  # behind: do not burst to catch up
        await asyncio.sleep(max(0.0, delay))


async def _watch(
    cluster: LocalCluster,
    http: aiohttp.ClientSession,
    snapshot: Snapshot,
    client: OffloadClient,
    narrator: Narrator,
    live: bool,
) -> None:
    """Refresh the snapshot twice a second and draw it (live), or print a status line every
    five seconds (no terminal)."""

    async def refresh() -> None:
        for key in ("nodes", "deployments", "migrations"):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"{cluster.ops_url}api/{key}") as response:
                    if response.status == 200:
                        setattr(snapshot, key, await response.json())
        observed = client.stats().migrations
        snapshot.gaps_ms = {o.migration_id: o.longest_gap_ms for o in observed}
        snapshot.span_gaps_ms = {
            o.migration_id: o.span_gap_ms for o in observed if o.span_gap_ms is not None
        }

    if live:
        with Live(live_view(snapshot), console=narrator.console, refresh_per_second=4) as view:
            while True:
                await refresh()
                view.update(live_view(snapshot))
                await asyncio.sleep(0.5)
    while True:
        await asyncio.sleep(5)
        await refresh()
        placed = next(iter(snapshot.deployments), None)
        where = f"on {placed['node_id']}" if placed else "not placed"
        narrator.say(
            f"status: client at {snapshot.client_site}, deployment {where}; "
            f"{snapshot.load.sent} requests, {snapshot.load.failed} failed; "
            f"{snapshot.load.recent_summary()}"
        )


async def _wait_observations(
    client: OffloadClient, broker: _BrokerCalls, deployment_id: str, say: Callable[[str], None]
) -> None:
    """Until the client has closed its observation of every finished migration."""
    finished = [m for m in await broker.migrations(deployment_id) if m["outcome"]]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        seen = {o.migration_id for o in client.stats().migrations}
        if all(m["migration_id"] in seen for m in finished):
            return
        await asyncio.sleep(0.2)
    say("WARNING: the client did not close every migration's observation within 30 s")


class _BrokerCalls:
    """The EdgeBroker calls the demo makes beside the client library: a deployment's
    explanation, and all its migrations with their timelines (the ops API lists only the
    recent ones of every deployment: a long trace would lose the first)."""

    def __init__(self, stub: pb_grpc.EdgeBrokerStub, api_key: str) -> None:
        self._stub = stub
        self._metadata = (("authorization", f"Bearer {api_key}"),)

    async def explanation(self, deployment_id: str, heading: str) -> tuple[str, str]:
        d = await self._stub.GetDeployment(
            pb.GetDeploymentRequest(deployment_id=deployment_id),
            metadata=self._metadata,
            timeout=10,
        )
        explanation = json.loads(d.explanation_json or "{}")
        text = explanation.get("text") or "(none recorded)"
        gpus = (explanation.get("chosen") or {}).get("gpus", [])
        return f"{heading}: {d.node_id}, GPUs {gpus}, epoch {d.epoch}", text

    async def migrations(self, deployment_id: str) -> list[dict[str, Any]]:
        """The deployment's migrations, oldest first (the broker's order), in the ops API's
        shape, which the live view's rows and the report share."""
        reply = await self._stub.ListMigrations(
            pb.ListMigrationsRequest(deployment_id=deployment_id),
            metadata=self._metadata,
            timeout=10,
        )
        return [
            {
                "migration_id": m.migration_id,
                "trigger": m.trigger,
                "source": m.source_node,
                "target": m.target_node,
                "strategy": m.strategy.replace("_", "-"),
                "outcome": m.outcome or None,
                "reason": m.reason,
                "downtime_ms": None if m.downtime_ms < 0 else m.downtime_ms,
                "span_gap_ms": None if m.span_gap_ms < 0 else m.span_gap_ms,
                "timeline": [{"event": e.event, "at": e.at} for e in m.timeline],
                "prewarmed": m.prewarmed,
            }
            for m in reply.migrations
        ]

    async def wait_finished(self, deployment_id: str, migration_id: str) -> str:
        deadline = time.monotonic() + MIGRATION_TIMEOUT_S
        while time.monotonic() < deadline:
            for m in await self.migrations(deployment_id):
                if m["migration_id"] == migration_id and m["outcome"]:
                    reason = f" ({m['reason']})" if m["reason"] else ""
                    warm = {
                        MoveKind.COLD: "",
                        MoveKind.PREWARMED: ", pre-warmed: switched to its standby",
                        MoveKind.STILL_STARTING: ", pre-warmed but the standby was still "
                        f"starting: waited {standby_wait_ms(m) or 0:.0f} ms for it",
                    }[move_kind(m)]
                    return f"{m['outcome']}{reason}, {m['source']} → {m['target']}{warm}"
            await asyncio.sleep(0.2)
        raise DemoFailed(f"migration {migration_id} did not finish in {MIGRATION_TIMEOUT_S:.0f}s")


def install_stop_signals(task: asyncio.Task[Any], say: Callable[[str], None]) -> None:
    """The first Ctrl-C (or SIGTERM) cancels `task` (the demo, or `bench.migration`'s run),
    whose `finally` stops the cluster; a second one only says that this is under way."""
    loop = asyncio.get_running_loop()

    def first(signum: int) -> None:
        say(f"{signal.Signals(signum).name}: stopping the cluster (a moment)")
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, lambda: say("still stopping the cluster; please wait"))
        task.cancel()

    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, first, s)
