"""`python -m bench.serving`: one replica under closed-loop clients, batching off and on in
interleaved rounds, both client kinds and the priority arm, every answer counted; and how it
reads the replicas' metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serving import Block, class_shares, merge_rounds, on_off_interval, queue_delay_p99_s
from bench.serving_client import phases


def test_the_short_run_measures_every_block_and_the_priority_arm(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.serving", "--quick", "--models", "mlp",
         "--clients", "1,4", "--kinds", "ours,triton", "--seconds", "0.5", "--rounds", "2",
         "--phase-seconds", "0.25",
         "--priority-clients", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (result,) = json.loads(out.read_text())
    blocks = {(b["config"], b["kind"], b["clients"]): b for b in result["blocks"]}
    assert set(blocks) == {
        (config, kind, clients)
        for config in ("off", "on")
        for kind in ("ours", "triton")
        for clients in (1, 4)
    }
    for block in blocks.values():
        assert block["rate"] > 0 and block["latency"]["n"] > 0
        assert block["failures"] == {}
        # Two interleaved rounds pooled: every answer of both, over both rounds' time.
        assert len(block["rounds"]) == 2 and block["seconds"] >= 2 * 0.5
        assert block["latency"]["n"] == round(block["rate"] * block["seconds"])
    assert blocks[("off", "ours", 4)]["mean_batch"] == 1.0
    assert set(result["ceiling"]) == {"1", "8"}
    priority = result["priority"]
    assert priority["best_effort_min_answers"] > 0 and priority["failures"] == {}
    assert set(priority["shares"]) >= {"critical", "best-effort"}
    (p50,) = [v for v in result["verdicts"] if v.startswith("ours, 1 client: p50 on/off")]
    assert "(pooled; by round " in p50 and "95 % interval " in p50
    # Each round has fresh replicas (`bench_model`): no process serves two rounds.
    rounds = re.findall(r"mlp round (\d) of 2: off pid (\d+), on pid (\d+)", done.stdout)
    assert [r[0] for r in rounds] == ["1", "2"]
    assert len({pid for r in rounds for pid in r[1:]}) == 4
    assert "--max-batch-size auto chose" in done.stdout
    # off and on, loaded in turn, have their event loops on one CPU (`_pin_loops_together`).
    loops = dict(re.findall(r"mlp (off|on): event loop on CPU (\S+)", done.stdout))
    assert set(loops) == {"off", "on"}
    if len(os.sched_getaffinity(0)) > 1:
        assert loops["off"] == loops["on"] and "," not in loops["on"]


def test_queue_delay_p99_is_the_bucket_holding_the_99th_request() -> None:
    scraped = {
        'offload_runtime_queue_delay_seconds_bucket{le="0.001",model="m"}': 90.0,
        'offload_runtime_queue_delay_seconds_bucket{le="0.01",model="m"}': 98.0,
        'offload_runtime_queue_delay_seconds_bucket{le="0.1",model="m"}': 100.0,
        'offload_runtime_queue_delay_seconds_bucket{le="+Inf",model="m"}': 100.0,
    }
    assert queue_delay_p99_s(scraped) == 0.1
    assert queue_delay_p99_s({}) is None


def test_class_shares_are_of_the_compute_time() -> None:
    scraped = {
        'offload_runtime_class_compute_seconds_total{class="critical",model="m"}': 1.0,
        'offload_runtime_class_compute_seconds_total{class="best-effort",model="m"}': 3.0,
    }
    assert class_shares(scraped) == {"critical": 0.25, "best-effort": 0.75}


def _round(config: str, answers: int, seconds: float, latency_ms: float) -> Block:
    return Block(
        config=config, kind="ours", clients=1, rate=answers / seconds, latency={},
        failures={}, mean_batch=1.0, server_cores=0.0, machine_cores=0.0,
        per_client=[[latency_ms] * answers], seconds=seconds,
    )  # fmt: skip


def test_the_on_off_interval_resamples_whole_rounds() -> None:
    # Round 1: on 10 % faster; round 2: level. The interval spans both, pooled between.
    on = merge_rounds([_round("on", 110, 1.0, 1.0), _round("on", 100, 1.0, 1.0)])
    off = merge_rounds([_round("off", 100, 1.0, 1.0), _round("off", 100, 1.0, 1.0)])
    low, high = on_off_interval(on, off, 0)
    assert low == 1.0 and high == 1.1
    assert on_off_interval(on, off, 1) == (1.0, 1.0)
    # Rounds that agree leave no spread, however many answers each holds.
    on = merge_rounds([_round("on", 90, 1.0, 2.0), _round("on", 180, 2.0, 2.0)])
    off = merge_rounds([_round("off", 100, 1.0, 1.0), _round("off", 200, 2.0, 1.0)])
    assert on_off_interval(on, off, 0) == pytest.approx((0.9, 0.9))
    assert on_off_interval(on, off, 1) == (2.0, 2.0)


def test_off_and_on_take_whole_phases_in_turn_and_a_slow_load_whole_blocks() -> None:
    assert phases(4.0, 1.0, 2) == (1.0, 8)  # off on off on ...: 4 s each
    assert phases(4.0, 1.5, 2) == (4.0 / 3, 6)  # whole phases of about the asked length
    assert phases(4.0, 12.8, 2) == (4.0, 2)  # a phase over the block: one block each
    assert phases(4.0, 1.0, 1) == (4.0, 1)  # one configuration: one phase


@pytest.mark.parametrize("flag", ["--phase-seconds", "--seconds", "--priority-seconds"])
def test_a_nonsense_duration_is_refused_by_name(flag: str) -> None:
    for bad in ("0.01", "nan", "-1", "1e9"):
        done = subprocess.run(
            [sys.executable, "-m", "bench.serving", flag, bad],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode != 0
        assert f"{flag} must be from 0.05 to 3600, not {float(bad)}" in done.stderr
