"""`python -m bench.batcher_cost`: the batcher's lone-request path against the unbatched
inline one, on the MLP, with the figures written out; nonsense counts refused by name."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_support import run_bench


def test_both_paths_are_timed_and_written(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    done = run_bench("bench.batcher_cost", "--calls", "200", "--repeats", "2", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["model"] == "mlp"
    assert figures["unbatched_us"] > 0 and figures["batched_us"] > 0
    assert figures["compute_us"] > 0
    assert "through the batcher" in done.stdout


def test_nonsense_counts_and_models_are_refused_by_name() -> None:
    done = run_bench("bench.batcher_cost", "--calls", "0")
    assert done.returncode == 2 and "--calls" in done.stderr
    done = run_bench("bench.batcher_cost", "--model", "no-such-model")
    assert done.returncode == 2 and "'no-such-model'" in done.stderr
