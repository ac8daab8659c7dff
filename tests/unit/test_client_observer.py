"""The gap accounting of `edge_client.observer`, with explicit timestamps (seconds)."""

from __future__ import annotations

import pytest

from edge_client.observer import GapObserver, MigrationObservation


def _steady(observer: GapObserver, start: float, stop: float, every: float) -> None:
    """Successful requests of 5 ms each, completing every `every` s in [start, stop)."""
    at = start
    while at < stop - 1e-9:
        observer.record(at - 0.005, at, ok=True)
        at = round(at + every, 6)


def test_make_before_break_gap_is_the_largest_spacing_across_the_switch() -> None:
    observer = GapObserver(window_s=2.0)
    _steady(observer, 0.0, 10.0, 0.1)  # last success before the update: 9.9
    assert observer.migration("d1", "m1", at=10.0)
    observer.record(10.02, 10.03, ok=True)  # 130 ms after 9.9
    _steady(observer, 10.1, 11.9, 0.1)
    observer.record(11.8, 11.85, ok=True)  # 50 ms
    assert observer.close("m1", now=11.99) is None  # the window runs to u + 2 s
    observer.record(12.0, 12.5, ok=True)  # 550 ms, but after the window's end (12.0)
    observation = observer.close("m1", now=12.5)
    assert observation == MigrationObservation(
        deployment_id="d1",
        migration_id="m1",
        longest_gap_ms=pytest.approx(130.0),
        failed_requests=0,
        requests=20,
        retried_requests=0,
    )
    assert observer.stats().migrations == (observation,)


def test_failures_before_the_update_count_and_the_gap_starts_at_the_last_success() -> None:
    observer = GapObserver(window_s=1.0)
    observer.record(0.9, 1.0, ok=True)
    observer.record(1.1, 1.2, ok=False)  # stop-start: the old replica is already gone
    observer.record(1.3, 1.4, ok=False)
    observer.migration("d1", "m1", at=2.0)
    observer.record(2.1, 2.2, ok=False)
    observer.record(2.3, 3.5, ok=True, retried=True)  # first success after the update
    observer.record(3.5, 3.6, ok=True)  # past u + 1 s and past f: outside
    observation = observer.close("m1", now=3.6)
    assert observation is not None
    assert observation.longest_gap_ms == pytest.approx(2500.0)  # 1.0 -> 3.5
    assert (observation.failed_requests, observation.requests) == (3, 4)
    assert observation.retried_requests == 1


def test_window_stays_open_until_a_success_after_the_update() -> None:
    observer = GapObserver(window_s=0.5)
    observer.migration("d1", "m1", at=5.0)  # no success ever before: the gap starts at u
    observer.record(5.0, 5.1, ok=False)
    assert observer.close("m1", now=9.0) is None
    observer.record(9.0, 9.2, ok=True)
    observation = observer.close("m1", now=9.2)
    assert observation is not None
    assert observation.longest_gap_ms == pytest.approx(4200.0)
    assert (observation.failed_requests, observation.requests) == (1, 2)


def test_overlapping_migrations_each_get_a_window_once() -> None:
    observer = GapObserver(window_s=1.0)
    observer.record(0.0, 0.1, ok=True)
    assert observer.migration("d1", "m1", at=0.2)
    observer.record(0.3, 0.4, ok=True)
    assert observer.migration("d1", "m2", at=0.5)
    assert not observer.migration("d1", "m1", at=0.6)  # the same update again
    observer.record(0.9, 1.0, ok=True)
    first, second = observer.close("m1", now=1.2), observer.close("m2", now=1.5)
    assert first is not None and second is not None
    assert (first.longest_gap_ms, first.requests) == (pytest.approx(600.0), 2)
    assert (second.longest_gap_ms, second.requests) == (pytest.approx(600.0), 1)
    assert not observer.migration("d1", "m1", at=2.0)  # closed ones are remembered too
    with pytest.raises(KeyError):
        observer.close("m1", now=3.0)


def test_stats_count_requests_and_give_nearest_rank_percentiles() -> None:
    observer = GapObserver(latency_samples=100)
    assert observer.stats().latency_p50_ms is None
    for i in range(1, 101):
        observer.record(float(i), i + i / 1000, ok=True)  # latencies 1..100 ms
    observer.record(200.0, 201.0, ok=False, retried=True)
    stats = observer.stats()
    assert (stats.requests, stats.failures, stats.retried) == (101, 1, 1)
    assert stats.latency_p50_ms == pytest.approx(50.0)
    assert stats.latency_p99_ms == pytest.approx(99.0)
    observer.record(300.0, 300.5, ok=True)  # evicts the oldest sample (1 ms)
    assert observer.stats().latency_p99_ms == pytest.approx(100.0)
    assert observer.stats().migrations == ()


def test_the_span_counts_the_gaps_of_the_preparation_that_the_switch_window_misses() -> None:
    observer = GapObserver(window_s=2.0)
    _steady(observer, 0.0, 5.0, 0.05)  # quiet: 50 ms apart, last at 4.95
    observer.record(4.9, 5.2, ok=True)  # 250 ms: before the decision (5.5), not in the span
    _steady(observer, 5.3, 6.0, 0.05)  # 5.2 -> 5.3 (100 ms) ends before 5.5: outside too
    observer.record(5.9, 6.18, ok=True)  # 230 ms while the target starts: in the span
    _steady(observer, 6.2, 8.0, 0.05)
    # The switch arrives at 8.0, 2.5 s after the broker decided.
    assert observer.migration("d1", "m1", at=8.0, prepared_s=2.5)
    observer.record(8.0, 8.07, ok=True)  # 120 ms across the switch (from 7.95)
    _steady(observer, 8.1, 10.1, 0.05)
    observation = observer.close("m1", now=10.1)
    assert observation is not None
    assert observation.longest_gap_ms == pytest.approx(120.0)
    assert observation.span_gap_ms == pytest.approx(230.0)


def test_a_gap_that_straddles_the_decision_counts_whole_and_the_span_covers_the_switch() -> None:
    observer = GapObserver(window_s=1.0)
    observer.record(0.9, 1.0, ok=True)
    observer.record(1.0, 1.4, ok=True)  # 400 ms, ending after the decision at 1.2
    observer.record(1.4, 1.5, ok=True)
    assert observer.migration("d1", "m1", at=2.0, prepared_s=0.8)
    observer.record(2.0, 2.6, ok=True)  # 1.1 s across the switch: the worst of both
    observer.record(2.6, 3.1, ok=True)
    observation = observer.close("m1", now=3.1)
    assert observation is not None
    assert observation.longest_gap_ms == pytest.approx(1100.0)
    assert observation.span_gap_ms == pytest.approx(1100.0)


def test_no_preparation_time_means_no_span_and_a_bad_one_is_ignored() -> None:
    observer = GapObserver(window_s=0.5)
    _steady(observer, 0.0, 1.0, 0.1)
    assert observer.migration("d1", "old-broker", at=1.0)
    assert observer.migration("d1", "nan", at=1.0, prepared_s=float("nan"))
    assert observer.migration("d1", "negative", at=1.0, prepared_s=-1.0)
    _steady(observer, 1.0, 2.0, 0.1)
    for migration_id in ("old-broker", "nan", "negative"):
        observation = observer.close(migration_id, now=2.0)
        assert observation is not None and observation.span_gap_ms is None


def test_a_span_older_than_the_history_is_clamped_and_old_gaps_are_forgotten() -> None:
    observer = GapObserver(window_s=0.5)
    observer.record(0.0, 0.0, ok=True)
    observer.record(0.0, 30.0, ok=True)  # 30 s, ending 30.0: beyond the history at 700
    _steady(observer, 30.05, 700.0, 0.05)
    assert observer.migration("d1", "m1", at=700.0, prepared_s=1e9)
    _steady(observer, 700.0, 701.0, 0.05)
    observation = observer.close("m1", now=701.0)
    assert observation is not None
    assert observation.span_gap_ms == pytest.approx(50.0)


def test_the_move_to_serving_time_runs_from_the_report_to_the_new_replica_first_answer() -> None:
    observer = GapObserver(window_s=2.0)
    _steady(observer, 0.0, 10.0, 0.1)
    # The update may arrive before the report's reply: the report is attached at close.
    assert observer.migration("d1", "m1", at=10.04)
    observer.record(10.0, 10.05, ok=True)  # a call to the old replica, in flight at the switch
    observer.served("m1", 10.07)  # the new replica's first answer
    observer.served("m1", 10.2)  # not the first: ignored
    observer.reported("m1", 10.01)
    _steady(observer, 10.1, 12.2, 0.1)
    observation = observer.close("m1", now=12.2)
    assert observation is not None
    assert observation.moved_to_served_ms == pytest.approx(60.0)


def test_no_move_to_serving_time_without_this_clients_report_or_a_new_answer() -> None:
    observer = GapObserver(window_s=1.0)
    _steady(observer, 0.0, 5.0, 0.1)
    assert observer.migration("d1", "operator", at=5.0)  # not started by this client
    assert observer.migration("d1", "unanswered", at=5.0)
    observer.served("operator", 5.05)
    observer.reported("unanswered", 4.99)
    _steady(observer, 5.1, 6.5, 0.1)
    for migration_id in ("operator", "unanswered"):
        observation = observer.close(migration_id, now=6.5)
        assert observation is not None and observation.moved_to_served_ms is None
    observer.served("operator", 7.0)  # its window is closed: nothing to change
    assert [o.moved_to_served_ms for o in observer.stats().migrations] == [None, None]
