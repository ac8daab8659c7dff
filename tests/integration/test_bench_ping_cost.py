"""`python -m bench.ping_cost`, what liveness costs a Python server per node, on a few nodes:
every connection opens its stream and is held through both ping arms; every node's beacons
reach the broker's real beacon reader through both beacon arms, none dropped; the figures
come out per run, per ping and per beacon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_every_connection_is_held_through_both_arms_twice(tmp_path: Path) -> None:
    out = tmp_path / "ping-cost.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.ping_cost", "--connections", "40", "--seconds", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["pings"] for r in result["runs"]] == [False, True, False, True]
    assert all(r["connections"] == 40 for r in result["runs"]), result
    assert result["pings_per_s"] == 40 / result["ping_interval_s"]
    assert len(result["per_ping_us"]) == 2
    assert "µs of gRPC core's CPU per ping" in done.stdout
    beacons = result["beacon_runs"]
    assert [r["beacons"] for r in beacons] == [False, True, False, True]
    for run in beacons:
        assert run["dropped"] == 0, run
        if run["beacons"]:
            # 40 nodes, a beacon a second each, through the settle and the window.
            assert run["senders"] == 40 and run["taken"] >= 40 * 1, run
        else:
            assert run["senders"] == 0 and run["taken"] == 0, run
    assert result["beacons_per_s"] == 40
    assert len(result["per_beacon_us"]) == 2
    assert "µs per beacon" in done.stdout
