"""The broker's domain: nodes, models and deployments, and how they change.

Plain Python over the state store (SQLite or PostgreSQL), the model store, the edge network,
placement (pure functions) and one `NodeClient` per node; the gRPC servicers in `broker.rpc`
are thin layers over it. Blocking store calls run in one worker thread (`_db`), in order.

Reads of deployments and of the cluster come from memory: the deployments as stored
(`DeploymentTable`, changed after every write the store commits) and placement's view of
the cluster (`ClusterSnapshot`), brought up to date node by node when a decision reads it
(the nodes a change touched are marked stale: `_stale`). A deploy, a heartbeat or a
reconciliation reads no row of the store.

Durability: every change is written to the store before it is acted on or answered, so a
broker killed at any point restarts into a state it can reconcile with what the nodes
report. Heartbeats are kept in memory only (a lost node is written when it is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard, TypeVar

from broker.core import Core, retrieve
from broker.deployment_table import ACTIVE, DeploymentTable
from broker.errors import (
    Busy,
    Impossible,
    InvalidRequest,
    NodeUnavailable,
    NotFound,
    PermissionDenied,
    ReplicaFailed,
    ResourceExhausted,
    Unauthenticated,
    Unfit,
    quote,
)
from broker.ids import NodeId, replica_id
from broker.key_verifier import KeyVerifier
from broker.model_store import InvalidModel, ModelStore, Upload
from broker.model_store import ModelNotFound as StoredModelNotFound
from broker.model_store import ModelTooLarge as StoredModelTooLarge
from broker.network import EdgeNetwork, UnknownSite
from broker.node_link import NodeLinkFactory, ReplicaResources
from broker.nodes import LIVE_REPLICA, MAX_GPUS, NodeEntry, NodeRegistry, ReplicaState, Reported
from broker.ops.metrics import BrokerMetrics
from broker.placement import (
    Allocation,
    ClusterSnapshot,
    Decision,
    NodeSnapshot,
    PlacementRequest,
    PriorityClass,
    place,
)
from broker.quotas import (
    DEFAULT_MAX_STAGED_BYTES,
    ClientLimits,
    Quotas,
    check_deployments,
    check_model_bytes,
    check_model_bytes_while_staging,
)
from broker.state import (
    DeploymentRecord,
    DeploymentState,
    MigrationRecord,
    MigrationState,
    ModelRecord,
    NodeState,
    OffloadReportRecord,
    OffloadSummary,
    StandbyRecord,
    StateStore,
)
from broker.telemetry import NodeSample
from broker.timed_lock import TimedLock
from common import heap
from common.inventory import Inventory
from common.replica_memory import share_too_small

logger = logging.getLogger(__name__)

T = TypeVar("T")

VISIBLE = (
    DeploymentState.PENDING,
    DeploymentState.STARTING,
    DeploymentState.RUNNING,
    DeploymentState.FAILED,
)


_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
OFFLOAD_SESSIONS_KEPT = 8
"""Offload summaries kept per deployment: those of the client's most recently reported
sessions (a client that restarts begins a new session)."""


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    heartbeat_interval_s: float = 1.0
    lost_after_s: float = 5.0
    """A node silent this long is marked lost."""
    orphan_grace_s: float = 30.0
    """A replica a node runs that no deployment claims is stopped after this long."""
    pending_retry_s: float = 2.0
    """How often pending deployments are tried again."""
    stop_grace_ms: int = 5000
    quotas: Quotas = field(default_factory=Quotas)
    """Per-client limits (`broker.quotas`)."""
    max_staged_upload_bytes: int = DEFAULT_MAX_STAGED_BYTES
    """Bytes of uploads staged at once, all clients together (`--max-staged-upload-bytes`)."""


HEAP_TRIM_DELAY_S = 1.0
"""How long after the last upload under way ended the broker trims its C heap."""


@dataclass(slots=True)
class ClientUpload:
    """One client's upload under way (`Broker.begin_upload`): its staging file in the model
    store and the bytes it counts against the staging caps."""

    client_id: str
    upload: Upload
    stored_bytes: int | None
    """The client's models' bytes when the upload began; None when it owns this model
    already (a new copy adds nothing to its quota)."""
    staged_bytes: int = 0
    """Bytes counted in `ClientLimits.staged` for this upload, until `end_upload`."""


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
    """A migration's reservation (`Broker.reserve_move`): the target's GPUs held and the
    deployment taken by it until `Broker.release_move`."""

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


@dataclass(slots=True)
class _Reconciliation:
    """What reconciling a node's report found to do (`Broker._reconcile_plan`)."""

    requeue: list[tuple[str, DeploymentRecord]] = field(default_factory=list)
    """(replica, deployment): running deployments whose replica is gone or exited."""
    retire: list[Standby] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    """Replicas nobody claims, past the orphan grace period."""

    def __bool__(self) -> bool:
        return bool(self.requeue or self.retire or self.stop)


@dataclass(slots=True)
class _Watchers:
    queues: dict[str, set[asyncio.Queue[PlacementUpdate | None]]] = field(default_factory=dict)

    def add(self, deployment_id: str) -> asyncio.Queue[PlacementUpdate | None]:
        queue: asyncio.Queue[PlacementUpdate | None] = asyncio.Queue()
        self.queues.setdefault(deployment_id, set()).add(queue)
        return queue

    def remove(self, deployment_id: str, queue: asyncio.Queue[PlacementUpdate | None]) -> None:
        self.queues.get(deployment_id, set()).discard(queue)

    def push(self, deployment_id: str, update: PlacementUpdate | None) -> None:
        for queue in self.queues.get(deployment_id, ()):
            queue.put_nowait(update)


class Broker:
    def __init__(
        self,
        store: StateStore,
        models: ModelStore,
        network: EdgeNetwork,
        join_token: str,
        settings: BrokerSettings,
        metrics: BrokerMetrics,
        node_links: NodeLinkFactory,
    ) -> None:
        """`node_links`: how the broker gets its link to a node (`NodeClient`, over mutual
        TLS when the broker has a certificate)."""
        self._core = Core(store, metrics)
        self._store = store
        self._db = self._core.db
        self._db_queued = self._core.db_queued
        self._durable = self._core.durable
        self.background = self._core.background
        self._own = self._core.own
        self.registry = NodeRegistry(
            self._core,
            network,
            node_links,
            metrics,
            lost_after_s=settings.lost_after_s,
            on_change=self._node_changed,
        )
        """The nodes (`broker.nodes`): their entries, secrets, liveness and resizes."""
        self.models = models
        self.network = network
        self.settings = settings
        self.metrics = metrics
        self._join_token = join_token
        self._placing = TimedLock(metrics.observe_placement_lock)
        """Held by every decision that reads and changes placement (deploy, place again,
        evict, reserve a move, switch, give up a move): one at a time, each naming its use
        for the lock's metrics."""
        self.watchers = _Watchers()
        self.limits = ClientLimits(settings.quotas, settings.max_staged_upload_bytes)
        """Per-client quotas and the upload and watch-stream slots they allow."""
        self._orphans: dict[tuple[str, str], float] = {}
        """(node id, replica id) -> when first seen unclaimed (monotonic)."""
        self._keys = KeyVerifier(store.client_for_api_key)
        self._reconciling: dict[str, Sequence[tuple[str, ReplicaState]] | None] = {}
        """node id -> the replicas of its latest heartbeat not yet reconciled (None: none
        waiting) while a reconciliation of the node runs."""
        self._deployments = DeploymentTable()
        """Every deployment not deleted, as stored (see the module docstring)."""
        self._placement = ClusterSnapshot.empty()
        """Placement's view of the cluster, up to date but for the `_stale` nodes."""
        self._stale: set[str] = set()
        """Nodes whose entry in `_placement` is out of date: their node entry, deployments,
        holds or a deployment's being taken by a move changed since it was made."""
        self._owned: set[tuple[str, str]] = set()
        """(client id, sha256) of models the store says the client owns (`_owns`)."""
        self._reloaded: set[str] = set()
        """Nodes whose load alone changed since their entry in `_placement` was made (every
        heartbeat's: the entry is copied with the new load, not made again)."""
        self._replacing: set[str] = set()
        self._busy: set[str] = set()
        """Deployments being migrated or deleted: no other move or eviction takes them, and
        reconciliation leaves them alone (their replicas come and go on purpose)."""
        self._creating: dict[str, int] = {}
        """Client id -> its first decisions whose `starting` write is not durable yet
        (`_hold_creation`): its quota counts them."""
        self._holds: dict[tuple[str, int], Hold] = {}
        """(deployment id, epoch) -> GPUs held for that replica beyond the records."""
        self._standbys: dict[str, Standby] = {}
        """deployment id -> its standby replica (`broker.prewarm`), while it may be used."""
        self._retiring: set[Standby] = set()
        """Standbys being stopped: they hold their GPUs (and count against the budget)
        until their replica is gone."""
        self.load_history = self.registry.load_history
        self.loop_lag = self.registry.loop_lag

    @property
    def nodes(self) -> Mapping[str, NodeEntry]:
        """The nodes the broker knows, read-only: only the registry changes them."""
        return self.registry.nodes

    def _node_changed(self, node_id: str, load_only: bool) -> None:
        """The registry's news: placement's entry for the node is stale."""
        (self._reloaded if load_only else self._stale).add(node_id)

    async def visible_deployments(self) -> list[DeploymentRecord]:
        """Every deployment a client can see (pending, starting, running, failed)."""
        return self._deployments.select(states=VISIBLE)

    # --- start-up and shutdown -----------------------------------------------------------

    async def load(self) -> None:
        """Reload the nodes the store knows (they get a full heartbeat timeout to check in).

        A deployment found `starting` was being started when the previous broker stopped:
        whether its replica came up is unknown, and nothing is waiting for it. It becomes
        pending (placed again by `retry_pending`, at the next epoch); a replica it may have
        left is claimed by nothing and stopped after the orphan grace."""
        await self.registry.load()
        self._deployments.load(await self._db(self._store.list_deployments, states=VISIBLE))
        for starting in self._deployments.select(states=(DeploymentState.STARTING,)):
            async with self._placing.use("load"):
                await self._write_pending(
                    starting.deployment_id, "the broker restarted while its replica was starting"
                )
            logger.warning(
                "deployment=%s was starting at restart: pending", starting.deployment_id
            )
        for left in await self._db(self._store.list_standbys):
            # The previous broker's standbys: its predictions are gone with it. Each holds its
            # GPUs until its replica is stopped.
            standby = Standby(left, 0.0, 0, time.monotonic())
            self._retiring.add(standby)
            self.background(
                self._stop_standby(standby, "the broker restarted", "lapsed"),
                f"retire-{standby.replica}",
            )
        logger.info(
            "state loaded: %d node(s), %d deployment(s)", len(self.nodes), len(self._deployments)
        )

    async def close(self) -> None:
        await self._core.cancel_tasks()
        await self.registry.close()
        for deployment_id in list(self.watchers.queues):
            self.watchers.push(deployment_id, None)
        self._keys.close()
        self._core.close()

    # --- authentication ------------------------------------------------------------------

    def check_join_token(self, supplied: str | None) -> bool:
        return supplied is not None and hmac.compare_digest(
            supplied.encode(), f"Bearer {self._join_token}".encode()
        )

    async def client_for(self, authorization: str | None, peer: str) -> str | None:
        """The client id an `authorization: Bearer <api key>` value belongs to, or None.
        The check runs off the state thread (`KeyVerifier`); ResourceExhausted when `peer`
        failed too many checks lately or too many keys wait for one."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return await self._keys.client_for(authorization.removeprefix("Bearer "), peer)

    def use_keys(self, keys: Sequence[str]) -> tuple[str, ...]:
        """Make `keys` (a parsed `--api-keys-file`) exactly the valid API keys, at once and
        without hashing (`KeyVerifier.use_keys`): a removed or replaced key is refused from
        the next call on, and the WatchDeployment streams opened with it end UNAUTHENTICATED.
        The ids of the clients whose key stopped working."""
        return self._keys.use_keys(keys)

    # --- nodes ---------------------------------------------------------------------------

    async def register_node(
        self,
        node_id: str,
        address: str,
        site: str,
        inventory: Inventory,
        runtimes: Sequence[str],
        replicas: Reported,
        *,
        secret: str,
        certified: bool = False,
    ) -> None:
        """Record (or refresh) a node (`NodeRegistry.register`), then reconcile the replicas
        it reports, given as (replica id, state), in the background."""
        await self.registry.register(
            node_id, address, site, inventory, runtimes, secret=secret, certified=certified
        )
        logger.info(
            "node=%s registered site=%s gpus=%d replicas=%d",
            node_id,
            site,
            len(inventory.gpus),
            len(replicas),
        )
        self._schedule_reconcile(node_id, replicas)

    def heartbeat(self, node_id: str, sample: NodeSample, replicas: Reported) -> None:
        """Record that the node is alive and its load (`NodeRegistry.heartbeat`), at once;
        reconciling the replicas it reports runs after, in the background. NotFound when
        the node is unknown (it registers again)."""
        self.registry.heartbeat(node_id, sample)
        self._schedule_reconcile(node_id, replicas)

    def _schedule_reconcile(
        self, node_id: str, replicas: Sequence[tuple[str, ReplicaState]]
    ) -> None:
        """Reconcile the node with `replicas`: at once when that needs no action (the usual
        heartbeat: no task made), else in the background. One reconciliation per node at a
        time; a report arriving meanwhile replaces the one waiting."""
        if node_id in self._reconciling:
            self._reconciling[node_id] = replicas
            return
        entry = self.nodes.get(node_id)
        if entry is None or not self._reconcile_plan(entry, replicas):
            return
        self._reconciling[node_id] = None
        self.background(self._reconcile_reported(node_id, replicas), f"reconcile-{node_id}")

    async def _reconcile_reported(
        self, node_id: str, replicas: Sequence[tuple[str, ReplicaState]] | None
    ) -> None:
        try:
            while replicas is not None and (entry := self.nodes.get(node_id)) is not None:
                await self._reconcile(entry, self._reconcile_plan(entry, replicas))
                replicas = self._reconciling.get(node_id)
                self._reconciling[node_id] = None
        finally:
            self._reconciling.pop(node_id, None)

    def _reconcile_plan(
        self, entry: NodeEntry, replicas: Sequence[tuple[str, ReplicaState]]
    ) -> _Reconciliation:
        """Compare what the node runs with what the broker expects on it, recording what the
        report says (the node's replicas, the load attributed to deployments, when a replica
        nobody claims was first seen) and returning what must be done: deployments whose
        replica is gone or exited to place again, standbys whose replica is gone to retire,
        replicas nobody claims past the orphan grace period to stop."""
        node_id = entry.record.node_id
        plan = _Reconciliation()
        running = {rid for rid, state in replicas if state in LIVE_REPLICA}
        # A heartbeat may have been taken before a switch it is processed after.
        settled_before = time.time() - 2 * self.settings.heartbeat_interval_s
        self.registry.reported(node_id, replicas)
        placed = self._deployments.on_node(node_id)
        expected = {
            replica_id(d.deployment_id, d.epoch): d
            for d in placed
            if d.state is DeploymentState.RUNNING
        }
        self.load_history.attribute(node_id, {r: d.deployment_id for r, d in expected.items()})
        plan.requeue = [
            (replica, deployment)
            for replica, deployment in expected.items()
            if replica not in running
            and deployment.deployment_id not in self._replacing
            and deployment.deployment_id not in self._busy
            and deployment.updated_at < settled_before
        ]
        # Claimed besides the running ones: replicas starting, and those a move holds (its
        # target before the switch, its source until it stops), however long that takes.
        claimed = {
            *(replica_id(d.deployment_id, d.epoch) for d in placed),
            *(replica_id(deployment, epoch) for deployment, epoch in self._holds),
            *(standby.replica for standby in self.standbys() if standby.node_id == node_id),
        }
        plan.retire = [
            standby
            for standby in self._standbys.values()
            if standby.node_id == node_id
            and standby.ready
            and standby.replica not in running
            and standby.record.created_at < settled_before
        ]
        now = time.monotonic()
        for replica, _state in replicas:
            if replica in claimed:
                self._orphans.pop((node_id, replica), None)
                continue
            first = self._orphans.setdefault((node_id, replica), now)
            if now - first >= self.settings.orphan_grace_s:
                plan.stop.append(replica)
        return plan

    async def _reconcile(self, entry: NodeEntry, plan: _Reconciliation) -> None:
        """Do what `_reconcile_plan` found: place again, retire, stop."""
        node_id = entry.record.node_id
        for replica, deployment in plan.requeue:
            logger.warning(
                "deployment=%s: its replica %s is not running on node %s; placing it again",
                deployment.deployment_id,
                replica,
                node_id,
            )
            await self.requeue(deployment, f"replica lost on node {node_id}")
        for standby in plan.retire:
            logger.warning(
                "standby %s is not running on node %s; retiring it", standby.replica, node_id
            )
            await self.retire_standby(standby, "its replica is gone", "lost")
        for replica in plan.stop:
            logger.warning(
                "node=%s replica=%s: no deployment claims it; stopping", node_id, replica
            )
            self._orphans.pop((node_id, replica), None)
            with contextlib.suppress(NodeUnavailable):
                await entry.client.stop_replica(replica, self.settings.stop_grace_ms)

    async def mark_lost_nodes(self) -> list[NodeId]:
        """Mark the nodes silent too long as lost (`NodeRegistry.find_lost`) and retire the
        standbys on them; their ids."""
        lost = await self.registry.find_lost()
        for standby in list(self._standbys.values()):
            if standby.node_id in lost:
                self.background(
                    self.retire_standby(standby, "its node was lost", "lost"),
                    f"retire-{standby.replica}",
                )
        return lost

    # --- models --------------------------------------------------------------------------

    async def begin_upload(self, client_id: str, sha256: str) -> ClientUpload:
        """Open a staging file for the model `client_id` declares to hash to `sha256`.
        InvalidRequest for a malformed sha256. The caller ends it with `finish_upload` and,
        whatever ends the stream, `end_upload`."""
        # A model the client owns already adds nothing to its stored bytes.
        stored = None
        if not await self._owns(client_id, sha256):
            stored = await self._db(self._store.client_model_bytes, client_id)
        # Made last, with no await after it, so that a cancelled call leaves no file behind.
        try:
            return ClientUpload(client_id, self.models.upload(sha256), stored)
        except (InvalidModel, ValueError) as err:
            raise InvalidRequest(str(err)) from err

    async def write_upload(self, upload: ClientUpload, data: bytes) -> None:
        """Stage one chunk on disk. ResourceExhausted (the upload to be ended) when the chunk
        would pass the client's model bytes quota, its staged bytes cap or the broker's, or
        the store's size limit; the bytes are counted before they are written."""
        limits = self.limits
        if upload.stored_bytes is not None:
            check_model_bytes_while_staging(
                limits.quotas,
                upload.client_id,
                upload.stored_bytes,
                limits.staged.of(upload.client_id),
                len(data),
            )
        limits.staged.take(upload.client_id, len(data))
        upload.staged_bytes += len(data)
        try:
            await asyncio.to_thread(upload.upload.write, data)
        except StoredModelTooLarge as err:
            raise ResourceExhausted(str(err)) from err

    async def finish_upload(self, upload: ClientUpload, name: str) -> tuple[str, int, bool]:
        """Check and store the upload (sha256, loadable ONNX), then record it as its
        client's. The third value, "deduplicated", is True only when this client had
        uploaded that content before: whether another client did stays invisible.
        ResourceExhausted when a new model would take the client past its model bytes quota
        (checked again before the file is kept: another upload may have been stored
        meanwhile). The staged bytes stay counted until `end_upload`."""
        client_id, staged = upload.client_id, upload.upload
        owned = await self._owns(client_id, staged.sha256)
        if not owned:
            stored = await self._db(self._store.client_model_bytes, client_id)
            check_model_bytes(self.limits.quotas, client_id, stored, staged.size)
        try:
            result = await asyncio.to_thread(staged.commit)
        except InvalidModel as err:
            raise InvalidRequest(str(err)) from err
        except StoredModelTooLarge as err:
            raise ResourceExhausted(str(err)) from err
        await self._db(
            self._store.put_model,
            ModelRecord(result.sha256, name or result.sha256[:12], result.size_bytes, time.time()),
        )
        await self._db(self._store.add_model_owner, result.sha256, client_id)
        self._owned.add((client_id, result.sha256))
        return result.sha256, result.size_bytes, owned

    def end_upload(self, upload: ClientUpload) -> None:
        """Remove the upload's staging file (a no-op after a commit) and give back the bytes
        it counted. Idempotent; for a `finally`: finished, failed, cancelled, disconnected.
        Once no upload is under way, the memory their chunks took goes back to the system
        (`_release_memory_soon`)."""
        upload.upload.abort()
        if upload.staged_bytes:
            self.limits.staged.give_back(upload.client_id, upload.staged_bytes)
            upload.staged_bytes = 0
            if not self.limits.staged.total:
                self._release_memory_soon()

    def _release_memory_soon(self) -> None:
        """Trim the C heap `HEAP_TRIM_DELAY_S` from now if no upload is under way then: the
        calls that just ended free their buffers and connections after their bytes were
        given back. In a thread: trimming a large heap takes milliseconds."""
        loop = asyncio.get_running_loop()

        def release() -> None:
            if not self.limits.staged.total:
                with contextlib.suppress(RuntimeError):  # the loop is shutting down
                    loop.run_in_executor(None, heap.release_free_memory)

        loop.call_later(HEAP_TRIM_DELAY_S, release)

    async def _owns(self, client_id: str, sha256: str) -> bool:
        """Whether the client uploaded that model. An owner is never removed, so a yes is
        remembered (every deploy asks); a no is asked of the store each time."""
        if (client_id, sha256) in self._owned:
            return True
        if not await self._db(self._store.owns_model, client_id, sha256):
            return False
        self._owned.add((client_id, sha256))
        return True

    def model_chunks(self, sha256: str) -> Iterator[bytes]:
        """Blocking generator over a stored model. NotFound when absent."""
        try:
            yield from self.models.open_chunks(sha256)
        except (StoredModelNotFound, ValueError, InvalidModel) as err:
            raise NotFound(f"model {sha256} is not stored at the broker") from err

    # --- deployments ---------------------------------------------------------------------

    def _node_snapshot(self, node_id: str, entry: NodeEntry) -> NodeSnapshot:
        """The node as placement sees it: its deployments' allocations and the holds on it.
        What no decision may take away (a replica starting, a deployment being moved or
        deleted, a hold) is entered at the top priority, so nothing preempts it."""
        node = NodeSnapshot.idle(
            node_id,
            entry.record.site,
            entry.topology,
            ready=entry.record.state is NodeState.READY,
            runtimes=entry.record.runtimes,
            cuda_version=entry.inventory.cuda_version,
            load=entry.load,
        )
        allocations = []
        for d in self._deployments.on_node(node_id):
            priority, memory_mib = _allocation_terms(d.request_json)
            pinned = d.state is DeploymentState.STARTING or d.deployment_id in self._busy
            allocations.append(
                Allocation(
                    d.deployment_id,
                    PriorityClass.CRITICAL if pinned else priority,
                    d.gpus,
                    memory_mib,
                )
            )
        for (deployment_id, epoch), hold in self._holds.items():
            if hold.node_id == node_id:
                allocations.append(
                    Allocation(
                        f"{deployment_id}@{epoch}",
                        PriorityClass.CRITICAL,
                        hold.gpus,
                        hold.memory_mib,
                    )
                )
        return node.with_allocations(allocations)

    def _placement_view(self, standbys: bool = False) -> ClusterSnapshot:
        """The cluster as placement sees it now (the stale nodes made again first); with
        `standbys`, the standbys too (at the lowest priority: a standby's own placement sees
        them, a real one does not, and takes their GPUs at will: `_standbys_under`)."""
        if self._stale or self._reloaded:
            nodes = [self._node_snapshot(n, self.nodes[n]) for n in self._stale if n in self.nodes]
            for n in self._reloaded - self._stale:
                old, entry = self._placement.get(n), self.nodes.get(n)
                if old is not None and entry is not None:
                    nodes.append(replace(old, load=entry.load))
            gone = [n for n in self._stale if n not in self.nodes]
            self._placement = self._placement.updated(nodes, removed=gone)
            self._stale, self._reloaded = set(), set()
        view = self._placement
        for standby in self.standbys() if standbys else ():
            node = view.get(standby.node_id)
            if node is not None:
                view = view.with_node(
                    node.with_allocation(
                        Allocation(
                            standby.allocation_id,
                            PriorityClass.STANDBY,
                            standby.record.gpus,
                            standby.memory_mib,
                        )
                    )
                )
        return view

    async def snapshot(self) -> ClusterSnapshot:
        """The cluster as placement sees it now, for a policy's dry run outside the placement
        lock (the decision it leads to checks again, under the lock)."""
        return self._placement_view()

    # --- deployment records: written to the store, then kept in the table -----------------

    def _keep(self, record: DeploymentRecord) -> DeploymentRecord:
        """`record`, as the store has just committed it, into the table; placement's view
        of the nodes it left or joined is stale."""
        self._stale |= self._deployments.put(record)
        return record

    async def _update(self, deployment_id: str, **changes: Any) -> DeploymentRecord:
        """Change a deployment in the store, then in the table; the record as stored."""
        return self._keep(await self._db(self._store.update_deployment, deployment_id, **changes))

    def _take(self, deployment_id: str) -> None:
        """Mark a deployment taken by a move or a delete (its allocation pinned)."""
        self._busy.add(deployment_id)
        self._stale_where(deployment_id)

    def _untake(self, deployment_id: str) -> None:
        self._busy.discard(deployment_id)
        self._stale_where(deployment_id)

    def _stale_where(self, deployment_id: str) -> None:
        record = self._deployments.get(deployment_id)
        if record is not None and record.node_id:
            self._stale.add(record.node_id)

    def _hold(self, key: tuple[str, int], hold: Hold) -> None:
        self._holds[key] = hold
        self._stale.add(hold.node_id)

    def _unhold(self, key: tuple[str, int]) -> None:
        hold = self._holds.pop(key, None)
        if hold is not None:
            self._stale.add(hold.node_id)

    async def set_node_state(self, node_id: str, state: NodeState) -> None:
        """An operator's change of a node's state (draining): a decision of its own."""
        async with self._placing.use("node state"):
            await self.registry.set_state(node_id, state)

    async def deploy(self, client_id: str, spec: DeploySpec) -> DeploymentRecord:
        """Place and start a deployment; returns it once its replica is ready, or pending
        when the start failed for another reason than the replica itself (the node killed or
        unreachable mid-start, the GPUs not free there yet): it is placed again.

        The placement and the start run as the broker's own task: a caller that goes away
        (its deadline, a cancelled call) leaves it to end running, pending or failed, never
        starting with its GPUs held.

        InvalidRequest, NotFound (model not uploaded), Impossible (more than any node has),
        ResourceExhausted (nothing fits now), NodeUnavailable (the replica failed by itself:
        the deployment is failed), Unfit (a GPU memory share below the model's need: before
        anything is recorded when its file shows it, else the deployment is failed).
        """
        spec.validate()
        # Another client's model answers exactly as one nobody uploaded.
        if not await self._owns(client_id, spec.model_sha256):
            raise NotFound(f"model {spec.model_sha256} is not uploaded; call UploadModel first")
        if spec.gpu_memory_mib:
            need = await asyncio.to_thread(self.models.gpu_need, spec.model_sha256)
            if need is not None and (
                refusal := share_too_small(spec.gpu_memory_mib, spec.model_name, need)
            ):
                raise Unfit(refusal)
        if spec.site not in self.network.sites:
            raise InvalidRequest(
                f"site {quote(spec.site)} is unknown; known sites: {', '.join(self.network.sites)}"
            )
        deployment_id = f"d-{secrets.token_hex(5)}"
        task = self._own(self._deploy(deployment_id, client_id, spec), f"deploy-{deployment_id}")
        task.add_done_callback(retrieve)
        return await asyncio.shield(task)

    async def _deploy(
        self, deployment_id: str, client_id: str, spec: DeploySpec
    ) -> DeploymentRecord:
        record, evicted = await self._reserve(deployment_id, client_id, spec, epoch=1)
        await self._stop_evicted(evicted)
        return await self._start(record, "deployed", DeploymentState.FAILED)

    async def _reserve(
        self, deployment_id: str, client_id: str, spec: DeploySpec, epoch: int
    ) -> tuple[DeploymentRecord, list[DeploymentRecord | Standby]]:
        """One decision: place the deployment (standbys unseen), write it `starting` there,
        write the deployments it preempts `pending` and the standbys on its GPUs retiring,
        all under the lock. The evicted records (as they were: their replicas are still to be
        stopped) and standbys.

        A first decision that evicts nothing queues its write under the lock and awaits it
        after, its GPUs held meanwhile (`_hold_creation`), so the lock is not held through
        the commit; the record is the table's once durable, as every record."""
        creating: asyncio.Future[None] | None = None
        async with self._placing.use("decide"):
            holding = time.perf_counter()
            if epoch == 1:
                current = self._deployments.count(client_id, VISIBLE)
                current += self._creating.get(client_id, 0)
                check_deployments(self.limits.quotas, client_id, current)
            snapshot = self._placement_view()
            largest, largest_node = snapshot.largest()
            if spec.gpus > largest:
                raise Impossible(
                    f"asks for {spec.gpus} GPU(s); the largest node has {largest} "
                    f"({largest_node or 'no nodes registered'}): ask for at most {largest}"
                )
            request = spec.placement_request(deployment_id, spec.site)
            started = time.perf_counter()
            try:
                decision = place(snapshot, request, self.network)
            except UnknownSite as err:
                raise InvalidRequest(str(err)) from err
            self.metrics.observe_placement(time.perf_counter() - started)
            if decision.node_id is None:
                raise ResourceExhausted(
                    f"nothing fits now: {decision.reason}\n{decision.explanation.render()}"
                )
            entry = self.nodes[decision.node_id]
            uuids = tuple(entry.inventory.gpus[i].uuid for i in decision.gpus)
            now = time.time()
            record = DeploymentRecord(
                deployment_id=deployment_id,
                client_id=client_id,
                model_sha256=spec.model_sha256,
                model_name=spec.model_name,
                request_json=spec.to_json(),
                priority=int(spec.priority),
                site=spec.site,
                state=DeploymentState.STARTING,
                node_id=decision.node_id,
                gpus=decision.gpus,
                gpu_uuids=uuids,
                endpoint="",
                token=secrets.token_urlsafe(24),
                epoch=epoch,
                explanation_json=explanation_json(decision),
                reason="",
                created_at=now,
                updated_at=now,
            )
            evicted: list[DeploymentRecord | Standby] = []
            evicted.extend(self._standbys_under(decision.node_id, decision.gpus))
            for victim_id in decision.preempt:
                victim = self._deployments.get(victim_id)
                if victim is not None and victim.state in ACTIVE:
                    await self._write_pending(victim_id, f"preempted by {deployment_id}")
                    evicted.append(victim)
            if epoch == 1 and not evicted:
                creating = self._hold_creation(record, spec)
            elif epoch == 1:
                await self._db(self._store.create_deployment, record)
                self._keep(record)
            else:
                record = await self._update(
                    deployment_id,
                    state=DeploymentState.STARTING,
                    node_id=record.node_id,
                    gpus=record.gpus,
                    gpu_uuids=record.gpu_uuids,
                    endpoint="",
                    epoch=epoch,
                    explanation_json=record.explanation_json,
                    reason="",
                )
            self.metrics.observe_decision(time.perf_counter() - holding)
        if creating is not None:  # a caller cancelled meanwhile leaves it to settle by itself
            await self._durable(asyncio.shield(creating))
        # Once the record is in the store (bench.control_plane times decisions by this line).
        logger.info(
            "deployment=%s placed on node=%s gpus=%s (%s)",
            deployment_id,
            decision.node_id,
            decision.gpus,
            ", ".join(decision.explanation.deciding) or "only candidate",
        )
        return record, evicted

    def _hold_creation(self, record: DeploymentRecord, spec: DeploySpec) -> asyncio.Future[None]:
        """Queue a first decision's `starting` write (call under `_placing`) and hold its
        GPUs until the write settles: the decisions after it, made before it commits, see
        them taken; nothing else sees the record before the store has it. Then the record
        takes the hold's place in one step (`_creation_settled`), whoever still awaits it."""
        assert record.node_id is not None
        self._hold(
            (record.deployment_id, record.epoch),
            Hold(record.node_id, record.gpus, spec.gpu_memory_mib, PriorityClass.CRITICAL),
        )
        self._creating[record.client_id] = self._creating.get(record.client_id, 0) + 1
        queued = self._db_queued(self._store.create_deployment, record)
        queued.add_done_callback(functools.partial(self._creation_settled, record))
        return queued

    def _creation_settled(self, record: DeploymentRecord, queued: asyncio.Future[None]) -> None:
        self._unhold((record.deployment_id, record.epoch))
        left = self._creating.pop(record.client_id) - 1
        if left:
            self._creating[record.client_id] = left
        if not queued.cancelled() and queued.exception() is None:
            self._keep(record)

    async def _write_pending(self, deployment_id: str, reason: str) -> None:
        """Take a deployment off its node in the store (its GPUs free for the next
        decision), and retire its standby (made for an epoch it will not have); call under
        `_placing`."""
        standby = self._standbys.pop(deployment_id, None)
        if standby is not None:
            self._retiring.add(standby)
            self.background(
                self._stop_standby(standby, f"the deployment left its node: {reason}", "lapsed"),
                f"retire-{standby.replica}",
            )
        await self._update(
            deployment_id,
            state=DeploymentState.PENDING,
            node_id=None,
            gpus=(),
            gpu_uuids=(),
            endpoint="",
            reason=reason,
        )

    async def _stop_evicted(self, evicted: Sequence[DeploymentRecord | Standby]) -> None:
        """Stop the standbys and the replicas of deployments a decision preempted, tell the
        deployments' clients, and place them again (they stay pending until something
        fits)."""
        for victim in evicted:
            if isinstance(victim, Standby):
                await self._stop_standby(victim, "preempted by a deployment", "preempted")
                continue
            await self.stop_replica(victim.node_id, replica_id(victim.deployment_id, victim.epoch))
            self._publish(victim.deployment_id)
            self._spawn_replace(victim.deployment_id)

    async def _start(
        self, record: DeploymentRecord, reason: str, on_failure: DeploymentState
    ) -> DeploymentRecord:
        """Start the replica of a `starting` record and write the outcome. When the replica
        itself failed (ReplicaFailed: its model does not load, it exited) the deployment
        becomes `on_failure` (failed for a first deploy: NodeUnavailable is raised; pending
        for one placed again). Any other failure (the node unreachable or killed mid-start,
        its model fetch failed, the GPUs the broker gave not free there yet) makes it
        pending, to be placed again. A deployment deleted while its replica started is left
        deleted and the replica stopped."""
        spec = DeploySpec.from_json(record.request_json)
        assert record.node_id is not None
        entry = self.nodes[record.node_id]
        try:
            endpoint = await entry.client.start_replica(
                deployment_id=record.deployment_id,
                epoch=record.epoch,
                model_sha256=record.model_sha256,
                model_name=record.model_name,
                gpu_uuids=record.gpu_uuids,
                resources=spec.resources(),
                token=record.token,
            )
        except (NodeUnavailable, ResourceExhausted) as err:
            again = on_failure is DeploymentState.PENDING or not isinstance(err, ReplicaFailed)
            async with self._placing.use("start failed"):
                current = await self._still_starting(record)
                if current is not None and again:
                    await self._write_pending(record.deployment_id, str(err))
                elif current is not None:
                    await self._update(
                        record.deployment_id,
                        state=DeploymentState.FAILED,
                        node_id=None,
                        gpus=(),
                        gpu_uuids=(),
                        reason=str(err),
                    )
            self._publish(record.deployment_id)
            if not again:
                if isinstance(err, Unfit):
                    raise  # FAILED_PRECONDITION: the client must change its request
                raise NodeUnavailable(str(err)) from err
            logger.warning("deployment=%s to be placed again: %s", record.deployment_id, err)
            self._spawn_replace(record.deployment_id)
            return await self._record(record.deployment_id)
        async with self._placing.use("running"):
            current = await self._still_starting(record)
            if current is not None:  # the write queued under the lock, awaited after it
                written = self._db_queued(
                    self._store.update_deployment,
                    record.deployment_id,
                    state=DeploymentState.RUNNING,
                    endpoint=endpoint,
                )
        if current is not None:
            running = await self._durable(written)
            # Kept only if nothing changed the deployment meanwhile: what did (a delete, a
            # lost node) wrote after this write, and its record is the one stored.
            if self._deployments.get(record.deployment_id) is current:
                record = self._keep(running)
            else:
                current = None
        if current is None:
            logger.warning("deployment=%s was deleted while it started", record.deployment_id)
            await self.stop_replica(record.node_id, replica_id(record.deployment_id, record.epoch))
            return await self._record(record.deployment_id)
        self.watchers.push(record.deployment_id, placement_update(record, reason))
        logger.info(
            "deployment=%s running at %s epoch=%d",
            record.deployment_id,
            record.endpoint,
            record.epoch,
        )
        return record

    async def _still_starting(self, record: DeploymentRecord) -> DeploymentRecord | None:
        """The deployment as stored if it is still `starting` at `record`'s epoch (nothing
        else can take a starting deployment but a delete); call under `_placing`."""
        current = self._deployments.get(record.deployment_id)
        if current is None or (current.state, current.epoch) != (
            DeploymentState.STARTING,
            record.epoch,
        ):
            return None
        return current

    async def _record(self, deployment_id: str) -> DeploymentRecord:
        record = await self.deployment(deployment_id)
        assert record is not None
        return record

    async def requeue(self, record: DeploymentRecord, reason: str) -> None:
        """Take a running deployment off its node (stopping its replica if the node is
        there), mark it pending and place it again; nothing when it changed since `record`
        was read or another decision holds it."""
        async with self._placing.use("requeue"):
            now = self._deployments.get(record.deployment_id)
            if (
                now is None
                or (now.state, now.epoch) != (DeploymentState.RUNNING, record.epoch)
                or record.deployment_id in self._busy
            ):
                return
            await self._write_pending(record.deployment_id, reason)
        await self.stop_replica(record.node_id, replica_id(record.deployment_id, record.epoch))
        self._publish(record.deployment_id)
        self._spawn_replace(record.deployment_id)

    def _spawn_replace(self, deployment_id: str) -> None:
        if deployment_id in self._replacing:
            return
        self._replacing.add(deployment_id)
        self.background(self._replace(deployment_id), f"replace-{deployment_id}")

    async def _replace(self, deployment_id: str) -> None:
        """Place a pending deployment again, at the next epoch; it stays pending with the
        reason when nothing fits."""
        try:
            await self._replace_once(deployment_id)
        finally:
            self._replacing.discard(deployment_id)

    async def _replace_once(self, deployment_id: str) -> None:
        record = self._deployments.get(deployment_id)
        if record is None or record.state is not DeploymentState.PENDING:
            return
        spec = DeploySpec.from_json(record.request_json)
        try:
            record, evicted = await self._reserve(
                deployment_id, record.client_id, spec, record.epoch + 1
            )
        except (ResourceExhausted, Impossible) as err:
            await self._update(
                deployment_id,
                reason=f"{record.reason.split('; waiting: ')[0]}; waiting: "
                f"{str(err).splitlines()[0]}",
            )
            return
        await self._stop_evicted(evicted)
        await self._start(record, "replaced", DeploymentState.PENDING)

    async def retry_pending(self) -> None:
        for record in self._deployments.select(states=(DeploymentState.PENDING,)):
            self._spawn_replace(record.deployment_id)

    # --- standbys: pre-warmed replicas (`broker.prewarm` decides, these hold and run them) --

    def standbys(self) -> list[Standby]:
        """Every standby held now: those that may still be used, then those being stopped."""
        return [*self._standbys.values(), *self._retiring]

    def is_busy(self, deployment_id: str) -> bool:
        """Whether a move or a delete holds the deployment now."""
        return deployment_id in self._busy

    def standby_of(self, deployment_id: str) -> Standby | None:
        """The deployment's standby that may still be used; None when it has none."""
        return self._standbys.get(deployment_id)

    async def reserve_standby(
        self,
        deployment_id: str,
        site: str,
        probability: float,
        choose: StandbyChoice,
        budget: int,
    ) -> Standby | None:
        """One decision, under the placement lock: the deployment runs, no move or delete
        holds it, it has no standby, fewer than `budget` standbys are held, and `choose`
        picks a node for a standby of it for a client at `site` (a decision of standby
        priority) on the cluster as it is now. Then the standby is recorded in the store,
        held, and its start begun at background CPU priority (`Standby.task`). None when
        any of that declines (`choose` says why in the log)."""
        async with self._placing.use("standby"):
            record = self._deployments.get(deployment_id)
            if not _runs(record) or deployment_id in self._busy or deployment_id in self._standbys:
                return None
            if len(self._standbys) + len(self._retiring) >= budget:
                logger.info(
                    "deployment=%s: no standby for site %s: the budget of %d is held",
                    deployment_id,
                    site,
                    budget,
                )
                self.metrics.count_standby("refused")
                return None
            decision = choose(record, self._placement_view(standbys=True))
            if decision is None or decision.node_id is None or decision.preempt:
                return None
            spec = DeploySpec.from_json(record.request_json)
            standby = Standby(
                StandbyRecord(
                    deployment_id=deployment_id,
                    epoch=record.epoch + 1,
                    node_id=decision.node_id,
                    site=site,
                    gpus=decision.gpus,
                    created_at=time.time(),
                ),
                probability,
                spec.gpu_memory_mib,
                time.monotonic(),
            )
            await self._db(self._store.put_standby, standby.record)
            self._standbys[deployment_id] = standby
            task = self._own(
                self._start_standby(standby, record, spec), f"standby-{standby.replica}"
            )
            task.add_done_callback(retrieve)
            standby.task = task
        self.metrics.count_standby("started")
        logger.info(
            "deployment=%s: standby %s starting on node=%s for site %s (%.0f%% likely)",
            deployment_id,
            standby.replica,
            standby.node_id,
            site,
            probability * 100,
        )
        return standby

    async def _start_standby(
        self, standby: Standby, record: DeploymentRecord, spec: DeploySpec
    ) -> str:
        """Start the standby's replica; its endpoint once ready. When the node cannot, the
        standby is retired (unless a move took it already: the move rolls back) and the
        error raised."""
        entry = self.nodes.get(standby.node_id)
        try:
            if entry is None:
                raise NodeUnavailable(f"node {standby.node_id} is gone")
            endpoint = await entry.client.start_replica(
                deployment_id=record.deployment_id,
                epoch=standby.record.epoch,
                model_sha256=record.model_sha256,
                model_name=record.model_name,
                gpu_uuids=tuple(entry.inventory.gpus[i].uuid for i in standby.record.gpus),
                resources=spec.resources(PriorityClass.STANDBY),
                token=record.token,
                background_start=True,
            )
        except (NodeUnavailable, ResourceExhausted) as err:
            logger.warning(
                "standby %s on node=%s failed: %s", standby.replica, standby.node_id, err
            )
            self.background(
                self.retire_standby(standby, f"its start failed: {err}", "failed"),
                f"retire-{standby.replica}",
            )
            raise
        logger.info(
            "standby %s ready on node=%s at %s", standby.replica, standby.node_id, endpoint
        )
        return endpoint

    async def retire_standby(self, standby: Standby, reason: str, outcome: str) -> bool:
        """Stop `standby` and release it if it is still the deployment's standby (not taken
        by a move, not retired already): whether it was. `outcome` counts it in the metrics
        (lapsed, expired, failed, lost ...)."""
        async with self._placing.use("standby retired"):
            if self._standbys.get(standby.deployment_id) is not standby:
                return False
            del self._standbys[standby.deployment_id]
            self._retiring.add(standby)
        await self._stop_standby(standby, reason, outcome)
        return True

    def _standbys_under(self, node_id: str, gpus: Sequence[int]) -> list[Standby]:
        """The standbys of other deployments that hold any of `gpus` on `node_id`, which a
        real placement took (it does not see them), turned retiring (call under `_placing`;
        the caller stops them, with `_stop_standby`, before it starts its replica)."""
        taken = []
        for standby in list(self._standbys.values()):
            if standby.node_id == node_id and set(standby.record.gpus) & set(gpus):
                del self._standbys[standby.deployment_id]
                self._retiring.add(standby)
                taken.append(standby)
        return taken

    async def _stop_standby(self, standby: Standby, reason: str, outcome: str) -> None:
        """Stop a retiring standby: end its start if it runs, stop its replica, forget its
        record; its hold goes last, once the replica is gone (or its node is)."""
        try:
            task = standby.task
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait([task])
            await self.stop_replica(standby.node_id, standby.replica, grace_ms=0)
            record = standby.record
            await self._db(
                self._store.delete_standby, record.deployment_id, record.epoch, record.node_id
            )
        finally:
            self._retiring.discard(standby)
        self.metrics.count_standby(outcome)
        logger.info("standby %s on node=%s retired: %s", standby.replica, standby.node_id, reason)

    # --- moves: the intent-level operations a migration runs on ---------------------------

    def _claim(self, deployment_id: str) -> None:
        """Mark a deployment taken by a move or a delete (call under `_placing`).
        Busy when it is taken already."""
        if deployment_id in self._busy:
            raise Busy(
                f"deployment {deployment_id} is being migrated or deleted; "
                "retry when that has finished"
            )
        self._take(deployment_id)

    async def reserve_move(
        self,
        deployment_id: str,
        choose: MoveChoice,
        *,
        client_id: str | None = None,
        if_idle: bool = False,
    ) -> Move | None:
        """One decision, under the placement lock: check that the deployment runs and no
        other move or delete holds it, let `choose` pick a target on the cluster as it is
        now, hold the target's GPUs and take the deployment until `release_move`. None when
        `choose` declines. NotFound for a deployment that is not running (or is another
        client's, with `client_id`); Impossible while another move or delete holds it (None
        instead with `if_idle`)."""
        async with self._placing.use("move"):
            record = self._deployments.get(deployment_id)
            if not _runs(record) or (client_id is not None and record.client_id != client_id):
                raise NotFound(f"no running deployment {deployment_id}")
            if if_idle and deployment_id in self._busy:
                return None
            self._claim(deployment_id)
            standby = self._standbys.get(deployment_id)
            chosen: tuple[Decision, str] | None = None
            try:
                chosen = choose(record, self._placement_view())
                if chosen is not None and chosen[0].preempt:
                    raise ResourceExhausted(
                        f"the best target, node {chosen[0].node_id}, has room only by "
                        f"preempting {', '.join(chosen[0].preempt)}; a migration preempts no "
                        "deployment"
                    )
                if chosen is not None and standby and chosen[0].node_id == standby.node_id:
                    # Its record goes before the switch can happen: a restarted broker
                    # stops the replicas its standby records name.
                    rec = standby.record
                    await self._db(
                        self._store.delete_standby, rec.deployment_id, rec.epoch, rec.node_id
                    )
            except BaseException:
                chosen = None
                raise
            finally:
                if chosen is None:  # declined, or raised: the deployment is not taken
                    self._untake(deployment_id)
            if chosen is None:
                return None
            decision, why = chosen
            assert decision.node_id is not None and record.node_id is not None
            spec = DeploySpec.from_json(record.request_json)
            target_gpus = decision.gpus
            lapsed = None
            if standby is not None:
                del self._standbys[deployment_id]
            if standby is not None and decision.node_id == standby.node_id:
                target_gpus = standby.record.gpus  # its replica runs on those
            elif standby is not None:
                self._retiring.add(standby)
                lapsed, standby = standby, None
            move = Move(
                deployment_id=deployment_id,
                source_node=record.node_id,
                source_gpus=record.gpus,
                source_epoch=record.epoch,
                target_node=decision.node_id,
                target_gpus=target_gpus,
                explanation_json=explanation_json(decision, why),
                why=why,
                standby=standby,
                evicting=tuple(
                    self.background(
                        self._stop_standby(
                            other, f"its GPUs went to a move of {deployment_id}", "preempted"
                        ),
                        f"retire-{other.replica}",
                    )
                    for other in self._standbys_under(decision.node_id, target_gpus)
                ),
            )
            self._hold(
                (deployment_id, move.epoch),
                Hold(move.target_node, move.target_gpus, spec.gpu_memory_mib, spec.priority),
            )
        if move.standby is not None:
            self.metrics.count_standby("hit")
        if lapsed is not None:
            self.background(
                self._stop_standby(lapsed, "the move went elsewhere", "lapsed"),
                f"retire-{lapsed.replica}",
            )
        return move

    async def start_move_target(self, move: Move, *, background: bool = False) -> str:
        """Start the replica of `move.epoch` on the target; its endpoint once ready (at
        once for a pre-warmed move whose standby is ready; once it is, for one still
        starting). With `background`, the node starts it at background CPU priority and
        raises it once it is ready (a replica serves meanwhile). NodeUnavailable or
        ResourceExhausted when the node cannot."""
        if move.evicting:
            await asyncio.shield(asyncio.gather(*move.evicting, return_exceptions=True))
        if move.standby is not None and move.standby.task is not None:
            try:
                return await asyncio.shield(move.standby.task)
            except asyncio.CancelledError:
                if move.standby.task.cancelled():
                    raise NodeUnavailable("the standby's start was cancelled") from None
                raise
        record = self._deployments.get(move.deployment_id)
        entry = self.nodes.get(move.target_node)
        if record is None or entry is None:
            raise NodeUnavailable("the deployment or the target node is gone")
        spec = DeploySpec.from_json(record.request_json)
        return await entry.client.start_replica(
            deployment_id=record.deployment_id,
            epoch=move.epoch,
            model_sha256=record.model_sha256,
            model_name=record.model_name,
            gpu_uuids=tuple(entry.inventory.gpus[i].uuid for i in move.target_gpus),
            resources=spec.resources(),
            token=record.token,
            background_start=background,
        )

    async def stop_replica(
        self, node_id: str | None, replica: str, grace_ms: int | None = None
    ) -> None:
        """Stop a replica (draining it for `grace_ms`, by default the settings'); a node that
        is gone, lost or cannot is left to reconciliation (the replica is unclaimed there and
        stopped after the orphan grace)."""
        entry = self.nodes.get(node_id or "")
        if entry is None or entry.record.state is NodeState.LOST:
            return
        try:
            await entry.client.stop_replica(
                replica, self.settings.stop_grace_ms if grace_ms is None else grace_ms
            )
        except NodeUnavailable as err:
            logger.warning("replica=%s: %s (the node reconciles it)", replica, err)

    async def commit_switch(
        self,
        move: Move,
        endpoint: str,
        *,
        hold_source: bool,
        reason: str,
        migration_id: str,
        decided_at: float | None = None,
    ) -> None:
        """Point the deployment at the target (one decision: the record, the target's hold
        turned into the record's GPUs and, with `hold_source`, the source's GPUs held until
        `release_move`), then push the update to the client's stream, with the time since
        `decided_at` (time.monotonic() of the migration's decision) as its `prepared_ms`."""
        entry = self.nodes[move.target_node]
        async with self._placing.use("switch"):
            if hold_source and move.source_node:
                record = self._deployments.get(move.deployment_id)
                assert record is not None
                spec = DeploySpec.from_json(record.request_json)
                self._hold(
                    (move.deployment_id, move.source_epoch),
                    Hold(move.source_node, move.source_gpus, spec.gpu_memory_mib, spec.priority),
                )
            record = await self._update(
                move.deployment_id,
                state=DeploymentState.RUNNING,
                node_id=move.target_node,
                gpus=move.target_gpus,
                gpu_uuids=tuple(entry.inventory.gpus[i].uuid for i in move.target_gpus),
                endpoint=endpoint,
                epoch=move.epoch,
                reason="",
                explanation_json=move.explanation_json,
            )
            self._unhold((move.deployment_id, move.epoch))
        prepared_ms = None if decided_at is None else (time.monotonic() - decided_at) * 1000
        self.watchers.push(
            move.deployment_id,
            placement_update(record, reason, migration_id=migration_id, prepared_ms=prepared_ms),
        )

    async def abandon_move(self, move: Move, reason: str) -> None:
        """The move failed with no replica left serving (failover, stop-start): the
        deployment becomes pending and is placed again as soon as something fits. Then
        `release_move`."""
        async with self._placing.use("move abandoned"):
            await self._write_pending(move.deployment_id, reason)
            self._release(move)
        self._publish(move.deployment_id)
        self._spawn_replace(move.deployment_id)

    def release_move(self, move: Move) -> None:
        """Drop what `move` holds (idempotent): its GPUs, and the deployment itself."""
        self._release(move)

    def _release(self, move: Move) -> None:
        self._unhold((move.deployment_id, move.epoch))
        self._unhold((move.deployment_id, move.source_epoch))
        self._untake(move.deployment_id)

    async def deployment(self, deployment_id: str) -> DeploymentRecord | None:
        """Any client's deployment, as stored (a deleted one read from the store); None when
        unknown."""
        record = self._deployments.get(deployment_id)
        if record is None:
            record = await self._db(self._store.get_deployment, deployment_id)
        return record

    async def running(self) -> list[DeploymentRecord]:
        """Every running deployment, as stored."""
        return self._deployments.select(states=(DeploymentState.RUNNING,))

    async def running_on(self, node_id: str) -> list[DeploymentRecord]:
        """The running deployments the store places on `node_id`."""
        return [
            r for r in self._deployments.on_node(node_id) if r.state is DeploymentState.RUNNING
        ]

    async def set_site(self, deployment_id: str, site: str) -> None:
        """Record the site the deployment's client reports from."""
        await self._update(deployment_id, site=site)

    # --- migration records ---------------------------------------------------------------

    async def record_migration(self, record: MigrationRecord) -> None:
        await self._db(self._store.create_migration, record)

    async def update_migration(self, migration_id: str, **changes: Any) -> None:
        """KeyError for an unknown migration."""
        await self._db(self._store.update_migration, migration_id, **changes)

    async def list_migrations(
        self,
        deployment_id: str | None = None,
        *,
        states: Collection[MigrationState] | None = None,
        updated_since: float | None = None,
    ) -> list[MigrationRecord]:
        """Migrations, oldest first: every one, or one deployment's, in `states`, changed
        since `updated_since` (`StateStore.list_migrations`)."""
        return await self._db(
            self._store.list_migrations,
            deployment_id,
            states=states,
            updated_since=updated_since,
        )

    async def get_migration(self, migration_id: str) -> MigrationRecord:
        """NotFound for an unknown migration."""
        found = await self._db(self._store.get_migration, migration_id)
        if found is None:
            raise NotFound(f"migration {migration_id} not found")
        return found

    # --- adaptive offload reports ----------------------------------------------------------

    async def record_offload(
        self, client_id: str, deployment_id: str, summary: OffloadSummary
    ) -> None:
        """Keep `summary` as the latest of its session for the client's deployment, stamped
        now. NotFound for an unknown deployment and for another client's (as `get`), also
        when it is deleted before the report is written. A report its session has a newer one
        of (more requests) changes nothing; so does the same report twice."""
        record = OffloadReportRecord(deployment_id, client_id, summary, time.time())
        if not await self._db(self._put_offload, record):
            raise NotFound(f"deployment {deployment_id} not found")
        logger.debug(
            "deployment=%s session=%s offload: %d remote, %d local, %d fallback(s)",
            deployment_id,
            summary.session,
            summary.remote_requests,
            summary.local_requests,
            summary.fallbacks,
        )

    def _put_offload(self, record: OffloadReportRecord) -> bool:
        """In the state thread, one transaction: the deployment is the client's and visible,
        and the report is written, or nothing is (False)."""
        with self._store.transaction():
            current = self._store.get_deployment(record.deployment_id)
            if (
                current is None
                or current.client_id != record.client_id
                or current.state not in VISIBLE
            ):
                return False
            self._store.put_offload_report(record, keep=OFFLOAD_SESSIONS_KEPT)
        return True

    async def offload_reports(self) -> list[OffloadReportRecord]:
        """The latest offload summary of each session of every deployment, by deployment, the
        most recently reported first (a deleted deployment's are gone with it)."""
        return await self._db(self._store.list_offload_reports)

    async def get(self, client_id: str, deployment_id: str) -> DeploymentRecord:
        """NotFound for an unknown deployment and for another client's: the two look alike."""
        record = self._deployments.get(deployment_id)
        if record is None or record.client_id != client_id or record.state not in VISIBLE:
            raise NotFound(f"deployment {deployment_id} not found")
        return record

    async def list(self, client_id: str) -> list[DeploymentRecord]:
        return self._deployments.select(client_id=client_id, states=VISIBLE)

    async def delete(self, client_id: str, deployment_id: str) -> bool:
        """Delete one of `client_id`'s deployments: stop its replica and its standby, if any,
        which frees their GPUs, and mark it deleted, which frees its place in the client's
        quota (`--max-deployments-per-client`). A pending or failed deployment holds no GPUs:
        it is only marked. True when this call deleted it.

        Idempotent: a deployment of the client's that is deleted already (by an earlier call,
        or one that ended as this one's lookup ran) answers False and changes nothing, so a
        delete whose answer was lost can be sent again. NotFound for an id there never was
        (and for one being created, not yet answered to its client); PermissionDenied for
        another client's deployment, deleted or not: ids are random, so a caller naming one
        learns only that the id is not theirs (GetDeployment and the other calls still answer
        NotFound for it, as for an unknown one). Busy while it is being migrated, or deleted
        by another call: the same call succeeds once that has finished.

        The delete runs as the broker's own task: a caller that goes away (its deadline, a
        cancelled call) leaves it to finish, never a replica stopped under a deployment
        still recorded running."""
        task = self._own(self._delete(client_id, deployment_id), f"delete-{deployment_id}")
        task.add_done_callback(retrieve)
        return await asyncio.shield(task)

    async def _delete(self, client_id: str, deployment_id: str) -> bool:
        standby: Standby | None = None
        async with self._placing.use("delete"):
            record = self._deployments.get(deployment_id)
            if record is not None:
                if record.client_id != client_id:
                    raise PermissionDenied(f"deployment {deployment_id} is not yours")
                self._claim(deployment_id)
                standby = self._standbys.pop(deployment_id, None)
                if standby is not None:
                    self._retiring.add(standby)
        if record is None:
            # The table drops a deployment only once its deletion is durable: what it lacks
            # is deleted, never was, or is still being created.
            stored = await self._db(self._store.get_deployment, deployment_id)
            if stored is not None and stored.client_id != client_id:
                raise PermissionDenied(f"deployment {deployment_id} is not yours")
            if stored is None or stored.state is not DeploymentState.DELETED:
                raise NotFound(f"deployment {deployment_id} not found")
            return False
        try:
            if standby is not None:
                await self._stop_standby(standby, "the deployment is deleted", "lapsed")
            if record.state in ACTIVE:
                await self.stop_replica(record.node_id, replica_id(deployment_id, record.epoch))
            # The commit is awaited outside the placement lock (it was 36-44 % of the lock's
            # time under the control-plane bench's mix): until the table drops the record,
            # its GPUs stay taken, which only ever holds placement back, and the deployment
            # is claimed, so no move, requeue or second delete touches it meanwhile.
            deleted = await self._db(self._store.delete_deployment, deployment_id)
            async with self._placing.use("deleted"):
                self._keep(deleted)
        finally:
            self._untake(deployment_id)
        self.load_history.forget_deployment(deployment_id)
        self.watchers.push(deployment_id, None)
        logger.info("deployment=%s deleted", deployment_id)
        return True

    def _publish(self, deployment_id: str) -> None:
        """Tell the deployment's watchers where it is now."""
        record = self._deployments.get(deployment_id)
        if record is not None:
            self.watchers.push(
                deployment_id,
                PlacementUpdate(
                    deployment_id,
                    record.endpoint,
                    record.token,
                    record.epoch,
                    record.reason,
                    record.state,
                ),
            )

    async def watch(
        self, client_id: str, deployment_id: str, authorization: str | None = None
    ) -> AsyncIterator[PlacementUpdate]:
        """The current placement, then one update per change; ends when it is deleted.
        Unauthenticated, ending it, when the key of `authorization` (the one the stream was
        opened with, as `client_for` takes it) stops working (`use_keys`)."""
        record = await self.get(client_id, deployment_id)
        queue = self.watchers.add(deployment_id)
        revoked = False

        def revoke() -> None:
            nonlocal revoked
            revoked = True
            queue.put_nowait(None)

        api_key = (authorization or "").removeprefix("Bearer ")
        try:
            with self._keys.on_revoke(api_key, revoke) if api_key else contextlib.nullcontext():
                yield placement_update(record, "current")
                while (update := await queue.get()) is not None:
                    yield update
                if revoked:
                    raise Unauthenticated(
                        "the API key this stream was opened with was revoked; open it again "
                        "with the client's current key"
                    )
        finally:
            self.watchers.remove(deployment_id, queue)

    async def report_location(self, client_id: str, site: str) -> None:
        if site not in self.network.sites:
            raise InvalidRequest(
                f"site {quote(site)} is unknown; known sites: {', '.join(self.network.sites)}"
            )
        await self._db(self._store.set_client_site, client_id, site)


@functools.lru_cache(maxsize=65536)
def _allocation_terms(request_json: str) -> tuple[PriorityClass, int]:
    """(priority, GPU memory share in MiB) of a stored deploy request: placement's view of
    a node reads them for each deployment on it, each time the node changes."""
    spec = DeploySpec.from_json(request_json)
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


def _runs(record: DeploymentRecord | None) -> TypeGuard[DeploymentRecord]:
    """Whether `record` is a deployment running on a node (what a move or a standby needs)."""
    return (
        record is not None
        and record.state is DeploymentState.RUNNING
        and record.node_id is not None
    )
