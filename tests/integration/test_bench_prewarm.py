"""`python -m bench.prewarm`, the live pre-warm benchmark, on its smallest setting: both arms
run, only the one with pre-warm switches to standbys, nothing fails, the budget holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_bench_measures_both_arms_and_only_prewarm_switches_to_standbys(
    tmp_path: Path,
) -> None:
    out = tmp_path / "prewarm.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "bench.prewarm", "--quick", "--vehicles", "1",
            "--model", "mlp", "--budget", "1", "--time-scale", "0.02", "--min-dwell", "2",
            "--json", str(out),
        ],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "move to serving: the client's report -> its first answer" in done.stdout
    result = json.loads(out.read_text())
    off, on = result["arms"]
    assert (off["budget"], on["budget"]) == (0, 1)
    # veh0 drives site-a, -b, -c, -b: three moves in each arm, each measured by the client.
    for arm in (off, on):
        assert [m["site"] for m in arm["moves"]] == ["site-b", "site-c", "site-b"]
        assert all(m["outcome"] == "succeeded" for m in arm["moves"])
        assert all(m["moved_to_served_ms"] is not None for m in arm["moves"])
        assert arm["failed"] == 0
    assert not any(m["prewarmed"] for m in off["moves"])
    # The other vehicles taught the broker the road: every one that left site-a went to
    # site-b, so that move was predicted (from site-b they went back as often as on).
    assert on["moves"][0]["prewarmed"] is True
    assert on["events"]["hit"] == sum(m["prewarmed"] for m in on["moves"])
    assert off["events"].get("started", 0) == 0
    assert result["most_standbys"] <= result["budget"] == 1
    assert result["failed_requests"] == 0
