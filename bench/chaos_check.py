"""What the chaos suite (`bench.chaos`) checks after each scenario: the broker's store, the
replicas each node reports, and the replica processes running on this machine must agree.

Three views of one `LocalCluster` (process runtime):

- the store: every deployment, from the ops API's `/api/deployments` (one call and no
  client key: while bogus keys flood in, the broker refuses even valid ones from this
  address);
- the nodes: `ListReplicas` of each live node daemon (its address from its log);
- the processes: every `python -m runtime.server` under the cluster's folder, with the
  replica id (its folder, the parent of `--token-file`), the node (`<node-id>-state` in
  that path) and the GPUs it sees (`CUDA_VISIBLE_DEVICES` in /proc/<pid>/environ).

`problems` compares them; `settle` polls until they agree or a deadline passes (a replica
no deployment claims is stopped by the broker after `--orphan-grace`, a migration under way
holds two replicas for a moment).
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc

from edge_client.demo.cluster import LocalCluster, processes_naming
from protos.offload.v1 import node_pb2 as npb
from protos.offload.v1 import node_pb2_grpc as npb_grpc

CALL_TIMEOUT_S = 10.0
LIVE_REPLICA = (npb.REPLICA_STATE_STARTING, npb.REPLICA_STATE_READY)
SETTLED = ("running", "pending")
"""The states a deployment may rest in: serving, or waiting for capacity."""
_NODE_ADDRESS = re.compile(rb"node agent listening on (\S+:\d+)")


@dataclass(frozen=True, slots=True)
class Stored:
    """A deployment as the broker's store has it."""

    deployment_id: str
    client_id: str
    state: str
    node_id: str
    """"" while it has none."""
    epoch: int
    reason: str


@dataclass(frozen=True, slots=True)
class ReplicaProcess:
    pid: int
    node_id: str
    replica_id: str
    gpu_uuids: tuple[str, ...]
    shares_gpu: bool
    """Started with a GPU memory limit: it may share its GPUs with other such replicas."""


@dataclass(frozen=True, slots=True)
class ClusterState:
    deployments: tuple[Stored, ...]
    """Every deployment not deleted."""
    reported: Mapping[str, tuple[npb.Replica, ...]]
    """node id -> the live replicas it reports, for each node whose daemon runs."""
    processes: tuple[ReplicaProcess, ...]


@dataclass(slots=True)
class Problems:
    """What disagrees, one line each, by invariant."""

    leaked: list[str] = field(default_factory=list)
    double_booked: list[str] = field(default_factory=list)
    lost_or_duplicated: list[str] = field(default_factory=list)
    unsettled: list[str] = field(default_factory=list)
    unobservable: list[str] = field(default_factory=list)
    """The state could not be read (a daemon did not answer)."""

    def empty(self) -> bool:
        return not any(
            (
                self.leaked,
                self.double_booked,
                self.lost_or_duplicated,
                self.unsettled,
                self.unobservable,
            )
        )


def node_address(cluster: LocalCluster, node_id: str) -> str:
    """The NodeAgent address of the node's latest start, from its log; "" if not logged."""
    found = _NODE_ADDRESS.findall(cluster.log(node_id).read_bytes())
    return found[-1].decode() if found else ""


def replica_processes(root: Path) -> list[ReplicaProcess]:
    """The runtime servers running under `root` (see the module docstring)."""
    found = []
    for pid, _ in processes_naming(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        if "runtime.server" not in argv or "--token-file" not in argv:
            continue
        token_file = Path(argv[argv.index("--token-file") + 1])
        node_dir = next((p.name for p in token_file.parents if p.name.endswith("-state")), "")
        visible = next(
            (
                e.split(b"=", 1)[1].decode()
                for e in environ
                if e.startswith(b"CUDA_VISIBLE_DEVICES=")
            ),
            "",
        )
        found.append(
            ReplicaProcess(
                pid=pid,
                node_id=node_dir.removesuffix("-state"),
                replica_id=token_file.parent.name,
                gpu_uuids=tuple(u for u in visible.split(",") if u),
                shares_gpu="--gpu-mem-limit-mib" in argv,
            )
        )
    return found


class Unobservable(Exception):
    """A view could not be read now."""


async def stored_deployments(
    http: aiohttp.ClientSession, cluster: LocalCluster, ops_headers: Mapping[str, str]
) -> list[Stored]:
    """Every deployment not deleted, from the ops API; Unobservable when it does not answer."""
    try:
        async with http.get(f"{cluster.ops_url}api/deployments", headers=ops_headers) as reply:
            if reply.status != 200:
                raise Unobservable(f"/api/deployments: HTTP {reply.status}")
            listed = await reply.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        raise Unobservable(f"/api/deployments: {type(err).__name__} {err}") from err
    return [
        Stored(
            deployment_id=d["deployment_id"],
            client_id=d["client_id"],
            state=d["state"],
            node_id=d["node_id"] or "",
            epoch=d["epoch"],
            reason=d["reason"] or "",
        )
        for d in listed
    ]


async def observe(
    http: aiohttp.ClientSession,
    cluster: LocalCluster,
    ops_headers: Mapping[str, str],
    join_token: str,
) -> ClusterState:
    """The three views now; Unobservable when one cannot be read (the caller retries).
    Each node's NodeAgent is read with that node's secret, as the broker calls it (the join
    token, `join_token`, no longer opens a NodeAgent; kept for the callers)."""
    deployments = await stored_deployments(http, cluster, ops_headers)
    reported: dict[str, tuple[npb.Replica, ...]] = {}
    for plan in cluster.nodes:
        process = cluster.processes.get(plan.node_id)
        if process is None or process.poll() is not None:
            continue
        agent_token = cluster.node_secret(plan.node_id)
        async with grpc.aio.insecure_channel(node_address(cluster, plan.node_id)) as channel:
            try:
                listed = await npb_grpc.NodeAgentStub(channel).ListReplicas(
                    npb.ListReplicasRequest(),
                    metadata=(("authorization", f"Bearer {agent_token}"),),
                    timeout=CALL_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as err:
                raise Unobservable(
                    f"{plan.node_id} ListReplicas: {err.code().name} {err.details()}"
                ) from err
        reported[plan.node_id] = tuple(r for r in listed.replicas if r.state in LIVE_REPLICA)
    processes = await asyncio.to_thread(replica_processes, cluster.root)
    return ClusterState(tuple(deployments), reported, tuple(processes))


def problems(state: ClusterState, acknowledged: Iterable[str] = ()) -> Problems:
    """Every way `state` breaks the invariants. `acknowledged`: deployment ids the broker
    answered OK to Deploy for and nobody deleted since (each must still be in the store)."""
    found = Problems()
    in_store = {d.deployment_id: d for d in state.deployments}
    for deployment_id in sorted(set(acknowledged) - in_store.keys()):
        found.lost_or_duplicated.append(f"{deployment_id}: acknowledged, not in the store")
    for d in state.deployments:
        if d.state not in SETTLED:
            found.unsettled.append(f"{d.deployment_id} is {d.state}: {d.reason[:120]}")
    # A replica is claimed when a running deployment has it on its node at its epoch.
    claimed = {
        (d.node_id, d.deployment_id, d.epoch) for d in state.deployments if d.state == "running"
    }
    replicas_of: dict[str, list[str]] = defaultdict(list)
    reported_ids: dict[str, set[str]] = {}
    for node_id, replicas in state.reported.items():
        reported_ids[node_id] = {r.replica_id for r in replicas}
        for r in replicas:
            replicas_of[r.spec.deployment_id].append(f"{r.replica_id} on {node_id}")
            if (node_id, r.spec.deployment_id, r.spec.epoch) not in claimed:
                found.leaked.append(f"{node_id} runs {r.replica_id}, which no deployment claims")
    running = {(p.node_id, p.replica_id) for p in state.processes}
    for node_id, replicas in state.reported.items():
        for r in replicas:
            if (node_id, r.replica_id) not in running:
                found.lost_or_duplicated.append(
                    f"{node_id} reports {r.replica_id} live, but no process runs it"
                )
    for p in state.processes:
        if p.node_id in reported_ids and p.replica_id not in reported_ids[p.node_id]:
            found.leaked.append(
                f"pid {p.pid} runs replica {p.replica_id} of {p.node_id}, which {p.node_id} "
                "does not report (so nothing reconciles it)"
            )
    for d in state.deployments:
        if d.state != "running":
            continue
        replicas = state.reported.get(d.node_id, ())
        if d.node_id in state.reported and not any(
            r.spec.deployment_id == d.deployment_id and r.spec.epoch == d.epoch for r in replicas
        ):
            found.lost_or_duplicated.append(
                f"{d.deployment_id} running on {d.node_id} at epoch {d.epoch}: no replica there"
            )
    for deployment_id, where in sorted(replicas_of.items()):
        if len(where) > 1:
            found.lost_or_duplicated.append(f"{deployment_id} has {len(where)} replicas: {where}")
    found.double_booked.extend(_double_booked(state))
    return found


def _double_booked(state: ClusterState) -> list[str]:
    """GPUs held by two live replicas, one of them holding it whole: by the processes'
    CUDA_VISIBLE_DEVICES, and by the nodes' reports."""
    seen: dict[str, dict[tuple[str, str], list[tuple[str, bool]]]] = {
        "in CUDA_VISIBLE_DEVICES of": defaultdict(list),
        "reported held by": defaultdict(list),
    }
    for p in state.processes:
        for uuid in p.gpu_uuids:
            seen["in CUDA_VISIBLE_DEVICES of"][(p.node_id, uuid)].append(
                (f"pid {p.pid} ({p.replica_id})", p.shares_gpu)
            )
    for node_id, replicas in state.reported.items():
        for r in replicas:
            for uuid in r.spec.gpu_uuids:
                seen["reported held by"][(node_id, uuid)].append(
                    (r.replica_id, r.spec.gpu_memory_mib > 0)
                )
    return [
        f"{node_id} GPU {uuid} {how} {[who for who, _ in holders]}"
        for how, by_gpu in seen.items()
        for (node_id, uuid), holders in sorted(by_gpu.items())
        if len(holders) > 1 and not all(shares for _, shares in holders)
    ]


async def settle(
    http: aiohttp.ClientSession,
    cluster: LocalCluster,
    ops_headers: Mapping[str, str],
    join_token: str,
    timeout_s: float,
    acknowledged: Iterable[str] = (),
) -> Problems:
    """Poll until the views agree or `timeout_s` passes; the last problems."""
    acked = list(acknowledged)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            found = problems(await observe(http, cluster, ops_headers, join_token), acked)
        except Unobservable as err:
            found = Problems(unobservable=[str(err)[:300]])
        if found.empty() or loop.time() > deadline:
            return found
        await asyncio.sleep(0.5)
