"""`python -m bench.metrics_page`: the node's page of a shared replica timed as the replica
serves it and as prometheus_client wrote it, and the node's parse of it, with the figures
written out; nonsense counts refused by name."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_support import run_bench


def test_the_page_and_its_parse_are_timed_and_written(tmp_path: Path) -> None:
    out = tmp_path / "page.json"
    done = run_bench("bench.metrics_page", "--quick", "--clients", "8", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["clients"] == 8 and figures["lines"] > 8 * 16
    for key in ("served_ms", "prometheus_client_ms", "node_parse_ms", "node_parse_unseen_ms"):
        assert figures[key] > 0, key
    assert "prometheus_client's formatting" in done.stdout


def test_nonsense_counts_are_refused_by_name() -> None:
    done = run_bench("bench.metrics_page", "--clients", "-1")
    assert done.returncode == 2 and "--clients" in done.stderr
    done = run_bench("bench.metrics_page", "--repeats", "0")
    assert done.returncode == 2 and "--repeats" in done.stderr
