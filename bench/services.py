"""One model, many clients (issue 52): N clients of one model as N private deployments
against the same N clients on one service, then clients of a service moving between sites
whose replicas run, one client flooding a service's replica, and clients of one replica in
different priority classes. The demo's cluster (`edge_client.demo.cluster.LocalCluster`: a
real `offload broker`, three real `offload node` daemons, process-runtime replicas), the
clients real `OffloadClient`s, each with an API key of its own.

Arms, each on a cluster of its own (the service arms first, the private ones last: 64 private
ResNet-18 replicas empty this machine's page cache for whatever runs next):
- private, for each model of --models (the MLP and ResNet-18): every client deploys the
  model at site-a (CPU only; all land on node-a) and calls it once; a private arm stops
  deploying while the machine has under `MEMORY_FLOOR_MIB` available (other work shares
  it), and the table then says how many clients it reached;
- service, for each model: an owner creates the service (at most one replica, none yet:
  the broker's scaling cannot start a second during the loops), and every client
  puts itself on it at site-a (`use_service`: the first starts the replica, the others are
  put on that one replica for many) and calls it once;
  for both: replicas started, the replicas' memory (the RSS of their processes, summed: what
  the nodes hold for them; the libraries' pages count once in each process; and the GPU
  memory NVML says those processes use, summed over the GPUs, "n/a (no NVML)" on a machine
  without NVML), each client's
  time from its Deploy or UseService to its first answer (and, for the service, the
  UseService call alone: the attach), then --loop-clients of them in closed loops for
  --seconds: requests/s, p50/p99, failed;
- mobility (MLP): a service with a replica at every site (`--min-replicas-per-site 1`) and
  --loop-clients clients (at most 4) in closed loops at site-a; --moves times, one client
  reports the next site: from the report to its first answer from that site's replica (no
  replica starts: a switch), and the loops' failed calls over the whole arm;
- flood (MLP): one quiet client calling a service's replica at half the per-client limit
  for --seconds alone, then beside another client, in a process of its own, flooding the
  replica with 16 concurrent loops (each client at most `FLOOD_MAX_RPS` calls a second: the
  replica paces a client over it, and refuses what would wait too long): the quiet client's
  p99 both times (the issue's bound: at most 2x), the flood's calls answered a second and
  those refused over its limit;
- priority, for each model of --priority-models (the MLP and ResNet-18; the MLP alone
  with --quick): --critical-clients clients attach to one service replica as critical
  (each with its own API key and token: the class is the client's, not the deployment's)
  and call it in closed loops for --seconds alone, then again beside --best-effort-clients
  clients attached as best-effort, in closed loops from processes of their own, one per
  CPU the clients run on (one process driving them all beside the critical ones would time
  its own event loop, not the replica), with 2 CPUs or more the replica and its node daemon on half
  of them and everything else on the other half (`offload node --cpuset`), as a server and
  its devices are apart: the critical p99 alone and among them, and its ratio (the
  runtime issue's bound: at most 1.5x); the fewest and most answers of any best-effort
  client (none starved: at least one each) and their calls a second; over the mixed window,
  from the replica's /metrics, each class's share of its compute
  (`offload_runtime_class_compute_seconds_total`), its calls computed, and the mean batch.
  A class orders calls in the replica's batcher (`runtime.batching`), on for both models
  (ResNet-18's `--max-batch-size auto` picks 1 on a CPU: a call a batch, still in class
  order); while critical calls run it paces the others to their weights' share, cut further
  while the replica's event loop queues, which is where the MLP's calls wait (it computes in
  well under a millisecond).

The baseline is the private arm of the same run; the figures are printed, not asserted (the
issue's targets, for the MLP and ResNet-18 alike: one replica for 64 clients, at most a
tenth of the memory of 64 private replicas, attach p99 at most 100 ms, the same or better
throughput at 16 clients, a move at most 100 ms median, the quiet client's p99 at most 2x
beside a flood, the critical p99 at most 1.5x among 60 best-effort clients with none
starved, zero failed requests). The exit status is 1 when a call failed.

    python -m bench.services [--quick] [--models mlp,resnet18] [--clients N]
        [--resnet-clients N] [--loop-clients T] [--seconds S] [--moves K]
        [--priority-models mlp,resnet18] [--critical-clients C] [--best-effort-clients B]
        [--arms services,mobility,flood,priority] [--json FILE]

`--quick` (CI): 8 MLP clients and 2 ResNet-18, 4 in loops for 2 s, 4 moves, 2 critical
among 6 best-effort. Full: 64 of each model, 16 in loops for 5 s, 20 moves, 4 critical among
60 best-effort.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pynvml

import modelzoo
from bench.node_failure import replica_pids
from bench.serving import class_shares, scrape
from broker.state.api_keys import new_api_key
from edge_client.client import OffloadClient
from edge_client.demo.cluster import LocalCluster
from edge_client.errors import OffloadError, ResourceExhausted
from node_daemon.server import format_cpuset, split_cpus

MODEL = "mlp"
"""The model of the mobility and flood arms."""
SITES = ("site-a", "site-b", "site-c")
NODES = ("node-a", "node-b", "node-c")
FLOOD_MAX_RPS = 200.0
"""Each client's calls per second at the flood arm's replica (`max_rps_per_client`)."""
MEMORY_FLOOR_MIB = 4096
"""A private arm deploys no more while the machine has less memory available than this."""
ARMS = ("services", "mobility", "flood", "priority")
"""`--arms`: the service and private arms ("services"), mobility, flood, priority."""


def rss_mib(pid: int) -> float:
    """A process's resident memory in MiB (0 when it is gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def available_mib() -> float:
    """The machine's available memory in MiB (`MemAvailable`; infinite when unreadable)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def gpu_processes() -> list[tuple[int, int | None]] | None:
    """Every compute process on every GPU, as NVML lists it now: (pid, the GPU memory it
    uses in bytes, None where NVML cannot tell); None without NVML (no NVIDIA driver here,
    or it failed). Initializes NVML and shuts it down again: call it between measurements.
    NVML gives pids as the host sees them: in a container without the host's pid namespace
    they are not the replicas' pids."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        processes: list[tuple[int, int | None]] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            processes += [
                (p.pid, p.usedGpuMemory)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            ]
        return processes
    except pynvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def gpu_mib(processes: Iterable[tuple[int, int | None]], pids: Collection[int]) -> float:
    """The GPU memory (MiB) that `processes` (`gpu_processes`) say the processes `pids` use,
    summed over the GPUs; one without a figure counts 0."""
    return round(sum(used or 0 for pid, used in processes if pid in pids) / 2**20, 1)


def replicas_memory(cluster: LocalCluster) -> tuple[int, float, float | None]:
    """The replica processes the nodes run, their RSS summed (MiB), and the GPU memory they
    use (MiB; None without NVML)."""
    pids = [pid for node in NODES for pid in replica_pids(cluster, node)]
    alive = [pid for pid in pids if rss_mib(pid) > 0]
    processes = gpu_processes()
    gpu = None if processes is None else gpu_mib(processes, set(alive))
    return len(alive), round(sum(rss_mib(pid) for pid in alive), 1), gpu


def percentile(values: Sequence[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2) if values else 0.0


async def closed_loops(
    clients: Sequence[OffloadClient], inputs: dict[str, np.ndarray], seconds: float
) -> dict[str, Any]:
    """Every client calls in a closed loop for `seconds`: requests/s, p50/p99 (ms), failed."""
    latencies: list[float] = []
    failed = 0
    stop = time.monotonic() + seconds

    async def loop(client: OffloadClient) -> None:
        nonlocal failed
        while time.monotonic() < stop:
            started = time.perf_counter()
            try:
                await client.infer(inputs)
            except OffloadError:
                failed += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)

    began = time.monotonic()
    await asyncio.gather(*(loop(c) for c in clients))
    took = time.monotonic() - began
    return {
        "requests_per_s": round(len(latencies) / took, 1),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "failed": failed,
    }


async def arm(
    kind: str, root: Path, model_name: str, n: int, loop_clients: int, seconds: float
) -> dict[str, Any]:
    """The private or the service arm of `model_name` on a cluster of its own."""
    keys = [new_api_key(f"c{i:03d}") for i in range(n)]
    cluster = LocalCluster(root, runtime="process", client_id="owner", more_api_keys=keys)
    model = modelzoo.model_path(model_name)
    inputs = modelzoo.sample_inputs(model)
    clients: list[OffloadClient] = []
    try:
        await cluster.start(lambda _: None)
        async with OffloadClient(cluster.broker_address, cluster.api_key) as owner:
            sha = await owner.upload_model(model)
            if kind == "service":
                await owner.create_service(
                    "bench", sha, model_name, any_client=True, max_replicas=1
                )
        first_answer: list[float] = []
        attach: list[float] = []
        for key in keys:
            if kind == "private" and available_mib() < MEMORY_FLOOR_MIB:
                break  # the machine is near full: the table says how many it reached
            client = OffloadClient(cluster.broker_address, key, deploy_timeout_s=600)
            await client.connect()
            clients.append(client)
            if kind == "private":  # its own copy of the model: the clock starts after
                await client.upload_model(model)
            started = time.perf_counter()
            if kind == "service":
                await client.use_service("bench", site="site-a")
                attach.append((time.perf_counter() - started) * 1000)
            else:
                await client.deploy(sha, model_name, site="site-a")
            await client.infer(inputs)
            first_answer.append((time.perf_counter() - started) * 1000)
        replicas, memory, gpu_memory = replicas_memory(cluster)
        loop = await closed_loops(clients[:loop_clients], inputs, seconds)
        nodes = {c.deployment.node_id for c in clients if c.deployment is not None}
        return {
            "arm": kind,
            "model": model_name,
            "clients_asked": n,
            "clients": len(clients),
            "replicas": replicas,
            "nodes_serving": sorted(nodes),
            "replicas_rss_mib": memory,
            "replicas_gpu_mib": gpu_memory,
            "first_answer_ms_p50": percentile(first_answer, 50),
            "first_answer_ms_p99": percentile(first_answer, 99),
            "first_answer_ms_max": round(max(first_answer, default=0.0), 1),
            **(
                {
                    "attach_ms_p50": percentile(attach[1:], 50),
                    "attach_ms_p99": percentile(attach[1:], 99),
                    "attach_ms_first": round(attach[0], 1),
                }
                if attach
                else {}
            ),
            "loop_clients": len(clients[:loop_clients]),
            **loop,
        }
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
        await cluster.stop()


async def mobility(root: Path, loop_clients: int, moves: int) -> dict[str, Any]:
    """Clients of a service with a replica at every site, moving: report to first answer."""
    keys = [new_api_key(f"m{i:03d}") for i in range(loop_clients)]
    cluster = LocalCluster(root, runtime="process", client_id="owner", more_api_keys=keys)
    model = modelzoo.model_path(MODEL)
    inputs = modelzoo.sample_inputs(model)
    clients: list[OffloadClient] = []
    failed = 0
    stop = asyncio.Event()
    try:
        await cluster.start(lambda _: None)
        async with OffloadClient(cluster.broker_address, cluster.api_key) as owner:
            sha = await owner.upload_model(model)
            created = await owner.create_service(
                "roam", sha, MODEL, any_client=True, min_replicas_per_site=1, max_replicas=3
            )
        replica_at = {r.site: r.deployment_id for r in created.replicas}
        for key in keys:
            client = OffloadClient(cluster.broker_address, key)
            await client.connect()
            await client.use_service("roam", site=SITES[0])
            clients.append(client)

        async def loop(client: OffloadClient) -> None:
            nonlocal failed
            while not stop.is_set():
                try:
                    await client.infer(inputs)
                except OffloadError:
                    failed += 1

        loops = [asyncio.create_task(loop(c)) for c in clients]
        await asyncio.sleep(0.5)
        times: list[float] = []
        for k in range(moves):
            client = clients[k % len(clients)]
            current = client.deployment
            assert current is not None
            here = next(s for s, d in replica_at.items() if d == current.deployment_id)
            there = SITES[(SITES.index(here) + 1) % len(SITES)]
            started = time.perf_counter()
            await client.report_location(there)
            deadline = time.monotonic() + 60
            while (now := client.deployment) is None or now.deployment_id != replica_at[there]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the client was not switched to {there}'s replica")
                await asyncio.sleep(0.001)
            await client.infer(inputs)
            times.append((time.perf_counter() - started) * 1000)
        stop.set()
        await asyncio.gather(*loops)
        service = None
        async with OffloadClient(cluster.broker_address, cluster.api_key) as owner:
            service = await owner.get_service("roam")
        return {
            "arm": "mobility",
            "model": MODEL,
            "moves": moves,
            "loop_clients": len(clients),
            "move_to_first_answer_ms_median": round(statistics.median(times), 1),
            "move_to_first_answer_ms_max": round(max(times), 1),
            "replicas_after": len(service.replicas),
            "failed": failed,
        }
    finally:
        stop.set()
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
        await cluster.stop()


async def paced(
    client: OffloadClient, inputs: dict[str, np.ndarray], seconds: float, period_s: float
) -> dict[str, Any]:
    """One call every `period_s` (or as soon as the last answered) for `seconds`: p99 (ms)
    and failed, as `closed_loops` reports them."""
    latencies: list[float] = []
    failed = 0
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        started = time.perf_counter()
        try:
            await client.infer(inputs)
            latencies.append((time.perf_counter() - started) * 1000)
        except OffloadError:
            failed += 1
        await asyncio.sleep(max(0.0, period_s - (time.perf_counter() - started)))
    return {"p99_ms": percentile(latencies, 99), "failed": failed}


def flood_child(
    address: str, key: str, loops: int, seconds: float, ready: Any, go: Any, out: Any
) -> None:
    """The flooding client, in a process of its own (as a device would be: its loops must
    not take the quiet client's event loop): it attaches, says so on `ready`, waits for
    `go`, then calls the service in `loops` closed loops for `seconds`, and sends on `out`
    its calls answered, refused over its rate limit, and failed otherwise."""

    async def run() -> dict[str, Any]:
        counts: dict[str, float] = {"answered": 0, "refused": 0, "failed": 0}
        async with OffloadClient(address, key) as client:
            await client.use_service("flooded", site=SITES[0])
            inputs = modelzoo.sample_inputs(modelzoo.model_path(MODEL))
            ready.set()
            await asyncio.to_thread(go.wait)
            stop = time.monotonic() + seconds

            async def loop() -> None:
                while time.monotonic() < stop:
                    try:
                        await client.infer(inputs)
                        counts["answered"] += 1
                    except ResourceExhausted:
                        counts["refused"] += 1  # over its rate limit, by design
                    except OffloadError:
                        counts["failed"] += 1

            began = time.monotonic()
            await asyncio.gather(*(loop() for _ in range(loops)))
            counts["calls_per_s"] = round(counts["answered"] / (time.monotonic() - began), 1)
        return counts

    out.send(asyncio.run(run()))


async def flood(root: Path, seconds: float, flood_loops: int, max_rps: float) -> dict[str, Any]:
    """One quiet client alone on a service's replica, then beside a client (in a process of
    its own) flooding it with `flood_loops` concurrent loops: the quiet one's p99 both times
    (the runtime takes clients in turn within a class, and paces each to `max_rps` calls a
    second, refusing what would wait longer), and the flood's calls answered a second."""
    keys = [new_api_key("quiet"), new_api_key("flood")]
    cluster = LocalCluster(root, runtime="process", client_id="owner", more_api_keys=keys)
    model = modelzoo.model_path(MODEL)
    inputs = modelzoo.sample_inputs(model)
    spawn = multiprocessing.get_context("spawn")
    ready, go = spawn.Event(), spawn.Event()
    try:
        await cluster.start(lambda _: None)
        async with OffloadClient(cluster.broker_address, cluster.api_key) as owner:
            sha = await owner.upload_model(model)
            await owner.create_service(
                "flooded", sha, MODEL, any_client=True, max_rps_per_client=max_rps
            )
        async with OffloadClient(cluster.broker_address, keys[0]) as quiet:
            await quiet.use_service("flooded", site=SITES[0])
            results, out = spawn.Pipe(duplex=False)
            child = spawn.Process(
                target=flood_child,
                args=(cluster.broker_address, keys[1], flood_loops, seconds + 1.0, ready, go, out),
                daemon=True,
            )
            child.start()
            try:
                if not await asyncio.to_thread(ready.wait, 120):
                    raise RuntimeError("the flooding client did not attach within 120 s")
                alone = await paced(quiet, inputs, seconds, 2 / max_rps)
                go.set()
                await asyncio.sleep(0.5)  # the flood under way
                beside = await paced(quiet, inputs, seconds, 2 / max_rps)
                if not await asyncio.to_thread(results.poll, 120):
                    raise RuntimeError("the flooding client never reported")
                flooded = results.recv()
            finally:
                child.kill()
                child.join()
        return {
            "arm": "flood",
            "model": MODEL,
            "max_rps_per_client": max_rps,
            "flood_loops": flood_loops,
            "quiet_p99_ms_alone": alone["p99_ms"],
            "quiet_p99_ms_beside_flood": beside["p99_ms"],
            "quiet_p99_ratio": round(beside["p99_ms"] / alone["p99_ms"], 2)
            if alone["p99_ms"]
            else None,
            "flood_calls_per_s": flooded["calls_per_s"],
            "flood_refused": flooded["refused"],
            "failed": alone["failed"] + beside["failed"] + flooded["failed"],
        }
    finally:
        await cluster.stop()


def metrics_urls(cluster: LocalCluster) -> list[str]:
    """The /metrics pages of the replicas the nodes run (their `replica.json` records)."""
    urls = []
    for node in NODES:
        for record in (cluster.root / f"{node}-state" / "replicas").glob("*/replica.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                if endpoint := json.loads(record.read_text())["metrics_endpoint"]:
                    urls.append(f"http://{endpoint}/metrics")
    return urls


def best_effort_child(
    address: str,
    model_name: str,
    keys: Sequence[str],
    seconds: float,
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    """Best-effort clients of the priority arm, in a process of their own: each attaches as
    best-effort with its own key, then (`ready` set, `go` awaited) calls the service in a
    closed loop for `seconds`; sends on `out` each client's answers and the calls failed."""

    async def run() -> dict[str, Any]:
        inputs = modelzoo.sample_inputs(modelzoo.model_path(model_name))
        # Patient callers: 60 best-effort clients share a fifth of a replica that answers
        # ResNet-18 about 20 times a second here, a call each 15 s; the SDK's 10 s default
        # would fail them at their deadline (as bench.serving's clients, 60 s).
        clients = [OffloadClient(address, key, call_timeout_s=60.0) for key in keys]
        answered = [0] * len(clients)
        failed = 0
        try:
            for client in clients:
                await client.connect()
                await client.use_service("prio", site=SITES[0], priority="best-effort")
            ready.set()
            await asyncio.to_thread(go.wait)
            stop = time.monotonic() + seconds

            async def loop(i: int, client: OffloadClient) -> None:
                nonlocal failed
                while time.monotonic() < stop:
                    try:
                        await client.infer(inputs)
                        answered[i] += 1
                    except OffloadError:
                        failed += 1

            await asyncio.gather(*(loop(i, c) for i, c in enumerate(clients)))
        finally:
            for client in clients:
                with contextlib.suppress(Exception):
                    await client.close()
        return {"answered": answered, "failed": failed}

    out.send(asyncio.run(run()))


async def priority(
    root: Path, model_name: str, critical_n: int, best_effort_n: int, seconds: float
) -> dict[str, Any]:
    """Critical clients of one service replica alone, then among best-effort clients (in
    processes of their own, one per client CPU) saturating it: the critical p99 both times,
    the best-effort clients' answers, and the classes' compute shares over the mixed
    window."""
    critical_keys = [new_api_key(f"crit{i:02d}") for i in range(critical_n)]
    best_effort_keys = [new_api_key(f"be{i:03d}") for i in range(best_effort_n)]
    # The replica (and its node daemon) on half of the CPUs, the clients on the other half
    # once the cluster runs, as a server and its devices are apart (bench.serving's
    # --pin-priority); the broker and the other daemons, idle meanwhile, keep every CPU.
    cpus = os.sched_getaffinity(0)
    pinned = split_cpus(cpus, 2) if len(cpus) >= 2 else None
    node_flags = ("--cpuset", format_cpuset(pinned[0])) if pinned else ()
    cluster = LocalCluster(
        root,
        runtime="process",
        client_id="owner",
        more_api_keys=critical_keys + best_effort_keys,
        node_flags=node_flags,
    )
    model = modelzoo.model_path(model_name)
    inputs = modelzoo.sample_inputs(model)
    spawn = multiprocessing.get_context("spawn")
    go = spawn.Event()
    critical: list[OffloadClient] = []
    children: list[tuple[Any, Any, Any]] = []  # (process, ready, results)
    try:
        await cluster.start(lambda _: None)
        if pinned:
            os.sched_setaffinity(0, pinned[1])  # the best-effort processes take it too
        async with OffloadClient(cluster.broker_address, cluster.api_key) as owner:
            sha = await owner.upload_model(model)
            await owner.create_service("prio", sha, model_name, any_client=True, max_replicas=1)
        for key in critical_keys:
            client = OffloadClient(cluster.broker_address, key)
            await client.connect()
            await client.use_service("prio", site=SITES[0], priority="critical")
            critical.append(client)
        await closed_loops(critical, inputs, 0.5)  # warm: the channels open
        alone = await closed_loops(critical, inputs, seconds)
        # One load process per CPU the clients have (with a second on the one client CPU
        # of a 2-core machine, the critical clients' process waited behind both).
        client_cpus = pinned[1] if pinned else cpus
        processes = min(len(client_cpus), best_effort_n)
        for share in (best_effort_keys[i::processes] for i in range(processes)):
            ready = spawn.Event()
            results, out = spawn.Pipe(duplex=False)
            child = spawn.Process(
                target=best_effort_child,
                args=(cluster.broker_address, model_name, share, seconds + 1.0, ready, go, out),
                daemon=True,
            )
            child.start()
            children.append((child, ready, results))
        for _, ready, _ in children:
            if not await asyncio.to_thread(ready.wait, 120):
                raise RuntimeError("the best-effort clients did not attach within 120 s")
        urls = metrics_urls(cluster)
        go.set()
        await asyncio.sleep(0.5)  # the best-effort loops under way
        before = await asyncio.to_thread(scrape, urls)
        among = await closed_loops(critical, inputs, seconds)
        after = await asyncio.to_thread(scrape, urls)
        answered: list[int] = []
        failed = 0
        for _, _, results in children:
            if not await asyncio.to_thread(results.poll, 120):
                raise RuntimeError("the best-effort clients never reported")
            got = results.recv()
            answered += got["answered"]
            failed += got["failed"]
        window = {k: v - before.get(k, 0.0) for k, v in after.items()}

        def total(prefix: str, label: str = "") -> float:
            return sum(v for k, v in window.items() if k.startswith(prefix) and label in k)

        batches = total("offload_runtime_batch_size_count")
        calls = {
            c: round(total("offload_runtime_class_requests_total", f'class="{c}"'))
            for c in ("critical", "best-effort")
        }
        return {
            "arm": "priority",
            "model": model_name,
            "critical_clients": critical_n,
            "best_effort_clients": best_effort_n,
            "best_effort_processes": processes,
            "replicas": len(urls),
            "critical_p99_ms_alone": alone["p99_ms"],
            "critical_p99_ms_among": among["p99_ms"],
            "critical_p99_ratio": round(among["p99_ms"] / alone["p99_ms"], 2)
            if alone["p99_ms"]
            else None,
            "critical_requests_per_s_alone": alone["requests_per_s"],
            "critical_requests_per_s_among": among["requests_per_s"],
            "best_effort_min_answers": min(answered, default=0),
            "best_effort_max_answers": max(answered, default=0),
            "best_effort_calls_per_s": round(sum(answered) / (seconds + 1.0), 1),
            "class_compute_shares": {k: round(v, 3) for k, v in class_shares(window).items()},
            "class_calls_computed": calls,
            "mean_batch_rows": round(total("offload_runtime_batch_size_sum") / batches, 2)
            if batches
            else None,
            "failed": alone["failed"] + among["failed"] + failed,
            "pinned": pinned is not None,
        }
    finally:
        for child, _, _ in children:
            child.kill()
            child.join()
        for client in critical:
            with contextlib.suppress(Exception):
                await client.close()
        await cluster.stop()
        os.sched_setaffinity(0, cpus)


def shown(value: object) -> str:
    """A figure in the report's table; None is a figure this machine cannot read (only the
    GPU memory, without NVML)."""
    return "n/a (no NVML)" if value is None else str(value)


def report(results: list[dict[str, Any]]) -> None:
    rows = (
        ("clients", "clients"),
        ("replicas started", "replicas"),
        ("replicas' RSS (MiB)", "replicas_rss_mib"),
        ("replicas' GPU memory (MiB)", "replicas_gpu_mib"),
        ("first answer p50 (ms)", "first_answer_ms_p50"),
        ("first answer p99 (ms)", "first_answer_ms_p99"),
        ("clients in loops", "loop_clients"),
        ("loops: req/s", "requests_per_s"),
        ("loops: p99 (ms)", "p99_ms"),
        ("failed", "failed"),
    )
    models = list(dict.fromkeys(r["model"] for r in results if r["arm"] == "service"))
    for model in models:
        private = next(r for r in results if r["arm"] == "private" and r["model"] == model)
        service = next(r for r in results if r["arm"] == "service" and r["model"] == model)
        print(f"{model}: {service['clients']} clients of one model, on the demo's cluster:")
        print(f"{'':<28}{'private':>15}{'service':>15}{'service / private':>20}")
        for label, key in rows:
            a, b = private[key], service[key]
            ratio = f"{b / a:.3f}" if isinstance(a, int | float) and a and b is not None else "-"
            print(f"{label:<28}{shown(a):>15}{shown(b):>15}{ratio:>20}")
        if private["clients"] < private["clients_asked"]:
            print(
                f"the private {model} arm reached {private['clients']} clients, not "
                f"{private['clients_asked']}: the machine had under {MEMORY_FLOOR_MIB} MiB "
                "available; its memory and first answers are for those"
            )
        print(
            f"service attach (UseService, after the first): p50 {service['attach_ms_p50']} "
            f"ms, p99 {service['attach_ms_p99']} ms (the first, which started the replica: "
            f"{service['attach_ms_first']} ms)"
        )
    for move in (r for r in results if r["arm"] == "mobility"):
        print(
            f"moves between sites whose replicas run ({move['moves']}, {move['loop_clients']} "
            f"clients in loops): report to first answer median "
            f"{move['move_to_first_answer_ms_median']} ms, max "
            f"{move['move_to_first_answer_ms_max']} ms; replicas after "
            f"{move['replicas_after']}; failed {move['failed']}"
        )
    for flooded in (r for r in results if r["arm"] == "flood"):
        print(
            f"a quiet client's p99 beside a client flooding the replica ({flooded['flood_loops']} "
            f"loops, each client at most {flooded['max_rps_per_client']:g} calls/s): alone "
            f"{flooded['quiet_p99_ms_alone']} ms, beside the flood "
            f"{flooded['quiet_p99_ms_beside_flood']} ms ({flooded['quiet_p99_ratio']}x; the "
            f"issue's bound 2x); the flood answered {flooded['flood_calls_per_s']} calls/s, "
            f"{flooded['flood_refused']} refused"
        )
    for prio in (r for r in results if r["arm"] == "priority"):
        shares = ", ".join(f"{c} {v:.1%}" for c, v in sorted(prio["class_compute_shares"].items()))
        calls = ", ".join(f"{c} {v}" for c, v in prio["class_calls_computed"].items())
        batch = (
            f"mean batch {prio['mean_batch_rows']} rows"
            if prio["mean_batch_rows"] is not None
            else "no batches (batching off: the classes wait alike)"
        )
        print(
            f"{prio['model']}: {prio['critical_clients']} critical clients of one replica among "
            f"{prio['best_effort_clients']} best-effort ones (in {prio['best_effort_processes']}"
            f" processes of their own), all in closed loops: critical p99 alone "
            f"{prio['critical_p99_ms_alone']} ms, among them {prio['critical_p99_ms_among']} ms "
            f"({prio['critical_p99_ratio']}x; the bound 1.5x); critical calls/s "
            f"{prio['critical_requests_per_s_alone']} alone, "
            f"{prio['critical_requests_per_s_among']} among"
        )
        print(
            f"  best-effort answers per client: fewest {prio['best_effort_min_answers']} (0: "
            f"one starved), most {prio['best_effort_max_answers']}; "
            f"{prio['best_effort_calls_per_s']} calls/s in all; over the mixed window the "
            f"replica's compute by class {shares or '-'}, calls computed {calls}, "
            f"{batch}; failed {prio['failed']}"
        )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(f"{text[:60]!r}: give a comma list of {', '.join(ARMS)}")
    return arms


def _models(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in modelzoo.ALL]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text[:60]!r}: give model zoo names, e.g. mlp,resnet18 (known: "
            f"{', '.join(modelzoo.ALL)})"
        )
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.services",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="8 MLP and 2 ResNet-18 clients, 4 in loops, 2 s, 4 moves, 2 critical among 6",
    )
    parser.add_argument(
        "--models",
        type=_models,
        default=["mlp", "resnet18"],
        help="the private and service arms' models, a comma list (mlp,resnet18)",
    )
    parser.add_argument("--clients", type=int, help="clients of each model (64; 8 with --quick)")
    parser.add_argument(
        "--resnet-clients",
        type=int,
        help="clients of resnet18 instead (--clients when given, else 64; 2 with --quick)",
    )
    parser.add_argument("--loop-clients", type=int, help="of them in closed loops (16; 4)")
    parser.add_argument("--seconds", type=float, help="of closed loops (5; 2)")
    parser.add_argument("--moves", type=int, help="moves in the mobility arm (20; 4)")
    parser.add_argument(
        "--priority-models",
        type=_models,
        help="the priority arm's models (mlp,resnet18; mlp with --quick)",
    )
    parser.add_argument(
        "--critical-clients", type=int, help="critical clients of the priority arm (4; 2)"
    )
    parser.add_argument(
        "--best-effort-clients", type=int, help="best-effort clients beside them (60; 6)"
    )
    parser.add_argument(
        "--arms",
        type=_arms,
        default=list(ARMS),
        help=f"the arms to run, a comma list ({','.join(ARMS)}; 'services' is the service "
        "and private arms together, one the other's baseline)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    n = args.clients or (8 if args.quick else 64)
    resnet_n = args.resnet_clients or args.clients or (2 if args.quick else 64)
    loop_clients = args.loop_clients or (4 if args.quick else 16)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    moves = args.moves or (4 if args.quick else 20)
    critical_n = args.critical_clients or (2 if args.quick else 4)
    best_effort_n = args.best_effort_clients or (6 if args.quick else 60)
    if not (
        1 <= n <= 256
        and 1 <= resnet_n <= 256
        and loop_clients >= 1
        and 0 < seconds <= 600
        and moves >= 1
        and 1 <= critical_n <= 16
        and 1 <= best_effort_n <= 256
    ):
        parser.error(
            "--clients and --resnet-clients 1..256, --loop-clients >= 1, --seconds 0..600, "
            "--moves >= 1, --critical-clients 1..16, --best-effort-clients 1..256"
        )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    priority_models = args.priority_models or (["mlp"] if args.quick else ["mlp", "resnet18"])
    for name in {MODEL, *args.models, *priority_models}:
        modelzoo.model_path(name)  # made before the clock starts
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-services-") as tmp:

        def compare(kind: str) -> None:
            for model in args.models:
                clients = resnet_n if model == "resnet18" else n
                root = Path(tmp) / f"{kind}-{model}"
                root.mkdir()
                result = arm(kind, root, model, clients, min(loop_clients, clients), seconds)
                results.append(asyncio.run(result))
                print(json.dumps(results[-1]), flush=True)

        if "services" in args.arms:
            compare("service")
        if "mobility" in args.arms:
            root = Path(tmp) / "mobility"
            root.mkdir()
            results.append(asyncio.run(mobility(root, min(loop_clients, 4), moves)))
            print(json.dumps(results[-1]), flush=True)
        if "flood" in args.arms:
            root = Path(tmp) / "flood"
            root.mkdir()
            results.append(asyncio.run(flood(root, seconds, 16, FLOOD_MAX_RPS)))
            print(json.dumps(results[-1]), flush=True)
        for model in priority_models if "priority" in args.arms else ():
            root = Path(tmp) / f"priority-{model}"
            root.mkdir()
            result = priority(root, model, critical_n, best_effort_n, seconds)
            results.append(asyncio.run(result))
            print(json.dumps(results[-1]), flush=True)
        # The private arms last: 64 private ResNet-18 replicas hold about 21 GB here, and an
        # arm run right after them found the page cache emptied (its first answers up to
        # 1.8 s, attaches 0.6 s, against 52 ms and 0.1 s on a machine at rest).
        if "services" in args.arms:
            compare("private")
    report(results)
    if args.json:
        args.json.write_text(json.dumps({"arms": results}, indent=2))
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
