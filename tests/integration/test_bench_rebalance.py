"""`python -m bench.rebalance`, the live rebalancing benchmark, on a short window: both arms
run; only the one with rebalancing moves, once, node-hot -> node-idle, make-before-break,
with its reason; nothing fails and nothing moves back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.rebalance import _last_verdict, main


def test_the_bench_rebalances_only_when_on_and_nothing_fails(tmp_path: Path) -> None:
    out = tmp_path / "rebalance.json"
    # The bench's default load, 0.4 of a CPU each by the model's compute time: 0.8 of
    # node-hot's CPU together, against the policy's hot at 0.7. (Measured against the
    # latency alone, as the bench did before, the offered load fell short of 0.7 on a slow
    # CI host, even at 0.45 each.)
    done = subprocess.run(
        [sys.executable, "-m", "bench.rebalance", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SLO attainment of node-hot's deployments:" in done.stdout
    result = json.loads(out.read_text())
    assert [(r["arm"], r["priority"]) for r in result["rows"]] == [
        ("off-1", "critical"),
        ("off-1", "best-effort"),
        ("on-1", "critical"),
        ("on-1", "best-effort"),
    ]
    assert all(r["requests"] > 0 and r["failed"] == 0 for r in result["rows"])
    assert 0 <= result["attainment_off"] <= 1 and 0 <= result["attainment_on"] <= 1
    assert len(result["migrations"]) == 1, done.stdout[-3000:]
    (move,) = result["migrations"]
    assert (move["arm"], move["trigger"], move["route"]) == (
        "on-1",
        "rebalance",
        "node-hot -> node-idle",
    )
    assert move["outcome"] == "succeeded"
    assert move["reason"].startswith("node node-hot load "), move["reason"]
    assert result["moved_back"] == 0
    assert result["failed_requests"] == 0


def test_an_arm_without_a_move_says_the_brokers_last_verdict(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    log.write_text("INFO broker listening on 127.0.0.1:1\n")
    assert "never found a node hot" in _last_verdict(log)
    log.write_text(
        "INFO broker.rebalance rebalance: node node-hot is hot; no move: first\n"
        "INFO broker.rebalance rebalance: node node-hot is hot; no move: second\n"
        "  node-idle: load 0.35 over 0.30\n"
        "INFO broker.server something else\n"
    )
    assert _last_verdict(log) == (
        "node node-hot is hot; no move: second\n     node-idle: load 0.35 over 0.30"
    )


def test_quick_keeps_the_window_and_rounds_given(capsys: pytest.CaptureFixture[str]) -> None:
    # --quick only picks the defaults: an explicit flag is checked, not overridden.
    for flags in (["--window", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as exited:
            main(["--quick", *flags])
        assert exited.value.code == 2
        assert "--window > 0, --slo-x > 1, --rounds at least 1" in capsys.readouterr().err
