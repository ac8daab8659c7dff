"""`python -m bench.resize`, the node resource manager benchmark, on a short setting: every arm
runs, `static` never resizes, the managed policies give the critical deployment more CPU in
a burst and take it back after, and nothing fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docker_support import require_docker


@pytest.mark.docker
def test_the_bench_resizes_the_bursting_critical_deployment_only_when_managed(
    tmp_path: Path,
) -> None:
    require_docker().close()
    out = tmp_path / "resize.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "bench.resize", "--quick", "--window", "12", "--burst", "3",
            "--quiet", "3", "--json", str(out),
        ],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "p99/static" in done.stdout
    result = json.loads(out.read_text())
    rows = {row["policy"]: row for row in result["rows"]}
    assert list(rows) == ["static", "usage", "gain"]
    assert result["failed_requests"] == 0
    assert all(row["failed"] == 0 for row in rows.values())
    assert all(row["critical_burst_requests"] > 0 for row in rows.values())
    assert all(row["best_effort_per_s"] > 0 for row in rows.values())
    assert result["resizes"]["static-1"] == []
    for policy in ("usage", "gain"):
        critical = rows[policy]["deployments"]["critical"]
        mine = [r for r in result["resizes"][f"{policy}-1"] if r["deployment_id"] == critical]
        assert all(r["policy"] == policy and r["reason"] for r in mine)
        # More than it started with (0.5 cores) in a burst, within its ceiling (1.75) ...
        grown = [i for i, r in enumerate(mine) if r["cpus_after"] > r["cpus_before"]]
        assert grown, mine
        assert all(r["cpus_after"] <= 1.75 + 1e-9 for r in mine)
        assert max(r["cpus_after"] for r in mine) > 0.5
        # ... and some of it given back after.
        assert any(r["cpus_after"] < r["cpus_before"] for r in mine[grown[0] :]), mine
