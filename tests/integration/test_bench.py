"""`python -m bench`: the fast benchmarks run in short mode and land in one JSON file with the
machine they ran on and each figure's baseline (the slow ones run in `make bench`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_short_mode_writes_figures_baselines_and_the_machine(tmp_path: Path) -> None:
    out = tmp_path / "results" / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "gpu_allocation", "placement",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== [1/2] gpu_allocation" in done.stdout and "== [2/2] placement" in done.stdout
    results = json.loads(out.read_text())
    assert results["mode"] == "quick"
    assert {"cpu", "cpus", "memory_gib", "python", "onnxruntime", "taken_at"} <= set(
        results["machine"]
    )
    # Each figure with its baseline from the same run: best_group against brute force, and
    # placement quality against first-fit.
    for timing in results["gpu_allocation"]["timing"].values():
        assert timing["cold_mean_us"] > 0 and timing["brute_mean_us"] > 0
    assert {"place", "first-fit"} <= set(results["placement"]["quality"])
    assert not out.with_name(out.name + ".part").exists()


def test_an_unknown_benchmark_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "nope"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr
