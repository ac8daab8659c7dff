"""`offload trace import` of FCD files written by the real SUMO from PyPI, then `offload
simulate` on the trace: the handovers are those `offload trace generate` makes of the same
positions."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_client.cli import main
from edge_client.mobility import sumo, traces
from edge_client.mobility.handover import CellTracker
from edge_client.mobility.traces import HandoverSettings, Site

SITES = (Site("west", 150, 375, 400), Site("middle", 375, 375, 400), Site("east", 600, 375, 400))
SITES_YAML = "sites:\n" + "".join(
    f"  - {{name: {s.name}, x: {s.x:g}, y: {s.y:g}, radius_m: {s.radius_m:g}}}\n" for s in SITES
)


@pytest.fixture(scope="module")
def sumo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SUMO's FCD of one run, as XML, gzipped XML and gzipped CSV (SUMO writes each form
    from the output file's name)."""
    work = tmp_path_factory.mktemp("sumo")
    net = sumo.grid_network(work / "net.net.xml", junctions=6, spacing_m=150, lanes=1, seed=5)
    trips = sumo.random_trips(
        net, work / "trips.xml", vehicles=6, depart_window_s=20, intermediate=10, seed=5
    )
    for name in ("fcd.xml", "fcd.xml.gz", "fcd.csv.gz"):
        sumo.simulate(net, trips, work / name, duration_s=120, period_s=1, seed=5)
    (work / "sites.yaml").write_text(SITES_YAML)
    return work


def test_sumo_fcd_imports_and_simulates(
    sumo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sites = sumo_run / "sites.yaml"
    imported = {}
    for name in ("fcd.xml", "fcd.xml.gz", "fcd.csv.gz"):
        out = tmp_path / f"{name}.json"
        argv = ["trace", "import", str(sumo_run / name), "--sites", str(sites), "-o", str(out)]
        assert main(argv) == 0
        imported[name] = traces.load(out)
    assert "6 vehicles, 3 sites" in capsys.readouterr().out
    vehicles = {name: trace.vehicles for name, trace in imported.items()}
    assert vehicles["fcd.xml"] == vehicles["fcd.xml.gz"] == vehicles["fcd.csv.gz"]

    # `offload trace generate`'s path: SUMO's positions through the same handover rule.
    trace = imported["fcd.xml"]
    tracker = CellTracker(SITES, HandoverSettings(50, 2))
    last = 0.0
    for t, ids, xs, ys in sumo.positions(sumo_run / "fcd.xml"):
        tracker.step(t, ids, xs, ys)
        last = t
    assert trace.duration_s == last + 1
    assert trace.vehicles == tuple(tracker.vehicles(1.0, last + 1))
    assert sum(v.handovers for v in trace.vehicles) > 0

    out = tmp_path / "fcd.xml.json"
    assert main(["simulate", "--trace", str(out), "--nodes", "30", "--jobs", "1"]) == 0
    handovers = sum(v.handovers for v in trace.vehicles)
    assert f"trace fcd: 6 vehicles, {handovers} handovers, 3 sites" in capsys.readouterr().out


def test_simulate_and_the_demo_name_the_format_they_want_for_sumo_output(
    sumo_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fcd = sumo_run / "fcd.csv.gz"
    assert main(["simulate", "--trace", str(fcd)]) == 2
    err = capsys.readouterr().err
    assert f"{fcd}: a gzip-compressed SUMO FCD CSV file, not a mobility trace JSON" in err
    assert f"`offload trace import {fcd} --sites SITES.yaml -o TRACE.json`" in err
    assert main(["demo", "--trace", str(sumo_run / "fcd.xml")]) == 2
    assert "a SUMO FCD XML file, not what `offload demo --trace` reads" in capsys.readouterr().err
