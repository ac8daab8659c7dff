"""The broker's durable records: what `StateStore` keeps and returns.

Plain frozen values, no I/O. Times are float seconds since the epoch (`time.time()`).
Fields named `*_json` hold JSON text that the store checks is valid JSON and otherwise keeps
as given: their shape belongs to the code that writes them (the registry, placement, the
migration orchestrator), not to the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# One strategy type end to end: the mechanism's, stored by its value.
from migration.mechanism import Strategy as MigrationStrategy

# One priority class type end to end: the runtime's, which batches by it.
from runtime.batching import PriorityClass


class NodeState(StrEnum):
    READY = "ready"
    """Registered and heartbeating: placement may use it."""
    LOST = "lost"
    """Missed heartbeats past the timeout; its deployments are to be re-placed."""
    DRAINING = "draining"
    """An operator is taking it out: nothing new lands on it."""


class DeploymentState(StrEnum):
    PENDING = "pending"
    """Waiting for a node that fits (`reason` says why none does yet)."""
    STARTING = "starting"
    """Placed: the node is starting its replica."""
    RUNNING = "running"
    """The replica is ready; `endpoint`, `token` and `epoch` are what clients use."""
    FAILED = "failed"
    """Gave up (`reason` says why)."""
    DELETING = "deleting"
    """The client asked to delete it; its replica is being stopped."""
    DELETED = "deleted"
    """Gone; the row stays for the audit trail and the migration history."""


class MigrationTrigger(StrEnum):
    MOBILITY = "mobility"
    NODE_LOST = "node_lost"
    DRAIN = "drain"
    REBALANCE = "rebalance"
    OPERATOR = "operator"


class MigrationState(StrEnum):
    PREPARING = "preparing"
    SWITCHING = "switching"
    DRAINING = "draining"
    COMPLETED = "completed"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ClientRecord:
    client_id: str
    created_at: float


@dataclass(frozen=True, slots=True)
class KeyChanges:
    """What `StateStore.replace_client_keys` changed, by client id (never the keys)."""

    added: tuple[str, ...]
    """Clients that had no key and now have one."""
    replaced: tuple[str, ...]
    """Clients whose key is a new one (the old one stopped working)."""
    revoked: tuple[str, ...]
    """Clients that had a key and now have none."""

    def __bool__(self) -> bool:
        return bool(self.added or self.replaced or self.revoked)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    node_id: str
    address: str
    """host:port of the node's NodeAgent service."""
    site: str
    """The edge site the node sits at (a vertex of the broker's network graph)."""
    state: NodeState
    inventory_json: str
    """GPUs, links and versions as the node registered them."""
    runtimes: tuple[str, ...]
    registered_at: float
    last_heartbeat_at: float
    usage_json: str
    """The usage the last heartbeat reported."""


@dataclass(frozen=True, slots=True)
class ModelRecord:
    sha256: str
    name: str
    """The name the uploader gave; informational, not unique."""
    size_bytes: int
    created_at: float


@dataclass(frozen=True, slots=True)
class DeploymentRecord:
    deployment_id: str
    client_id: str
    """The client that owns it; no other client may see it."""
    model_sha256: str
    model_name: str
    request_json: str
    """The full deploy request, so the deployment can be placed again after a restart."""
    priority: int
    """Higher is more important; only a higher priority may preempt a lower one."""
    site: str
    """The client's site when it deployed."""
    state: DeploymentState
    node_id: str | None
    """The node it is placed on; None while it has none."""
    gpus: tuple[int, ...]
    """GPU indices on `node_id`; empty for a CPU-only replica or while unplaced."""
    gpu_uuids: tuple[str, ...]
    endpoint: str
    """host:port clients call for inference; "" until the replica is ready."""
    token: str
    """The per-deployment token the replica checks; "" until the replica is ready."""
    epoch: int
    """Bumped on every switch to a new replica; clients drop replies of older epochs."""
    explanation_json: str
    """The placement decision and its score terms (`offload explain`)."""
    reason: str
    """Why it is pending or failed; "" otherwise."""
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class MigrationRecord:
    migration_id: str
    deployment_id: str
    trigger: MigrationTrigger
    source_node: str
    target_node: str
    strategy: MigrationStrategy
    state: MigrationState
    timeline_json: str
    """The timed steps (prepare, ready, switch, drained, stopped ...) as they happened."""
    outcome: str
    """A one-line summary once it finished; "" before."""
    reason: str
    """Why it was started and, when it failed or rolled back, why ("<cause>; <error>")."""
    downtime_ms: float | None
    """The longest gap clients saw across the switch; None until measured."""
    failed_requests: int | None
    """Requests that failed during the move; None until known."""
    created_at: float
    updated_at: float
    span_gap_ms: float | None = None
    """The longest gap clients saw over the whole migration, from the decision to the old
    replica stopped (at least `downtime_ms`); None until measured, or from a client that
    does not measure it. Schema version 3."""
    prewarmed: bool = False
    """The target was a pre-warmed standby replica: the move started nothing. Schema
    version 5."""


@dataclass(frozen=True, slots=True)
class StandbyRecord:
    """A standby replica of a deployment at its client's predicted next site, for the epoch
    it would serve at (`broker.prewarm`); recorded before it is started."""

    deployment_id: str
    epoch: int
    node_id: str
    site: str
    """The predicted site it was placed for."""
    gpus: tuple[int, ...]
    created_at: float


@dataclass(frozen=True, slots=True)
class EventRecord:
    seq: int
    """Increases with every event appended; never reused."""
    at: float
    kind: str
    """What happened, e.g. "deployment.placed" or "node.lost"."""
    subject: str
    """The id of what it happened to."""
    detail_json: str


@dataclass(frozen=True, slots=True)
class Lease:
    """A leader lease as its holder got it: valid until `expires_at` unless renewed."""

    name: str
    holder: str
    """Who holds it (a broker's id of its own choosing)."""
    term: int
    """Increases with every change of holder (and every take after an expiry or a release):
    the fencing token a write checks with `StateStore.check_lease`."""
    expires_at: float
    """By the database's clock, seconds since the epoch."""


@dataclass(frozen=True, slots=True)
class OffloadCount:
    """Requests one client sent to one side for one reason."""

    target: str
    """Where they ran: "remote" (the replica) or "local" (the device's own model)."""
    reason: str
    """Why (`common.offload.REASONS`)."""
    requests: int


@dataclass(frozen=True, slots=True)
class OffloadSummary:
    """Where one client session's requests ran and why, cumulative since the client started
    (as `ObservationReport.offload` carries it, checked)."""

    session: str
    """Names one start of the client; a newer summary of the session supersedes the older."""
    policy: str
    """`common.offload.POLICIES`."""
    local_model: str
    """The local model's file name; "" when the client did not say."""
    decisions: tuple[OffloadCount, ...]
    """At most one entry per (target, reason)."""
    remote_requests: int
    local_requests: int
    fallbacks: int
    """Requests the replica failed and the local model then served."""
    remote_estimate_ms: float | None
    """Median of the replica's recent round trips, transfer included; None: no figure yet."""
    local_estimate_ms: float | None
    """Median of the local model's recent compute times; None: no figure yet."""
    remote_reachable: bool
    """False between a failed remote attempt and the next success."""


@dataclass(frozen=True, slots=True)
class OffloadReportRecord:
    """The latest summary of one session of a client's deployment. Schema version 4."""

    deployment_id: str
    client_id: str
    summary: OffloadSummary
    reported_at: float
    """When the broker received it."""


@dataclass(frozen=True, slots=True)
class ResizeRecord:
    """A CPU change a node's resource manager made to a deployment's replica. Schema
    version 6."""

    node_id: str
    event_id: str
    """Unique on its node (across the node daemon's restarts)."""
    deployment_id: str
    replica_id: str
    cpus_before: float
    cpus_after: float
    policy: str
    """"usage" or "gain" (the node's `--resize-policy`)."""
    reason: str
    at: float
    """Unix seconds, the node's clock."""


@dataclass(frozen=True, slots=True)
class ServiceRecord:
    """A model published once for many clients (`offload service create`). Schema version 9."""

    name: str
    """Unique; chosen by its owner."""
    owner: str
    """The client id that created it."""
    model_sha256: str
    spec_json: str
    """The service's spec (resources, allow-list, replicas per site, SLO, rate limit), a JSON
    object as the broker wrote it."""
    created_at: float


@dataclass(frozen=True, slots=True)
class ServiceReplicaRecord:
    """A deployment that serves a service at a site; recorded before it is started, so a
    broker that restarts finds every replica it may have left. Schema version 9."""

    deployment_id: str
    """The replica's deployment (not checked against `deployments`: its own delete path may
    remove it first)."""
    service: str
    site: str
    """The site it was started for."""
    created_at: float


class ScaleAction(StrEnum):
    """What a service's scale decision did."""

    START = "start"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class ServiceEventRecord:
    """A scale decision of a service: a replica started or stopped, and why, as the broker
    explains it (`offload service show`, the dashboard). Schema version 10."""

    service: str
    at: float
    action: ScaleAction
    deployment_id: str
    """The replica started or stopped."""
    site: str
    reason: str


@dataclass(frozen=True, slots=True)
class ServiceClientRecord:
    """A client attached to a service: the replica it is on and the token it uses there. A
    re-attach (a move, a new token) replaces the record. Schema version 9."""

    service: str
    client_id: str
    token_sha256: str
    """The sha256 (64 lowercase hex digits) of the client's own token at the replica; the
    token itself is never stored."""
    priority_class: PriorityClass
    """The class of the client's requests at the replica."""
    deployment_id: str
    """The replica it is on (`ServiceReplicaRecord.deployment_id`)."""
    site: str
    """The client's site when it attached."""
    attached_at: float
