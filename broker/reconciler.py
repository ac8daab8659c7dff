"""Reconciliation: what a node reports running against what the broker expects on it.

A deployment whose replica is gone or exited is placed again; a standby whose replica is gone
is retired; a replica nobody claims (no deployment, move, hold or standby) is stopped once it
has been unclaimed past the orphan grace. A report that needs nothing (the usual heartbeat)
costs no task; one reconciliation per node at a time, a report arriving meanwhile replacing
the one waiting.

A node reports its replicas when they change, and otherwise only with its usage sample (every
`--sample-interval`, 20 s by default): so an orphan's grace is not left to the next report,
which may be that far off. When one is first seen, its node's latest report is reconciled
again as the grace ends (`_orphan_due`); if a newer report came meanwhile, that one is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from broker.applier import PlacementApplier
from broker.core import Core
from broker.deployments import Deployments
from broker.errors import NodeUnavailable
from broker.ids import replica_id
from broker.nodes import LIVE_REPLICA, NodeEntry, NodeRegistry, ReplicaState, Reported
from broker.standbys import StandbyPool
from broker.state import DeploymentRecord, DeploymentState
from broker.values import BrokerSettings, Standby

logger = logging.getLogger(__name__)

ORPHAN_DUE_MARGIN_S = 0.1
"""How long after an orphan's grace its node's report is judged again: asyncio may run a
timer up to its clock's resolution early, and a replica judged a hair before its grace
would wait for the next report."""


@dataclass(slots=True)
class _Reconciliation:
    """What reconciling a node's report found to do (`Reconciler._plan`)."""

    requeue: list[tuple[str, DeploymentRecord]] = field(default_factory=list)
    """(replica, deployment): running deployments whose replica is gone or exited."""
    retire: list[Standby] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    """Replicas nobody claims, past the orphan grace period."""

    def __bool__(self) -> bool:
        return bool(self.requeue or self.retire or self.stop)


class Reconciler:
    """Compares what each node reports running with what the broker expects there, and
    acts on the difference (see the module docstring)."""

    def __init__(
        self,
        core: Core,
        registry: NodeRegistry,
        applier: PlacementApplier,
        deployments: Deployments,
        standbys: StandbyPool,
        settings: BrokerSettings,
    ) -> None:
        self._core = core
        self._registry = registry
        self._applier = applier
        self._deployments = deployments
        self._table = deployments.table
        self._standbys = standbys
        self._settings = settings
        self._orphans: dict[tuple[str, str], float] = {}
        """(node id, replica id) -> when first seen unclaimed (monotonic)."""
        self._reports: dict[str, Reported] = {}
        """node id -> the replicas of its latest report (for `_orphan_due`)."""
        self._reconciling: dict[str, Reported | None] = {}
        """node id -> the replicas of its latest heartbeat not yet reconciled (None: none
        waiting) while a reconciliation of the node runs."""

    def schedule(self, node_id: str, replicas: Sequence[tuple[str, ReplicaState]]) -> None:
        """Reconcile the node with `replicas`: at once when that needs no action (the usual
        heartbeat: no task made), else in the background. One reconciliation per node at a
        time; a report arriving meanwhile replaces the one waiting."""
        self._reports[node_id] = replicas
        if node_id in self._reconciling:
            self._reconciling[node_id] = replicas
            return
        entry = self._registry.nodes.get(node_id)
        if entry is None or not self._plan(entry, replicas):
            return
        self._reconciling[node_id] = None
        self._core.background(self._reconcile_reported(node_id, replicas), f"reconcile-{node_id}")

    async def _reconcile_reported(
        self, node_id: str, replicas: Sequence[tuple[str, ReplicaState]] | None
    ) -> None:
        try:
            while (
                replicas is not None and (entry := self._registry.nodes.get(node_id)) is not None
            ):
                await self._reconcile(entry, self._plan(entry, replicas))
                replicas = self._reconciling.get(node_id)
                self._reconciling[node_id] = None
        finally:
            self._reconciling.pop(node_id, None)

    def _plan(
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
        settled_before = time.time() - 2 * self._settings.heartbeat_interval_s
        self._registry.reported(node_id, replicas)
        placed = self._table.on_node(node_id)
        expected = {
            replica_id(d.deployment_id, d.epoch): d
            for d in placed
            if d.state is DeploymentState.RUNNING
        }
        self._registry.load_history.attribute(
            node_id, {r: d.deployment_id for r, d in expected.items()}
        )
        plan.requeue = [
            (replica, deployment)
            for replica, deployment in expected.items()
            if replica not in running
            and not self._deployments.is_replacing(deployment.deployment_id)
            and not self._applier.is_busy(deployment.deployment_id)
            and deployment.updated_at < settled_before
        ]
        # Claimed besides the running ones: replicas starting, and those a move holds (its
        # target before the switch, its source until it stops), however long that takes.
        claimed = {
            *(replica_id(d.deployment_id, d.epoch) for d in placed),
            *(replica_id(deployment, epoch) for deployment, epoch in self._applier.holds),
            *(standby.replica for standby in self._standbys.held() if standby.node_id == node_id),
        }
        plan.retire = [
            standby
            for standby in self._standbys.usable()
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
            if first == now:  # first seen: judged again as its grace ends
                asyncio.get_running_loop().call_later(
                    self._settings.orphan_grace_s + ORPHAN_DUE_MARGIN_S, self._orphan_due, node_id
                )
            if now - first >= self._settings.orphan_grace_s:
                plan.stop.append(replica)
        return plan

    def _orphan_due(self, node_id: str) -> None:
        """An orphan of `node_id` has reached its grace: reconcile the node's latest report
        again, without waiting for its next one; not for a node that is no longer live (its
        report is stale: what it runs is told by its next registration)."""
        replicas = self._reports.get(node_id)
        entry = self._registry.nodes.get(node_id)
        if replicas is not None and entry is not None and self._registry.is_live(entry):
            self.schedule(node_id, replicas)

    async def _reconcile(self, entry: NodeEntry, plan: _Reconciliation) -> None:
        """Do what `_plan` found: place again, retire, stop."""
        node_id = entry.record.node_id
        for replica, deployment in plan.requeue:
            logger.warning(
                "deployment=%s: its replica %s is not running on node %s; placing it again",
                deployment.deployment_id,
                replica,
                node_id,
            )
            await self._deployments.requeue(deployment, f"replica lost on node {node_id}")
        for standby in plan.retire:
            logger.warning(
                "standby %s is not running on node %s; retiring it", standby.replica, node_id
            )
            await self._standbys.retire(standby, "its replica is gone", "lost")
        for replica in plan.stop:
            logger.warning(
                "node=%s replica=%s: no deployment claims it; stopping", node_id, replica
            )
            self._orphans.pop((node_id, replica), None)
            with contextlib.suppress(NodeUnavailable):
                await entry.client.stop_replica(replica, self._settings.stop_grace_ms)
