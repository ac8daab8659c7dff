"""When a service's replica counts as over its load (`broker.services.over_targets`): every
sample of the last SCALE_SUSTAIN_S past a target, judged on synthetic samples."""

from __future__ import annotations

from broker.services import (
    SCALE_SUSTAIN_S,
    latency_target,
    over_targets,
    queue_target,
)
from broker.telemetry import DeploymentPoint, ReplicaLoad, RequestFigures

NOW = 10_000.0


def point(
    ago_s: float, latency_p99_ms: float | None, queue_delay_p99_ms: float | None = 1.0
) -> DeploymentPoint:
    """A sample `ago_s` before NOW of a replica answering 100 calls a second."""
    figures = RequestFigures(
        rate_per_s=100.0,
        failure_rate_per_s=0.0,
        latency_p50_ms=latency_p99_ms,
        latency_p99_ms=latency_p99_ms,
        in_flight=1,
        queued=0,
        queue_delay_p99_ms=queue_delay_p99_ms,
    )
    return DeploymentPoint(NOW - ago_s, "node-a", ReplicaLoad("r-1", 1.0, 0.0, 0.0, 90, figures))


def test_latency_past_the_slo_in_every_sample_is_over_and_says_by_how_much() -> None:
    points = [point(4, 25.0), point(2, 50.0), point(0, 25.0)]
    why = over_targets(points, [queue_target(50.0), latency_target(20.0)], NOW)
    assert why is not None
    assert "latency p99 25-50 ms, past the 20 ms latency SLO by at least 5 ms" in why, why
    assert "queue delay" not in why  # 1 ms waits: under the queue target
    assert "in all 3 samples over 4.0 s, at 100 req/s" in why, why


def test_one_sample_within_the_slo_is_not_over() -> None:
    points = [point(4, 25.0), point(2, 10.0), point(0, 25.0)]
    assert over_targets(points, [queue_target(50.0), latency_target(20.0)], NOW) is None


def test_without_a_latency_target_a_slow_replica_is_judged_by_its_queue_alone() -> None:
    points = [point(4, 250.0), point(0, 250.0)]
    assert over_targets(points, [queue_target(50.0)], NOW) is None


def test_both_targets_passed_are_both_named() -> None:
    points = [point(3, 100.0, 60.0), point(0, 250.0, 80.0)]
    why = over_targets(points, [queue_target(50.0), latency_target(20.0)], NOW)
    assert why is not None
    assert "queue delay p99 60-80 ms, past the 50 ms target by at least 10 ms" in why, why
    assert "latency p99 100-250 ms, past the 20 ms latency SLO by at least 80 ms" in why, why


def test_a_sample_without_a_finished_request_is_not_past() -> None:
    points = [point(4, 25.0), point(2, None), point(0, 25.0)]
    assert over_targets(points, [latency_target(20.0)], NOW) is None


def test_too_few_or_too_short_samples_are_not_demand() -> None:
    slo = [latency_target(20.0)]
    assert over_targets([point(0, 500.0)], slo, NOW) is None
    assert over_targets([point(1, 500.0), point(0, 500.0)], slo, NOW) is None  # 1 s of 5
    # A sample older than the window does not count, under its target or past it.
    old = point(SCALE_SUSTAIN_S + 1, 5.0)
    assert over_targets([old, point(3, 500.0), point(0, 500.0)], slo, NOW) is not None
