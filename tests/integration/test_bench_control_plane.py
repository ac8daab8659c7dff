"""`python -m bench.control_plane`, the control-plane scale benchmark, on a small cluster: a
real broker process and hollow nodes in two hollow processes; every node registers and keeps
heartbeating (none is marked lost), the clients' deploys are answered running and recorded
by the broker, and the hollow nodes hold the replicas the broker placed on them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from broker.nodes import LEASE_RENEWALS
from broker.server import DEFAULT_NODE_LEASE_S
from node_daemon.broker_link import SAMPLE_INTERVAL_S

NODE_STEPS = (12, 30)
BURST = 24
"""Deploys asked at once at each step: a quarter of the smaller step's GPUs."""


def test_hollow_nodes_heartbeat_and_deploys_are_committed(tmp_path: Path) -> None:
    out = tmp_path / "control-plane.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.control_plane",
         "--steps", ",".join(map(str, NODE_STEPS)), "--window", "4", "--settle", "2",
         "--clients", "3", "--hollow-processes", "2", "--sites", "3",
         "--burst", str(BURST), "--bursts", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Saturation:" in done.stdout
    assert "kube-scheduler" in done.stdout and "Nomad C1M" in done.stdout
    assert f"burst of {BURST} deploys at once" in done.stdout
    result = json.loads(out.read_text())
    assert result["state"] == "sqlite"
    # The floor: the largest step's hollow nodes against a registry that only answers them.
    floor = result["heartbeat_floor"]
    assert floor["nodes"] == NODE_STEPS[-1] and "late" not in floor, floor
    assert floor["idle_heartbeats_per_s"] >= NODE_STEPS[-1] / 2, floor
    assert "x the floor" in done.stdout
    for nodes in NODE_STEPS:  # what the target rate would cost the broker at each step
        assert f"At {nodes} nodes 300 deploys/s carried to running would take" in done.stdout
    assert [s["nodes"] for s in result["steps"]] == list(NODE_STEPS)
    for step in result["steps"]:
        assert step["registered"] == step["nodes"], step
        assert step["marked_lost"] == 0 and step["lost_now"] == 0, step
        assert step["heartbeats_failed"] == 0 and step["stopped_nodes"] == 0, step
        # On the node port a node renews its lease every DEFAULT_NODE_LEASE_S /
        # LEASE_RENEWALS (24 s) or sends a sample (every SAMPLE_INTERVAL_S, 20 s, and when
        # its replicas change) in its stead, so the window
        # holds at least its share of renewals (half of it is plenty on a loaded machine; the
        # fleet falling silent would fall far below it). Silence long enough to count is
        # caught above: no node marked lost.
        renewals = step["nodes"] * step["window_s"] / (DEFAULT_NODE_LEASE_S / LEASE_RENEWALS)
        assert step["heartbeats"] >= renewals / 2, step
        assert 0 < step["heartbeat_p50_ms"] <= step["heartbeat_p99_ms"], step
        assert step["hollow_loop_lag_max_ms"] >= step["hollow_loop_lag_p99_ms"], step
        # What the heartbeats alone cost, over one --sample-interval (20 s): on the node
        # port an idle node sends its sample that often (its renewal, every 24 s, never falls
        # due), so each sends about one message; half of that is plenty on a loaded machine.
        assert step["idle_heartbeats_per_s"] >= step["nodes"] / SAMPLE_INTERVAL_S / 2, step
        # (a few ms of CPU over a second: the clock's ticks may count none; the cores are
        # rounded to 3 decimals)
        per_s = step["idle_heartbeats_per_s"]
        assert step["broker_us_per_heartbeat"] == pytest.approx(
            step["idle_broker_cpu_cores"] / per_s * 1e6, rel=0.02, abs=0.0006 / per_s * 1e6
        ), step
        assert step["deploys_committed"] > 0, step
        assert step["deploys_per_s"] > 0 and step["deploy_p50_ms"] > 0, step
        assert step["outcomes"]["deploy running"] == step["deploys_committed"], step
        # The broker's own count of decisions: at least one per deploy answered running.
        assert step["decisions_per_s"] >= step["deploys_per_s"] * 0.9, step
        assert step["decision_ms_mean"] > 0 and step["decision_capacity_per_s"] > 0, step
        # Every decision takes the placement lock, and so do the writes that settle them.
        assert step["lock_uses_per_s"] > step["decisions_per_s"], step
        assert 0 < step["lock_busy"] <= 1 and step["lock_wait_ms_mean"] >= 0, step
        # ... each use named: the decisions and the `running` writes among them, adding up.
        by_use = step["lock_busy_by_use"]
        assert {"decide", "running"} <= by_use.keys(), step
        assert sum(by_use.values()) == pytest.approx(step["lock_busy"], abs=0.01), step
        assert step["broker_cpu_cores"] > 0, step
        assert 0 < step["broker_loop_cpu_cores"] <= step["broker_cpu_cores"], step
        assert step["clients_cpu_cores"] > 0, step
        assert step["metrics_scrape_ms"] > 0, step
        assert 0 < step["broker_rss_mib"] <= step["broker_peak_rss_mib"], step
        # The burst: every deploy decided once and answered running, its pace from the
        # broker's own count of committed decisions; then every one of them deleted.
        assert step["burst"] == BURST, step
        assert len(step["bursts"]) == 2, step
        # the step's figures are those of one of its bursts
        assert {k: v for k, v in step.items() if k.startswith("burst_")} in [
            {k: v for k, v in b.items() if k != "burst"} for b in step["bursts"]
        ], step
        assert step["burst_outcomes"] == {"running": BURST}, step
        assert step["burst_running"] == BURST, step
        # every one of the burst's deploys has its decision line in the broker's log
        assert step["burst_decided"] == BURST, step
        assert step["burst_decided_s"] > 0 and step["burst_decisions_per_s"] > 0, step
        assert 0 < step["burst_deploy_p50_ms"] <= step["burst_deploy_p99_ms"], step
        assert step["burst_running_per_s"] > 0 and step["burst_deletes_per_s"] > 0, step
        assert step["burst_decision_ms_mean"] > 0, step
        assert step["burst_state_calls_per_commit"] >= 1, step
        # The burst's CPU: the broker decided and recorded every deploy (the others' share
        # of a short burst may fall between the clock's ticks).
        assert step["burst_broker_cpu_cores"] > 0, step
        for figure in ("hollow_cpu_cores", "clients_cpu_cores", "heartbeats_per_s"):
            assert step[f"burst_{figure}"] >= 0, step
        # Its CPU per deploy is the broker's CPU over the burst less the heartbeats it
        # answered meanwhile (each at the settle's cost), over the decisions; within what the
        # JSON's rounding leaves (cores to 2 decimals, the span to 3, heartbeats/s to 1).
        span, decided = step["burst_answered_s"], step["burst_decided"]
        cores, us = step["burst_broker_cpu_cores"], step["broker_us_per_heartbeat"]
        beats_cpu = step["burst_heartbeats_per_s"] * span * us / 1e6
        rounding_s = 0.005 * span + 0.0005 * cores + 0.05 * span * us / 1e6
        assert step["burst_broker_ms_per_deploy"] == pytest.approx(
            (cores * span - beats_cpu) / decided * 1000, abs=rounding_s / decided * 1000 + 0.001
        ), step
        # and the closing line prices the target rate from the same figures
        need = step["idle_broker_cpu_cores"] + 300 * step["burst_broker_ms_per_deploy"] / 1000
        assert (
            f"At {step['nodes']} nodes 300 deploys/s carried to running would take the "
            f"broker {need:.2f} cores" in done.stdout
        ), step
        # The store's commits: each makes at least one call durable.
        assert step["state_commits_per_s"] > 0 and step["state_calls_per_commit"] >= 1, step
    last = result["steps"][-1]
    # The replicas the hollow nodes hold are those of the deployments that run: each
    # committed deploy put one there, each answered delete took one away (migrations may
    # still hold a second replica for a moment: at most one more per migration).
    committed = sum(s["deploys_committed"] for s in result["steps"])
    deleted = sum(s["outcomes"].get("delete answered", 0) for s in result["steps"])
    migrated = sum(s["outcomes"].get("migrate answered", 0) for s in result["steps"])
    assert committed - deleted <= last["replicas_on_nodes"] <= committed - deleted + migrated
    assert [a["name"] for a in result["anchors"]] == ["kube-scheduler", "Godel", "Nomad C1M"]
