"""`python -m bench.key_reload` and `python -m bench.upload_memory` in their quick modes: each
runs, prints its figure beside its baseline, and holds what it measures (a dropped key is
refused after the reload; stalled uploads past the staging cap are refused and the broker's
memory comes back)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_bench(module: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--json", str(out), *extra],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_key_reload_bench_reports_the_reload_beside_the_old_one(tmp_path: Path) -> None:
    out = tmp_path / "keys.json"
    done = run_bench("bench.key_reload", out, "--keys", "10", "--reloads", "2")
    assert "baseline (every key checked again, as before)" in done.stdout
    result = json.loads(out.read_text())
    assert (result["keys"], result["reloads"]) == (10, 2)
    assert result["baseline_ms"] > 0 and result["reload_ms"]["max"] > 0


def test_the_upload_memory_bench_refuses_past_the_cap_and_holds(tmp_path: Path) -> None:
    out = tmp_path / "uploads.json"
    done = run_bench("bench.upload_memory", out)
    assert "(baseline: idle" in done.stdout
    result = json.loads(out.read_text())
    assert result["holds"]
    # 5 clients x 2 x 8 MiB against a cap of 48 MiB: some are refused, naming the cap.
    assert result["refused"] > 0
    assert "--max-staged-upload-bytes" in result["refusal"]
