"""One model, many clients (issue 52): N clients of one model as N private deployments
against the same N clients on one service, then clients of a service moving between sites
whose replicas run. The demo's cluster (`edge_client.demo.cluster.LocalCluster`: a real
`offload broker`, three real `offload node` daemons, process-runtime replicas of the MLP),
the clients real `OffloadClient`s in this process, each with an API key of its own.

Arms, each on a cluster of its own:
- private: every client deploys the model at site-a (CPU only) and calls it once;
- service: an owner creates the service (no replica yet), and every client puts itself on
  it at site-a (`use_service`: the first starts the replica, the others share it) and calls
  it once;
  for both: replicas started, the replicas' memory (the RSS of their processes, summed: what
  the nodes hold for them), each client's time from its Deploy or UseService to its first
  answer (and, for the service, the UseService call alone: the attach), then --loop-clients
  of them in closed loops for --seconds: requests/s, p50/p99, failed;
- mobility: a service with a replica at every site (`--min-replicas-per-site 1`) and
  --loop-clients clients in closed loops at site-a; --moves times, one client reports the
  next site: from the report to its first answer from that site's replica (no replica
  starts: a switch), and the loops' failed calls over the whole arm;
- flood: one quiet client calling a service's replica at half the per-client limit for
  --seconds alone, then beside another client, in a process of its own, flooding the
  replica with 16 concurrent loops (each client at most `FLOOD_MAX_RPS` calls a second: the
  replica paces a client over it, and refuses what would wait too long): the quiet client's
  p99 both times (the issue's bound: at most 2x), the flood's calls answered a second and
  those refused over its limit.

The baseline is the private arm of the same run; the figures are printed, not asserted (the
issue's targets: a tenth of the memory, attach p99 at most 100 ms, the same or better
throughput at 16 clients, a move at most 100 ms median, zero failed requests). The exit
status is 1 when a call failed.

    python -m bench.services [--quick] [--clients N] [--loop-clients T] [--seconds S]
        [--moves K] [--json FILE]

`--quick` (CI): 8 clients, 4 in loops for 2 s, 4 moves. Full: 64, 16, 5 s, 20.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import modelzoo
from bench.node_failure import replica_pids
from broker.state.api_keys import new_api_key
from edge_client.client import OffloadClient
from edge_client.demo.cluster import LocalCluster
from edge_client.errors import OffloadError, ResourceExhausted

MODEL = "mlp"
SITES = ("site-a", "site-b", "site-c")
NODES = ("node-a", "node-b", "node-c")
FLOOD_MAX_RPS = 200.0
"""Each client's calls per second at the flood arm's replica (`max_rps_per_client`)."""


def rss_mib(pid: int) -> float:
    """A process's resident memory in MiB (0 when it is gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def replicas_memory(cluster: LocalCluster) -> tuple[int, float]:
    """The replica processes the nodes run, and their RSS summed (MiB)."""
    pids = [pid for node in NODES for pid in replica_pids(cluster, node)]
    alive = [pid for pid in pids if rss_mib(pid) > 0]
    return len(alive), round(sum(rss_mib(pid) for pid in alive), 1)


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


async def arm(kind: str, root: Path, n: int, loop_clients: int, seconds: float) -> dict[str, Any]:
    """The private or the service arm on a cluster of its own."""
    keys = [new_api_key(f"c{i:03d}") for i in range(n)]
    cluster = LocalCluster(root, runtime="process", client_id="owner", more_api_keys=keys)
    model = modelzoo.model_path(MODEL)
    inputs = modelzoo.sample_inputs(model)
    clients: list[OffloadClient] = []
    try:
        await cluster.start(lambda _: None)
        async with OffloadClient(cluster.broker_address, cluster.api_key) as owner:
            sha = await owner.upload_model(model)
            if kind == "service":
                await owner.create_service("bench", sha, MODEL, any_client=True)
        for key in keys:
            client = OffloadClient(cluster.broker_address, key, deploy_timeout_s=600)
            await client.connect()
            clients.append(client)
        first_answer: list[float] = []
        attach: list[float] = []
        for client in clients:
            if kind == "private":  # its own copy of the model: the clock starts after
                await client.upload_model(model)
            started = time.perf_counter()
            if kind == "service":
                await client.use_service("bench", site="site-a")
                attach.append((time.perf_counter() - started) * 1000)
            else:
                await client.deploy(sha, MODEL, site="site-a")
            await client.infer(inputs)
            first_answer.append((time.perf_counter() - started) * 1000)
        replicas, memory = replicas_memory(cluster)
        loop = await closed_loops(clients[:loop_clients], inputs, seconds)
        nodes = {c.deployment.node_id for c in clients if c.deployment is not None}
        return {
            "arm": kind,
            "clients": n,
            "replicas": replicas,
            "nodes_serving": sorted(nodes),
            "replicas_rss_mib": memory,
            "first_answer_ms_p50": percentile(first_answer, 50),
            "first_answer_ms_p99": percentile(first_answer, 99),
            "first_answer_ms_max": round(max(first_answer), 1),
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


def report(results: list[dict[str, Any]]) -> None:
    private = next(r for r in results if r["arm"] == "private")
    service = next(r for r in results if r["arm"] == "service")
    move = next(r for r in results if r["arm"] == "mobility")
    rows = (
        ("replicas started", "replicas", ""),
        ("replicas' RSS (MiB)", "replicas_rss_mib", ""),
        ("first answer p50 (ms)", "first_answer_ms_p50", ""),
        ("first answer p99 (ms)", "first_answer_ms_p99", ""),
        (f"{service['loop_clients']} clients: req/s", "requests_per_s", ""),
        (f"{service['loop_clients']} clients: p99 (ms)", "p99_ms", ""),
        ("failed", "failed", ""),
    )
    print(f"{service['clients']} clients of one model, on the demo's cluster:")
    print(f"{'':<28}{'private':>12}{'service':>12}{'service / private':>20}")
    for label, key, _ in rows:
        a, b = private[key], service[key]
        ratio = f"{b / a:.3f}" if isinstance(a, int | float) and a else "-"
        print(f"{label:<28}{a!s:>12}{b!s:>12}{ratio:>20}")
    print(
        f"service attach (UseService, after the first): p50 {service['attach_ms_p50']} ms, "
        f"p99 {service['attach_ms_p99']} ms (the first, which started the replica: "
        f"{service['attach_ms_first']} ms)"
    )
    print(
        f"moves between sites whose replicas run ({move['moves']}, {move['loop_clients']} "
        f"clients in loops): report to first answer median "
        f"{move['move_to_first_answer_ms_median']} ms, max {move['move_to_first_answer_ms_max']}"
        f" ms; replicas after {move['replicas_after']}; failed {move['failed']}"
    )
    flooded = next(r for r in results if r["arm"] == "flood")
    print(
        f"a quiet client's p99 beside a client flooding the replica ({flooded['flood_loops']} "
        f"loops, each client at most {flooded['max_rps_per_client']:g} calls/s): alone "
        f"{flooded['quiet_p99_ms_alone']} ms, beside the flood "
        f"{flooded['quiet_p99_ms_beside_flood']} ms ({flooded['quiet_p99_ratio']}x; the "
        f"issue's bound 2x); the flood answered {flooded['flood_calls_per_s']} calls/s, "
        f"{flooded['flood_refused']} refused"
    )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.services",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="8 clients, 4 in loops, 2 s, 4 moves")
    parser.add_argument("--clients", type=int, help="clients of the model (64; 8 with --quick)")
    parser.add_argument("--loop-clients", type=int, help="of them in closed loops (16; 4)")
    parser.add_argument("--seconds", type=float, help="of closed loops (5; 2)")
    parser.add_argument("--moves", type=int, help="moves in the mobility arm (20; 4)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    n = args.clients or (8 if args.quick else 64)
    loop_clients = args.loop_clients or (4 if args.quick else 16)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    moves = args.moves or (4 if args.quick else 20)
    if not (1 <= n <= 256 and 1 <= loop_clients <= n and 0 < seconds <= 600 and moves >= 1):
        parser.error("--clients 1..256, --loop-clients 1..clients, --seconds 0..600, --moves >= 1")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    modelzoo.model_path(MODEL)  # made before the clock starts
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-services-") as tmp:
        for kind in ("private", "service"):
            root = Path(tmp) / kind
            root.mkdir()
            results.append(asyncio.run(arm(kind, root, n, loop_clients, seconds)))
            print(json.dumps(results[-1]), flush=True)
        root = Path(tmp) / "mobility"
        root.mkdir()
        results.append(asyncio.run(mobility(root, min(loop_clients, 4), moves)))
        print(json.dumps(results[-1]), flush=True)
        root = Path(tmp) / "flood"
        root.mkdir()
        results.append(asyncio.run(flood(root, seconds, 16, FLOOD_MAX_RPS)))
        print(json.dumps(results[-1]), flush=True)
    report(results)
    if args.json:
        args.json.write_text(json.dumps({"arms": results}, indent=2))
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
