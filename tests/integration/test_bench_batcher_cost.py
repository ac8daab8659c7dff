"""`python -m bench.batcher_cost`: the batcher's lone-request path against the unbatched
inline one, on the MLP, with the figures written out; nonsense counts refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.batcher_cost", *args],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_both_paths_are_timed_and_written(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    done = _run("--calls", "200", "--repeats", "2", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["model"] == "mlp"
    assert figures["unbatched_us"] > 0 and figures["batched_us"] > 0
    assert figures["compute_us"] > 0
    assert "through the batcher" in done.stdout


def test_nonsense_counts_and_models_are_refused_by_name() -> None:
    done = _run("--calls", "0")
    assert done.returncode == 2 and "--calls" in done.stderr
    done = _run("--model", "no-such-model")
    assert done.returncode == 2 and "'no-such-model'" in done.stderr
