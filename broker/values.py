"""The broker's domain values: what a client asks for (`DeploySpec`, parsed once per stored
request: `spec_of`), what a decision holds (`Hold`, `Move`, `Standby`), what a client is told
(`PlacementUpdate`), and the broker's settings. Plain, frozen data: the owners
(`broker.deployments`, `broker.moves`, `broker.standbys`, ...) change the state they
describe."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol, TypedDict, TypeGuard

from broker.errors import InvalidRequest, quote
from broker.ids import replica_id
from broker.node_link import ReplicaResources
from broker.placement import (
    ClusterSnapshot,
    Decision,
    PlacementRequest,
    PriorityClass,
)
from broker.quotas import DEFAULT_MAX_STAGED_BYTES, Quotas
from broker.state import (
    DeploymentRecord,
    DeploymentState,
    MigrationState,
    StandbyRecord,
)

MAX_GPUS = 64
"""The most GPUs a node may have, and a deployment ask for."""

VISIBLE = (
    DeploymentState.PENDING,
    DeploymentState.STARTING,
    DeploymentState.RUNNING,
    DeploymentState.FAILED,
)


_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    heartbeat_interval_s: float = 1.0
    lost_after_s: float = 5.0
    """A node silent this long is marked lost."""
    node_lease_s: float | None = None
    """With nodes on a port of their own that pings them (`--node-listen`): the lease of a
    node whose heartbeat stream is open (`--node-lease`); None without that port."""
    orphan_grace_s: float = 30.0
    """A replica a node runs that no deployment claims is stopped after this long."""
    service_idle_s: float = 60.0
    """A service's replica with no client on it is stopped after this long, beyond the
    service's `min_replicas_per_site` (`--service-idle-grace`)."""
    service_queue_target_ms: float = 50.0
    """A service's replica whose requests wait longer than this for their batch (queue
    delay p99) for `broker.services.SCALE_SUSTAIN_S` gets another replica at its site for
    half its clients (`--service-queue-target-ms`; 0: never on load)."""
    pending_retry_s: float = 2.0
    """How often pending deployments are tried again."""
    stop_grace_ms: int = 5000
    quotas: Quotas = field(default_factory=Quotas)
    """Per-client limits (`broker.quotas`)."""
    max_staged_upload_bytes: int = DEFAULT_MAX_STAGED_BYTES
    """Bytes of uploads staged at once, all clients together (`--max-staged-upload-bytes`)."""


@dataclass(frozen=True, slots=True)
class DeploySpec:
    """What a client asks for (the domain side of DeployRequest)."""

    model_sha256: str
    model_name: str
    site: str
    gpus: int = 0
    gpu_memory_mib: int = 0
    p2p_required: bool = False
    cpus: float = 0.0
    memory_mib: int = 0
    priority: PriorityClass = PriorityClass.STANDARD
    latency_slo_ms: float = 0.0
    """0: none."""
    cpus_min: float = 0.0
    cpus_max: float = 0.0
    """The CPU floor and ceiling a node's resource manager keeps the replica within (0: half
    of `cpus`, and the node's cores; node.proto `ReplicaSpec`)."""
    service: str = ""
    """The service this deployment is a replica of (`broker.services`); "" for a client's
    own. A service's replica stays at its site: it does not follow its owner's moves."""

    def validate(self) -> None:
        if not _MODEL_NAME.fullmatch(self.model_name):
            raise InvalidRequest(
                f"model_name {quote(self.model_name)} must be 1-64 characters of letters, "
                "digits, '_', '.' and '-'"
            )
        if not 0 <= self.gpus <= MAX_GPUS:
            raise InvalidRequest(f"gpus must be within 0..{MAX_GPUS}, not {self.gpus}")
        if self.gpu_memory_mib < 0 or self.cpus < 0 or self.memory_mib < 0:
            raise InvalidRequest("gpu_memory_mib, cpus and memory_mib must not be negative")
        if self.gpu_memory_mib and not self.gpus:
            raise InvalidRequest("a GPU memory share (gpu_memory_mib) needs gpus >= 1")
        if self.latency_slo_ms < 0:
            raise InvalidRequest("latency_slo_ms must not be negative")
        if self.cpus_min < 0 or self.cpus_max < 0:
            raise InvalidRequest("cpus_min and cpus_max must not be negative")
        if (self.cpus_min or self.cpus_max) and not self.cpus:
            raise InvalidRequest("a CPU floor or ceiling (cpus_min, cpus_max) needs cpus > 0")
        if self.cpus_max and not self.cpus_min <= self.cpus <= self.cpus_max:
            raise InvalidRequest(
                f"need cpus_min <= cpus <= cpus_max, not {self.cpus_min:g} <= {self.cpus:g} "
                f"<= {self.cpus_max:g}"
            )
        if self.cpus_min > self.cpus:
            raise InvalidRequest(f"cpus_min {self.cpus_min:g} must not exceed cpus {self.cpus:g}")

    def resources(self, priority: PriorityClass | None = None) -> ReplicaResources:
        """What a replica of this deployment is started with; `priority` overrides the
        deployment's (a standby runs at `STANDBY`)."""
        return ReplicaResources(
            gpu_memory_mib=self.gpu_memory_mib,
            cpus=self.cpus,
            memory_mib=self.memory_mib,
            priority=int(self.priority if priority is None else priority),
            cpus_min=self.cpus_min,
            cpus_max=self.cpus_max,
        )

    def placement_request(self, placement_id: str, site: str) -> PlacementRequest:
        """What placement is asked for a replica of this deployment for a client at `site`
        (`placement_id` names it in the snapshot and the explanation)."""
        return PlacementRequest(
            deployment_id=placement_id,
            site=site,
            gpus=self.gpus,
            gpu_memory_mib=self.gpu_memory_mib,
            p2p_required=self.p2p_required,
            priority=self.priority,
            latency_slo_ms=self.latency_slo_ms or None,
        )

    def to_json(self) -> str:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["priority"] = int(self.priority)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DeploySpec:
        """Also reads a spec stored before a field was added (it takes the default)."""
        data = json.loads(text)
        data["priority"] = PriorityClass(data["priority"])
        return cls(**data)


SERVICE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
"""What a service's name may be (it names the service in URLs, metrics and logs)."""
DEFAULT_MAX_REPLICAS = 16
MAX_REPLICAS = 1024
MAX_SERVICE_CLIENTS = 10_000
"""Clients a service may list (a replica's clients file takes at most as many)."""


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """A model published once for many clients (the domain side of broker.proto's
    ServiceSpec): what each replica runs with, who may use it, and how replicas follow
    demand."""

    model_sha256: str
    model_name: str
    gpus: int = 0
    gpu_memory_mib: int = 0
    cpus: float = 0.0
    memory_mib: int = 0
    clients: tuple[str, ...] = ()
    """Client ids that may use it besides its owner (ignored with `any_client`)."""
    any_client: bool = False
    min_replicas_per_site: int = 0
    max_replicas: int = DEFAULT_MAX_REPLICAS
    latency_slo_ms: float = 0.0
    """A client is put on a replica at most this far from its site, else one is started at
    its site; 0: any replica in reach."""
    max_rps_per_client: float = 0.0
    """Each client's inference calls per second at a replica; 0: no limit."""

    def validate(self, sites: Collection[str]) -> None:
        """InvalidRequest naming the first bad field; `sites`: the cluster's."""
        self.deploy_spec("").validate()
        if not 0 <= self.min_replicas_per_site <= MAX_REPLICAS:
            raise InvalidRequest(
                f"min_replicas_per_site must be within 0..{MAX_REPLICAS}, not "
                f"{self.min_replicas_per_site}"
            )
        if not 1 <= self.max_replicas <= MAX_REPLICAS:
            raise InvalidRequest(
                f"max_replicas must be within 1..{MAX_REPLICAS}, not {self.max_replicas}"
            )
        if self.min_replicas_per_site * len(sites) > self.max_replicas:
            raise InvalidRequest(
                f"min_replicas_per_site {self.min_replicas_per_site} at each of the "
                f"{len(sites)} sites needs max_replicas of at least "
                f"{self.min_replicas_per_site * len(sites)}, not {self.max_replicas}"
            )
        for name, value in (
            ("latency_slo_ms", self.latency_slo_ms),
            ("max_rps_per_client", self.max_rps_per_client),
        ):
            if not math.isfinite(value) or not 0 <= value <= 1e6:
                raise InvalidRequest(f"{name} must be within 0..1e6, not {value!r}")
        if len(self.clients) > MAX_SERVICE_CLIENTS:
            raise InvalidRequest(
                f"clients lists {len(self.clients)}; at most {MAX_SERVICE_CLIENTS}"
            )
        if self.any_client and self.clients:
            raise InvalidRequest("give clients or any_client, not both")

    def deploy_spec(self, site: str, service: str = "") -> DeploySpec:
        """What a replica of `service` at `site` is deployed with."""
        return DeploySpec(
            model_sha256=self.model_sha256,
            model_name=self.model_name,
            site=site,
            gpus=self.gpus,
            gpu_memory_mib=self.gpu_memory_mib,
            cpus=self.cpus,
            memory_mib=self.memory_mib,
            service=service,
        )

    def allows(self, client_id: str) -> bool:
        """Whether `client_id` may use it (its owner always may: checked by the caller)."""
        return self.any_client or client_id in self.clients

    def to_json(self) -> str:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["clients"] = list(self.clients)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServiceSpec:
        data = json.loads(text)
        data["clients"] = tuple(data["clients"])
        return cls(**data)


@functools.lru_cache(maxsize=65536)
def _parsed(request_json: str) -> DeploySpec:
    return DeploySpec.from_json(request_json)


def spec_of(record: DeploymentRecord) -> DeploySpec:
    """The deploy request of a stored deployment, typed. Parsed once per request: a stored
    request never changes and `DeploySpec` is frozen, so every reader shares the value
    parsed first (cached by the stored JSON)."""
    return _parsed(record.request_json)


@dataclass(frozen=True, slots=True)
class PlacementUpdate:
    deployment_id: str
    endpoint: str
    token: str
    epoch: int
    reason: str
    state: DeploymentState
    migration_id: str = ""
    prepared_ms: float | None = None
    """On a migration's switch: from the broker's decision to this update, in ms (the
    client's span window reaches back that far)."""
    node_id: str = ""
    """The node of `endpoint`, where the update carries it (a service's clients)."""


@dataclass(frozen=True, slots=True)
class Hold:
    """GPUs held outside a deployment's record: a migration's target before the switch,
    its source after it until the old replica stops."""

    node_id: str
    gpus: tuple[int, ...]
    memory_mib: int
    priority: PriorityClass


@dataclass(frozen=True, slots=True)
class Move:
    """A migration's reservation (`Moves.reserve_move`): the target's GPUs held and the
    deployment taken by it until `Moves.release_move`."""

    deployment_id: str
    source_node: str
    source_gpus: tuple[int, ...]
    source_epoch: int
    target_node: str
    target_gpus: tuple[int, ...]
    explanation_json: str
    """The target's placement explanation, which becomes the deployment's at the switch."""
    why: str = ""
    """What moved it (the move policy's reason)."""
    standby: Standby | None = None
    """The pre-warmed standby the move switches to (its target replica, started already);
    None for a cold start."""
    evicting: tuple[asyncio.Task[None], ...] = ()
    """The stops of other deployments' standbys on the target's GPUs (placement does not
    see them): the target starts once they are done."""

    @property
    def prewarmed(self) -> bool:
        return self.standby is not None

    @property
    def epoch(self) -> int:
        """The epoch the deployment has on the target."""
        return self.source_epoch + 1

    @property
    def source_replica(self) -> str:
        return replica_id(self.deployment_id, self.source_epoch)


@dataclass(eq=False, slots=True)
class Standby:
    """A replica of a deployment started ahead of a move, at the node placement chose for
    its client's predicted next site, for the epoch it would serve at (`broker.prewarm`).
    Only other standbys' placement sees it (at standby priority); a real placement takes its
    GPUs as if they were free, and the standby is stopped first."""

    record: StandbyRecord
    probability: float
    """How likely the prediction was when it was started."""
    memory_mib: int
    created: float
    """time.monotonic() of its reservation."""
    task: asyncio.Task[str] | None = None
    """Its start: the endpoint once ready (NodeUnavailable or ResourceExhausted when the node
    cannot); None until started."""

    @property
    def deployment_id(self) -> str:
        return self.record.deployment_id

    @property
    def node_id(self) -> str:
        return self.record.node_id

    @property
    def site(self) -> str:
        return self.record.site

    @property
    def replica(self) -> str:
        return replica_id(self.record.deployment_id, self.record.epoch)

    @property
    def allocation_id(self) -> str:
        return standby_allocation(self.record.deployment_id, self.record.epoch)

    @property
    def ready(self) -> bool:
        task = self.task
        return task is not None and task.done() and not task.cancelled() and not task.exception()


def standby_allocation(deployment_id: str, epoch: int) -> str:
    """The id a standby's hold has in a standby placement's snapshot."""
    return f"{deployment_id}@{epoch}~standby"


MoveChoice = Callable[[DeploymentRecord, ClusterSnapshot], "tuple[Decision, str] | None"]
"""Given a running deployment and the cluster as it is now, the target (a placement
decision that names a node) and why it moves there; None to leave it where it is. Pure: it
runs under the placement lock."""


StandbyChoice = Callable[[DeploymentRecord, ClusterSnapshot], "Decision | None"]
"""Given a running deployment and the cluster as it is now, where its standby goes (a
placement decision of standby priority), or None for no standby. Pure: it runs under the
placement lock."""


def allocation_terms(record: DeploymentRecord) -> tuple[PriorityClass, int]:
    """(priority, GPU memory share in MiB) of a stored deployment: placement's view of
    a node reads them for each deployment on it, each time the node changes."""
    spec = spec_of(record)
    return spec.priority, spec.gpu_memory_mib


def explanation_json(decision: Decision, why: str = "") -> str:
    """A placement decision's explanation as stored with the deployment: its fields, its
    rendered text, and `why` (what moved it there, for a migration) above that text."""
    text = decision.explanation.render()
    return json.dumps(
        {
            **decision.explanation.to_dict(),
            "why": why,
            "text": f"why: {why}\n{text}" if why else text,
        }
    )


def placement_update(
    record: DeploymentRecord,
    reason: str,
    migration_id: str = "",
    prepared_ms: float | None = None,
) -> PlacementUpdate:
    return PlacementUpdate(
        record.deployment_id,
        record.endpoint,
        record.token,
        record.epoch,
        reason,
        record.state,
        migration_id,
        prepared_ms,
    )


def runs(record: DeploymentRecord | None) -> TypeGuard[DeploymentRecord]:
    """Whether `record` is a deployment running on a node (what a move or a standby needs)."""
    return (
        record is not None
        and record.state is DeploymentState.RUNNING
        and record.node_id is not None
    )


class DeploymentChanges(TypedDict, total=False):
    """What a decision may change in a stored deployment (`Deployments.update`); the
    store stamps `updated_at`."""

    state: DeploymentState
    node_id: str | None
    gpus: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    endpoint: str
    epoch: int
    explanation_json: str
    reason: str
    site: str


class MigrationChanges(TypedDict, total=False):
    """What a migration's steps may change in its record (`Moves.update_migration`)."""

    state: MigrationState
    timeline_json: str
    outcome: str
    reason: str
    downtime_ms: float | None
    failed_requests: int | None
    span_gap_ms: float | None
    prewarmed: bool
    target_node: str


class DeploymentReader(Protocol):
    """The deployments as stored, read-only (`DeploymentTable`'s reads): what every owner
    but `broker.deployments`, which writes them, is handed."""

    def get(self, deployment_id: str) -> DeploymentRecord | None: ...

    def select(
        self, client_id: str | None = None, states: Collection[DeploymentState] | None = None
    ) -> list[DeploymentRecord]: ...

    def count(self, client_id: str, states: Collection[DeploymentState]) -> int: ...

    def on_node(self, node_id: str) -> list[DeploymentRecord]: ...
