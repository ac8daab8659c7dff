"""`python -m bench.chaos` as a user runs it: a selected scenario runs against a real cluster
on loopback, the table and the JSON report it with every invariant, and nothing the suite
started is left behind. (Whether the invariants hold depends on the broker and the node
daemon, not on the suite: `make chaos` reports that.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.chaos import COLUMNS
from edge_client.demo.cluster import processes_naming

INVARIANTS = {
    "calls",
    "unknown_or_internal",
    "unexpected",
    "nodes_falsely_lost",
    "placed_below_room",
    "leaked",
    "double_booked",
    "lost_or_duplicated",
    "unsettled",
}


def test_a_selected_scenario_runs_and_everything_is_stopped(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--quick", "--scenarios", "bogus-flood",
         "--seed", "7", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["mode"] == "quick" and result["seed"] == 7
    ran = [s for s in result["scenarios"] if s["name"] not in ("setup", "teardown")]
    assert [s["name"] for s in ran] == ["bogus-flood"]
    scenario = ran[0]
    assert set(scenario) >= INVARIANTS, sorted(scenario)
    assert scenario["held"] == (not scenario["failures"])
    # It tried what it says: bogus keys, and a valid client's calls meanwhile.
    assert sum(scenario["calls"]["bogus key"].values()) > 0
    assert sum(scenario["calls"]["ListDeployments (valid key)"].values()) > 0
    # The table: its header with every invariant, the scenario's row, the verdict.
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("scenario "))
    assert all(short in header for _, short in COLUMNS), header
    assert any(line.startswith("bogus-flood ") for line in lines)
    assert any(line.startswith("chaos (quick mode, seed 7") for line in lines)
    # Torn down: the cluster's folder removed, no process of it left.
    cluster = Path(result["cluster_folder"])
    assert not cluster.exists()
    assert processes_naming(cluster) == []


def test_an_unknown_scenario_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--scenarios", "nope"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr
