"""Migrations in the broker: what triggers them, and the `MigrationHost` they run on.

Triggers: a client's location report past the hysteresis (`migration.policy`), an operator's
migrate, a node drain, a node lost. The mechanism (`migration.mechanism.run_migration`)
drives each one through this host: node calls, the deployment record, the client's watch
stream, the migration record. While a migration runs, the target's GPUs (and, after the
switch, the source's until its replica stops) are held in `Broker.holds`, so no other
deployment is placed on them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from broker.errors import InvalidRequest, NodeUnavailable, NotFound, ResourceExhausted
from broker.placement import ClusterSnapshot, Decision, PlacementRequest, place
from broker.service import Broker, DeploySpec, Hold, explanation_json, placement_update
from broker.state import (
    DeploymentRecord,
    DeploymentState,
    MigrationRecord,
    MigrationState,
    MigrationStrategy,
    MigrationTrigger,
    NodeState,
)
from migration.mechanism import MigrationPlan, Strategy, TargetFailed, Timeline, run_migration
from migration.policy import Hysteresis, mobility_verdict

logger = logging.getLogger(__name__)

UNFINISHED = (MigrationState.PREPARING, MigrationState.SWITCHING, MigrationState.DRAINING)


class Migrations:
    def __init__(
        self, broker: Broker, hysteresis: Hysteresis, drain_timeout_s: float = 5.0
    ) -> None:
        self.broker = broker
        self.hysteresis = hysteresis
        self.drain_timeout_s = drain_timeout_s
        self._acks: dict[tuple[str, int], asyncio.Event] = {}
        self._last: dict[str, float] = {}
        """deployment id -> time.monotonic() of its last migration."""
        self._running: set[str] = set()
        """Deployments with a migration under way (one at a time each)."""
        self._explanations: dict[tuple[str, int], str] = {}
        """(deployment id, target epoch) -> the target's placement explanation (JSON), which
        becomes the deployment's at the switch."""

    # --- triggers ------------------------------------------------------------------------

    async def on_location(self, client_id: str, site: str) -> list[str]:
        """The client is at `site` now: move each of its running deployments whose best
        node is past the hysteresis. Returns the migrations started."""
        await self.broker.report_location(client_id, site)
        started = []
        for record in await self.broker.list(client_id):
            if record.state is not DeploymentState.RUNNING or record.node_id is None:
                continue
            await self.broker.db(
                self.broker.store.update_deployment, record.deployment_id, site=site
            )
            plan = await self._plan_mobility(record, site)
            if plan is not None:
                started.append(plan.migration_id)
                self._launch(plan)
        return started

    async def _plan_mobility(self, record: DeploymentRecord, site: str) -> MigrationPlan | None:
        broker = self.broker
        assert record.node_id is not None
        entry = broker.nodes.get(record.node_id)
        if entry is None or record.deployment_id in self._running:
            return None
        current_ms = broker.network.latency_ms(site, entry.record.site, record.node_id)
        async with broker.placing:
            # The best other node that fits, against staying where it is.
            snapshot = (await broker.current_snapshot()).without_node(record.node_id)
            decision = place(snapshot, self._request(record, site), broker.network)
            chosen = decision.explanation.chosen
            if decision.node_id is None or chosen is None:
                logger.info(
                    "deployment=%s stays on %s for site %s: no other node fits",
                    record.deployment_id,
                    record.node_id,
                    site,
                )
                return None
            last = self._last.get(record.deployment_id)
            verdict = mobility_verdict(
                current_ms,
                chosen.latency_ms,
                None if last is None else time.monotonic() - last,
                self.hysteresis,
            )
            logger.info(
                "deployment=%s site=%s: %s %s",
                record.deployment_id,
                site,
                "migrating," if verdict.move else "not migrating:",
                verdict.reason,
            )
            if not verdict.move:
                return None
            return self._reserve(
                record,
                MigrationTrigger.MOBILITY,
                Strategy.MAKE_BEFORE_BREAK,
                decision,
                why=f"client moved to {site}: {verdict.reason}",
            )

    async def migrate(
        self,
        deployment_id: str,
        to_node: str,
        strategy: Strategy,
        trigger: MigrationTrigger = MigrationTrigger.OPERATOR,
        client_id: str | None = None,
    ) -> str:
        """Move a running deployment now, to `to_node` or the best node for its site.
        NotFound, InvalidRequest, ResourceExhausted when no target fits."""
        broker = self.broker
        record = (
            await broker.get(client_id, deployment_id)
            if client_id is not None
            else await broker.db(broker.store.get_deployment, deployment_id)
        )
        if record is None or record.state is not DeploymentState.RUNNING:
            raise NotFound(f"no running deployment {deployment_id}")
        if deployment_id in self._running:
            raise InvalidRequest(f"deployment {deployment_id} is migrating already")
        if to_node and to_node not in broker.nodes:
            raise NotFound(f"node {to_node} is not registered")
        async with broker.placing:
            snapshot = await broker.current_snapshot()
            if to_node:
                node = snapshot.node(to_node)
                snapshot = ClusterSnapshot.of([node])
            else:
                snapshot = snapshot.without_node(record.node_id or "")
            decision = place(snapshot, self._request(record, record.site), broker.network)
            if decision.node_id is None:
                raise ResourceExhausted(
                    f"no node can take deployment {deployment_id}: {decision.reason}"
                )
            plan = self._reserve(record, trigger, strategy, decision, why=f"{trigger} migration")
        timeline = Timeline()
        timeline.mark("decided")
        await self.save(plan, "preparing", timeline, "", "")
        self._launch(plan)
        return plan.migration_id

    async def drain(self, node_id: str) -> list[str]:
        """Stop placing on the node and move every deployment off it (make-before-break)."""
        broker = self.broker
        entry = broker.nodes.get(node_id)
        if entry is None:
            raise NotFound(f"node {node_id} is not registered")
        await broker.set_node_state(node_id, NodeState.DRAINING)
        started = []
        for record in await broker.db(
            broker.store.list_deployments, states=(DeploymentState.RUNNING,)
        ):
            if record.node_id == node_id:
                try:
                    started.append(
                        await self.migrate(
                            record.deployment_id,
                            "",
                            Strategy.MAKE_BEFORE_BREAK,
                            MigrationTrigger.DRAIN,
                        )
                    )
                except (ResourceExhausted, InvalidRequest) as err:
                    logger.error(
                        "drain %s: deployment=%s stays: %s", node_id, record.deployment_id, err
                    )
        return started

    async def on_node_lost(self, node_id: str) -> list[str]:
        """Fail over every deployment of a lost node to the best node that fits."""
        broker = self.broker
        started = []
        for record in await broker.db(
            broker.store.list_deployments, states=(DeploymentState.RUNNING,)
        ):
            if record.node_id != node_id or record.deployment_id in self._running:
                continue
            async with broker.placing:
                snapshot = (await broker.current_snapshot()).without_node(node_id)
                decision = place(snapshot, self._request(record, record.site), broker.network)
                if decision.node_id is None:
                    logger.error(
                        "deployment=%s lost with node %s and nothing fits: %s",
                        record.deployment_id,
                        node_id,
                        decision.reason,
                    )
                    continue
                plan = self._reserve(
                    record,
                    MigrationTrigger.NODE_LOST,
                    Strategy.FAILOVER,
                    decision,
                    why=f"node {node_id} was lost",
                )
            started.append(plan.migration_id)
            self._launch(plan)
        return started

    def on_ack(self, deployment_id: str, epoch: int) -> None:
        event = self._acks.get((deployment_id, epoch))
        if event is not None:
            event.set()

    async def on_observation(
        self, client_id: str, deployment_id: str, migration_id: str, gap_ms: float, failed: int
    ) -> None:
        broker = self.broker
        await broker.get(client_id, deployment_id)
        if gap_ms < 0 or failed < 0:
            raise InvalidRequest("longest_gap_ms and failed_requests must not be negative")
        records = await broker.db(broker.store.list_migrations, deployment_id)
        if not any(m.migration_id == migration_id for m in records):
            raise NotFound(f"migration {migration_id} of deployment {deployment_id} not found")
        await broker.db(
            broker.store.update_migration,
            migration_id,
            downtime_ms=gap_ms,
            failed_requests=failed,
        )
        broker.metrics.observe_downtime(gap_ms / 1000)
        logger.info(
            "migration=%s client-observed gap %.1f ms, %d failed request(s)",
            migration_id,
            gap_ms,
            failed,
        )

    async def resume_after_restart(self) -> None:
        """A migration the broker was killed in the middle of: before the switch, roll it
        back (the target replica is unclaimed and stopped after the orphan grace); after it,
        it is complete (the old replica is unclaimed and stopped likewise)."""
        broker = self.broker
        for m in await broker.db(broker.store.list_migrations):
            if m.state not in UNFINISHED:
                continue
            record = await broker.db(broker.store.get_deployment, m.deployment_id)
            switched = record is not None and record.node_id == m.target_node
            state = MigrationState.COMPLETED if switched else MigrationState.ROLLED_BACK
            outcome = "succeeded" if switched else "rolled_back"
            await broker.db(
                broker.store.update_migration,
                m.migration_id,
                state=state,
                outcome=outcome,
                reason="broker restarted during the migration; "
                + ("it had switched" if switched else "it had not switched"),
            )
            logger.warning("migration=%s resumed after restart: %s", m.migration_id, outcome)

    # --- planning ------------------------------------------------------------------------

    @staticmethod
    def _request(record: DeploymentRecord, site: str) -> PlacementRequest:
        spec = DeploySpec.from_json(record.request_json)
        return PlacementRequest(
            deployment_id=f"{record.deployment_id}@{record.epoch + 1}",
            site=site,
            gpus=spec.gpus,
            gpu_memory_mib=spec.gpu_memory_mib,
            p2p_required=spec.p2p_required,
            priority=spec.priority,
            latency_slo_ms=spec.latency_slo_ms or None,
        )

    def _reserve(
        self,
        record: DeploymentRecord,
        trigger: MigrationTrigger,
        strategy: Strategy,
        decision: Decision,
        why: str,
    ) -> MigrationPlan:
        """Hold the target's GPUs and mark the deployment migrating; `why` heads the
        explanation the deployment gets at the switch."""
        assert decision.node_id is not None
        target_node, target_gpus = decision.node_id, decision.gpus
        spec = DeploySpec.from_json(record.request_json)
        epoch = record.epoch + 1
        self.broker.holds[(record.deployment_id, epoch)] = Hold(
            target_node, target_gpus, spec.gpu_memory_mib, spec.priority
        )
        self._running.add(record.deployment_id)
        self.broker.busy.add(record.deployment_id)
        self._acks[(record.deployment_id, epoch)] = asyncio.Event()
        self._explanations[(record.deployment_id, epoch)] = explanation_json(decision, why)
        return MigrationPlan(
            migration_id=f"m-{secrets.token_hex(5)}",
            deployment_id=record.deployment_id,
            trigger=str(trigger),
            strategy=strategy,
            source_node=record.node_id,
            source_replica=f"{record.deployment_id}-{record.epoch}",
            target_node=target_node,
            target_gpus=target_gpus,
            epoch=epoch,
            drain_timeout_s=self.drain_timeout_s,
            stop_grace_ms=self.broker.settings.stop_grace_ms,
        )

    def _launch(self, plan: MigrationPlan) -> None:
        self.broker.background(self._run(plan), f"migration-{plan.migration_id}")

    async def _run(self, plan: MigrationPlan) -> None:
        try:
            outcome = await run_migration(self, plan)
            self.broker.metrics.record_migration(str(outcome), None)
        finally:
            self.broker.holds.pop((plan.deployment_id, plan.epoch), None)
            self.broker.holds.pop((plan.deployment_id, plan.epoch - 1), None)
            self._acks.pop((plan.deployment_id, plan.epoch), None)
            self._explanations.pop((plan.deployment_id, plan.epoch), None)
            self._running.discard(plan.deployment_id)
            self.broker.busy.discard(plan.deployment_id)
            self._last[plan.deployment_id] = time.monotonic()

    # --- MigrationHost -------------------------------------------------------------------

    async def start_target(self, plan: MigrationPlan) -> str:
        broker = self.broker
        record = await broker.db(broker.store.get_deployment, plan.deployment_id)
        entry = broker.nodes.get(plan.target_node)
        if record is None or entry is None:
            raise TargetFailed("the deployment or the target node is gone")
        spec = DeploySpec.from_json(record.request_json)
        try:
            return await entry.client.start_replica(
                deployment_id=record.deployment_id,
                epoch=plan.epoch,
                model_sha256=record.model_sha256,
                model_name=record.model_name,
                gpu_uuids=tuple(entry.inventory.gpus[i].uuid for i in plan.target_gpus),
                gpu_memory_mib=spec.gpu_memory_mib,
                cpus=spec.cpus,
                memory_mib=spec.memory_mib,
                token=record.token,
            )
        except (NodeUnavailable, ResourceExhausted) as err:
            raise TargetFailed(str(err)) from err

    async def stop_replica(self, node_id: str, replica_id: str, grace_ms: int) -> None:
        entry = self.broker.nodes.get(node_id)
        if entry is None or entry.record.state is NodeState.LOST:
            return
        try:
            await entry.client.stop_replica(replica_id, grace_ms)
        except NodeUnavailable as err:
            logger.warning(
                "stopping %s on %s failed (%s); the node reconciles it", replica_id, node_id, err
            )

    async def switch(self, plan: MigrationPlan, endpoint: str) -> None:
        broker = self.broker
        entry = broker.nodes[plan.target_node]
        if plan.source_node and plan.strategy is Strategy.MAKE_BEFORE_BREAK:
            # The old replica keeps its GPUs until it is stopped.
            old = await broker.db(broker.store.get_deployment, plan.deployment_id)
            if old is not None and old.node_id:
                spec = DeploySpec.from_json(old.request_json)
                broker.holds[(plan.deployment_id, plan.epoch - 1)] = Hold(
                    old.node_id, old.gpus, spec.gpu_memory_mib, spec.priority
                )
        # A migration resumed after a broker restart has no explanation: the old one stays.
        explanation = self._explanations.pop((plan.deployment_id, plan.epoch), None)
        explained = {"explanation_json": explanation} if explanation else {}
        record = await broker.db(
            broker.store.update_deployment,
            plan.deployment_id,
            state=DeploymentState.RUNNING,
            node_id=plan.target_node,
            gpus=plan.target_gpus,
            gpu_uuids=tuple(entry.inventory.gpus[i].uuid for i in plan.target_gpus),
            endpoint=endpoint,
            epoch=plan.epoch,
            reason="",
            **explained,
        )
        broker.holds.pop((plan.deployment_id, plan.epoch), None)
        broker.watchers.push(
            plan.deployment_id,
            placement_update(record, plan.trigger, migration_id=plan.migration_id),
        )

    async def wait_ack(self, plan: MigrationPlan, timeout_s: float) -> bool:
        event = self._acks.get((plan.deployment_id, plan.epoch))
        if event is None:
            return False
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def save(
        self, plan: MigrationPlan, state: str, timeline: Timeline, outcome: str, reason: str
    ) -> None:
        broker = self.broker
        now = time.time()
        existing = await broker.db(broker.store.list_migrations, plan.deployment_id)
        if any(m.migration_id == plan.migration_id for m in existing):
            await broker.db(
                broker.store.update_migration,
                plan.migration_id,
                state=MigrationState(state),
                timeline_json=timeline.to_json(),
                outcome=outcome,
                reason=reason,
            )
            return
        await broker.db(
            broker.store.create_migration,
            MigrationRecord(
                migration_id=plan.migration_id,
                deployment_id=plan.deployment_id,
                trigger=MigrationTrigger(plan.trigger),
                source_node=plan.source_node or "",
                target_node=plan.target_node,
                strategy=MigrationStrategy(str(plan.strategy)),
                state=MigrationState(state),
                timeline_json=timeline.to_json(),
                outcome=outcome,
                reason=reason,
                downtime_ms=None,
                failed_requests=None,
                created_at=now,
                updated_at=now,
            ),
        )
