"""How a deployment moves: make-before-break, stop-start (the baseline), or failover.

`run_migration` drives one migration through a `MigrationHost` (the broker implements it:
node calls, the deployment record, the client's stream) and records a timeline. Plain
asyncio over that protocol; nothing here knows gRPC or SQLite.

make-before-break: prepare the target (replica started, warmed, ready), switch (epoch + 1,
the record, the update pushed to the client), drain the old (the client's ack, then
`straggler_grace_s` for calls it addressed to the old endpoint just before switching; or a
drain timeout; then in-flight calls finish under the stop's grace period), stop it. A
target that fails is stopped and the old keeps serving: rolled back, with the reason.
stop-start: stop the old first, then start the target and switch (the client sees a gap).
failover: the source is gone (node lost): start the target and switch.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import itertools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)


class Strategy(enum.StrEnum):
    """How a deployment moves; the broker stores it by its value (one type end to end)."""

    MAKE_BEFORE_BREAK = "make_before_break"
    """Start and warm the target, switch clients to it, then drain and stop the source."""
    STOP_START = "stop_start"
    """The baseline: stop the source, then start the target (break before make)."""
    FAILOVER = "failover"
    """The source is gone (node lost): start the target and switch."""


class Outcome(enum.StrEnum):
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


class TargetFailed(Exception):
    """The target replica could not start or become ready."""


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    migration_id: str
    deployment_id: str
    trigger: str
    strategy: Strategy
    source_node: str | None
    """None when the source is gone (failover)."""
    source_replica: str | None
    target_node: str
    target_gpus: tuple[int, ...]
    epoch: int
    """The epoch the deployment has on the target."""
    drain_timeout_s: float = 5.0
    """How long to wait for the client's ack before stopping the old replica anyway."""
    stop_grace_ms: int = 5000
    straggler_grace_s: float = 0.2
    """After the client's ack, how long the old replica keeps taking new calls: a request the
    client addressed to the old endpoint just before it switched can arrive after the ack."""
    prewarmed: bool = False
    """The target is a pre-warmed standby (`broker.prewarm`): its start is at most a wait for
    it to be ready."""
    cause: str = ""
    """Why it was started (the policy's reason: the client's move and its gain, the node
    that is hot); recorded with it, before a failure's reason."""


@dataclass(slots=True)
class Timeline:
    clock: Callable[[], float] = time.time
    events: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, event: str) -> None:
        self.events.append((event, self.clock()))

    def to_json(self) -> str:
        return json.dumps([{"event": e, "at": at} for e, at in self.events])


PHASE_EVENTS = frozenset({"target_started", "target_ready", "switched", "completed"})
"""The timeline events `phase_at` needs (a migration rolled back early lacks some)."""


def phase_at(events: Mapping[str, float], at: float) -> str:
    """The phase of a migration, by its timeline's `events` (name -> time, `PHASE_EVENTS`
    among them), in which a gap
    that ended at `at` ended: prep (decision to the target's start; stop-start stops the old
    replica there), start (the target's start), ready (target ready to the broker's switch),
    switched (from there to the end: the client switches, the old replica drains and stops),
    after (a gap that straddles the end)."""
    end = max(events.get("old_stopped", events["completed"]), events["completed"])
    bounds = (
        ("prep", events["target_started"]),
        ("start", events["target_ready"]),
        ("ready", events["switched"]),
        ("switched", end),
    )
    return next((phase for phase, until_ in bounds if at <= until_), "after")


def worst_gap(answered_at: Sequence[float], start: float, end: float) -> tuple[float, float]:
    """The longest gap between consecutive answers (`answered_at`, sorted) over `[start,
    end]`, as (its start, its end): from the last answer by `start` through the first one at
    or after `end` (a gap that straddles either edge counts whole). ValueError with fewer than
    two answers there."""
    first = max(0, bisect.bisect_right(answered_at, start) - 1)
    last = bisect.bisect_left(answered_at, end) + 1
    pairs = list(itertools.pairwise(answered_at[first:last]))
    if not pairs:
        raise ValueError("fewer than two answers over the span")
    return max(pairs, key=lambda ab: ab[1] - ab[0])


SPAN_EXCESS_MS = {"mlp": 10.0}
"""Issue 12: make-before-break's worst gap over the whole span may exceed the same load's
gap with no migration by at most this much, per model ..."""
SPAN_EXCESS_FRACTION = 0.25
"""... and by at most this fraction of it for the other models."""


def span_allowance_ms(model: str, quiet_ms: float) -> float:
    """How far a migration's worst gap over its whole span may exceed the same load's gap
    with no migration, `quiet_ms` (issue 12): 10 ms for the MLP, a quarter of `quiet_ms` for
    the heavier models. `bench.migration` holds the p99s of many migrations to it, the demo
    the worst of its few."""
    if model in SPAN_EXCESS_MS:
        return SPAN_EXCESS_MS[model]
    return SPAN_EXCESS_FRACTION * quiet_ms


class MigrationHost(Protocol):
    async def start_target(self, plan: MigrationPlan) -> str:
        """Start the replica of `plan.epoch` on the target; its endpoint once ready.
        TargetFailed when it cannot."""
        ...

    async def stop_replica(self, node_id: str, replica_id: str, grace_ms: int) -> None:
        """Stop a replica (drain, then remove); a node or replica already gone is fine."""
        ...

    async def switch(self, plan: MigrationPlan, endpoint: str) -> None:
        """Point the deployment at the target (record first, then the client's stream)."""
        ...

    async def wait_ack(self, plan: MigrationPlan, timeout_s: float) -> bool:
        """Whether the client acknowledged the switch to `plan.epoch` within `timeout_s`."""
        ...

    async def save(
        self, plan: MigrationPlan, state: str, timeline: Timeline, outcome: str, reason: str
    ) -> None:
        """Write the migration record (state, timeline, outcome, reason)."""
        ...


async def run_migration(host: MigrationHost, plan: MigrationPlan) -> Outcome:
    """Carry out `plan`; never leaves it half-done: it ends switched (succeeded) or with the
    old replica still serving (rolled back), or, for stop-start and failover whose target
    fails, with the deployment for the host to place again (failed)."""
    timeline = Timeline()
    timeline.mark("decided")
    await host.save(plan, "preparing", timeline, "", "")
    if plan.strategy is Strategy.STOP_START and plan.source_node and plan.source_replica:
        await host.stop_replica(plan.source_node, plan.source_replica, plan.stop_grace_ms)
        timeline.mark("old_stopped")
    timeline.mark("target_started")
    try:
        endpoint = await host.start_target(plan)
    except TargetFailed as err:
        timeline.mark("target_failed")
        rollback = plan.strategy is Strategy.MAKE_BEFORE_BREAK
        outcome = Outcome.ROLLED_BACK if rollback else Outcome.FAILED
        timeline.mark("rolled_back" if rollback else "failed")
        await host.save(plan, str(outcome), timeline, str(outcome), str(err))
        logger.warning(
            "migration=%s deployment=%s %s: %s",
            plan.migration_id,
            plan.deployment_id,
            outcome,
            err,
        )
        return outcome
    timeline.mark("target_ready")
    await host.save(plan, "switching", timeline, "", "")
    await host.switch(plan, endpoint)
    timeline.mark("switched")
    if plan.strategy is Strategy.MAKE_BEFORE_BREAK and plan.source_node and plan.source_replica:
        await host.save(plan, "draining", timeline, "", "")
        acked = await host.wait_ack(plan, plan.drain_timeout_s)
        timeline.mark("client_acknowledged" if acked else "drain_timeout")
        if acked:
            await asyncio.sleep(plan.straggler_grace_s)
        await host.stop_replica(plan.source_node, plan.source_replica, plan.stop_grace_ms)
        timeline.mark("old_stopped")
    timeline.mark("completed")
    await host.save(plan, "completed", timeline, str(Outcome.SUCCEEDED), "")
    logger.info(
        "migration=%s deployment=%s %s -> %s (%s) succeeded",
        plan.migration_id,
        plan.deployment_id,
        plan.source_node,
        plan.target_node,
        plan.strategy,
    )
    return Outcome.SUCCEEDED
