"""`python -m bench.ping_cost`, what the node port's keepalive pings cost a gRPC server, on a
few connections: every connection opens its stream and is held through both arms, and the
figures come out per run and per ping."""

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
