"""Migrations in the broker: what triggers them, and the `MigrationHost` they run on.

Triggers: a client's location report past the hysteresis (`migration.policy`), an operator's
migrate, a node drain, a node lost. Each becomes a `Move` reserved through
`Moves.reserve_move`: one decision under the broker's placement lock checks that the
deployment runs and no other move or delete holds it, chooses the target, and holds the
target's GPUs. The mechanism (`migration.mechanism.run_migration`) then drives it through
this host, which calls only the broker's intent-level operations (start the target, commit
the switch, give up, release) and its migration records: this module keeps no deployment
state of its own beyond the client acks it waits for and the mobility cooldown.

Predictive pre-warm (`broker.prewarm`) hangs off the same triggers: every location report
teaches its model; a deployment left settled (no move started, a migration ended, just
deployed) is planned a standby; the mobility choice takes the deployment's standby when the
client reports the site it was started for.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable

from broker.errors import Impossible, InvalidRequest, NodeUnavailable, NotFound, ResourceExhausted
from broker.placement import ClusterSnapshot, Decision, PlacementRequest, place
from broker.prewarm import Prewarm
from broker.service import Broker
from broker.state import (
    DeploymentRecord,
    DeploymentState,
    MigrationRecord,
    MigrationState,
    MigrationTrigger,
    NodeState,
)
from broker.values import Move, spec_of
from migration.mechanism import (
    MigrationPlan,
    Outcome,
    Strategy,
    TargetFailed,
    Timeline,
    run_migration,
)
from migration.policy import Hysteresis, PrewarmSettings, mobility_verdict

logger = logging.getLogger(__name__)

UNFINISHED = (MigrationState.PREPARING, MigrationState.SWITCHING, MigrationState.DRAINING)

Choice = tuple[Decision, str] | None


class Migrations:
    def __init__(
        self,
        broker: Broker,
        hysteresis: Hysteresis,
        drain_timeout_s: float = 5.0,
        prewarm: PrewarmSettings | None = None,
    ) -> None:
        self.broker = broker
        self.hysteresis = hysteresis
        self.prewarm = Prewarm(broker, hysteresis, prewarm or PrewarmSettings())
        """Predictive pre-warm: off unless its settings give it a budget."""
        self.drain_timeout_s = drain_timeout_s
        self._acks: dict[tuple[str, int], asyncio.Event] = {}
        self._last: dict[str, float] = {}
        """deployment id -> time.monotonic() of the end of its last migration."""
        self._moves: dict[str, Move] = {}
        """migration id -> its reservation, while it runs."""
        self.background_targets = True
        """Make-before-break starts its target at background CPU priority (`start_target`);
        False only to measure what that buys (`python -m bench.migration
        --foreground-targets`)."""
        self._decided: dict[str, float] = {}
        """migration id -> time.monotonic() of its decision, while it runs (the switch tells
        the client how long it prepared)."""

    # --- triggers ------------------------------------------------------------------------

    async def on_location(self, client_id: str, site: str) -> list[str]:
        """The client is at `site` now: move each of its running deployments whose best
        node is past the hysteresis. Returns the migrations started."""
        broker = self.broker
        await broker.deployments.report_location(client_id, site)
        await broker.services.on_location(client_id, site)
        self.prewarm.observe(client_id, site)
        started = []
        for record in await broker.deployments.list(client_id):
            if record.state is not DeploymentState.RUNNING or spec_of(record).service:
                continue  # a service's replica stays at its site, wherever its owner is
            deployment_id = record.deployment_id
            await broker.deployments.set_site(deployment_id, site)
            try:
                move = await broker.moves.reserve_move(
                    deployment_id,
                    lambda r, snapshot: self._mobility_choice(r, snapshot, site),
                    client_id=client_id,
                    if_idle=True,
                )
            except NotFound:
                continue  # it stopped running since it was listed
            except ResourceExhausted as err:
                logger.info("deployment=%s stays for site %s: %s", deployment_id, site, err)
                move = None
            if move is not None:
                started.append(
                    await self._launch(move, MigrationTrigger.MOBILITY, Strategy.MAKE_BEFORE_BREAK)
                )
                continue
            if broker.applier.is_busy(deployment_id):
                continue  # a move under way: pre-warm plans again when it ends
            standby = broker.standbys.standby_of(deployment_id)
            if standby is not None and site != record.site:
                # The client moved and no move was made: what the standby was for is over.
                why = f"the client reported {site}" + (
                    " and stays on its node" if site == standby.site else ""
                )
                broker.background(
                    self._replan(deployment_id, broker.standbys.retire(standby, why, "lapsed")),
                    f"prewarm-{deployment_id}",
                )
            else:
                broker.background(self.prewarm.plan(deployment_id), f"prewarm-{deployment_id}")
        return started

    def _mobility_choice(
        self, record: DeploymentRecord, snapshot: ClusterSnapshot, site: str
    ) -> Choice:
        """The best other node that fits, if it beats staying by the hysteresis; the
        deployment's standby for `site`, if it has one there that does (no cooldown: the
        move starts nothing)."""
        assert record.node_id is not None
        current = snapshot.get(record.node_id)
        if current is None:
            return None
        current_ms = self.broker.network.latency_ms(site, current.site, record.node_id)
        standby = self.broker.standbys.standby_of(record.deployment_id)
        if standby is not None and standby.site == site and standby.node_id in snapshot:
            node = snapshot.node(standby.node_id)
            standby_ms = self.broker.network.latency_ms(site, node.site, standby.node_id)
            verdict = mobility_verdict(current_ms, standby_ms, None, self.hysteresis)
            decision = place(
                ClusterSnapshot.of([node]), _request(record, site), self.broker.network
            )
            if verdict.move and decision.node_id is not None:
                logger.info(
                    "deployment=%s site=%s: migrating to its standby on %s, %s",
                    record.deployment_id,
                    site,
                    standby.node_id,
                    verdict.reason,
                )
                return decision, f"client moved to {site}, as predicted: {verdict.reason}"
        decision = place(
            snapshot.without_node(record.node_id), _request(record, site), self.broker.network
        )
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
        return decision, f"client moved to {site}: {verdict.reason}"

    async def migrate(
        self,
        deployment_id: str,
        to_node: str,
        strategy: Strategy,
        trigger: MigrationTrigger = MigrationTrigger.OPERATOR,
        client_id: str | None = None,
    ) -> str:
        """Move a running deployment now, to `to_node` or the best node for its site.
        NotFound (no such running deployment, or node), ResourceExhausted when no target
        fits, Impossible while it is being migrated or deleted already."""

        def choose(record: DeploymentRecord, snapshot: ClusterSnapshot) -> Choice:
            if to_node:
                if to_node not in snapshot:
                    raise NotFound(f"node {to_node} is not registered")
                snapshot = ClusterSnapshot.of([snapshot.node(to_node)])
            else:
                snapshot = snapshot.without_node(record.node_id or "")
            decision = place(snapshot, _request(record, record.site), self.broker.network)
            if decision.node_id is None:
                raise ResourceExhausted(
                    f"no node can take deployment {deployment_id}: {decision.reason}"
                )
            return decision, f"{trigger} migration"

        move = await self.broker.moves.reserve_move(deployment_id, choose, client_id=client_id)
        assert move is not None
        return await self._launch(move, trigger, strategy)

    async def rebalance(self, deployment_id: str, target_node: str, why: str) -> str | None:
        """Move a running deployment to `target_node` make-before-break because its node is
        hot (`broker.rebalance`); `why` is the policy's reason, recorded with the migration.
        None when it is busy (another move or a delete holds it), stopped running, or no
        longer fits there."""

        def choose(record: DeploymentRecord, snapshot: ClusterSnapshot) -> Choice:
            if target_node not in snapshot:
                return None
            decision = place(
                ClusterSnapshot.of([snapshot.node(target_node)]),
                _request(record, record.site),
                self.broker.network,
            )
            return None if decision.node_id is None else (decision, why)

        try:
            move = await self.broker.moves.reserve_move(deployment_id, choose, if_idle=True)
        except (NotFound, ResourceExhausted) as err:
            logger.info("rebalance of deployment=%s not started: %s", deployment_id, err)
            return None
        if move is None:
            return None
        return await self._launch(move, MigrationTrigger.REBALANCE, Strategy.MAKE_BEFORE_BREAK)

    def fits(self, record: DeploymentRecord, node_id: str, snapshot: ClusterSnapshot) -> bool:
        """Whether placement would put the deployment's next replica on `node_id` (a dry run
        on `snapshot`, for the rebalancing policy)."""
        if node_id not in snapshot:
            return False
        decision = place(
            ClusterSnapshot.of([snapshot.node(node_id)]),
            _request(record, record.site),
            self.broker.network,
        )
        return decision.node_id is not None and not decision.preempt

    async def drain(self, node_id: str) -> list[str]:
        """Stop placing on the node and move every deployment off it (make-before-break)."""
        broker = self.broker
        if node_id not in broker.nodes:
            raise NotFound(f"node {node_id} is not registered")
        await broker.set_node_state(node_id, NodeState.DRAINING)
        started = []
        for record in await broker.deployments.running_on(node_id):
            try:
                started.append(
                    await self.migrate(
                        record.deployment_id,
                        "",
                        Strategy.MAKE_BEFORE_BREAK,
                        MigrationTrigger.DRAIN,
                    )
                )
            except (ResourceExhausted, Impossible, NotFound) as err:
                logger.error(
                    "drain %s: deployment=%s stays: %s", node_id, record.deployment_id, err
                )
        return started

    async def on_node_lost(self, node_id: str) -> list[str]:
        """Fail over every deployment of a lost node to the best node that fits; one that
        nothing fits becomes pending (placed again when capacity returns)."""
        broker = self.broker
        started = []

        def choose(record: DeploymentRecord, snapshot: ClusterSnapshot) -> Choice:
            decision = place(
                snapshot.without_node(node_id), _request(record, record.site), broker.network
            )
            return (decision, f"node {node_id} was lost") if decision.node_id else None

        for record in await broker.deployments.running_on(node_id):
            try:
                move = await broker.moves.reserve_move(record.deployment_id, choose, if_idle=True)
            except NotFound:
                continue
            except ResourceExhausted:
                move = None  # only by preempting: placed again, it may
            if move is None:
                logger.error(
                    "deployment=%s lost with node %s and nothing fits now: pending",
                    record.deployment_id,
                    node_id,
                )
                await broker.deployments.requeue(
                    record, f"node {node_id} was lost and nothing fits now"
                )
                continue
            started.append(await self._launch(move, MigrationTrigger.NODE_LOST, Strategy.FAILOVER))
        return started

    async def _replan(self, deployment_id: str, retired: Awaitable[bool]) -> None:
        """Retire the lapsed standby (off the report's path), then plan the next one."""
        await retired
        await self.prewarm.plan(deployment_id)

    def on_deployed(self, record: DeploymentRecord) -> None:
        """A deployment was placed: plan its standby now if it runs (the sweep would, but
        a client may move before the sweep comes round)."""
        if record.state is DeploymentState.RUNNING:
            self.broker.background(
                self.prewarm.plan(record.deployment_id), f"prewarm-{record.deployment_id}"
            )

    def on_ack(self, deployment_id: str, epoch: int) -> None:
        event = self._acks.get((deployment_id, epoch))
        if event is not None:
            event.set()

    async def on_observation(
        self,
        client_id: str,
        deployment_id: str,
        migration_id: str,
        gap_ms: float,
        failed: int,
        span_gap_ms: float | None = None,
    ) -> None:
        """Keep what the client saw: the longest gap across the switch (`gap_ms`, the
        downtime), and over the whole migration (`span_gap_ms`; None from an older client).
        Values are checked by the caller (`broker.rpc.validate`); negative ones are refused
        here too."""
        broker = self.broker
        await broker.deployments.get(client_id, deployment_id)
        if gap_ms < 0 or failed < 0 or (span_gap_ms is not None and span_gap_ms < 0):
            raise InvalidRequest(
                "longest_gap_ms, span_gap_ms and failed_requests must not be negative"
            )
        records = await broker.moves.list_migrations(deployment_id)
        if not any(m.migration_id == migration_id for m in records):
            raise NotFound(f"migration {migration_id} of deployment {deployment_id} not found")
        await broker.moves.update_migration(
            migration_id, downtime_ms=gap_ms, span_gap_ms=span_gap_ms, failed_requests=failed
        )
        broker.metrics.observe_downtime(gap_ms / 1000)
        if span_gap_ms is not None:
            broker.metrics.observe_span_gap(span_gap_ms / 1000)
        logger.info(
            "migration=%s client-observed gap %.1f ms across the switch, %s over the "
            "migration, %d failed request(s)",
            migration_id,
            gap_ms,
            "-" if span_gap_ms is None else f"{span_gap_ms:.1f} ms",
            failed,
        )

    async def resume_after_restart(self) -> None:
        """A migration the broker was killed in the middle of: before the switch, roll it
        back (the target replica is unclaimed and stopped after the orphan grace); after it,
        it is complete (the old replica is unclaimed and stopped likewise)."""
        broker = self.broker
        for m in await broker.moves.list_migrations(states=UNFINISHED):
            record = await broker.deployments.deployment(m.deployment_id)
            switched = record is not None and record.node_id == m.target_node
            await broker.moves.update_migration(
                m.migration_id,
                state=MigrationState.COMPLETED if switched else MigrationState.ROLLED_BACK,
                outcome=str(Outcome.SUCCEEDED if switched else Outcome.ROLLED_BACK),
                reason="broker restarted during the migration; "
                + ("it had switched" if switched else "it had not switched"),
            )
            logger.warning(
                "migration=%s resumed after restart: %s",
                m.migration_id,
                "completed" if switched else "rolled back",
            )

    # --- running -------------------------------------------------------------------------

    async def _launch(self, move: Move, trigger: MigrationTrigger, strategy: Strategy) -> str:
        """Record the migration and run it in the background; its id."""
        plan = MigrationPlan(
            migration_id=f"m-{secrets.token_hex(5)}",
            deployment_id=move.deployment_id,
            trigger=str(trigger),
            strategy=strategy,
            source_node=move.source_node,
            source_replica=move.source_replica,
            target_node=move.target_node,
            target_gpus=move.target_gpus,
            epoch=move.epoch,
            drain_timeout_s=self.drain_timeout_s,
            stop_grace_ms=self.broker.settings.stop_grace_ms,
            prewarmed=move.prewarmed,
            cause=move.why,
        )
        self._moves[plan.migration_id] = move
        self._decided[plan.migration_id] = time.monotonic()
        self._acks[(plan.deployment_id, plan.epoch)] = asyncio.Event()
        try:
            timeline = Timeline()
            timeline.mark("decided")
            await self.save(plan, "preparing", timeline, "", "")
        except BaseException:
            self._finish(plan)
            raise
        self.broker.background(self._run(plan), f"migration-{plan.migration_id}")
        return plan.migration_id

    async def _run(self, plan: MigrationPlan) -> None:
        try:
            outcome = await run_migration(self, plan)
            self.broker.metrics.record_migration(str(outcome), plan.trigger, None)
            source = self.broker.nodes.get(plan.source_node or "")
            source_lost = source is None or source.record.state is NodeState.LOST
            if outcome is Outcome.FAILED or (outcome is Outcome.ROLLED_BACK and source_lost):
                # No replica serves any more (failover, stop-start, or a rollback to a node
                # lost meanwhile): place it again.
                await self.broker.moves.abandon_move(
                    self._moves[plan.migration_id], f"{plan.strategy} migration failed"
                )
        finally:
            self._finish(plan)
        self.broker.background(
            self.prewarm.plan(plan.deployment_id), f"prewarm-{plan.deployment_id}"
        )

    def _finish(self, plan: MigrationPlan) -> None:
        move = self._moves.pop(plan.migration_id, None)
        self._decided.pop(plan.migration_id, None)
        if move is not None:
            self.broker.moves.release_move(move)
        self._acks.pop((plan.deployment_id, plan.epoch), None)
        self._last[plan.deployment_id] = time.monotonic()

    # --- MigrationHost -------------------------------------------------------------------

    async def start_target(self, plan: MigrationPlan) -> str:
        """Make-before-break starts the target at background CPU priority (the node raises
        it once the target is ready, before it answers, so before the switch): the replica
        serving meanwhile may share the target's CPUs. Nothing serves during the start of
        the other strategies; they start it at full speed."""
        try:
            return await self.broker.moves.start_move_target(
                self._moves[plan.migration_id],
                background=self.background_targets and plan.strategy is Strategy.MAKE_BEFORE_BREAK,
            )
        except (NodeUnavailable, ResourceExhausted) as err:
            raise TargetFailed(str(err)) from err

    async def stop_replica(self, node_id: str, replica_id: str, grace_ms: int) -> None:
        await self.broker.registry.stop_replica(node_id, replica_id, grace_ms)

    async def switch(self, plan: MigrationPlan, endpoint: str) -> None:
        await self.broker.moves.commit_switch(
            self._moves[plan.migration_id],
            endpoint,
            # The old replica keeps its GPUs until it is stopped.
            hold_source=plan.strategy is Strategy.MAKE_BEFORE_BREAK,
            reason=plan.trigger,
            migration_id=plan.migration_id,
            decided_at=self._decided.get(plan.migration_id),
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
        reason = "; ".join(r for r in (plan.cause, reason) if r)
        existing = await broker.moves.list_migrations(plan.deployment_id)
        if any(m.migration_id == plan.migration_id for m in existing):
            await broker.moves.update_migration(
                plan.migration_id,
                state=MigrationState(state),
                timeline_json=timeline.to_json(),
                outcome=outcome,
                reason=reason,
            )
            return
        await broker.moves.record_migration(
            MigrationRecord(
                migration_id=plan.migration_id,
                deployment_id=plan.deployment_id,
                trigger=MigrationTrigger(plan.trigger),
                source_node=plan.source_node or "",
                target_node=plan.target_node,
                strategy=plan.strategy,
                state=MigrationState(state),
                timeline_json=timeline.to_json(),
                outcome=outcome,
                reason=reason,
                downtime_ms=None,
                failed_requests=None,
                span_gap_ms=None,
                created_at=now,
                updated_at=now,
                prewarmed=plan.prewarmed,
            ),
        )


def _request(record: DeploymentRecord, site: str) -> PlacementRequest:
    """What placement is asked for the deployment's replica at the next epoch."""
    spec = spec_of(record)
    return spec.placement_request(f"{record.deployment_id}@{record.epoch + 1}", site)
