"""Live load: what nodes report in their heartbeats, and a short history of it.

A node samples its replicas every heartbeat interval (`node_daemon.telemetry`): CPU used over
the interval, the CPU quota and how often it throttled, memory, and the request figures the
replica's runtime exports. `NodeSample` is one heartbeat's worth; `LoadHistory` keeps the
last `window_s` of them per node and per deployment, for placement's load term (the latest
sample), the rebalancing policy (sustained load, request-rate trends), `/metrics`, `/api/load`
and the dashboard's charts.

A node's load, the 0..1 figure placement weighs, is the larger of its replicas' CPU share of
the cores it offers and its GPUs' mean utilization (NVML nodes; a topology-file node reports
none). A node older than the telemetry fields reports GPU utilization only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

WINDOW_S = 300.0
"""How much history is kept (the dashboard's time axis)."""


@dataclass(frozen=True, slots=True)
class ClientFigures:
    """One client's calls at a replica for many (a service's), over the node's interval."""

    client_id: str
    rate_per_s: float
    """Calls answered per second, refusals included."""
    refused_per_s: float
    """Calls refused RESOURCE_EXHAUSTED per second (its rate limit, its share of the queue)."""
    latency_p99_ms: float | None
    """None when none of its calls finished in the interval."""


@dataclass(frozen=True, slots=True)
class RequestFigures:
    """A replica's requests over the node's last sampling interval (its runtime's metrics)."""

    rate_per_s: float
    failure_rate_per_s: float
    latency_p50_ms: float | None
    """None when no request finished in the interval."""
    latency_p99_ms: float | None
    in_flight: int
    queued: int
    batch_size_mean: float | None = None
    """Rows per batch run; None when no batch ran in the interval (the model does not batch,
    the replica idled, or its node or runtime predates batching)."""
    queue_delay_p99_ms: float | None = None
    """The requests' wait for their batch, p99; None as `batch_size_mean`."""
    class_shares: tuple[tuple[str, float], ...] = ()
    """(priority class, its share 0..1 of the batches' compute time) for each class that
    computed in the interval."""
    clients: tuple[ClientFigures, ...] = ()
    """The busiest of a replica for many's clients (a node sends at most 64), the busiest
    first; none for a private deployment's replica, or from an older node."""
    clients_total: int = 0
    """The clients the replica had figures for, `clients` being the busiest of them."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica_id: str
    cpu_used_cores: float
    cpu_limit_cores: float
    """Its CPU quota now; 0 when unlimited."""
    throttled_ratio: float
    """Share of the interval's CPU periods its quota throttled it, 0..1."""
    memory_used_mib: int
    requests: RequestFigures | None
    """None when the node could not read the runtime's metrics."""


@dataclass(frozen=True, slots=True)
class Resize:
    """A CPU change a node's resource manager made to a replica, as the node reported it."""

    event_id: str
    replica_id: str
    deployment_id: str
    cpus_before: float
    cpus_after: float
    policy: str
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class NodeSample:
    """One heartbeat's telemetry."""

    cpu_cores: float = 0.0
    """Cores the node offers to replicas; 0 from a node that does not say."""
    cpu_used_cores: float = 0.0
    memory_total_mib: int = 0
    memory_used_mib: int = 0
    gpu_utilization_pct: tuple[int, ...] = ()
    replicas: tuple[ReplicaLoad, ...] = ()
    resizes: tuple[Resize, ...] = ()
    resize_policy: str = ""

    @property
    def load(self) -> float:
        """0..1: the larger of the CPU share and the mean GPU utilization."""
        cpu = self.cpu_used_cores / self.cpu_cores if self.cpu_cores > 0 else 0.0
        gpu = (
            sum(self.gpu_utilization_pct) / (100 * len(self.gpu_utilization_pct))
            if self.gpu_utilization_pct
            else 0.0
        )
        value = max(cpu, gpu)
        return 0.0 if math.isnan(value) else min(1.0, max(0.0, value))


@dataclass(frozen=True, slots=True)
class NodePoint:
    at: float
    """Unix seconds (the broker's clock, when the heartbeat arrived)."""
    load: float
    cpu_used_cores: float
    cpu_cores: float
    memory_used_mib: int


@dataclass(frozen=True, slots=True)
class DeploymentPoint:
    at: float
    node_id: str
    replica: ReplicaLoad


@dataclass(slots=True)
class _Series:
    node_id: str = ""
    points: deque[DeploymentPoint] = field(default_factory=deque)


class LoadHistory:
    """The last `window_s` of samples, per node and per deployment. Owned by the broker and
    written only from its event loop (heartbeats); readers get copies."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._nodes: dict[str, deque[NodePoint]] = {}
        self._latest: dict[str, tuple[float, NodeSample]] = {}
        self._attributed: dict[str, float] = {}
        """node id -> when its sample last added to the deployments' history."""
        self._deployments: dict[str, _Series] = {}

    def record(self, node_id: str, sample: NodeSample, at: float) -> None:
        """Add a node's sample, received at `at`: its load at once (placement reads it)."""
        points = self._nodes.setdefault(node_id, deque())
        points.append(
            NodePoint(
                at, sample.load, sample.cpu_used_cores, sample.cpu_cores, sample.memory_used_mib
            )
        )
        self._trim(points, at)
        self._latest[node_id] = (at, sample)

    def attribute(self, node_id: str, serving: Mapping[str, str]) -> None:
        """Add the node's latest sample to the history of the deployments it serves:
        `serving` maps the replica ids that serve a deployment there to the deployment (the
        broker learns that from its records after the heartbeat; a standby or a move's
        target is not serving and is left out). A sample is attributed once."""
        latest = self._latest.get(node_id)
        if latest is None or self._attributed.get(node_id) == latest[0]:
            return
        at, sample = latest
        self._attributed[node_id] = at
        for replica in sample.replicas:
            deployment_id = serving.get(replica.replica_id)
            if deployment_id is None:
                continue
            series = self._deployments.setdefault(deployment_id, _Series())
            series.node_id = node_id  # where it serves now (it may have moved)
            series.points.append(DeploymentPoint(at, node_id, replica))
            self._trim(series.points, at)

    def _trim(self, points: deque[NodePoint] | deque[DeploymentPoint], now: float) -> None:
        while points and points[0].at < now - self.window_s:
            points.popleft()

    def forget_node(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)
        self._latest.pop(node_id, None)
        self._attributed.pop(node_id, None)

    def forget_deployment(self, deployment_id: str) -> None:
        self._deployments.pop(deployment_id, None)

    def latest(self, node_id: str) -> NodeSample | None:
        latest = self._latest.get(node_id)
        return latest[1] if latest else None

    def latest_point(self, node_id: str) -> NodePoint | None:
        points = self._nodes.get(node_id)
        return points[-1] if points else None

    def node_points(self, node_id: str) -> list[NodePoint]:
        return list(self._nodes.get(node_id, ()))

    def deployment_points(self, deployment_id: str) -> list[DeploymentPoint]:
        series = self._deployments.get(deployment_id)
        return list(series.points) if series else []

    def latest_replica(self, deployment_id: str) -> DeploymentPoint | None:
        series = self._deployments.get(deployment_id)
        return series.points[-1] if series and series.points else None

    def node_ids(self) -> Iterator[str]:
        return iter(sorted(self._nodes))

    def deployment_ids(self) -> Iterator[str]:
        return iter(sorted(self._deployments))
