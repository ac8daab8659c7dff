"""Deployments: the owner of the deployment records (the store's rows and the in-memory
table), of the clients' watch streams, and of the decisions that place a deployment, place
it again, and delete it. Reads of deployments come from memory; every change is written to
the store before it is acted on or answered."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Unpack

from broker.applier import PlacementApplier
from broker.core import Core, retrieve
from broker.deployment_table import ACTIVE, DeploymentTable
from broker.errors import (
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
from broker.ids import replica_id
from broker.key_verifier import KeyVerifier
from broker.model_store import ModelStore
from broker.network import EdgeNetwork, UnknownSite
from broker.nodes import NodeRegistry
from broker.ops.metrics import BrokerMetrics
from broker.placement import place
from broker.quotas import ClientLimits, check_deployments
from broker.standbys import StandbyPool
from broker.state import DeploymentRecord, DeploymentState
from broker.uploads import Uploads
from broker.values import (
    VISIBLE,
    BrokerSettings,
    DeploymentChanges,
    DeploymentReader,
    DeploySpec,
    PlacementUpdate,
    Standby,
    explanation_json,
    placement_update,
    spec_of,
)
from common.replica_memory import share_too_small

logger = logging.getLogger(__name__)


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


def new_deployment_id() -> str:
    return f"d-{secrets.token_hex(5)}"


class Deployments:
    """Every deployment not deleted, as stored (`DeploymentTable`: changed after every
    write the store commits), the clients watching them, and the decisions that place
    them (through the applier)."""

    def __init__(
        self,
        core: Core,
        registry: NodeRegistry,
        applier: PlacementApplier,
        table: DeploymentTable,
        standbys: StandbyPool,
        uploads: Uploads,
        *,
        models: ModelStore,
        network: EdgeNetwork,
        limits: ClientLimits,
        keys: KeyVerifier,
        metrics: BrokerMetrics,
        settings: BrokerSettings,
    ) -> None:
        self._core = core
        self._registry = registry
        self._applier = applier
        self._table = table
        self._standbys = standbys
        self._uploads = uploads
        self._models = models
        self._network = network
        self._limits = limits
        self._keys = keys
        self._metrics = metrics
        self._settings = settings
        self.watchers = _Watchers()
        """The clients' WatchDeployment streams, by deployment."""
        self._replacing: set[str] = set()
        """Deployments being placed again (`spawn_replace`), one task each."""

    @property
    def table(self) -> DeploymentReader:
        """The deployments as stored, read-only."""
        return self._table

    def is_replacing(self, deployment_id: str) -> bool:
        """Whether the deployment is being placed again now."""
        return deployment_id in self._replacing

    async def load(self) -> None:
        """Reload the deployments the store has. One found `starting` was being started when
        the previous broker stopped: whether its replica came up is unknown, and nothing is
        waiting for it. It becomes pending (placed again by `retry_pending`, at the next
        epoch); a replica it may have left is claimed by nothing and stopped after the
        orphan grace."""
        self._table.load(await self._core.db(self._core.store.list_deployments, states=VISIBLE))
        for starting in self._table.select(states=(DeploymentState.STARTING,)):
            async with self._applier.use("load"):
                await self.write_pending(
                    starting.deployment_id, "the broker restarted while its replica was starting"
                )
            logger.warning(
                "deployment=%s was starting at restart: pending", starting.deployment_id
            )

    def close(self) -> None:
        """End every watch stream."""
        for deployment_id in list(self.watchers.queues):
            self.watchers.push(deployment_id, None)

    async def visible(self) -> list[DeploymentRecord]:
        """Every deployment a client can see (pending, starting, running, failed)."""
        return self._table.select(states=VISIBLE)

    def keep(self, record: DeploymentRecord) -> DeploymentRecord:
        """`record`, as the store has just committed it, into the table; placement's view
        of the nodes it left or joined is stale."""
        self._applier.records_changed(self._table.put(record))
        return record

    async def update(
        self, deployment_id: str, **changes: Unpack[DeploymentChanges]
    ) -> DeploymentRecord:
        """Change a deployment in the store, then in the table; the record as stored."""
        return self.keep(
            await self._core.db(self._core.store.update_deployment, deployment_id, **changes)
        )

    async def deploy(
        self, client_id: str, spec: DeploySpec, deployment_id: str | None = None
    ) -> DeploymentRecord:
        """Place and start a deployment (`deployment_id`: one its caller recorded already,
        else a new one); returns it once its replica is ready, or pending
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
        if not await self._uploads.owns(client_id, spec.model_sha256):
            raise NotFound(f"model {spec.model_sha256} is not uploaded; call UploadModel first")
        if spec.gpu_memory_mib:
            need = await asyncio.to_thread(self._models.gpu_need, spec.model_sha256)
            if need is not None and (
                refusal := share_too_small(spec.gpu_memory_mib, spec.model_name, need)
            ):
                raise Unfit(refusal)
        if spec.site not in self._network.sites:
            known = ", ".join(self._network.sites)
            raise InvalidRequest(f"site {quote(spec.site)} is unknown; known sites: {known}")
        deployment_id = deployment_id or new_deployment_id()
        task = self._core.own(
            self._deploy(deployment_id, client_id, spec), f"deploy-{deployment_id}"
        )
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
        async with self._applier.use("decide"):
            holding = time.perf_counter()
            if epoch == 1:
                current = self._table.count(client_id, VISIBLE)
                current += self._applier.creating(client_id)
                check_deployments(self._limits.quotas, client_id, current)
            snapshot = self._applier.view()
            largest, largest_node = snapshot.largest()
            if spec.gpus > largest:
                raise Impossible(
                    f"asks for {spec.gpus} GPU(s); the largest node has {largest} "
                    f"({largest_node or 'no nodes registered'}): ask for at most {largest}"
                )
            request = spec.placement_request(deployment_id, spec.site)
            started = time.perf_counter()
            try:
                decision = place(snapshot, request, self._network)
            except UnknownSite as err:
                raise InvalidRequest(str(err)) from err
            self._metrics.observe_placement(time.perf_counter() - started)
            if decision.node_id is None:
                raise ResourceExhausted(
                    f"nothing fits now: {decision.reason}\n{decision.explanation.render()}"
                )
            entry = self._registry.nodes[decision.node_id]
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
            evicted.extend(self._standbys.take_under(decision.node_id, decision.gpus))
            for victim_id in decision.preempt:
                victim = self._table.get(victim_id)
                if victim is not None and victim.state in ACTIVE:
                    await self.write_pending(victim_id, f"preempted by {deployment_id}")
                    evicted.append(victim)
            if epoch == 1 and not evicted:
                creating = self._hold_creation(record, spec)
            elif epoch == 1:
                await self._core.db(self._core.store.create_deployment, record)
                self.keep(record)
            else:
                record = await self.update(
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
            self._metrics.observe_decision(time.perf_counter() - holding)
        if creating is not None:  # a caller cancelled meanwhile leaves it to settle by itself
            await self._core.durable(asyncio.shield(creating))
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
        """Queue a first decision's `starting` write (call under the applier's lock) and
        hold its GPUs until the write settles (`PlacementApplier.hold_creation`): the
        decisions after it, made before it commits, see them taken; nothing else sees the
        record before the store has it. Then the record takes the hold's place in one step
        (`_creation_settled`), whoever still awaits it."""
        self._applier.hold_creation(record, spec.gpu_memory_mib)
        queued = self._core.db_queued(self._core.store.create_deployment, record)
        queued.add_done_callback(functools.partial(self._creation_settled, record))
        return queued

    def _creation_settled(self, record: DeploymentRecord, queued: asyncio.Future[None]) -> None:
        self._applier.creation_settled(record)
        if not queued.cancelled() and queued.exception() is None:
            self.keep(record)

    async def write_pending(self, deployment_id: str, reason: str) -> None:
        """Take a deployment off its node in the store (its GPUs free for the next
        decision), and retire its standby (made for an epoch it will not have); call under
        the applier's lock."""
        self._standbys.drop(deployment_id, f"the deployment left its node: {reason}")
        await self.update(
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
                await self._standbys.stop(victim, "preempted by a deployment", "preempted")
                continue
            await self._registry.stop_replica(
                victim.node_id, replica_id(victim.deployment_id, victim.epoch)
            )
            self.publish(victim.deployment_id)
            self.spawn_replace(victim.deployment_id)

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
        spec = spec_of(record)
        assert record.node_id is not None
        entry = self._registry.nodes[record.node_id]
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
            async with self._applier.use("start failed"):
                current = await self._still_starting(record)
                if current is not None and again:
                    await self.write_pending(record.deployment_id, str(err))
                elif current is not None:
                    await self.update(
                        record.deployment_id,
                        state=DeploymentState.FAILED,
                        node_id=None,
                        gpus=(),
                        gpu_uuids=(),
                        reason=str(err),
                    )
            self.publish(record.deployment_id)
            if not again:
                if isinstance(err, Unfit):
                    raise  # FAILED_PRECONDITION: the client must change its request
                raise NodeUnavailable(str(err)) from err
            logger.warning("deployment=%s to be placed again: %s", record.deployment_id, err)
            self.spawn_replace(record.deployment_id)
            return await self._record(record.deployment_id)
        async with self._applier.use("running"):
            current = await self._still_starting(record)
            if current is not None:  # the write queued under the lock, awaited after it
                written = self._core.db_queued(
                    self._core.store.update_deployment,
                    record.deployment_id,
                    state=DeploymentState.RUNNING,
                    endpoint=endpoint,
                )
        if current is not None:
            running = await self._core.durable(written)
            # Kept only if nothing changed the deployment meanwhile: what did (a delete, a
            # lost node) wrote after this write, and its record is the one stored.
            if self._table.get(record.deployment_id) is current:
                record = self.keep(running)
            else:
                current = None
        if current is None:
            logger.warning("deployment=%s was deleted while it started", record.deployment_id)
            await self._registry.stop_replica(
                record.node_id, replica_id(record.deployment_id, record.epoch)
            )
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
        else can take a starting deployment but a delete); call under the applier's lock."""
        current = self._table.get(record.deployment_id)
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
        async with self._applier.use("requeue"):
            now = self._table.get(record.deployment_id)
            if (
                now is None
                or (now.state, now.epoch) != (DeploymentState.RUNNING, record.epoch)
                or self._applier.is_busy(record.deployment_id)
            ):
                return
            await self.write_pending(record.deployment_id, reason)
        await self._registry.stop_replica(
            record.node_id, replica_id(record.deployment_id, record.epoch)
        )
        self.publish(record.deployment_id)
        self.spawn_replace(record.deployment_id)

    def spawn_replace(self, deployment_id: str) -> None:
        if deployment_id in self._replacing:
            return
        self._replacing.add(deployment_id)
        self._core.background(self._replace(deployment_id), f"replace-{deployment_id}")

    async def _replace(self, deployment_id: str) -> None:
        """Place a pending deployment again, at the next epoch; it stays pending with the
        reason when nothing fits."""
        try:
            await self._replace_once(deployment_id)
        finally:
            self._replacing.discard(deployment_id)

    async def _replace_once(self, deployment_id: str) -> None:
        record = self._table.get(deployment_id)
        if record is None or record.state is not DeploymentState.PENDING:
            return
        spec = spec_of(record)
        try:
            record, evicted = await self._reserve(
                deployment_id, record.client_id, spec, record.epoch + 1
            )
        except (ResourceExhausted, Impossible) as err:
            await self.update(
                deployment_id,
                reason=f"{record.reason.split('; waiting: ')[0]}; waiting: "
                f"{str(err).splitlines()[0]}",
            )
            return
        await self._stop_evicted(evicted)
        await self._start(record, "replaced", DeploymentState.PENDING)

    async def retry_pending(self) -> None:
        for record in self._table.select(states=(DeploymentState.PENDING,)):
            self.spawn_replace(record.deployment_id)

    async def deployment(self, deployment_id: str) -> DeploymentRecord | None:
        """Any client's deployment, as stored (a deleted one read from the store); None when
        unknown."""
        record = self._table.get(deployment_id)
        if record is None:
            record = await self._core.db(self._core.store.get_deployment, deployment_id)
        return record

    async def running(self) -> list[DeploymentRecord]:
        """Every running deployment, as stored."""
        return self._table.select(states=(DeploymentState.RUNNING,))

    async def running_on(self, node_id: str) -> list[DeploymentRecord]:
        """The running deployments the store places on `node_id`."""
        return [r for r in self._table.on_node(node_id) if r.state is DeploymentState.RUNNING]

    async def set_site(self, deployment_id: str, site: str) -> None:
        """Record the site the deployment's client reports from."""
        await self.update(deployment_id, site=site)

    async def get(self, client_id: str, deployment_id: str) -> DeploymentRecord:
        """NotFound for an unknown deployment and for another client's: the two look alike."""
        record = self._table.get(deployment_id)
        if record is None or record.client_id != client_id or record.state not in VISIBLE:
            raise NotFound(f"deployment {deployment_id} not found")
        return record

    async def list(self, client_id: str) -> list[DeploymentRecord]:
        return self._table.select(client_id=client_id, states=VISIBLE)

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
        task = self._core.own(self._delete(client_id, deployment_id), f"delete-{deployment_id}")
        task.add_done_callback(retrieve)
        return await asyncio.shield(task)

    async def _delete(self, client_id: str, deployment_id: str) -> bool:
        standby: Standby | None = None
        async with self._applier.use("delete"):
            record = self._table.get(deployment_id)
            if record is not None:
                if record.client_id != client_id:
                    raise PermissionDenied(f"deployment {deployment_id} is not yours")
                self._applier.claim(deployment_id)
                standby = self._standbys.take_retiring(deployment_id)
        if record is None:
            # The table drops a deployment only once its deletion is durable: what it lacks
            # is deleted, never was, or is still being created.
            stored = await self._core.db(self._core.store.get_deployment, deployment_id)
            if stored is not None and stored.client_id != client_id:
                raise PermissionDenied(f"deployment {deployment_id} is not yours")
            if stored is None or stored.state is not DeploymentState.DELETED:
                raise NotFound(f"deployment {deployment_id} not found")
            return False
        try:
            if standby is not None:
                await self._standbys.stop(standby, "the deployment is deleted", "lapsed")
            if record.state in ACTIVE:
                await self._registry.stop_replica(
                    record.node_id, replica_id(deployment_id, record.epoch)
                )
            # The commit is awaited outside the placement lock (it was 36-44 % of the lock's
            # time under the control-plane bench's mix): until the table drops the record,
            # its GPUs stay taken, which only ever holds placement back, and the deployment
            # is claimed, so no move, requeue or second delete touches it meanwhile.
            deleted = await self._core.db(self._core.store.delete_deployment, deployment_id)
            async with self._applier.use("deleted"):
                self.keep(deleted)
        finally:
            self._applier.untake(deployment_id)
        self._registry.load_history.forget_deployment(deployment_id)
        self.watchers.push(deployment_id, None)
        logger.info("deployment=%s deleted", deployment_id)
        return True

    def publish(self, deployment_id: str) -> None:
        """Tell the deployment's watchers where it is now."""
        record = self._table.get(deployment_id)
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
        if site not in self._network.sites:
            raise InvalidRequest(
                f"site {quote(site)} is unknown; known sites: {', '.join(self._network.sites)}"
            )
        await self._core.db(self._core.store.set_client_site, client_id, site)
