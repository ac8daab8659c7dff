"""Deleting deployments with the SDK (`OffloadClient.delete`, `SyncOffloadClient.delete`)
against a real broker and a node daemon (process runtime, GPUs from a topology capture) on
loopback: the replica stops, its GPUs and its quota place are freed, a failed deployment
can be deleted, and the refusals say why."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

import modelzoo
from edge_client.client import OffloadClient, SyncOffloadClient
from edge_client.errors import (
    NotDeployed,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from tests.cluster_support import (
    THREE_NODES,
    Cluster,
    node_replicas,
    replica_processes,
    unloadable_model,
)
from tests.ops_support import ops_headers

NODE_A = THREE_NODES[0]
"""node-a at site-a: 4 GPUs (RTX 6000 Ada, from its topology capture)."""
QUOTA = 2


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker("--max-deployments-per-client", str(QUOTA))
        await cluster.start_node(NODE_A)
        yield cluster
    finally:
        await cluster.stop()


async def free_gpus(cluster: Cluster, node_id: str) -> int:
    """How many of the node's GPUs the broker has free (its ops API)."""
    async with (
        aiohttp.ClientSession(
            headers=ops_headers(cluster.root / "broker-state" / "ops-token")
        ) as http,
        http.get(f"http://127.0.0.1:{cluster.ops_port}/api/nodes") as response,
    ):
        assert response.status == 200
        nodes = await response.json()
    (node,) = (n for n in nodes if n["node_id"] == node_id)
    return sum(g["free"] for g in node["gpus"])


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60
) -> None:
    """Poll the async `check` until it is true; AssertionError naming `what` after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.1)


async def replica_gone(cluster: Cluster, replica: str) -> bool:
    """Neither reported by its node nor alive as a process."""
    reported = await node_replicas(cluster)
    alive = replica_processes(cluster)
    return replica not in reported[NODE_A.node_id] and replica not in alive[NODE_A.node_id]


async def test_delete_frees_the_replica_the_gpus_and_the_quota_and_can_be_repeated(
    cluster: Cluster, tmp_path: Path
) -> None:
    model = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(model)
    bad = unloadable_model(tmp_path / "bad.onnx")
    async with (
        OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice,
        OffloadClient(cluster.broker_address, cluster.api_keys["bob"]) as bob,
    ):
        sha = await alice.upload_model(model)
        bad_sha = await alice.upload_model(bad)
        first = await alice.deploy(sha, "mlp", gpus=1, site="site-a")
        assert (first.node_id, first.state) == (NODE_A.node_id, "running")
        first_replica = f"{first.deployment_id}-{first.epoch}"
        assert first_replica in replica_processes(cluster)[NODE_A.node_id]
        assert await free_gpus(cluster, NODE_A.node_id) == 3
        with pytest.raises(Unavailable, match="could not start a replica"):
            await alice.deploy(bad_sha, "bad", gpus=1, site="site-a")
        async with cluster.edge("alice") as edge:
            listed = await edge.list()
        (failed,) = (d for d in listed if d.state == "failed")
        assert failed.reason, failed
        assert await free_gpus(cluster, NODE_A.node_id) == 3  # a failed one holds none
        # The failed deployment counts: alice is at her quota.
        with pytest.raises(ResourceExhausted, match="--max-deployments-per-client 2"):
            await alice.deploy(sha, "mlp", gpus=1, site="site-a")

        with pytest.raises(PermissionDenied, match="not yours"):
            await bob.delete(first.deployment_id)
        with pytest.raises(NotFound, match="d-0123456789 not found"):
            await alice.delete("d-0123456789")
        assert first_replica in replica_processes(cluster)[NODE_A.node_id]

        # Deleting the failed one gives its quota place back.
        assert await alice.delete(failed.deployment_id) is True
        second = await alice.deploy(sha, "mlp", gpus=1, site="site-a")
        assert second.state == "running"
        assert await free_gpus(cluster, NODE_A.node_id) == 2

        # Deleting a running one stops its replica and frees its GPU and its quota place.
        await alice.attach(first.deployment_id)
        await alice.infer(inputs)
        assert await alice.delete(first.deployment_id) is True
        assert alice.deployment is None
        with pytest.raises(NotDeployed):
            await alice.infer(inputs)
        await eventually(
            lambda: replica_gone(cluster, first_replica), f"replica {first_replica} stopped"
        )
        assert await free_gpus(cluster, NODE_A.node_id) == 3
        third = await alice.deploy(sha, "mlp", gpus=1, site="site-a")
        assert third.state == "running"

        # Twice is fine; another client's is refused, deleted or not.
        assert await alice.delete(first.deployment_id) is False
        assert await alice.delete(failed.deployment_id) is False
        with pytest.raises(PermissionDenied, match="not yours"):
            await bob.delete(first.deployment_id)
        async with cluster.edge("alice") as edge:
            remaining = {d.deployment_id for d in await edge.list()}
        assert remaining == {second.deployment_id, third.deployment_id}

    # The blocking client, in a plain function.
    assert await asyncio.to_thread(
        _delete_twice, cluster.broker_address, cluster.api_keys["alice"], third.deployment_id
    ) == (True, False)
    await eventually(
        lambda: replica_gone(cluster, f"{third.deployment_id}-{third.epoch}"),
        "the sync client's delete stopped the replica",
    )
    assert await free_gpus(cluster, NODE_A.node_id) == 3


def _delete_twice(broker: str, api_key: str, deployment_id: str) -> tuple[bool, bool]:
    with SyncOffloadClient(broker, api_key) as client:
        return client.delete(deployment_id), client.delete(deployment_id)
