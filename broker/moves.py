"""Moves: a running deployment's replica moved make-before-break to another node. A move
takes the deployment (no other move, eviction or delete touches it) and holds its target's
GPUs from its decision to `release_move`; the switch is one decision. It owns the migration
records in the store; the deployment records it changes through `broker.deployments`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Unpack

from broker.applier import PlacementApplier
from broker.core import Core
from broker.deployments import Deployments
from broker.errors import (
    NodeUnavailable,
    NotFound,
    ResourceExhausted,
)
from broker.nodes import NodeRegistry
from broker.ops.metrics import BrokerMetrics
from broker.placement import Decision
from broker.standbys import StandbyPool
from broker.state import (
    DeploymentState,
    MigrationRecord,
    MigrationState,
)
from broker.values import (
    Hold,
    MigrationChanges,
    Move,
    MoveChoice,
    explanation_json,
    placement_update,
    runs,
    spec_of,
)


class Moves:
    """The intent-level operations a migration runs on (`broker.migrations` drives them):
    reserve a target, start its replica, commit the switch, abandon, release; and the
    migration records."""

    def __init__(
        self,
        core: Core,
        registry: NodeRegistry,
        applier: PlacementApplier,
        deployments: Deployments,
        standbys: StandbyPool,
        metrics: BrokerMetrics,
    ) -> None:
        self._core = core
        self._registry = registry
        self._applier = applier
        self._deployments = deployments
        self._table = deployments.table
        self._standbys = standbys
        self._metrics = metrics

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
        async with self._applier.use("move"):
            record = self._table.get(deployment_id)
            if not runs(record) or (client_id is not None and record.client_id != client_id):
                raise NotFound(f"no running deployment {deployment_id}")
            if if_idle and self._applier.is_busy(deployment_id):
                return None
            self._applier.claim(deployment_id)
            standby = self._standbys.standby_of(deployment_id)
            chosen: tuple[Decision, str] | None = None
            try:
                chosen = choose(record, self._applier.view())
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
                    await self._core.db(
                        self._core.store.delete_standby, rec.deployment_id, rec.epoch, rec.node_id
                    )
            except BaseException:
                chosen = None
                raise
            finally:
                if chosen is None:  # declined, or raised: the deployment is not taken
                    self._applier.untake(deployment_id)
            if chosen is None:
                return None
            decision, why = chosen
            assert decision.node_id is not None and record.node_id is not None
            spec = spec_of(record)
            target_gpus = decision.gpus
            if standby is not None:
                self._standbys.take(deployment_id)
            if standby is not None and decision.node_id == standby.node_id:
                target_gpus = standby.record.gpus  # its replica runs on those
            elif standby is not None:
                self._standbys.lapse(standby)
                standby = None
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
                    self._core.background(
                        self._standbys.stop(
                            other, f"its GPUs went to a move of {deployment_id}", "preempted"
                        ),
                        f"retire-{other.replica}",
                    )
                    for other in self._standbys.take_under(decision.node_id, target_gpus)
                ),
            )
            self._applier.hold(
                (deployment_id, move.epoch),
                Hold(move.target_node, move.target_gpus, spec.gpu_memory_mib, spec.priority),
            )
        if move.standby is not None:
            self._metrics.count_standby("hit")
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
        record = self._table.get(move.deployment_id)
        entry = self._registry.nodes.get(move.target_node)
        if record is None or entry is None:
            raise NodeUnavailable("the deployment or the target node is gone")
        spec = spec_of(record)
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
        entry = self._registry.nodes[move.target_node]
        async with self._applier.use("switch"):
            if hold_source and move.source_node:
                record = self._table.get(move.deployment_id)
                assert record is not None
                spec = spec_of(record)
                self._applier.hold(
                    (move.deployment_id, move.source_epoch),
                    Hold(move.source_node, move.source_gpus, spec.gpu_memory_mib, spec.priority),
                )
            record = await self._deployments.update(
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
            self._applier.unhold((move.deployment_id, move.epoch))
        prepared_ms = None if decided_at is None else (time.monotonic() - decided_at) * 1000
        self._deployments.watchers.push(
            move.deployment_id,
            placement_update(record, reason, migration_id=migration_id, prepared_ms=prepared_ms),
        )

    async def abandon_move(self, move: Move, reason: str) -> None:
        """The move failed with no replica left serving (failover, stop-start): the
        deployment becomes pending and is placed again as soon as something fits. Then
        `release_move`."""
        async with self._applier.use("move abandoned"):
            await self._deployments.write_pending(move.deployment_id, reason)
            self.release_move(move)
        self._deployments.publish(move.deployment_id)
        self._deployments.spawn_replace(move.deployment_id)

    def release_move(self, move: Move) -> None:
        """Drop what `move` holds (idempotent): its GPUs, and the deployment itself."""
        self._applier.unhold((move.deployment_id, move.epoch))
        self._applier.unhold((move.deployment_id, move.source_epoch))
        self._applier.untake(move.deployment_id)

    async def record_migration(self, record: MigrationRecord) -> None:
        await self._core.db(self._core.store.create_migration, record)

    async def update_migration(
        self, migration_id: str, **changes: Unpack[MigrationChanges]
    ) -> None:
        """KeyError for an unknown migration."""
        await self._core.db(self._core.store.update_migration, migration_id, **changes)

    async def list_migrations(
        self,
        deployment_id: str | None = None,
        *,
        states: Collection[MigrationState] | None = None,
        updated_since: float | None = None,
    ) -> list[MigrationRecord]:
        """Migrations, oldest first: every one, or one deployment's, in `states`, changed
        since `updated_since` (`StateStore.list_migrations`)."""
        return await self._core.db(
            self._core.store.list_migrations,
            deployment_id,
            states=states,
            updated_since=updated_since,
        )

    async def get_migration(self, migration_id: str) -> MigrationRecord:
        """NotFound for an unknown migration."""
        found = await self._core.db(self._core.store.get_migration, migration_id)
        if found is None:
            raise NotFound(f"migration {migration_id} not found")
        return found
