"""`run_migration` over a recording host: the old replica outlives the client's ack by the
straggler grace, and a missing ack does not wait for it twice."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from migration.mechanism import (
    MigrationPlan,
    Outcome,
    Strategy,
    Timeline,
    phase_at,
    run_migration,
    worst_gap,
)


@dataclass
class RecordingHost:
    ack: bool
    calls: list[tuple[str, float]] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.calls.append((what, time.monotonic()))

    async def start_target(self, plan: MigrationPlan) -> str:
        self.note("start_target")
        return "127.0.0.1:1"

    async def stop_replica(self, node_id: str, replica_id: str, grace_ms: int) -> None:
        self.note(f"stop {replica_id}")

    async def switch(self, plan: MigrationPlan, endpoint: str) -> None:
        self.note("switch")

    async def wait_ack(self, plan: MigrationPlan, timeout_s: float) -> bool:
        if not self.ack:
            await asyncio.sleep(timeout_s)
        self.note("ack" if self.ack else "no ack")
        return self.ack

    async def save(
        self, plan: MigrationPlan, state: str, timeline: Timeline, outcome: str, reason: str
    ) -> None:
        self.note(f"save {state}")


def plan(grace_s: float) -> MigrationPlan:
    return MigrationPlan(
        migration_id="m-1", deployment_id="d-1", trigger="mobility",
        strategy=Strategy.MAKE_BEFORE_BREAK, source_node="node-a", source_replica="d-1-1",
        target_node="node-b", target_gpus=(0,), epoch=2,
        drain_timeout_s=0.05, straggler_grace_s=grace_s,
    )  # fmt: skip


def at(host: RecordingHost, what: str) -> float:
    return next(t for name, t in host.calls if name == what)


async def test_the_old_replica_takes_calls_for_the_grace_after_the_ack() -> None:
    host = RecordingHost(ack=True)
    assert await run_migration(host, plan(grace_s=0.3)) is Outcome.SUCCEEDED
    names = [name for name, _ in host.calls]
    assert names.index("switch") < names.index("ack") < names.index("stop d-1-1")
    assert at(host, "stop d-1-1") - at(host, "ack") >= 0.3


async def test_without_an_ack_the_drain_timeout_is_the_only_wait() -> None:
    host = RecordingHost(ack=False)
    assert await run_migration(host, plan(grace_s=5.0)) is Outcome.SUCCEEDED
    assert at(host, "stop d-1-1") - at(host, "no ack") < 1.0


def test_the_worst_gap_counts_gaps_that_straddle_the_span_whole() -> None:
    answered = [0.0, 0.5, 1.2, 1.3, 2.0, 4.0]
    assert worst_gap(answered, 1.0, 1.9) == (0.5, 1.2)  # from the last answer by the start
    assert worst_gap(answered, 1.25, 1.5) == (1.3, 2.0)  # through the first one after the end
    assert worst_gap(answered, 2.5, 3.0) == (2.0, 4.0)  # no answer inside: the gap around it
    with pytest.raises(ValueError, match="fewer than two answers"):
        worst_gap([1.0], 0.0, 2.0)


def test_a_gap_is_placed_in_the_phase_it_ended_in() -> None:
    events = {
        "decided": 0.0,
        "target_started": 0.1,
        "target_ready": 1.0,
        "switched": 1.1,
        "old_stopped": 1.6,
        "completed": 1.6,
    }
    expected = {0.05: "prep", 0.1: "prep", 0.5: "start", 1.05: "ready", 1.5: "switched"}
    assert {at: phase_at(events, at) for at in expected} == expected
    assert phase_at(events, 1.7) == "after"
    # Stop-start stops the old replica before the start: the span ends at `completed`.
    assert phase_at({**events, "old_stopped": 0.05}, 1.5) == "switched"
