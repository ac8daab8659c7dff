"""A node daemon that fails under a deployment (issue 51, item 4): SIGKILLed (its
connections reset, its heartbeat stream broken) or SIGSTOPped (its connection open, its
lease no longer renewed, its beacons stopped). Either way the broker marks the node lost and
places the deployment again on another node, where it serves. Real `offload broker` and
`offload node` processes, process-runtime replicas. No timing is asserted:
`bench.node_failure` measures how fast."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import modelzoo
from tests.cluster_support import THREE_NODES, Cluster, EdgeClient, infer_once, wait_for_log

NODE_A, NODE_B, _NODE_C = THREE_NODES


@pytest.fixture(params=["shared-port", "node-port"])
async def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    """Nodes on the clients' port (`--lost-after` 3 s is their lease), or on a port of their
    own (`--node-listen`), where they beacon: there the stream's lease is 300 s
    (`--node-lease`), so that only a broken stream or beacons gone silent can have the node
    lost in time."""
    node_port = request.param == "node-port"
    cluster = Cluster(tmp_path, node_listen=node_port)
    try:
        await cluster.start_broker(*(["--node-lease", "300"] if node_port else []))
        await asyncio.gather(cluster.start_node(NODE_A), cluster.start_node(NODE_B))
        yield cluster
    finally:
        for process in cluster.nodes.values():  # a stopped daemon must take its SIGTERM
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        await cluster.stop()


async def placed_elsewhere(alice: EdgeClient, deployment_id: str, timeout_s: float = 90) -> None:
    """Until the deployment runs on a node other than node-a (AssertionError if not)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        current = await alice.get(deployment_id)
        if current.state == "running" and current.node_id not in ("", "node-a"):
            await infer_once(current)
            return
        assert loop.time() < deadline, f"still {current.state} on {current.node_id!r}"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
async def test_a_failed_node_daemon_is_lost_and_its_deployment_placed_again(
    cluster: Cluster, fault: signal.Signals
) -> None:
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
        deployment = await alice.deploy(model_sha256=sha, model_name="mlp", gpus=1, site="site-a")
        assert deployment.node_id == "node-a"
        offset = cluster.broker_log.stat().st_size
        daemon = cluster.nodes["node-a"]
        if fault is signal.SIGKILL:
            # The node's host gone: its replica with it.
            os.kill(cluster.replica_pid(deployment), signal.SIGKILL)
        daemon.send_signal(fault)
        lost = await wait_for_log(
            cluster.broker_log, r"node=node-a lost: .*", after=offset, timeout_s=60
        )
        if cluster.node_listen:
            # Its stream's lease (300 s) ran on: killed, its stream broke; paused, its
            # connection held and its beacons stopped.
            why = "its heartbeat stream broke" if fault is signal.SIGKILL else "no beacon or"
            assert why in lost, lost
        await placed_elsewhere(alice, deployment.deployment_id)
        again = await alice.get(deployment.deployment_id)
        assert again.epoch > deployment.epoch
        if fault is signal.SIGSTOP:
            # Resumed, the daemon renews its lease again: the node is back, not a stranger.
            offset = cluster.broker_log.stat().st_size
            daemon.send_signal(signal.SIGCONT)
            await wait_for_log(
                cluster.broker_log, r"node=node-a (is back|registered)", after=offset, timeout_s=60
            )
