"""The demo's live view and report, drawn from fixed data (no cluster)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from rich.console import Console

from edge_client.demo.view import (
    LoadStats,
    Report,
    Snapshot,
    live_view,
    longest_gaps_ms,
    move_summary,
    print_report,
    span_bound,
    span_gap_where,
)


def node(node_id: str, site: str, holders: dict[int, list[str]], count: int) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "site": site,
        "state": "ready",
        "gpus": [
            {"name": "A100", "free": i not in holders, "holders": holders.get(i, [])}
            for i in range(count)
        ],
    }


MIGRATION = {
    "migration_id": "m-1",
    "trigger": "mobility",
    "source": "node-a",
    "target": "node-b",
    "strategy": "make-before-break",
    "outcome": "succeeded",
    "reason": "",
    "downtime_ms": 61.0,
    "timeline": [{"event": "decided", "at": 100.0}, {"event": "completed", "at": 100.75}],
}


DEPLOYMENT = {
    "deployment_id": "d-1",
    "model_name": "resnet18",
    "state": "running",
    "node_id": "node-b",
    "epoch": 2,
    "explanation": "latency 0.5 ms; deciding: latency",
}


def rendered(renderable: object) -> str:
    console = Console(record=True, width=120, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_the_live_view_marks_the_node_holding_the_replica() -> None:
    load = LoadStats()
    for ms in (10.0, 12.0, 30.0):
        load.record_ok(ms)
    load.failed = 1
    snapshot = Snapshot(
        title="resnet18 on docker replicas",
        nodes=[node("node-a", "site-a", {}, 4), node("node-b", "site-b", {2: ["d-1"]}, 8)],
        deployments=[
            {
                "deployment_id": "d-1",
                "model_name": "resnet18",
                "state": "running",
                "node_id": "node-b",
                "epoch": 2,
                "explanation": "latency 0.5 ms; deciding: latency",
            }
        ],
        migrations=[MIGRATION],
        client_site="site-b",
        step="waypoint 2/4",
        load=load,
        gaps_ms={"m-1": 55.5},
        span_gaps_ms={"m-1": 130.5},
    )
    text = rendered(live_view(snapshot))
    row_a = next(line for line in text.splitlines() if line.strip().startswith("node-a"))
    row_b = next(line for line in text.splitlines() if line.strip().startswith("node-b"))
    assert "◀ epoch 2 running" in row_b and "◀" not in row_a
    assert "■" * 8 in row_b
    assert "client at site-b (waypoint 2/4): 4 requests, 1 failed; 0.6 req/s" in text
    assert "placement: latency 0.5 ms; deciding: latency" in text
    # The client's own gap wins over the broker's copy of it.
    assert "m-1" in text and "node-a → node-b" in text and "750 ms" in text
    assert "55.5 ms" in text and "61.0 ms" not in text
    assert "130.5 ms" in text  # and the worst gap over the whole migration beside it


def report(failed: int, outcome: str) -> Report:
    load = LoadStats()
    for ms in range(1, 101):
        load.record_ok(float(ms))
    load.failed = failed
    return Report(
        runtime="docker",
        model="resnet18 (46.7 MB, sha256 fe2ef7e45652)",
        model_name="resnet18",
        trace="commute",
        seconds=12.0,
        load=load,
        period_ms=50,
        retried=2,
        migrations=[{**MIGRATION, "outcome": outcome}],
        gaps_ms={"m-1": 55.5},
        failed_in_window={"m-1": 0},
        span_gaps_ms={"m-1": 140.5},
        explanations=[("first placement: node-a, GPUs [0], epoch 1", "chosen: node-a\nline 2")],
        dashboard="http://127.0.0.1:8080/",
        kept=False,
    )


def test_the_report_has_percentiles_timelines_explanations_and_the_dashboard() -> None:
    console = Console(record=True, width=200, color_system=None)
    print_report(console, report(0, "succeeded"))
    text = console.export_text()
    assert "100 sent, 100 ok, 0 failed (2 retried" in text
    assert "p50 50.00 ms, p90 90.00 ms, p99 99.00 ms, max 100.00 ms" in text
    assert "migrations   1, 1 succeeded" in text
    assert "answer gaps  longest " in text and "(a request every 50 ms)" in text
    assert "first placement: node-a, GPUs [0], epoch 1\n    chosen: node-a\n    line 2" in text
    assert (
        "m-1 mobility node-a → node-b make-before-break: succeeded, took 750 ms; "
        "client-observed downtime 55.5 ms, 0 failed request(s), worst gap over the whole "
        "migration 140.5 ms"
    ) in text
    assert "decided +0  completed +750 (ms)" in text
    assert "moves        report to first answer at the new site: -; pre-warm off" in text
    assert "dashboard  http://127.0.0.1:8080/  (stopped with the demo" in text
    assert "result     ok: no failed request" in text


def test_the_report_tells_pre_warmed_moves_and_their_time_to_serving_apart() -> None:
    warm = {**MIGRATION, "migration_id": "m-2", "outcome": "succeeded", "prewarmed": True}
    moved = dataclasses.replace(
        report(0, "succeeded"),
        migrations=[{**MIGRATION, "outcome": "succeeded"}, warm],
        moved_to_served_ms={"m-1": 1210.0, "m-2": 48.5},
        prewarm=2,
    )
    console = Console(record=True, width=250, color_system=None)
    print_report(console, moved)
    text = console.export_text()
    assert (
        "moves        pre-warm on (budget 2): 1 of 2 moves pre-warmed, 0 waited for a standby "
        "still starting; report to first answer at the new site: median 48.5 ms (n=1) "
        "pre-warmed, - standby still starting, median 1210.0 ms (n=1) cold"
    ) in text
    assert "m-2 mobility node-a → node-b make-before-break (pre-warmed): succeeded" in text
    assert "m-1 mobility node-a → node-b make-before-break: succeeded" in text
    assert "report to first answer at the new site 48.5 ms" in text
    assert "report to first answer at the new site 1210.0 ms" in text


def moves(*ms: float, prewarm: int = 0) -> Report:
    """A report of cold moves, each `ms` from its report to the first answer at its site."""
    ids = [f"m-{i}" for i in range(len(ms))]
    return dataclasses.replace(
        report(0, "succeeded"),
        migrations=[{**MIGRATION, "migration_id": i} for i in ids],
        moved_to_served_ms=dict(zip(ids, ms, strict=True)),
        prewarm=prewarm,
    )


@pytest.mark.parametrize(
    ("ms", "median"),
    [
        ((488.2, 204.0), "median 346.1 ms (n=2)"),  # not the lower middle one (204.0)
        ((900.0, 10.0, 400.0, 30.0), "median 215.0 ms (n=4)"),
        ((30.0, 10.0, 20.0), "median 20.0 ms (n=3)"),
        ((7.5,), "median 7.5 ms (n=1)"),
    ],
)
def test_the_moves_median_is_the_middle_one_or_the_mean_of_the_middle_two(
    ms: tuple[float, ...], median: str
) -> None:
    assert move_summary(moves(*ms)) == (
        f"report to first answer at the new site: {median}; pre-warm off"
    )
    assert f"{median} cold" in move_summary(moves(*ms, prewarm=2))


def timeline(started: float, ready: float) -> list[dict[str, Any]]:
    events = [("decided", 99.9), ("target_started", started), ("target_ready", ready)]
    events += [("switched", ready + 0.005), ("completed", ready + 0.7)]
    return [{"event": e, "at": at} for e, at in events]


def test_a_move_that_waited_for_a_standby_still_starting_is_counted_apart() -> None:
    ready = {"prewarmed": True, "timeline": timeline(100.0, 100.0002)}
    starting = {"prewarmed": True, "timeline": timeline(100.0, 101.45)}
    migrations = [
        {**MIGRATION, "outcome": "succeeded"},
        {**MIGRATION, "migration_id": "m-2", **ready},
        {**MIGRATION, "migration_id": "m-3", **starting},
        {**MIGRATION, "migration_id": "m-4", **starting},
        {**MIGRATION, "migration_id": "m-5", "prewarmed": True},  # no start: not waited for
    ]
    moved = dataclasses.replace(
        report(0, "succeeded"),
        migrations=migrations,
        moved_to_served_ms={"m-1": 1210.0, "m-2": 48.5, "m-3": 1502.0, "m-4": 1620.0},
        prewarm=2,
    )
    assert move_summary(moved) == (
        "pre-warm on (budget 2): 2 of 5 moves pre-warmed, 2 waited for a standby still "
        "starting; report to first answer at the new site: median 48.5 ms (n=1) pre-warmed, "
        "median 1561.0 ms (n=2) standby still starting, median 1210.0 ms (n=1) cold"
    )
    console = Console(record=True, width=250, color_system=None)
    print_report(console, moved)
    text = console.export_text()
    assert "m-2 mobility node-a → node-b make-before-break (pre-warmed): succeeded" in text
    assert (
        "m-3 mobility node-a → node-b make-before-break (pre-warmed, standby still starting: "
        "waited 1450 ms): succeeded"
    ) in text


def test_gaps_are_split_by_the_migration_windows() -> None:
    answered = [0.0, 0.05, 0.10, 0.30, 0.35, 1.0, 1.06]
    # 0.10 -> 0.30 overlaps the window; 0.35 -> 1.0 is the longest outside one.
    assert longest_gaps_ms(answered, [(0.2, 0.25)]) == pytest.approx((650, 200))
    assert longest_gaps_ms(answered, []) == pytest.approx((650, 0))
    assert longest_gaps_ms([], [(0, 1)]) == (0, 0)


def test_the_span_bound_is_a_quarter_of_the_quiet_gap_or_10_ms_for_the_mlp() -> None:
    assert span_bound("resnet18", 80.0, 100.0).endswith("20.0 ms allowed: within it")
    assert span_bound("resnet18", 80.0, 100.5) == (
        "during a migration +20.5 ms over the longest gap between them, 20.0 ms allowed: over it"
    )
    assert span_bound("mlp", 80.0, 90.0).endswith(
        "+10.0 ms over the longest gap between them, 10.0 ms allowed: within it"
    )
    assert span_bound("mlp", 80.0, 90.5).endswith("over it")
    assert span_bound("mobilenetv2", 80.0, 60.0).startswith("during a migration -20.0 ms")


def test_the_report_says_whether_its_migrations_kept_the_span_bound() -> None:
    load = LoadStats()
    # Answers every 50 ms but for one 70 ms gap before m-1 (its timeline: 100.0 to 100.75)
    # and one 90 ms gap during it.
    gaps = [0.05] * 5 + [0.07] + [0.05] * 14 + [0.09] + [0.05] * 20
    load.answered_at = list(itertools.accumulate(gaps, initial=99.0))
    console = Console(record=True, width=200, color_system=None)
    print_report(console, dataclasses.replace(report(0, "succeeded"), load=load))
    text = console.export_text()
    assert "answer gaps  longest 70.0 ms between migrations, 90.0 ms during one" in text
    assert (
        "span bound   during a migration +20.0 ms over the longest gap between them, "
        "17.5 ms allowed: over it"
    ) in text
    assert "span bound" not in export(dataclasses.replace(report(0, "succeeded"), migrations=[]))


def export(r: Report) -> str:
    console = Console(record=True, width=200, color_system=None)
    print_report(console, r)
    return console.export_text()


def test_a_failed_request_or_migration_fails_the_report() -> None:
    assert report(0, "succeeded").succeeded
    assert not report(1, "succeeded").succeeded
    assert not report(0, "rolled_back").succeeded


FULL_TIMELINE = [
    {"event": event, "at": 100.0 + ms / 1000}
    for event, ms in (
        ("decided", 0),
        ("target_started", 2),
        ("target_ready", 1800),
        ("switched", 1805),
        ("old_stopped", 2300),
        ("completed", 2300),
    )
]


def test_the_report_places_each_migrations_longest_gap_in_its_timeline() -> None:
    """The longest gap between the demo's answers over a migration, from before its decision
    to after its end (a gap straddling either edge counts whole), and the phase it ended in."""
    # An answer every 50 ms from 0.1 s before the decision to 0.1 s after the end, but none
    # from +85 to +220 ms (a 135 ms gap).
    steady = [100.0 + ms / 1000 for ms in range(-100, 2401, 50) if not 85 < ms < 220]
    answered = sorted([*steady, 100.085, 100.220])
    assert span_gap_where(answered, FULL_TIMELINE) == "135.0 ms, +85 to +220 ms, in start"
    # 2.35 s after the decision: past the old replica's stop, the gap ends "after" it.
    assert (
        span_gap_where([101.9, 102.35], FULL_TIMELINE) == "450.0 ms, +1900 to +2350 ms, in after"
    )
    # A timeline without the events that name phases (a move rolled back early): no phase.
    assert span_gap_where(answered, MIGRATION["timeline"]) == "135.0 ms, +85 to +220 ms"
    assert span_gap_where([99.0], FULL_TIMELINE) == ""
    assert span_gap_where(answered, []) == ""
    moved = dataclasses.replace(
        report(0, "succeeded"), migrations=[{**MIGRATION, "timeline": FULL_TIMELINE}]
    )
    moved.load.answered_at = answered
    console = Console(record=True, width=240, color_system=None)
    print_report(console, moved)
    assert (
        "decided +0  target_started +2  target_ready +1800  switched +1805  old_stopped +2300  "
        "completed +2300 (ms); longest gap between answers: 135.0 ms, +85 to +220 ms, in start"
    ) in console.export_text()
