"""`offload deploy`, `offload deployments` and `offload delete` as a user runs them, against a
real broker (one deployment per client) and a node daemon (process runtime, GPUs from a
topology capture) on loopback: a failed deploy fills the quota, `deployments` says why it
failed and how to delete it, and `delete` gives the quota back, stops the replica, and says
what it did for each id."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import modelzoo
from tests.cluster_support import (
    THREE_NODES,
    Cluster,
    replica_processes,
    unloadable_model,
    until,
)

NODE_A = THREE_NODES[0]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker("--max-deployments-per-client", "1")
        await cluster.start_node(NODE_A)
        yield cluster
    finally:
        await cluster.stop()


async def offload(cluster: Cluster, client: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`offload ARGS` as `client`, with the broker and the key file in the environment."""
    key_file = cluster.root / f"{client}.key"
    key_file.write_text(cluster.api_keys[client] + "\n")
    env = {
        **os.environ,
        "OFFLOAD_BROKER": cluster.broker_address,
        "OFFLOAD_API_KEY_FILE": str(key_file),
        "COLUMNS": "200",  # the table's reasons on one line each
    }
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "edge_client.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def deployed_id(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    match = re.fullmatch(r"(d-\w+) running on node-a at \S+\n", done.stdout)
    assert match, done.stdout
    return match.group(1)


async def test_a_user_deletes_a_failed_and_a_running_deployment(
    cluster: Cluster, tmp_path: Path
) -> None:
    model = str(modelzoo.model_path("mlp"))
    bad = str(unloadable_model(tmp_path / "bad.onnx"))
    failed = await offload(cluster, "alice", "deploy", bad, "--gpus", "1", "--site", "site-a")
    assert failed.returncode == 1, failed.stderr
    assert "could not start a replica" in failed.stderr, failed.stderr

    listed = await offload(cluster, "alice", "deployments")
    assert listed.returncode == 0, listed.stderr
    (failed_id,) = re.findall(r"(d-\w+) +│ bad +│ failed \(", listed.stdout)
    assert "cannot load" in listed.stdout, listed.stdout  # why it failed
    assert f"delete them with: offload delete {failed_id}" in listed.stdout, listed.stdout

    refused = await offload(cluster, "alice", "deploy", model, "--gpus", "1", "--site", "site-a")
    assert refused.returncode == 1
    assert "--max-deployments-per-client 1); delete one first" in refused.stderr, refused.stderr

    deleted = await offload(cluster, "alice", "delete", failed_id)
    assert (deleted.returncode, deleted.stdout) == (0, f"{failed_id} deleted\n"), deleted.stderr
    running_id = deployed_id(
        await offload(cluster, "alice", "deploy", model, "--gpus", "1", "--site", "site-a")
    )
    replica = f"{running_id}-1"
    assert replica in replica_processes(cluster)[NODE_A.node_id]

    # Another client's: refused, and nothing is stopped.
    theirs = await offload(cluster, "bob", "delete", running_id)
    assert theirs.returncode == 1
    assert f"PERMISSION_DENIED deployment {running_id} is not yours" in theirs.stderr
    assert replica in replica_processes(cluster)[NODE_A.node_id]

    # Several ids: each is answered; an unknown one does not stop the others.
    both = await offload(cluster, "alice", "delete", "d-0123456789", running_id, failed_id)
    assert both.returncode == 1
    assert "NOT_FOUND deployment d-0123456789 not found" in both.stderr, both.stderr
    assert both.stdout == f"{running_id} deleted\n{failed_id} was deleted already\n"
    await until(
        lambda: replica not in replica_processes(cluster)[NODE_A.node_id],
        f"replica {replica} stopped",
    )

    again = await offload(cluster, "alice", "delete", running_id)
    assert (again.returncode, again.stdout) == (0, f"{running_id} was deleted already\n")
    listed = await offload(cluster, "alice", "deployments", "--json")
    assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed
    # The quota place is back.
    deployed_id(
        await offload(cluster, "alice", "deploy", model, "--gpus", "1", "--site", "site-a")
    )
