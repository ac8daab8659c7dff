"""An in-memory `OpsView` (the data-source seam the broker implements) for the ops tests.

A DGX-like node (8 GPUs, NV12 between every pair), a 4-GPU PCIe workstation, one deployment
on four NVLink GPUs, two finished migrations (the newer one switched to a pre-warmed standby)
and two standbys of the deployment (one ready, one a previous broker left).
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from broker.ops import (
    DeploymentFigures,
    DeploymentInfo,
    GpuInfo,
    LinkInfo,
    LoadInfo,
    MetricFigures,
    MigrationInfo,
    NodeFigures,
    NodeInfo,
    OffloadInfo,
    PrewarmInfo,
    ServiceClientFigures,
    ServiceFigures,
    ServiceInfo,
)

DEPLOYMENT_ID = "dep-7f3a"
BATCH_DEPLOYMENT_ID = "dep-batch-2b9c"
OPS_TOKEN = "ops-token-for-tests-0123456789"
ARTIFACTS_DIR = Path(
    os.environ.get("TEST_ARTIFACTS_DIR") or Path(__file__).parents[1] / "build" / "test-artifacts"
)
"""Where tests leave what a person should look at (the dashboard's screenshots): the
`TEST_ARTIFACTS_DIR` environment variable, else `build/test-artifacts` (git ignores `build/`)."""


def save_artifact(name: str, data: bytes) -> Path:
    """Write `data` to `ARTIFACTS_DIR / name` (replacing an earlier run's) and return the path."""
    ARTIFACTS_DIR.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS_DIR / name
    path.write_bytes(data)
    return path


def ops_headers(token_file: Path) -> dict[str, str]:
    """The header that reads a broker's ops API with the token in `token_file` (its
    `--ops-token-file`, or the `<state-dir>/ops-token` it wrote without one)."""
    return {"Authorization": f"Bearer {token_file.read_text().strip()}"}


def _gpus(prefix: str, name: str, memory_mib: int, count: int, held: set[int]) -> list[GpuInfo]:
    return [
        {
            "index": i,
            "uuid": f"GPU-{prefix}-{i:04d}",
            "name": name,
            "memory_total_mib": memory_mib,
            "free": i not in held,
            "holders": [DEPLOYMENT_ID] if i in held else [],
        }
        for i in range(count)
    ]


def _pcie_kind(a: int, b: int) -> str:
    # Two PCIe switches of two GPUs each, one per CPU socket.
    return "PIX" if a // 2 == b // 2 else "SYS"


def sample_nodes() -> list[NodeInfo]:
    """Two nodes: 8 NVLink GPUs (four held by the deployment) and 4 PCIe GPUs."""
    dgx_links: list[LinkInfo] = [
        {"a": a, "b": b, "kind": "NV12"} for a, b in itertools.combinations(range(8), 2)
    ]
    pcie_links: list[LinkInfo] = [
        {"a": a, "b": b, "kind": _pcie_kind(a, b)} for a, b in itertools.combinations(range(4), 2)
    ]
    return [
        {
            "node_id": "node-dgx-a",
            "site": "metro-east",
            "state": "ready",
            "address": "127.0.0.1:7070",
            "last_heartbeat_age_s": 1.5,
            "runtime": "docker",
            "gpus": _gpus("a", "NVIDIA A100-SXM4-40GB", 40960, 8, held={0, 1, 2, 3}),
            "links": dgx_links,
            "topology_text": "\tGPU0\tGPU1\nGPU0\t X \tNV12\nGPU1\tNV12\t X \n",
        },
        {
            "node_id": "node-ws-b",
            "site": "campus-west",
            "state": "ready",
            "address": "127.0.0.1:7071",
            "last_heartbeat_age_s": None,
            "runtime": "process",
            "gpus": _gpus("b", "NVIDIA RTX 6000 Ada Generation", 49140, 4, held=set()),
            "links": pcie_links,
            "topology_text": "",
        },
    ]


def sample_offload() -> list[OffloadInfo]:
    """The deployment's client: this start of it (mostly local, the replica unreachable now)
    and an earlier one (all remote)."""
    return [
        {
            "session": "5e55a0c0ffee0001",
            "policy": "fastest",
            "local_model": "resnet50-int8.onnx",
            "remote_requests": 40,
            "local_requests": 160,
            "remote_share": 0.2,
            "fallbacks": 3,
            "decisions": [
                {"target": "local", "reason": "fallback", "requests": 3},
                {"target": "local", "reason": "faster", "requests": 150},
                {"target": "local", "reason": "remote-down", "requests": 7},
                {"target": "remote", "reason": "measuring", "requests": 2},
                {"target": "remote", "reason": "probe", "requests": 38},
            ],
            "remote_estimate_ms": 18.25,
            "local_estimate_ms": 6.5,
            "remote_reachable": False,
            "reported_at": 1_700_000_100.0,
            "reported_age_s": 4.0,
        },
        {
            "session": "5e55a0c0ffee0000",
            "policy": "remote",
            "local_model": "",
            "remote_requests": 12,
            "local_requests": 0,
            "remote_share": 1.0,
            "fallbacks": 0,
            "decisions": [{"target": "remote", "reason": "policy", "requests": 12}],
            "remote_estimate_ms": 20.0,
            "local_estimate_ms": None,
            "remote_reachable": True,
            "reported_at": 1_700_000_000.0,
            "reported_age_s": 104.0,
        },
    ]


def sample_deployments() -> list[DeploymentInfo]:
    return [
        {
            "deployment_id": DEPLOYMENT_ID,
            "client_id": "car-12",
            "model_name": "resnet50",
            "state": "running",
            "node_id": "node-dgx-a",
            "gpus": [0, 1, 2, 3],
            "endpoint": "127.0.0.1:9001",
            "epoch": 2,
            "priority": "high",
            "site": "metro-east",
            "reason": None,
            "explanation": "latency 2.0 ms; NV12 group; load 0.5",
            "offload": sample_offload(),
        }
    ]


def sample_migrations() -> list[MigrationInfo]:
    """Newest first: a pre-warmed move back to the DGX node, and the move that left it."""
    start = time.time() - 30.0
    return [
        {
            "migration_id": "mig-0002",
            "deployment_id": DEPLOYMENT_ID,
            "trigger": "mobility",
            "source": "node-ws-b",
            "target": "node-dgx-a",
            "strategy": "make-before-break",
            "outcome": "succeeded",
            "downtime_ms": 3.5,
            "span_gap_ms": 3.5,
            "failed_requests": 0,
            "reason": "",
            "timeline": [
                {"event": "triggered", "at": start + 20.0},
                {"event": "target_ready", "at": start + 20.01},
                {"event": "switched", "at": start + 20.05},
                {"event": "drained", "at": start + 20.6},
            ],
            "prewarmed": True,
        },
        {
            "migration_id": "mig-0001",
            "deployment_id": DEPLOYMENT_ID,
            "trigger": "mobility",
            "source": "node-dgx-a",
            "target": "node-ws-b",
            "strategy": "make-before-break",
            "outcome": "succeeded",
            "downtime_ms": 42.5,
            "span_gap_ms": 97.5,
            "failed_requests": 0,
            "reason": "",
            "timeline": [
                {"event": "triggered", "at": start},
                {"event": "target_ready", "at": start + 1.8},
                {"event": "switched", "at": start + 1.85},
                {"event": "drained", "at": start + 2.4},
            ],
            "prewarmed": False,
        },
    ]


def sample_prewarm() -> PrewarmInfo:
    """A budget of 4; the oldest first: a standby a previous broker left (being stopped, no
    prediction behind it) and one ready at the site the client is predicted to reach."""
    return {
        "budget": 4,
        "standbys": [
            {
                "deployment_id": DEPLOYMENT_ID,
                "replica_id": "rep-sb-0001",
                "node_id": "node-dgx-a",
                "site": "metro-east",
                "gpus": [4],
                "probability": None,
                "state": "retiring",
                "age_s": 75.0,
            },
            {
                "deployment_id": DEPLOYMENT_ID,
                "replica_id": "rep-sb-0002",
                "node_id": "node-ws-b",
                "site": "campus-west",
                "gpus": [0, 1],
                "probability": 0.62,
                "state": "ready",
                "age_s": 12.5,
            },
        ],
    }


def sample_load() -> LoadInfo:
    """Two heartbeats of two nodes: node-dgx-a busy (its replica throttled, then resized),
    node-ws-b idle; the deployment's figures at both; one resize."""
    return {
        "window_s": 300.0,
        "nodes": [
            {
                "node_id": "node-dgx-a",
                "site": "metro-east",
                "resize_policy": "usage",
                "points": [[1000.0, 0.91, 14.6, 16.0, 2048], [1001.0, 0.95, 15.2, 16.0, 2050]],
            },
            {
                "node_id": "node-ws-b",
                "site": "campus-west",
                "resize_policy": "static",
                "points": [[1000.0, 0.02, 0.1, 4.0, 300], [1001.0, 0.0, 0.0, 4.0, 300]],
            },
        ],
        "deployments": [
            {
                "deployment_id": DEPLOYMENT_ID,
                "node_id": "node-dgx-a",
                "priority": "critical",
                "latency_slo_ms": 50.0,
                "points": [
                    [1000.0, 40.0, 12.5, 61.0, 0.5, 0.5, 0.0],
                    [1001.0, 42.5, 11.0, 30.0, 0.9, 1.25, 0.5],
                ],
                "batching": {
                    "batch_size_mean": 3.46,
                    "queue_delay_p99_ms": 2.5,
                    "class_shares": {"best-effort": 0.2, "critical": 0.8},
                },
            }
        ],
        "resizes": [
            {
                "event_id": "r-0001",
                "at": 1000.5,
                "node_id": "node-dgx-a",
                "deployment_id": DEPLOYMENT_ID,
                "replica_id": f"{DEPLOYMENT_ID}-3",
                "cpus_before": 0.5,
                "cpus_after": 1.25,
                "policy": "usage",
                "reason": "throttled 62% of the last 1.0 s at 0.50 cores; critical",
            }
        ],
    }


def live_load(now: float, seconds: int = 60) -> LoadInfo:
    """A minute of heartbeats (one a second, the last at `now`), deterministic: node-dgx-a
    bursts in the middle (the critical deployment's requests triple, its p99 crosses its 50 ms
    SLO until the usage policy raises its CPU limit, and gets the cores back after the burst);
    node-ws-b idles with a best-effort deployment that has no SLO and, for three heartbeats,
    no finished request (its latencies unknown: null)."""
    start = now - (seconds - 1)
    burst = range(seconds // 3, 2 * seconds // 3)
    raised, lowered = seconds // 3 + 5, 3 * seconds // 4
    dgx: list[list[float]] = []
    ws: list[list[float]] = []
    critical: list[list[float | None]] = []
    batch: list[list[float | None]] = []
    for i in range(seconds):
        t = round(start + i, 3)
        in_burst = i in burst
        limit = 1.5 if raised <= i < lowered else 0.75 if i >= lowered else 0.5
        rate = 60.0 if in_burst else 20.0
        used = round(min(limit, rate / 40), 3)
        p99 = (85.0 if i < raised else 38.0) if in_burst else 24.0 + 2 * math.sin(i / 4)
        dgx_load = round(min(1.0, 0.3 + (0.6 if in_burst else 0.0) + 0.03 * math.sin(i / 3)), 4)
        ws_load = round(0.12 + 0.05 * math.sin(i / 5), 4)
        dgx.append([t, dgx_load, round(16 * dgx_load, 3), 16.0, 2048 + i])
        ws.append([t, ws_load, round(4 * ws_load, 3), 4.0, 300])
        critical.append([t, rate, round(p99 / 3, 1), round(p99, 1), used, limit, 0.0])
        if 10 <= i < 13:  # no request finished: latencies unknown
            batch.append([t, 0.0, None, None, 0.05, 0.0, 0.0])
        else:
            batch.append([t, 8.0, 40.0, round(95 + 10 * math.sin(i / 6), 1), 0.3, 0.0, 0.0])
    return {
        "window_s": 300.0,
        "nodes": [
            {
                "node_id": "node-dgx-a",
                "site": "metro-east",
                "resize_policy": "usage",
                "points": dgx,
            },
            {
                "node_id": "node-ws-b",
                "site": "campus-west",
                "resize_policy": "static",
                "points": ws,
            },
        ],
        "deployments": [
            {
                "deployment_id": DEPLOYMENT_ID,
                "node_id": "node-dgx-a",
                "priority": "critical",
                "latency_slo_ms": 50.0,
                "points": critical,
                "batching": None,
            },
            {
                "deployment_id": BATCH_DEPLOYMENT_ID,
                "node_id": "node-ws-b",
                "priority": "best-effort",
                "latency_slo_ms": 0.0,
                "points": batch,
                "batching": None,
            },
        ],
        "resizes": [
            {
                "event_id": "r-0001",
                "at": start + raised - 0.5,
                "node_id": "node-dgx-a",
                "deployment_id": DEPLOYMENT_ID,
                "replica_id": f"{DEPLOYMENT_ID}-3",
                "cpus_before": 0.5,
                "cpus_after": 1.5,
                "policy": "usage",
                "reason": "throttled 48% of the last 1.0 s at 0.50 cores; critical",
            },
            {
                "event_id": "r-0002",
                "at": start + lowered - 0.5,
                "node_id": "node-dgx-a",
                "deployment_id": DEPLOYMENT_ID,
                "replica_id": f"{DEPLOYMENT_ID}-3",
                "cpus_before": 1.5,
                "cpus_after": 0.75,
                "policy": "usage",
                "reason": "used 0.50 of 1.50 cores over 10 s; critical",
            },
        ],
    }


SERVICE = "detector"


def sample_services() -> list[ServiceInfo]:
    """One service of three clients: a replica serving at metro-east (batching, one client
    refused over its rate), and one pending at campus-west (no figures yet)."""
    return [
        {
            "name": SERVICE,
            "owner": "fleet-ops",
            "model_name": "yolo-n",
            "clients": 3,
            "replicas": [
                {
                    "deployment_id": "dep-svc-01",
                    "site": "metro-east",
                    "node_id": "node-dgx-a",
                    "state": "running",
                    "clients": 3,
                    "request_rate": 24.0,
                    "latency_p99_ms": 18.0,
                    "queued": 2,
                    "batch_size_mean": 3.2,
                    "class_shares": {"best-effort": 0.4, "critical": 0.6},
                },
                {
                    "deployment_id": "dep-svc-02",
                    "site": "campus-west",
                    "node_id": None,
                    "state": "pending",
                    "clients": 0,
                    "request_rate": None,
                    "latency_p99_ms": None,
                    "queued": None,
                    "batch_size_mean": None,
                    "class_shares": {},
                },
            ],
            "request_rate": 24.0,
            "latency_p99_ms": 18.0,
            "batch_size_mean": 3.2,
            "class_shares": {"best-effort": 0.4, "critical": 0.6},
            "busiest_clients": [
                {
                    "client_id": "cam-1",
                    "deployment_id": "dep-svc-01",
                    "request_rate": 12.0,
                    "refused_rate": 0.0,
                    "latency_p99_ms": 10.0,
                },
                {
                    "client_id": "cam-2",
                    "deployment_id": "dep-svc-01",
                    "request_rate": 8.0,
                    "refused_rate": 1.5,
                    "latency_p99_ms": 18.0,
                },
                {
                    "client_id": "cam-3",
                    "deployment_id": "dep-svc-01",
                    "request_rate": 4.0,
                    "refused_rate": 0.0,
                    "latency_p99_ms": None,
                },
            ],
            "scale_decisions": [
                {
                    "at": 1_764_900_000.0,
                    "action": "start",
                    "deployment_id": "dep-svc-01",
                    "site": "metro-east",
                    "reason": "a client at metro-east needs a replica: none runs yet",
                },
                {
                    "at": 1_764_900_060.0,
                    "action": "start",
                    "deployment_id": "dep-svc-02",
                    "site": "campus-west",
                    "reason": "a client at campus-west needs a replica: none within 10 ms",
                },
            ],
        }
    ]


@dataclass
class StaticOpsView:
    """An `OpsView` over fixed lists; `failure`, when set, is raised by every call."""

    node_list: list[NodeInfo] = field(default_factory=sample_nodes)
    deployment_list: list[DeploymentInfo] = field(default_factory=sample_deployments)
    migration_list: list[MigrationInfo] = field(default_factory=sample_migrations)
    prewarm_info: PrewarmInfo = field(default_factory=sample_prewarm)
    load_info: LoadInfo = field(default_factory=sample_load)
    service_list: list[ServiceInfo] = field(default_factory=sample_services)
    failure: Exception | None = None

    async def nodes(self) -> list[NodeInfo]:
        self._maybe_fail()
        return copy.deepcopy(self.node_list)

    async def deployments(self) -> list[DeploymentInfo]:
        self._maybe_fail()
        return copy.deepcopy(self.deployment_list)

    async def migrations(self) -> list[MigrationInfo]:
        self._maybe_fail()
        return copy.deepcopy(self.migration_list)

    async def prewarm(self) -> PrewarmInfo:
        self._maybe_fail()
        return copy.deepcopy(self.prewarm_info)

    async def load(self) -> LoadInfo:
        self._maybe_fail()
        return copy.deepcopy(self.load_info)

    async def services(self) -> list[ServiceInfo]:
        self._maybe_fail()
        return copy.deepcopy(self.service_list)

    async def figures(self) -> MetricFigures:
        self._maybe_fail()
        return figures_from_views(
            self.node_list,
            self.deployment_list,
            self.prewarm_info,
            self.load_info,
            self.service_list,
        )

    def _maybe_fail(self) -> None:
        if self.failure is not None:
            raise self.failure


def figures_from_views(
    nodes: list[NodeInfo],
    deployments: list[DeploymentInfo],
    prewarm: PrewarmInfo,
    load: LoadInfo,
    services: list[ServiceInfo],
) -> MetricFigures:
    """What `/metrics` shows, read off the dashboard's views: the oracle a broker's own
    `figures()` (counted without building the views) must agree with."""
    gpus = [gpu for node in nodes for gpu in node["gpus"]]
    free = sum(1 for gpu in gpus if gpu["free"])
    requests: Counter[tuple[str, str, str]] = Counter()
    reachable: dict[str, bool] = {}
    for deployment in deployments:
        sessions = deployment["offload"]
        for session in sessions:
            for c in session["decisions"]:
                requests[deployment["deployment_id"], c["target"], c["reason"]] += c["requests"]
        if sessions:  # the most recent first
            reachable[deployment["deployment_id"]] = sessions[0]["remote_reachable"]
    load_nodes = {
        n["node_id"]: NodeFigures(
            site=n["site"],
            load=n["points"][-1][1],
            cpu_used_cores=n["points"][-1][2],
            cpu_cores=n["points"][-1][3],
            memory_used_bytes=n["points"][-1][4] * 1024 * 1024,
        )
        for n in load["nodes"]
        if n["points"]
    }
    load_deployments = {}
    for d in load["deployments"]:
        _, rate, p50_ms, p99_ms, cpu_used, cpu_limit, failure_rate = d["points"][-1]
        load_deployments[d["deployment_id"]] = DeploymentFigures(
            latency_slo_seconds=d["latency_slo_ms"] / 1000,
            cpu_used_cores=cpu_used or 0.0,
            cpu_limit_cores=cpu_limit or 0.0,
            request_rate=rate,
            failure_rate=failure_rate,
            latency_p50_seconds=None if p50_ms is None else p50_ms / 1000,
            latency_p99_seconds=None if p99_ms is None else p99_ms / 1000,
        )
    return MetricFigures(
        nodes=Counter(node["state"] for node in nodes),
        gpus_free=free,
        gpus_used=len(gpus) - free,
        deployments=Counter(deployment["state"] for deployment in deployments),
        standbys=len(prewarm["standbys"]),
        standby_budget=prewarm["budget"],
        offload_requests=requests,
        remote_reachable=reachable,
        load_nodes=load_nodes,
        load_deployments=load_deployments,
        services={
            s["name"]: ServiceFigures(
                replicas=Counter(r["site"] for r in s["replicas"]),
                clients=s["clients"],
                request_rate=s["request_rate"],
                latency_p99_seconds=None
                if s["latency_p99_ms"] is None
                else s["latency_p99_ms"] / 1000,
                batch_size_mean=s["batch_size_mean"],
                class_shares=s["class_shares"],
                client_figures={
                    c["client_id"]: ServiceClientFigures(c["request_rate"], c["refused_rate"])
                    for c in s["busiest_clients"]
                },
            )
            for s in services
        },
    )
