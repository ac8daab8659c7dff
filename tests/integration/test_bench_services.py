"""The priority arm of bench/services.py on its smallest setting: each client's class comes
from its own attach to one service replica (not from the deployment), every best-effort
client is answered, and the replica's own figures for the window are read. CI's short run of
the whole benchmark checks only its exit status; this checks what the arm reads."""

from __future__ import annotations

import os
from pathlib import Path

from bench.services import priority
from node_daemon.server import split_cpus


async def test_the_priority_arm_reads_each_clients_class_at_one_replica(tmp_path: Path) -> None:
    result = await priority(tmp_path, "mlp", 1, 3, 0.5)
    assert result["replicas"] == 1
    assert result["failed"] == 0
    # One load process per CPU the clients run on (the other half of the machine's).
    cpus = os.sched_getaffinity(0)
    client_cpus = split_cpus(cpus, 2)[1] if len(cpus) >= 2 else cpus
    assert result["best_effort_processes"] == min(3, len(client_cpus))
    assert result["best_effort_min_answers"] > 0
    # Both classes were computed at the replica: the tokens carried the clients' classes.
    assert set(result["class_compute_shares"]) == {"critical", "best-effort"}
    assert all(n > 0 for n in result["class_calls_computed"].values())
    assert result["mean_batch_rows"] is not None  # the MLP batches
