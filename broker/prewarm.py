"""Predictive pre-warm: a standby replica at the site a client is predicted to reach next.

The broker learns every client's site transitions (`migration.prediction.TransitionModel`:
per client and for everyone, from the current and the previous site). When a deployment is
settled (its client reported a site and no move is under way; a migration ended; the periodic
sweep), `plan` asks the model for the client's most likely next site, has placement choose the
best node for a client there (standby priority: it preempts nothing and anything preempts
it), and starts a standby there when `migration.policy.prewarm_verdict` says the move would
be made and is worth it (probability x gain), within the operator's budget of standbys held
at once (`PrewarmSettings`). The broker (`StandbyPool.reserve`) records it before asking
the node, holds it in the snapshot, and starts it at background CPU priority.

The standby is the deployment's replica at its next epoch. When the client reports the
predicted site, the mobility choice moves to the standby's node if that passes the
hysteresis (no cooldown: the move starts nothing), and `Moves.reserve_move` turns the
standby into the move's target: the migration switches as soon as it is decided, recorded
with `prewarmed`. A standby lapses when the client reports another site (or the move goes
elsewhere), expires after `ttl_s`, is preempted by any deployment that needs its GPUs, and
is retired with its deployment; a restarted broker stops the standbys its predecessor left
(their records say which).

The model lives in memory: a restarted broker learns again from the reports that follow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from broker.network import UnknownSite
from broker.placement import ClusterSnapshot, Decision, PriorityClass, place
from broker.placement import Strategy as PlacementStrategy
from broker.service import Broker
from broker.state import DeploymentRecord, DeploymentState
from broker.values import Standby, spec_of
from migration.policy import Hysteresis, PrewarmSettings, prewarm_verdict
from migration.prediction import Prediction, TransitionModel

logger = logging.getLogger(__name__)


class Prewarm:
    def __init__(
        self,
        broker: Broker,
        hysteresis: Hysteresis,
        settings: PrewarmSettings,
        model: TransitionModel | None = None,
    ) -> None:
        self.broker = broker
        self.hysteresis = hysteresis
        self.settings = settings
        self.model = model or TransitionModel()
        broker.metrics.set_standby_budget(settings.budget)

    def observe(self, client_id: str, site: str) -> None:
        """The client reports `site` (learned whether pre-warm is on or not)."""
        self.model.observe(client_id, site)

    async def plan(self, deployment_id: str) -> Standby | None:
        """Start a standby of the deployment at its client's predicted next site, if that is
        worth it and allowed (see the module docstring); the standby, or None."""
        if not self.settings.enabled:
            return None
        broker = self.broker
        record = await broker.deployments.deployment(deployment_id)
        if record is None or record.state is not DeploymentState.RUNNING:
            return None
        if spec_of(record).service:
            return None  # a service's replica serves its site: no client of its own moves
        if broker.standbys.standby_of(deployment_id) is not None:
            return None
        self.model.observe(record.client_id, record.site)  # its deploy site, say
        prediction = self.model.predict(record.client_id)
        if prediction is None or prediction.probability < self.settings.min_probability:
            return None
        standby = await broker.standbys.reserve(
            deployment_id,
            prediction.site,
            prediction.probability,
            lambda r, snapshot: self._choose(r, snapshot, prediction),
            self.settings.budget,
        )
        if standby is not None:
            broker.background(self._expire(standby), f"expire-{standby.replica}")
        return standby

    def _choose(
        self, record: DeploymentRecord, snapshot: ClusterSnapshot, prediction: Prediction
    ) -> Decision | None:
        """Where the standby goes: the best other node for a client at the predicted site,
        if the verdict says so. Runs under the placement lock."""
        assert record.node_id is not None
        current = snapshot.get(record.node_id)
        if current is None:
            return None
        network = self.broker.network
        spec = spec_of(record)
        # Spread: a standby goes where deployments, which pack, would go last (they take
        # the GPUs of a standby in their way, and it is lost).
        request = dataclasses.replace(
            spec.placement_request(f"{record.deployment_id}@{record.epoch + 1}", prediction.site),
            priority=PriorityClass.STANDBY,
            strategy=PlacementStrategy.SPREAD,
        )
        try:
            current_ms = network.latency_ms(prediction.site, current.site, record.node_id)
            decision = place(snapshot.without_node(record.node_id), request, network)
        except UnknownSite:
            return None  # the site left the cluster file since it was learned
        chosen = decision.explanation.chosen
        if decision.node_id is None or chosen is None:
            logger.info(
                "deployment=%s: no standby for site %s: %s",
                record.deployment_id,
                prediction.site,
                decision.reason,
            )
            return None
        verdict = prewarm_verdict(
            prediction.probability, current_ms, chosen.latency_ms, self.hysteresis, self.settings
        )
        logger.info(
            "deployment=%s next site %s (%.0f%%): %s%s",
            record.deployment_id,
            prediction.site,
            prediction.probability * 100,
            "pre-warming, " if verdict.move else "no standby: ",
            verdict.reason,
        )
        return decision if verdict.move else None

    async def _expire(self, standby: Standby) -> None:
        await asyncio.sleep(self.settings.ttl_s)
        await self.broker.standbys.retire(
            standby,
            f"the client did not reach {standby.site} in {self.settings.ttl_s:g}s",
            "expired",
        )

    async def sweep(self) -> None:
        """Plan every running deployment that has no standby and no move under way: those
        deployed since, and those the budget turned away when it was full."""
        if not self.settings.enabled:
            return
        broker = self.broker
        for record in await broker.deployments.visible():
            if len(broker.standbys.held()) >= self.settings.budget:
                return  # nothing more fits the budget: not refused, just not tried
            if record.state is DeploymentState.RUNNING and not broker.applier.is_busy(
                record.deployment_id
            ):
                await self.plan(record.deployment_id)
