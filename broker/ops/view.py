"""What the ops HTTP server reads: the `OpsView` protocol and the JSON shapes it returns.

The broker implements `OpsView` over its registry, deployments and migration records; the ops
app serialises what it returns as JSON, unchanged, for `/api/...` and the dashboard page. Every
value is plain JSON data (str, int, float, bool, None, lists, dicts): no enums, no datetimes.
Times are Unix seconds (`float`), durations carry their unit in the key (`_s`, `_ms`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypedDict

if TYPE_CHECKING:
    from broker.ops.metrics import MetricFigures


class GpuInfo(TypedDict):
    """One GPU of a node, as placement sees it."""

    index: int
    """The GPU's index on its node (`nvidia-smi` order)."""
    uuid: str
    name: str
    memory_total_mib: int
    free: bool
    """True when no deployment holds the GPU."""
    holders: list[str]
    """Ids of the deployments that hold the GPU (several when they share it by memory)."""


class LinkInfo(TypedDict):
    """A GPU-to-GPU link of a node; each unordered pair appears once."""

    a: int
    """GPU index of one end."""
    b: int
    """GPU index of the other end."""
    kind: str
    """In `nvidia-smi topo -m` terms: "NV12", "PIX", "PXB", "PHB", "NODE", "SYS"."""


class NodeInfo(TypedDict):
    """A node the registry knows, with its GPUs and their topology."""

    node_id: str
    site: str
    state: str
    """The node's state ("ready", "lost", ...)."""
    address: str
    """The node daemon's gRPC address, host:port."""
    last_heartbeat_age_s: float | None
    """Seconds since the last heartbeat; None before the first one."""
    runtime: str
    """The container runtime the node runs replicas with ("docker", "process")."""
    gpus: list[GpuInfo]
    links: list[LinkInfo]
    topology_text: str
    """The topology as `nvidia-smi topo -m` prints it (a matrix), for operators to read."""


class OffloadDecisionInfo(TypedDict):
    """Requests of one client session that ran on one side for one reason."""

    target: str
    """"remote" (the deployment's replica) or "local" (the device's own model)."""
    reason: str
    """"policy", "faster", "measuring", "probe", "remote-down" or "fallback"."""
    requests: int


class OffloadInfo(TypedDict):
    """Where one client session's requests ran and why: its latest report, cumulative since
    the client started."""

    session: str
    """Names one start of the client."""
    policy: str
    """"remote", "local", "fastest" or "remote-then-local"."""
    local_model: str
    """The device's model file name; empty when not reported."""
    remote_requests: int
    local_requests: int
    remote_share: float | None
    """remote_requests / (remote + local), 0..1; None before any request."""
    fallbacks: int
    """Requests the replica failed and the local model then served."""
    decisions: list[OffloadDecisionInfo]
    remote_estimate_ms: float | None
    """Median of the replica's recent round trips (transfer included); None: no figure."""
    local_estimate_ms: float | None
    """Median of the local model's recent compute times; None: no figure."""
    remote_reachable: bool
    """False between a failed remote attempt and the next success, as last reported."""
    reported_at: float
    """When the broker received the report, Unix seconds."""
    reported_age_s: float
    """Seconds since then (the broker's clock)."""


class DeploymentInfo(TypedDict):
    """A client deployment and where it runs."""

    deployment_id: str
    client_id: str
    model_name: str
    state: str
    """The deployment's state ("pending", "running", "migrating", ...)."""
    node_id: str | None
    """The node serving it; None while it has none (pending)."""
    gpus: list[int]
    """GPU indices on `node_id`."""
    endpoint: str | None
    """host:port clients call for inference; None while it has none."""
    epoch: int
    """Placement epoch: +1 at every switch of the endpoint."""
    priority: str
    """The priority class."""
    site: str
    """The client's current site."""
    reason: str | None
    """Why it is in its state (pending, preempted, failed), when there is a reason."""
    explanation: str
    """One-line summary of the placement explanation (the deciding terms)."""
    offload: list[OffloadInfo]
    """Adaptive offload reports of the client's sessions, the most recent first (a few at
    most); empty when its client has no local model, or predates the reports."""


class TimelineEvent(TypedDict):
    """One step of a migration."""

    event: str
    """What happened ("triggered", "target_ready", "switched", "drained", "rolled_back" ...)."""
    at: float
    """When, in Unix seconds."""


class MigrationInfo(TypedDict):
    """A migration of one deployment, finished or under way."""

    migration_id: str
    deployment_id: str
    trigger: str
    """Why it started ("mobility", "node_lost", "drain", "rebalance", "operator")."""
    source: str | None
    """Node id it moves from; None when the source is gone before the record starts."""
    target: str | None
    """Node id it moves to; None until one is chosen."""
    strategy: str
    """Either "make-before-break" or "stop-start" (the baseline)."""
    outcome: str | None
    """One of "succeeded", "rolled_back", "failed"; None while under way."""
    reason: str
    """Why it rolled back or failed; empty otherwise."""
    downtime_ms: float | None
    """The longest gap the client observed across the switch, in milliseconds; None until
    reported."""
    span_gap_ms: float | None
    """The longest gap the client observed over the whole migration (the decision to the
    old replica stopped: the target's start included), in milliseconds; None until
    reported, or from a client that does not measure it."""
    failed_requests: int | None
    """Requests the client saw fail during the migration; None until reported."""
    timeline: list[TimelineEvent]
    """Steps in the order they happened."""
    prewarmed: bool
    """The target was a pre-warmed standby: the move started nothing."""


class StandbyInfo(TypedDict):
    """A standby replica: a deployment's next replica, started at the node chosen for the
    site its client is predicted to reach next."""

    deployment_id: str
    replica_id: str
    node_id: str
    site: str
    """The predicted site it waits for."""
    gpus: list[int]
    probability: float | None
    """How likely the prediction was; None for one a previous broker left (being stopped)."""
    state: str
    """"starting", "ready", or "retiring" (being stopped)."""
    age_s: float
    """Seconds since it was reserved."""


class PrewarmInfo(TypedDict):
    """Predictive pre-warm now."""

    budget: int
    """Standbys allowed at once (0: pre-warm is off)."""
    standbys: list[StandbyInfo]
    """Those held now, the oldest first."""


class NodeLoadInfo(TypedDict):
    """A node's load over the history window."""

    node_id: str
    site: str
    resize_policy: str
    """The node's resource manager policy ("static", "usage", "gain"); empty when its
    daemon does not say."""
    points: list[list[float]]
    """[Unix seconds, load 0..1, CPU used (cores), CPU offered (cores), memory used (MiB)],
    oldest first."""


class BatchingInfo(TypedDict):
    """How a deployment's replica batched over the node's latest sampling interval."""

    batch_size_mean: float
    """Rows per batch run."""
    queue_delay_p99_ms: float | None
    """The requests' wait for their batch, p99 (a histogram bucket's upper bound)."""
    class_shares: dict[str, float]
    """Priority class ("critical", "standard", "best-effort") -> its share 0..1 of the
    batches' compute time; only classes that computed."""


class DeploymentLoadInfo(TypedDict):
    """A deployment's requests and CPU over the history window (its serving replica's)."""

    deployment_id: str
    node_id: str
    """Where it served at the latest point."""
    priority: str
    latency_slo_ms: float
    """0: none."""
    points: list[list[float | None]]
    """[Unix seconds, requests/s, latency p50 ms, latency p99 ms, CPU used (cores), CPU limit
    (cores, 0: unlimited), failed requests/s], oldest first; a figure the node could not
    read is null."""
    batching: BatchingInfo | None
    """At the latest point; None when the replica ran no batch in it (its model does not
    batch, it idled, or its node or runtime predates batching figures)."""


class ResizeInfo(TypedDict):
    """A CPU change a node's resource manager made, and why."""

    event_id: str
    at: float
    node_id: str
    deployment_id: str
    replica_id: str
    cpus_before: float
    cpus_after: float
    policy: str
    reason: str


class LoadInfo(TypedDict):
    """Live load: what nodes reported in their heartbeats over the last `window_s`."""

    window_s: float
    nodes: list[NodeLoadInfo]
    deployments: list[DeploymentLoadInfo]
    """Deployments not deleted that reported in the window."""
    resizes: list[ResizeInfo]
    """The most recent resizes, oldest first."""


class ServiceReplicaInfo(TypedDict):
    """A replica of a service, with its latest figures (its node's last sampling interval)."""

    deployment_id: str
    site: str
    """The site it was started for."""
    node_id: str | None
    """The node serving it; None while it has none."""
    state: str
    """Its deployment's state ("running", "pending", ...), or "deleted" when it is gone."""
    clients: int
    """Clients the broker put on it."""
    request_rate: float | None
    """Requests/s it answered; None when its node could not read its figures (or before)."""
    latency_p99_ms: float | None
    """None also when no request finished in the interval."""
    queued: int | None
    """Requests waiting for a batch or a worker now."""
    batch_size_mean: float | None
    """Rows per batch; None when it ran no batch in the interval."""
    class_shares: dict[str, float]
    """Priority class -> its share 0..1 of the batches' compute; only classes that computed."""


class ServiceClientInfo(TypedDict):
    """One client's calls on a service over the replicas' latest intervals."""

    client_id: str
    deployment_id: str
    """The replica it called most."""
    request_rate: float
    """Calls answered per second, refusals included, summed over its replicas."""
    refused_rate: float
    """Calls refused RESOURCE_EXHAUSTED per second (its rate limit, its share of the queue)."""
    latency_p99_ms: float | None
    """The worst of its replicas' p99 for it; None when none of its calls finished."""


class ScaleDecisionInfo(TypedDict):
    """A replica of a service started or stopped, and why (`service_events`)."""

    at: float
    """Unix seconds."""
    action: str
    """"start" or "stop"."""
    deployment_id: str
    site: str
    reason: str


class ServiceInfo(TypedDict):
    """A service (one model for many clients), its replicas and its busiest clients."""

    name: str
    owner: str
    """The client id that created it."""
    model_name: str
    clients: int
    """Clients attached to it."""
    replicas: list[ServiceReplicaInfo]
    """Oldest first."""
    request_rate: float | None
    """Requests/s its replicas answered, summed; None when none reported figures."""
    latency_p99_ms: float | None
    """The worst replica's p99."""
    batch_size_mean: float | None
    """Rows per batch, the replicas' means weighted by their request rates."""
    class_shares: dict[str, float]
    """Priority class -> its share 0..1 of the batches' compute, weighted the same way."""
    busiest_clients: list[ServiceClientInfo]
    """At most `SERVICE_CLIENTS_SHOWN`, the busiest first (by requests/s, then refused/s)."""
    scale_decisions: list[ScaleDecisionInfo]
    """Its `SCALE_DECISIONS_SHOWN` most recent, oldest first."""


SERVICE_CLIENTS_SHOWN = 10
"""Clients of a service the view lists (a service may have thousands)."""
SCALE_DECISIONS_SHOWN = 5
"""Scale decisions of a service the view lists (the most recent)."""


class OpsView(Protocol):
    """The broker's read-only view for operators; each call returns a fresh snapshot.

    Calls must not block the event loop (read in-memory state, or go through a thread). An
    exception from a call becomes a 500 response naming it; it is logged by the ops app.
    """

    async def nodes(self) -> list[NodeInfo]:
        """Every node the registry knows, lost ones included, in a stable order."""
        ...

    async def deployments(self) -> list[DeploymentInfo]:
        """Every deployment not deleted, in a stable order."""
        ...

    async def migrations(self) -> list[MigrationInfo]:
        """Recent migrations, newest first; how many is the broker's choice."""
        ...

    async def prewarm(self) -> PrewarmInfo:
        """The pre-warm budget and the standbys held now."""
        ...

    async def load(self) -> LoadInfo:
        """Live load over the history window, and the recent resizes."""
        ...

    async def services(self) -> list[ServiceInfo]:
        """Every service by name, with its replicas' latest figures and its busiest
        clients."""
        ...

    async def figures(self) -> MetricFigures:
        """What `/metrics` shows of the state now: the same counts and latest figures the
        views above give, counted without building them (a scrape must stay cheap however
        large the cluster)."""
        ...
