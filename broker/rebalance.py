"""Speculative rebalancing (SpeCon) in the live broker: move work off a node that stays hot.

Every sweep (`REBALANCE_SWEEP_S`), `Rebalancer.sweep` builds the pure policy's views
(`migration.rebalance`): each node's load history from the heartbeats (`broker.telemetry`),
each running deployment that no move or delete holds with its request-rate history, p99
latency and CPU used on its current node, its client's network latency to every node, and a
placement dry run for "does it fit there"; with the migrations that ended within the
cooldown and the rebalances under way. For each move the policy names, it starts a
make-before-break migration (trigger "rebalance", the policy's reason recorded with it and
shown by `offload migrations`, `offload explain` after the switch, and the dashboard). The
decision itself is taken again under the placement lock (`Migrations.rebalance`): a target
that no longer fits, or a deployment another move took meanwhile, starts nothing.

Every time here is Unix seconds: the load history and the migration records use that clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from broker.migrations import UNFINISHED, Migrations
from broker.network import UnknownSite
from broker.placement import ClusterSnapshot
from broker.state import DeploymentRecord, MigrationTrigger, NodeState
from broker.values import spec_of
from migration.rebalance import (
    DeploymentView,
    MoveRecord,
    NodeView,
    RebalanceSettings,
    RebalanceVerdict,
    plan_rebalances,
)

logger = logging.getLogger(__name__)

REBALANCE_SWEEP_S = 2.0
"""How often the policy looks; the heat it acts on must last `sustain_s` anyway."""
VERDICT_LOG_S = 60.0
"""How often an unchanged verdict about hot nodes is logged again."""


class Rebalancer:
    def __init__(
        self,
        migrations: Migrations,
        settings: RebalanceSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.migrations = migrations
        self.settings = settings
        self._clock = clock
        self.verdict: RebalanceVerdict | None = None
        """The latest round's verdict (what moved, or why nothing did)."""
        self._about: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._logged = -VERDICT_LOG_S

    async def sweep(self) -> list[str]:
        """One round of the policy; the migrations it started."""
        if not self.settings.enabled:
            return []
        broker = self.migrations.broker
        now = self._clock()
        history = broker.load_history
        nodes = []
        for node_id, entry in sorted(broker.nodes.items()):
            latest = history.latest(node_id)
            nodes.append(
                NodeView(
                    node_id=node_id,
                    site=entry.record.site,
                    load_history=[(p.at, p.load) for p in history.node_points(node_id)],
                    ready=entry.record.state is NodeState.READY,
                    cpu_cores=latest.cpu_cores if latest else 0.0,
                )
            )
        snapshot = await broker.snapshot()
        records = {
            r.deployment_id: r
            for r in await broker.deployments.running()
            if not broker.applier.is_busy(r.deployment_id)
        }
        deployments = [
            view for r in records.values() if (view := self._view(r, snapshot, now)) is not None
        ]
        cooldown_start = now - self.settings.cooldown_s
        in_flight = [
            MoveRecord(m.deployment_id, m.source_node, m.target_node, m.created_at)
            for m in await broker.moves.list_migrations(states=UNFINISHED)
            if m.trigger is MigrationTrigger.REBALANCE
        ]
        recent = [
            MoveRecord(m.deployment_id, m.source_node, m.target_node, m.updated_at)
            for m in await broker.moves.list_migrations(updated_since=cooldown_start)
            if m.state not in UNFINISHED
        ]
        verdict = plan_rebalances(nodes, deployments, self.settings, now, recent, in_flight)
        self._log(verdict, now)
        started = []
        for move in verdict.moves:
            migration_id = await self.migrations.rebalance(
                move.deployment_id, move.target_node, move.reason
            )
            if migration_id is not None:
                logger.warning(
                    "rebalance: migration=%s moves deployment=%s %s -> %s: %s",
                    migration_id,
                    move.deployment_id,
                    move.source_node,
                    move.target_node,
                    move.reason,
                )
                started.append(migration_id)
        return started

    def _log(self, verdict: RebalanceVerdict, now: float) -> None:
        """Log a verdict about hot nodes when what it is about changes (which nodes are hot,
        what moves), and at most every `VERDICT_LOG_S` while it stays the same."""
        about = (verdict.hot_nodes, tuple(m.deployment_id for m in verdict.moves))
        if verdict.hot_nodes and (about != self._about or now - self._logged >= VERDICT_LOG_S):
            logger.info("rebalance: %s", verdict.render())
            self._logged = now
        self._about = about
        self.verdict = verdict

    def _view(
        self, record: DeploymentRecord, snapshot: ClusterSnapshot, now: float
    ) -> DeploymentView | None:
        """What the policy knows of a running deployment: its figures on its current node
        only (its history there), its client's latency to every node."""
        broker = self.migrations.broker
        node_id = record.node_id
        if node_id is None:
            return None
        points = [
            p
            for p in broker.load_history.deployment_points(record.deployment_id)
            if p.node_id == node_id
        ]
        latency = {}
        for other, entry in broker.nodes.items():
            try:
                latency[other] = broker.network.latency_ms(record.site, entry.record.site, other)
            except UnknownSite:
                continue
        latest = points[-1].replica if points else None
        p99 = latest.requests.latency_p99_ms if latest and latest.requests else None
        # CPU used over the span heat is judged on, not one interval: replicas that share a
        # CPU take turns, and one sample can split it very unevenly between them.
        recent = [
            p.replica.cpu_used_cores for p in points if p.at >= now - self.settings.sustain_s
        ]
        return DeploymentView(
            deployment_id=record.deployment_id,
            node_id=node_id,
            priority=record.priority,
            rate_history=[
                (p.at, p.replica.requests.rate_per_s) for p in points if p.replica.requests
            ],
            latency_ms=latency,
            fits=lambda target: self.migrations.fits(record, target, snapshot),
            latency_slo_ms=spec_of(record).latency_slo_ms,
            p99_ms=p99 or 0.0,
            cpu_used_cores=sum(recent) / len(recent) if recent else 0.0,
        )
