"""Standbys: pre-warmed replicas of running deployments, started where their clients are
predicted to go (`broker.prewarm` decides; this pool holds and runs them). It alone writes
the standby rows and which standbys are held; a move takes a standby through `take`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence

from broker.applier import PlacementApplier
from broker.core import Core, retrieve
from broker.errors import NodeUnavailable, ResourceExhausted
from broker.nodes import NodeRegistry
from broker.ops.metrics import BrokerMetrics
from broker.placement import PriorityClass
from broker.state import DeploymentRecord, StandbyRecord
from broker.values import (
    DeploymentReader,
    DeploySpec,
    Standby,
    StandbyChoice,
    runs,
    spec_of,
)

logger = logging.getLogger(__name__)


class StandbyPool:
    """The standbys held now: those that may still be used (one per deployment at most),
    and those being stopped, which hold their GPUs until their replica is gone."""

    def __init__(
        self,
        core: Core,
        registry: NodeRegistry,
        applier: PlacementApplier,
        table: DeploymentReader,
        metrics: BrokerMetrics,
    ) -> None:
        self._core = core
        self._registry = registry
        self._applier = applier
        self._table = table
        self._metrics = metrics
        self._standbys: dict[str, Standby] = {}
        """deployment id -> its standby replica, while it may be used."""
        self._retiring: set[Standby] = set()
        """Standbys being stopped: they hold their GPUs (and count against the budget)
        until their replica is gone."""

    async def load(self) -> None:
        """Stop the previous broker's standbys (its predictions are gone with it); each
        holds its GPUs until its replica is stopped."""
        for left in await self._core.db(self._core.store.list_standbys):
            standby = Standby(left, 0.0, 0, time.monotonic())
            self._retiring.add(standby)
            self._core.background(
                self.stop(standby, "the broker restarted", "lapsed"),
                f"retire-{standby.replica}",
            )

    def usable(self) -> list[Standby]:
        """The standbys that may still be used, one per deployment at most."""
        return list(self._standbys.values())

    def take_retiring(self, deployment_id: str) -> Standby | None:
        """Turn the deployment's usable standby, if any, retiring (call under the applier's
        lock); the caller stops it (`stop`)."""
        standby = self._standbys.pop(deployment_id, None)
        if standby is not None:
            self._retiring.add(standby)
        return standby

    def drop(self, deployment_id: str, reason: str) -> None:
        """Turn the deployment's usable standby, if any, retiring, and stop it in the
        background (call under the applier's lock)."""
        standby = self.take_retiring(deployment_id)
        if standby is not None:
            self._core.background(
                self.stop(standby, reason, "lapsed"), f"retire-{standby.replica}"
            )

    def take(self, deployment_id: str) -> Standby | None:
        """Take the deployment's usable standby for a move (call under the applier's lock):
        no longer usable, not retiring; the move uses it or gives it back to `lapse`."""
        return self._standbys.pop(deployment_id, None)

    def lapse(self, standby: Standby) -> None:
        """A standby `take` took that its move does not use: retiring, stopped in the
        background."""
        self._retiring.add(standby)
        self._core.background(
            self.stop(standby, "the move went elsewhere", "lapsed"), f"retire-{standby.replica}"
        )

    def on_nodes_lost(self, lost: Collection[str]) -> None:
        """Retire the standbys on nodes just lost."""
        for standby in list(self._standbys.values()):
            if standby.node_id in lost:
                self._core.background(
                    self.retire(standby, "its node was lost", "lost"),
                    f"retire-{standby.replica}",
                )

    def held(self) -> list[Standby]:
        """Every standby held now: those that may still be used, then those being stopped."""
        return [*self._standbys.values(), *self._retiring]

    def standby_of(self, deployment_id: str) -> Standby | None:
        """The deployment's standby that may still be used; None when it has none."""
        return self._standbys.get(deployment_id)

    async def reserve(
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
        async with self._applier.use("standby"):
            record = self._table.get(deployment_id)
            if (
                not runs(record)
                or self._applier.is_busy(deployment_id)
                or deployment_id in self._standbys
            ):
                return None
            if len(self._standbys) + len(self._retiring) >= budget:
                logger.info(
                    "deployment=%s: no standby for site %s: the budget of %d is held",
                    deployment_id,
                    site,
                    budget,
                )
                self._metrics.count_standby("refused")
                return None
            decision = choose(record, self._applier.view(self.held()))
            if decision is None or decision.node_id is None or decision.preempt:
                return None
            spec = spec_of(record)
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
            await self._core.db(self._core.store.put_standby, standby.record)
            self._standbys[deployment_id] = standby
            task = self._core.own(self._start(standby, record, spec), f"standby-{standby.replica}")
            task.add_done_callback(retrieve)
            standby.task = task
        self._metrics.count_standby("started")
        logger.info(
            "deployment=%s: standby %s starting on node=%s for site %s (%.0f%% likely)",
            deployment_id,
            standby.replica,
            standby.node_id,
            site,
            probability * 100,
        )
        return standby

    async def _start(self, standby: Standby, record: DeploymentRecord, spec: DeploySpec) -> str:
        """Start the standby's replica; its endpoint once ready. When the node cannot, the
        standby is retired (unless a move took it already: the move rolls back) and the
        error raised."""
        entry = self._registry.nodes.get(standby.node_id)
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
            self._core.background(
                self.retire(standby, f"its start failed: {err}", "failed"),
                f"retire-{standby.replica}",
            )
            raise
        logger.info(
            "standby %s ready on node=%s at %s", standby.replica, standby.node_id, endpoint
        )
        return endpoint

    async def retire(self, standby: Standby, reason: str, outcome: str) -> bool:
        """Stop `standby` and release it if it is still the deployment's standby (not taken
        by a move, not retired already): whether it was. `outcome` counts it in the metrics
        (lapsed, expired, failed, lost ...)."""
        async with self._applier.use("standby retired"):
            if self._standbys.get(standby.deployment_id) is not standby:
                return False
            del self._standbys[standby.deployment_id]
            self._retiring.add(standby)
        await self.stop(standby, reason, outcome)
        return True

    def take_under(self, node_id: str, gpus: Sequence[int]) -> list[Standby]:
        """The standbys of other deployments that hold any of `gpus` on `node_id`, which a
        real placement took (it does not see them), turned retiring (call under the
        applier's lock; the caller stops them, with `stop`, before it starts its replica)."""
        taken = []
        for standby in list(self._standbys.values()):
            if standby.node_id == node_id and set(standby.record.gpus) & set(gpus):
                del self._standbys[standby.deployment_id]
                self._retiring.add(standby)
                taken.append(standby)
        return taken

    async def stop(self, standby: Standby, reason: str, outcome: str) -> None:
        """Stop a retiring standby: end its start if it runs, stop its replica, forget its
        record; its hold goes last, once the replica is gone (or its node is)."""
        try:
            task = standby.task
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait([task])
            await self._registry.stop_replica(standby.node_id, standby.replica, grace_ms=0)
            record = standby.record
            await self._core.db(
                self._core.store.delete_standby, record.deployment_id, record.epoch, record.node_id
            )
        finally:
            self._retiring.discard(standby)
        self._metrics.count_standby(outcome)
        logger.info("standby %s on node=%s retired: %s", standby.replica, standby.node_id, reason)
