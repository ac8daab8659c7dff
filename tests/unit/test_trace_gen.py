"""Handover from positions, the trace format, and the demo's reading of a generated trace."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from edge_client.demo.trace import TraceError, load_trace
from edge_client.mobility import traces
from edge_client.mobility.handover import CellTracker
from edge_client.mobility.traces import HandoverSettings, Site

SHIPPED = Path(__file__).resolve().parents[2] / "edge_client" / "demo" / "traces" / "streets.json"
SITES = (Site("west", 0, 0, 600), Site("east", 1000, 0, 600))


def drive(settings: HandoverSettings, xs: Sequence[float], period: float = 1.0) -> list:
    tracker = CellTracker(SITES, settings)
    for step, x in enumerate(xs):
        tracker.step(step * period, ["car"], np.array([x]), np.array([0.0]))
    (vehicle,) = tracker.vehicles(period, len(xs) * period)
    return list(vehicle.sites)


def test_handover_waits_for_the_margin_and_the_time_to_trigger() -> None:
    # East of the midpoint at x=520 (40 m closer to east): under the 50 m margin; from x=530
    # (60 m closer) on, 2 s later it is handed over.
    xs = [0, 200, 400, 520, 530, 540, 550, 700]
    assert drive(HandoverSettings(50, 2), xs) == [(0.0, "west"), (6.0, "east")]
    assert drive(HandoverSettings(50, 0), xs) == [(0.0, "west"), (4.0, "east")]
    assert drive(HandoverSettings(0, 0), xs) == [(0.0, "west"), (3.0, "east")]


def test_ping_pong_at_the_border_is_damped() -> None:
    border = [480, 530, 470, 530, 480, 530, 470]  # never 50 m closer to east for 2 s
    assert drive(HandoverSettings(50, 2), border) == [(0.0, "west")]
    # without hysteresis it flaps at every sample that crosses the midpoint
    assert len(drive(HandoverSettings(0, 0), border)) == 7


def test_the_count_starts_again_when_the_condition_breaks() -> None:
    xs = [600, 600, 450, 600, 600, 600]
    assert drive(HandoverSettings(50, 2), xs) == [(0.0, "east")]
    xs = [0, 600, 450, 600, 600, 600]
    assert drive(HandoverSettings(50, 2), xs) == [(0.0, "west"), (5.0, "east")]


def test_out_of_every_radius_keeps_the_serving_site() -> None:
    far = [0, 2000, 2000, 2000]  # nearer east, but outside its 600 m radius
    assert drive(HandoverSettings(50, 0), far) == [(0.0, "west")]


def doc() -> dict:
    return json.loads(SHIPPED.read_text())


def test_the_shipped_trace_round_trips() -> None:
    trace = traces.load(SHIPPED)
    assert trace.dumps() == SHIPPED.read_text()
    assert trace.busiest().handovers >= 3
    assert {s.name for s in trace.sites} == {"site-a", "site-b", "site-c"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(format="other"), "format"),
        (lambda d: d["vehicles"][0]["sites"].append([1.0, "site-a"]), "times must increase"),
        (lambda d: d["vehicles"][0]["sites"][1].__setitem__(1, "nowhere"), "unknown site"),
        (lambda d: d["vehicles"][0].update(end_s=1e9), "end_s"),
        (lambda d: d["sites"][0].update(radius_m=-1), "radius_m"),
        (lambda d: d["links"][0].update(latency_ms=float("nan")), "latency_ms"),
    ],
)
def test_an_invalid_trace_is_refused_with_its_field(change, message: str) -> None:
    document = doc()
    change(document)
    with pytest.raises(traces.TraceFormatError, match=message):
        traces.parse(document)


def test_the_demo_follows_the_busiest_vehicle_or_the_one_asked(tmp_path: Path) -> None:
    sites = ["site-a", "site-b", "site-c"]
    trace = traces.load(SHIPPED)
    busiest = trace.busiest()
    demo = load_trace(SHIPPED, sites)
    assert [w.site for w in demo.waypoints] == [s for _, s in busiest.sites]
    assert sum(w.dwell_s for w in demo.waypoints) == pytest.approx(busiest.end_s - busiest.start_s)
    other = trace.vehicles[0]
    assert [w.site for w in load_trace(SHIPPED, sites, other.id).waypoints] == [
        s for _, s in other.sites
    ]
    with pytest.raises(TraceError, match="no vehicle"):
        load_trace(SHIPPED, sites, "nobody")
    with pytest.raises(TraceError, match="does not have"):
        load_trace(SHIPPED, ["site-a"])
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(broken, sites)
