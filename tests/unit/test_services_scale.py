"""When a service's replica counts as over its load (`broker.services.over_targets`): every
sample in force over the last SCALE_SUSTAIN_S (those of the span and the one standing at its
start) past a target, judged on synthetic samples."""

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
    points = [point(6, 25.0), point(2, 50.0), point(0, 25.0)]
    why = over_targets(points, [queue_target(50.0), latency_target(20.0)], NOW)
    assert why is not None
    assert "latency p99 25-50 ms, past the 20 ms latency SLO by at least 5 ms" in why, why
    assert "queue delay" not in why  # 1 ms waits: under the queue target
    assert "in all 3 samples in force over the last 6.0 s, at 100 req/s" in why, why


def test_one_sample_within_the_slo_is_not_over() -> None:
    points = [point(6, 25.0), point(2, 10.0), point(0, 25.0)]
    assert over_targets(points, [queue_target(50.0), latency_target(20.0)], NOW) is None


def test_without_a_latency_target_a_slow_replica_is_judged_by_its_queue_alone() -> None:
    points = [point(6, 250.0), point(0, 250.0)]
    assert over_targets(points, [queue_target(50.0)], NOW) is None


def test_both_targets_passed_are_both_named() -> None:
    points = [point(5, 100.0, 60.0), point(0, 250.0, 80.0)]
    why = over_targets(points, [queue_target(50.0), latency_target(20.0)], NOW)
    assert why is not None
    assert "queue delay p99 60-80 ms, past the 50 ms target by at least 10 ms" in why, why
    assert "latency p99 100-250 ms, past the 20 ms latency SLO by at least 80 ms" in why, why


def test_a_sample_without_a_finished_request_is_not_past() -> None:
    points = [point(6, 25.0), point(2, None), point(0, 25.0)]
    assert over_targets(points, [latency_target(20.0)], NOW) is None


def test_a_span_whose_start_no_sample_covers_is_not_demand() -> None:
    """Samples only from within the span (a replica that just started reporting) leave its
    start unknown: not demand, however far past."""
    slo = [latency_target(20.0)]
    assert over_targets([point(0, 500.0)], slo, NOW) is None
    assert over_targets([point(4, 500.0), point(2, 500.0), point(0, 500.0)], slo, NOW) is None


def test_a_sample_standing_since_before_the_span_counts_and_older_ones_do_not() -> None:
    """A steady load sends no sample until it changes or `--sample-interval` passes: the last
    sample before the span stood through it (past the target: demand, alone or with those
    in the span); the ones before that were replaced, under their target or past it."""
    slo = [latency_target(20.0)]
    why = over_targets([point(15, 500.0)], slo, NOW)
    assert why is not None and "in the one sample in force over the last 15.0 s" in why, why
    replaced = point(SCALE_SUSTAIN_S + 10, 5.0)
    assert over_targets([replaced, point(6, 500.0), point(0, 500.0)], slo, NOW) is not None
    # Under the target at the span's start (its standing sample): not demand yet.
    assert over_targets([point(6, 5.0), point(3, 500.0), point(0, 500.0)], slo, NOW) is None
