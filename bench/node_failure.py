"""How fast a failed node is noticed and its deployments placed again, under a client's load.

Each round starts the demo's cluster (`edge_client.demo.cluster.LocalCluster`): a real
`offload broker` and three real `offload node` daemons as subprocesses (process-runtime
replicas, topology-file GPUs, the broker's default liveness settings). An independent
closed-loop client in a process of its own (`bench.migration_client`, as an edge device would
be) deploys the MLP at site-a, which lands on node-a, and runs `--concurrency` inference loops
on it; this process deploys `--deployments` more at site-a, on node-a too. Once the load runs
steadily, node-a fails, in one of two arms:

- kill: node-a's daemon is SIGKILLed, and its replica processes with it (the node's host is
  gone): the daemon's connections are reset, and the client's replica stops answering;
- stop: node-a's daemon is SIGSTOPped (a hung daemon, a frozen VM): its TCP connection to
  the broker stays open but nothing is sent on it; its replicas keep serving. It is
  SIGCONTed once the round is measured.

Measured per round, from the signal (all on this host's CLOCK_MONOTONIC):
- lost: until the broker's ops API (`/api/nodes`, polled every `POLL_S`) shows node-a `lost`;
- re-placed: until every deployment of node-a is `running` on another node (`/api/deployments`);
- the client's gap: the longest gap between successful responses from the signal until the
  load settled after the re-placement (for `stop`, where the old replica serves on, only a
  switch shows);
- failed: requests that raised from the signal on, and those beyond the failover gap (raised
  after the client's first success past the gap's end: a client that switched should see no
  more failures).

The failover gap (docs/OPERATIONS.md, "Node failure") is the time to "lost" plus placing and
starting the replacement; what the bench checks it against is itself across commits (the
figures in docs/BENCHMARKS.md): failure detection must not get slower. The figures are
reported, not asserted; the exit status is 1 when a round did not see the node lost or its
deployments placed again within `STEP_TIMEOUT_S`.

    python -m bench.node_failure [--quick] [--rounds N] [--arms kill,stop] [--deployments N]
        [--concurrency N] [--json FILE]

`--quick` (CI): one round per arm. Full: three.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc

import modelzoo
from bench.migration import Load
from edge_client.demo.cluster import LocalCluster
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc

VICTIM = "node-a"
"""The node that fails: the only one at site-a, where every deployment asks to be."""
POLL_S = 0.02
"""How often the broker's ops API is read while waiting for "lost" and the re-placement."""
WARM_OK = 50
"""Successful responses before the fault: the load is steady."""
SETTLE_S = 2.0
"""How long the load runs on after the re-placement before the round ends."""
ARMS = ("kill", "stop")
STEP_TIMEOUT_S = 120.0
"""How long a round waits for the node lost and its deployments running elsewhere."""
_REPO_ROOT = Path(__file__).resolve().parents[1]


async def ops(http: aiohttp.ClientSession, cluster: LocalCluster, path: str) -> Any:
    async with http.get(f"{cluster.ops_url}api/{path}", headers=cluster.ops_headers) as reply:
        reply.raise_for_status()
        return await reply.json()


def replica_pids(cluster: LocalCluster, node_id: str) -> list[int]:
    """The process replicas' pids the node recorded (`replica.json`)."""
    pids = []
    for record in (cluster.root / f"{node_id}-state" / "replicas").glob("*/replica.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            pids.append(int(json.loads(record.read_text())["pid"]))
    return pids


async def spawn_load(cluster: LocalCluster, concurrency: int) -> Load:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.migration_client", "--broker", cluster.broker_address,
        "--api-key", cluster.api_key, "--model", "mlp", "--concurrency", str(concurrency),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        cwd=_REPO_ROOT, limit=1 << 24,
    )  # fmt: skip
    return Load(process)


class FailedAt:
    """The arrival times of the load's failure counts (`Load.failed` only sums them)."""

    def __init__(self, load: Load) -> None:
        self.load = load
        self.seen = 0
        self.times: list[tuple[float, int]] = []

    async def watch(self) -> None:
        while not self.load.ended:
            if self.load.failed > self.seen:
                self.times.append((time.monotonic(), self.load.failed - self.seen))
                self.seen = self.load.failed
            await asyncio.sleep(0.01)

    def after(self, at: float) -> int:
        return sum(n for t, n in self.times if t > at)


async def round_(arm: str, root: Path, deployments: int, concurrency: int) -> dict[str, Any]:
    cluster = LocalCluster(root, runtime="process")
    stopped: int | None = None
    load: Load | None = None
    tasks: list[asyncio.Task[None]] = []
    try:
        await cluster.start(lambda _: None)
        async with aiohttp.ClientSession() as http:
            load = await spawn_load(cluster, concurrency)
            failed_at = FailedAt(load)
            tasks = [
                asyncio.create_task(load.read(), name="load-read"),
                asyncio.create_task(failed_at.watch(), name="load-failures"),
            ]
            await load.until(lambda: load.deployed is not None, "the client deploying")
            assert load.deployed is not None
            ids = [load.deployed["deployment_id"]]
            async with grpc.aio.insecure_channel(cluster.broker_address) as channel:
                stub = pb_grpc.EdgeBrokerStub(channel)
                metadata = (("authorization", f"Bearer {cluster.api_key}"),)
                sha = await stub.ListDeployments(pb.ListDeploymentsRequest(), metadata=metadata)
                model_sha = sha.deployments[0].model_sha256
                for _ in range(deployments):
                    d = await stub.Deploy(
                        pb.DeployRequest(
                            model_sha256=model_sha, model_name="mlp", gpus=1, site="site-a"
                        ),
                        metadata=metadata,
                        timeout=120,
                    )
                    ids.append(d.deployment_id)
            placed = {d["deployment_id"]: d for d in await ops(http, cluster, "deployments")}
            on_victim = [i for i in ids if placed[i]["node_id"] == VICTIM]
            start_ok = load.ok
            await load.until(lambda: load.ok >= start_ok + WARM_OK, "the load warming up")
            daemon = cluster.processes[VICTIM]
            pids = replica_pids(cluster, VICTIM)
            fault = time.monotonic()
            if arm == "kill":
                daemon.kill()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            else:
                daemon.send_signal(signal.SIGSTOP)
                stopped = daemon.pid
            lost_at = replaced_at = None
            deadline = fault + STEP_TIMEOUT_S
            while replaced_at is None and time.monotonic() < deadline:
                now = time.monotonic()
                if lost_at is None:
                    nodes = {n["node_id"]: n for n in await ops(http, cluster, "nodes")}
                    if nodes[VICTIM]["state"] == "lost":
                        lost_at = now
                if lost_at is not None:
                    current = {
                        d["deployment_id"]: d for d in await ops(http, cluster, "deployments")
                    }
                    if all(
                        current[i]["state"] == "running" and current[i]["node_id"] != VICTIM
                        for i in on_victim
                    ):
                        replaced_at = now
                await asyncio.sleep(POLL_S)
            end = (replaced_at or time.monotonic()) + SETTLE_S
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            gap_start, gap_end = load.worst_gap(fault, replaced_at or end)
            return {
                "arm": arm,
                "deployments_on_node": len(on_victim),
                "lost_s": None if lost_at is None else round(lost_at - fault, 3),
                "replaced_s": None if replaced_at is None else round(replaced_at - fault, 3),
                "client_gap_ms": round((gap_end - gap_start) * 1000, 1),
                "failed": failed_at.after(fault),
                "failed_beyond_gap": failed_at.after(gap_end),
            }
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        if load is not None and not load.ended:
            with contextlib.suppress(Exception):  # the round's figures matter more
                await load.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await cluster.stop()


def summary(rounds: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    mine = [r for r in rounds if r["arm"] == arm]

    def median(key: str) -> float | None:
        values = [r[key] for r in mine if r[key] is not None]
        return round(statistics.median(values), 3) if values else None

    return {
        "rounds": len(mine),
        "lost_s_median": median("lost_s"),
        "lost_s_max": max((r["lost_s"] for r in mine if r["lost_s"] is not None), default=None),
        "replaced_s_median": median("replaced_s"),
        "client_gap_ms_median": median("client_gap_ms"),
        "failed": sum(r["failed"] for r in mine),
        "failed_beyond_gap": sum(r["failed_beyond_gap"] for r in mine),
    }


def print_report(rounds: list[dict[str, Any]], arms: Sequence[str]) -> None:
    print(
        f"{'arm':<6}{'round':>6}{'on node':>9}{'lost s':>9}{'re-placed s':>13}"
        f"{'client gap ms':>15}{'failed':>8}{'beyond gap':>12}"
    )
    for arm in arms:
        for i, r in enumerate(x for x in rounds if x["arm"] == arm):
            print(
                f"{arm:<6}{i + 1:>6}{r['deployments_on_node']:>9}{_s(r['lost_s']):>9}"
                f"{_s(r['replaced_s']):>13}{r['client_gap_ms']:>15.0f}{r['failed']:>8}"
                f"{r['failed_beyond_gap']:>12}"
            )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.node_failure",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="one round per arm")
    parser.add_argument("--rounds", type=int, help="rounds per arm (3; 1 with --quick)")
    parser.add_argument("--arms", default=",".join(ARMS), help="kill,stop (both)")
    parser.add_argument(
        "--deployments", type=int, default=2, help="more deployments on the node (2)"
    )
    parser.add_argument("--concurrency", type=int, default=2, help="client loops (2)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - set(ARMS):
        parser.error(f"--arms: one or more of {','.join(ARMS)}")
    if not 0 <= args.deployments <= 3:
        parser.error("--deployments: 0 to 3 (node-a has 4 GPUs, the client takes one)")
    rounds_per_arm = args.rounds or (1 if args.quick else 3)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    modelzoo.model_path("mlp")  # made before the clock starts
    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="bench-node-failure-") as tmp:
        for n in range(rounds_per_arm):
            for arm in arms:
                root = Path(tmp) / f"{arm}-{n}"
                root.mkdir()
                result = asyncio.run(round_(arm, root, args.deployments, args.concurrency))
                rounds.append(result)
                failed |= result["lost_s"] is None or result["replaced_s"] is None
                print(json.dumps(result), flush=True)
    print_report(rounds, arms)
    figures = {
        "rounds": rounds,
        "arms": {arm: summary(rounds, arm) for arm in arms},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
