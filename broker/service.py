"""The broker's domain: nodes, models and deployments, and how they change.

Plain Python over the state store (SQLite), the model store, the edge network, placement
(pure functions) and one `NodeClient` per node; the gRPC servicers in `broker.rpc` are thin
layers over it. Blocking store calls run in one worker thread (`_db`), in order.

Durability: every change is written to the store before it is acted on or answered, so a
broker killed at any point restarts into a state it can reconcile with what the nodes
report. Heartbeats are kept in memory only (a lost node is written when it is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from broker.errors import (
    Impossible,
    InvalidRequest,
    NodeUnavailable,
    NotFound,
    ResourceExhausted,
)
from broker.model_store import InvalidModel, ModelStore, Upload
from broker.model_store import ModelNotFound as StoredModelNotFound
from broker.model_store import ModelTooLarge as StoredModelTooLarge
from broker.network import EdgeNetwork, UnknownSite
from broker.node_client import NodeClient
from broker.ops import BrokerMetrics
from broker.placement import (
    Allocation,
    ClusterSnapshot,
    Decision,
    NodeSnapshot,
    PlacementRequest,
    PriorityClass,
    place,
)
from broker.state import (
    DeploymentRecord,
    DeploymentState,
    ModelRecord,
    NodeRecord,
    NodeState,
    StateStore,
)
from node_daemon.inventory import Gpu, Inventory, Link, LinkKind
from node_daemon.topology import Topology

logger = logging.getLogger(__name__)

T = TypeVar("T")

ACTIVE = (DeploymentState.STARTING, DeploymentState.RUNNING)
"""Deployments that hold GPUs on a node."""
VISIBLE = (
    DeploymentState.PENDING,
    DeploymentState.STARTING,
    DeploymentState.RUNNING,
    DeploymentState.FAILED,
)
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_GPUS = 64


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

    def validate(self) -> None:
        if not _MODEL_NAME.fullmatch(self.model_name):
            raise InvalidRequest(
                f"model_name {self.model_name!r} must be 1-64 characters of letters, digits, "
                "'_', '.' and '-'"
            )
        if not 0 <= self.gpus <= MAX_GPUS:
            raise InvalidRequest(f"gpus must be within 0..{MAX_GPUS}, not {self.gpus}")
        if self.gpu_memory_mib < 0 or self.cpus < 0 or self.memory_mib < 0:
            raise InvalidRequest("gpu_memory_mib, cpus and memory_mib must not be negative")
        if self.gpu_memory_mib and not self.gpus:
            raise InvalidRequest("a GPU memory share (gpu_memory_mib) needs gpus >= 1")
        if self.latency_slo_ms < 0:
            raise InvalidRequest("latency_slo_ms must not be negative")

    def to_json(self) -> str:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["priority"] = int(self.priority)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DeploySpec:
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


@dataclass(frozen=True, slots=True)
class Hold:
    """GPUs held outside a deployment's record: a migration's target before the switch,
    its source after it until the old replica stops."""

    node_id: str
    gpus: tuple[int, ...]
    memory_mib: int
    priority: PriorityClass


@dataclass(slots=True)
class NodeEntry:
    """A node the broker knows, as of its last registration and heartbeat."""

    record: NodeRecord
    inventory: Inventory
    topology: Topology
    client: NodeClient
    last_heartbeat: float
    """time.monotonic() of the last registration or heartbeat."""
    replicas: frozenset[str] = frozenset()
    """The replica ids the node reported last."""
    load: float = 0.0


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


def inventory_to_json(inventory: Inventory) -> str:
    return json.dumps(
        {
            "gpus": [
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "name": g.name,
                    "memory_total_mib": g.memory_total_mib,
                    "numa_node": g.numa_node,
                }
                for g in inventory.gpus
            ],
            "links": [[a, b, str(link)] for (a, b), link in sorted(inventory.links.items())],
            "driver_version": inventory.driver_version,
            "cuda_version": inventory.cuda_version,
        }
    )


def inventory_from_json(text: str) -> Inventory:
    data = json.loads(text)
    links = {}
    for a, b, kind in data["links"]:
        links[(a, b)] = (
            Link(LinkKind.NV, int(kind[2:])) if kind.startswith("NV") else Link(LinkKind(kind))
        )
    return Inventory(
        gpus=tuple(Gpu(**g) for g in data["gpus"]),
        links=links,
        driver_version=data["driver_version"],
        cuda_version=data["cuda_version"],
    )


class Broker:
    def __init__(
        self,
        store: StateStore,
        models: ModelStore,
        network: EdgeNetwork,
        join_token: str,
        settings: BrokerSettings,
        metrics: BrokerMetrics,
    ) -> None:
        self.store = store
        self.models = models
        self.network = network
        self.settings = settings
        self.metrics = metrics
        self._join_token = join_token
        self._db_executor = ThreadPoolExecutor(1, thread_name_prefix="state")
        self.nodes: dict[str, NodeEntry] = {}
        self.placing = asyncio.Lock()
        self.watchers = _Watchers()
        self._orphans: dict[tuple[str, str], float] = {}
        """(node id, replica id) -> when first seen unclaimed (monotonic)."""
        self._key_cache: dict[str, str] = {}
        self._replacing: set[str] = set()
        self.busy: set[str] = set()
        """Deployments being migrated or deleted: reconciliation leaves them alone (their
        replicas come and go on purpose)."""
        self.holds: dict[tuple[str, int], Hold] = {}
        """(deployment id, epoch) -> GPUs held for that replica beyond the records."""
        self._tasks: set[asyncio.Task[None]] = set()
        """Background work started by a change (placing again, publishing updates)."""

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._db_executor, lambda: fn(*args, **kwargs))

    # --- start-up and shutdown -----------------------------------------------------------

    async def load(self) -> None:
        """Reload the nodes the store knows (they get a full heartbeat timeout to check in)."""
        for record in await self.db(self.store.list_nodes):
            if record.state is NodeState.LOST:
                continue
            try:
                inventory = inventory_from_json(record.inventory_json)
                self.network.add_node(record.node_id, record.site)
            except (ValueError, KeyError) as err:
                logger.error("node=%s in the state cannot be restored: %s", record.node_id, err)
                continue
            self.nodes[record.node_id] = NodeEntry(
                record,
                inventory,
                Topology.from_inventory(inventory),
                NodeClient(record.node_id, record.address, self._join_token),
                time.monotonic(),
            )
        deployments = await self.db(self.store.list_deployments, states=VISIBLE)
        logger.info(
            "state loaded: %d node(s), %d deployment(s)", len(self.nodes), len(deployments)
        )

    def background(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for entry in self.nodes.values():
            await entry.client.close()
        for deployment_id in list(self.watchers.queues):
            self.watchers.push(deployment_id, None)
        self._db_executor.shutdown(wait=True)

    # --- authentication ------------------------------------------------------------------

    def check_join_token(self, supplied: str | None) -> bool:
        return supplied is not None and hmac.compare_digest(
            supplied.encode(), f"Bearer {self._join_token}".encode()
        )

    async def client_for(self, authorization: str | None) -> str | None:
        """The client id an `authorization: Bearer <api key>` value belongs to, or None."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        key = authorization.removeprefix("Bearer ")
        digest = hashlib.sha256(key.encode()).hexdigest()
        if digest in self._key_cache:
            return self._key_cache[digest]
        client_id = await self.db(self.store.client_for_api_key, key)
        if client_id is not None:
            self._key_cache[digest] = client_id
        return client_id

    # --- nodes ---------------------------------------------------------------------------

    async def register_node(
        self,
        node_id: str,
        address: str,
        site: str,
        inventory: Inventory,
        runtimes: Sequence[str],
        replicas: Sequence[tuple[str, str]],
    ) -> None:
        """Record (or refresh) a node and reconcile the replicas it reports, given as
        (replica id, state name). InvalidRequest for an unknown site or bad fields."""
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{0,62}", node_id):
            raise InvalidRequest(f"node_id {node_id!r} must be 1-63 of a-z, 0-9, '.', '-'")
        if not re.fullmatch(r"[^\s:]+:\d{1,5}", address):
            raise InvalidRequest(f"address {address!r} is not host:port")
        if site not in self.network.sites:
            raise InvalidRequest(
                f"site {site!r} is not in the cluster file; known sites: "
                f"{', '.join(self.network.sites)}"
            )
        try:
            topology = Topology.from_inventory(inventory)
        except ValueError as err:
            raise InvalidRequest(f"inventory: {err}") from err
        now = time.time()
        previous = self.nodes.get(node_id)
        record = NodeRecord(
            node_id=node_id,
            address=address,
            site=site,
            state=NodeState.READY,
            inventory_json=inventory_to_json(inventory),
            runtimes=tuple(runtimes),
            registered_at=now,
            last_heartbeat_at=now,
            usage_json="{}",
        )
        await self.db(self.store.upsert_node, record)
        self.network.add_node(node_id, site)
        if previous is not None and previous.record.address == address:
            client = previous.client
        else:
            if previous is not None:
                await previous.client.close()
            client = NodeClient(node_id, address, self._join_token)
        entry = NodeEntry(record, inventory, topology, client, time.monotonic())
        self.nodes[node_id] = entry
        logger.info(
            "node=%s registered site=%s gpus=%d replicas=%d",
            node_id,
            site,
            len(inventory.gpus),
            len(replicas),
        )
        await self._reconcile(entry, replicas)

    async def heartbeat(
        self, node_id: str, load: float, replicas: Sequence[tuple[str, str]]
    ) -> None:
        """NotFound when the node is unknown (it registers again)."""
        entry = self.nodes.get(node_id)
        if entry is None:
            raise NotFound(f"node {node_id} is not registered; register again")
        entry.last_heartbeat = time.monotonic()
        entry.load = min(1.0, max(0.0, load))
        if entry.record.state is NodeState.LOST:
            entry.record = replace(entry.record, state=NodeState.READY)
            await self.db(self.store.set_node_state, node_id, NodeState.READY)
            logger.info("node=%s is back", node_id)
        await self._reconcile(entry, replicas)

    async def _reconcile(self, entry: NodeEntry, replicas: Sequence[tuple[str, str]]) -> None:
        """Compare what the node runs with what the broker expects on it: a deployment whose
        replica is gone or exited is placed again; a replica nobody claims is stopped after
        the orphan grace period."""
        node_id = entry.record.node_id
        running = {rid for rid, state in replicas if state in ("ready", "starting", "stopping")}
        # A heartbeat may have been taken before a switch it is processed after.
        settled_before = time.time() - 2 * self.settings.heartbeat_interval_s
        entry.replicas = frozenset(rid for rid, _ in replicas)
        expected = {
            f"{d.deployment_id}-{d.epoch}": d
            for d in await self.db(self.store.list_deployments, states=(DeploymentState.RUNNING,))
            if d.node_id == node_id
        }
        for replica_id, deployment in expected.items():
            if (
                replica_id not in running
                and deployment.deployment_id not in self._replacing
                and deployment.deployment_id not in self.busy
                and deployment.updated_at < settled_before
            ):
                logger.warning(
                    "deployment=%s: its replica %s is not running on node %s; placing it again",
                    deployment.deployment_id,
                    replica_id,
                    node_id,
                )
                await self._requeue(deployment, f"replica lost on node {node_id}")
        starting = {
            f"{d.deployment_id}-{d.epoch}"
            for d in await self.db(self.store.list_deployments, states=(DeploymentState.STARTING,))
        }
        now = time.monotonic()
        for replica_id, _state in replicas:
            if replica_id in expected or replica_id in starting:
                self._orphans.pop((node_id, replica_id), None)
                continue
            first = self._orphans.setdefault((node_id, replica_id), now)
            if now - first >= self.settings.orphan_grace_s:
                logger.warning(
                    "node=%s replica=%s: no deployment claims it; stopping", node_id, replica_id
                )
                del self._orphans[(node_id, replica_id)]
                with contextlib.suppress(NodeUnavailable):
                    await entry.client.stop_replica(replica_id, self.settings.stop_grace_ms)

    async def mark_lost_nodes(self) -> list[str]:
        """Mark nodes silent past the timeout as lost; returns their ids."""
        now = time.monotonic()
        lost = []
        for node_id, entry in self.nodes.items():
            silent = now - entry.last_heartbeat
            if entry.record.state is NodeState.READY and silent > self.settings.lost_after_s:
                entry.record = replace(entry.record, state=NodeState.LOST)
                await self.db(self.store.set_node_state, node_id, NodeState.LOST)
                logger.error("node=%s lost: no heartbeat for %.1fs", node_id, silent)
                lost.append(node_id)
        return lost

    # --- models --------------------------------------------------------------------------

    def begin_upload(self, sha256: str) -> Upload:
        try:
            return self.models.upload(sha256)
        except (InvalidModel, ValueError) as err:
            raise InvalidRequest(str(err)) from err

    async def finish_upload(self, upload: Upload, name: str) -> tuple[str, int, bool]:
        """Check and store the upload (sha256, loadable ONNX), then record it."""
        try:
            result = await asyncio.to_thread(upload.commit)
        except InvalidModel as err:
            raise InvalidRequest(str(err)) from err
        except StoredModelTooLarge as err:
            raise ResourceExhausted(str(err)) from err
        created = await self.db(
            self.store.put_model,
            ModelRecord(result.sha256, name or result.sha256[:12], result.size_bytes, time.time()),
        )
        return result.sha256, result.size_bytes, result.deduplicated or not created

    def write_upload(self, upload: Upload, data: bytes) -> None:
        try:
            upload.write(data)
        except StoredModelTooLarge as err:
            raise ResourceExhausted(str(err)) from err

    def model_chunks(self, sha256: str) -> Iterator[bytes]:
        """Blocking generator over a stored model. NotFound when absent."""
        try:
            yield from self.models.open_chunks(sha256)
        except (StoredModelNotFound, ValueError, InvalidModel) as err:
            raise NotFound(f"model {sha256} is not stored at the broker") from err

    # --- deployments ---------------------------------------------------------------------

    def _snapshot(self, deployments: Sequence[DeploymentRecord]) -> ClusterSnapshot:
        by_node: dict[str, list[DeploymentRecord]] = {}
        for d in deployments:
            if d.node_id and d.state in ACTIVE:
                by_node.setdefault(d.node_id, []).append(d)
        nodes = []
        for node_id, entry in self.nodes.items():
            node = NodeSnapshot.idle(
                node_id,
                entry.record.site,
                entry.topology,
                ready=entry.record.state is NodeState.READY,
                runtimes=entry.record.runtimes,
                cuda_version=entry.inventory.cuda_version,
                load=entry.load,
            )
            for d in by_node.get(node_id, ()):
                spec = DeploySpec.from_json(d.request_json)
                node = node.with_allocation(
                    Allocation(d.deployment_id, spec.priority, d.gpus, spec.gpu_memory_mib)
                )
            for (deployment_id, epoch), hold in self.holds.items():
                if hold.node_id == node_id:
                    node = node.with_allocation(
                        Allocation(
                            f"{deployment_id}@{epoch}", hold.priority, hold.gpus, hold.memory_mib
                        )
                    )
            nodes.append(node)
        return ClusterSnapshot.of(nodes)

    async def current_snapshot(self) -> ClusterSnapshot:
        """The cluster as placement sees it now (call under `placing`)."""
        return self._snapshot(await self.db(self.store.list_deployments, states=ACTIVE))

    async def set_node_state(self, node_id: str, state: NodeState) -> None:
        entry = self.nodes[node_id]
        entry.record = replace(entry.record, state=state)
        await self.db(self.store.set_node_state, node_id, state)

    async def deploy(self, client_id: str, spec: DeploySpec) -> DeploymentRecord:
        """Place and start a deployment; returns it once its replica is ready.

        InvalidRequest, NotFound (model not uploaded), Impossible (more than any node has),
        ResourceExhausted (nothing fits now), NodeUnavailable (the node failed to start it).
        """
        spec.validate()
        if await self.db(self.store.get_model, spec.model_sha256) is None:
            raise NotFound(f"model {spec.model_sha256} is not uploaded; call UploadModel first")
        if spec.site not in self.network.sites:
            raise InvalidRequest(
                f"site {spec.site!r} is unknown; known sites: {', '.join(self.network.sites)}"
            )
        deployment_id = f"d-{secrets.token_hex(5)}"
        record, decision = await self._reserve(deployment_id, client_id, spec, epoch=1)
        await self._evict(decision.preempt, deployment_id)
        record = await self._start(record, "deployed")
        for evicted in decision.preempt:
            self._spawn_replace(evicted)
        return record

    async def _reserve(
        self, deployment_id: str, client_id: str, spec: DeploySpec, epoch: int
    ) -> tuple[DeploymentRecord, Decision]:
        async with self.placing:
            snapshot = await self.current_snapshot()
            largest, largest_node = snapshot.largest()
            if spec.gpus > largest:
                raise Impossible(
                    f"asks for {spec.gpus} GPU(s); the largest node has {largest} "
                    f"({largest_node or 'no nodes registered'}): ask for at most {largest}"
                )
            request = PlacementRequest(
                deployment_id=deployment_id,
                site=spec.site,
                gpus=spec.gpus,
                gpu_memory_mib=spec.gpu_memory_mib,
                p2p_required=spec.p2p_required,
                priority=spec.priority,
                latency_slo_ms=spec.latency_slo_ms or None,
            )
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
            if epoch == 1:
                await self.db(self.store.create_deployment, record)
            else:
                record = await self.db(
                    self.store.update_deployment,
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
            logger.info(
                "deployment=%s placed on node=%s gpus=%s (%s)",
                deployment_id,
                decision.node_id,
                decision.gpus,
                ", ".join(decision.explanation.deciding) or "only candidate",
            )
            return record, decision

    async def _start(self, record: DeploymentRecord, reason: str) -> DeploymentRecord:
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
                gpu_memory_mib=spec.gpu_memory_mib,
                cpus=spec.cpus,
                memory_mib=spec.memory_mib,
                token=record.token,
            )
        except (NodeUnavailable, ResourceExhausted) as err:
            await self.db(
                self.store.update_deployment,
                record.deployment_id,
                state=DeploymentState.FAILED,
                reason=str(err),
            )
            self._publish(record.deployment_id)
            raise NodeUnavailable(str(err)) from err
        record = await self.db(
            self.store.update_deployment,
            record.deployment_id,
            state=DeploymentState.RUNNING,
            endpoint=endpoint,
        )
        self.watchers.push(record.deployment_id, placement_update(record, reason))
        logger.info(
            "deployment=%s running at %s epoch=%d",
            record.deployment_id,
            record.endpoint,
            record.epoch,
        )
        return record

    async def _evict(self, deployment_ids: Sequence[str], by: str) -> None:
        for deployment_id in deployment_ids:
            record = await self.db(self.store.get_deployment, deployment_id)
            if record is None:
                continue
            await self._requeue(record, f"preempted by {by}", place_again=False)

    async def _requeue(
        self, record: DeploymentRecord, reason: str, place_again: bool = True
    ) -> None:
        """Take a deployment off its node (stopping its replica if the node is there) and
        mark it pending; with `place_again`, try to place it at once."""
        entry = self.nodes.get(record.node_id or "")
        if entry is not None and entry.record.state is NodeState.READY:
            with contextlib.suppress(NodeUnavailable):
                await entry.client.stop_replica(
                    f"{record.deployment_id}-{record.epoch}", self.settings.stop_grace_ms
                )
        await self.db(
            self.store.update_deployment,
            record.deployment_id,
            state=DeploymentState.PENDING,
            node_id=None,
            gpus=(),
            gpu_uuids=(),
            endpoint="",
            reason=reason,
        )
        self._publish(record.deployment_id)
        if place_again:
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
        record = await self.db(self.store.get_deployment, deployment_id)
        if record is None or record.state is not DeploymentState.PENDING:
            return
        spec = DeploySpec.from_json(record.request_json)
        try:
            record, decision = await self._reserve(
                deployment_id, record.client_id, spec, record.epoch + 1
            )
        except (ResourceExhausted, Impossible) as err:
            await self.db(
                self.store.update_deployment,
                deployment_id,
                reason=f"{record.reason}; waiting: {str(err).splitlines()[0]}",
            )
            return
        await self._evict(decision.preempt, deployment_id)
        try:
            await self._start(record, "replaced")
        except NodeUnavailable as err:
            logger.error("deployment=%s could not be placed again: %s", deployment_id, err)
        for evicted in decision.preempt:
            self._spawn_replace(evicted)

    async def retry_pending(self) -> None:
        for record in await self.db(
            self.store.list_deployments, states=(DeploymentState.PENDING,)
        ):
            self._spawn_replace(record.deployment_id)

    async def get(self, client_id: str, deployment_id: str) -> DeploymentRecord:
        """NotFound for an unknown deployment and for another client's: the two look alike."""
        record = await self.db(self.store.get_deployment, deployment_id)
        if record is None or record.client_id != client_id or record.state not in VISIBLE:
            raise NotFound(f"deployment {deployment_id} not found")
        return record

    async def list(self, client_id: str) -> list[DeploymentRecord]:
        return await self.db(self.store.list_deployments, client_id=client_id, states=VISIBLE)

    async def delete(self, client_id: str, deployment_id: str) -> None:
        record = await self.get(client_id, deployment_id)
        self.busy.add(deployment_id)
        try:
            await self._delete(record)
        finally:
            self.busy.discard(deployment_id)

    async def _delete(self, record: DeploymentRecord) -> None:
        deployment_id = record.deployment_id
        entry = self.nodes.get(record.node_id or "")
        if entry is not None and record.state in ACTIVE:
            try:
                await entry.client.stop_replica(
                    f"{record.deployment_id}-{record.epoch}", self.settings.stop_grace_ms
                )
            except NodeUnavailable as err:
                logger.warning(
                    "deployment=%s: %s (the node will stop it later)", deployment_id, err
                )
        await self.db(self.store.delete_deployment, deployment_id)
        self.watchers.push(deployment_id, None)
        logger.info("deployment=%s deleted", deployment_id)

    def _publish(self, deployment_id: str) -> None:
        self.background(self._publish_now(deployment_id), f"publish-{deployment_id}")

    async def _publish_now(self, deployment_id: str) -> None:
        record = await self.db(self.store.get_deployment, deployment_id)
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

    async def watch(self, client_id: str, deployment_id: str) -> AsyncIterator[PlacementUpdate]:
        """The current placement, then one update per change; ends when it is deleted."""
        record = await self.get(client_id, deployment_id)
        queue = self.watchers.add(deployment_id)
        try:
            yield placement_update(record, "current")
            while (update := await queue.get()) is not None:
                yield update
        finally:
            self.watchers.remove(deployment_id, queue)

    async def report_location(self, client_id: str, site: str) -> None:
        if site not in self.network.sites:
            raise InvalidRequest(
                f"site {site!r} is unknown; known sites: {', '.join(self.network.sites)}"
            )
        await self.db(self.store.set_client_site, client_id, site)


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
    record: DeploymentRecord, reason: str, migration_id: str = ""
) -> PlacementUpdate:
    return PlacementUpdate(
        record.deployment_id,
        record.endpoint,
        record.token,
        record.epoch,
        reason,
        record.state,
        migration_id,
    )


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("%s failed: %s", task.get_name(), task.exception())
