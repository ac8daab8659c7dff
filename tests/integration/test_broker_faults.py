"""Starts that are cancelled, brokers killed mid-deploy and mid-migration, failovers whose
target cannot start (issue 10): every deployment ends serving or pending, no replica is
left unclaimed past the orphan grace, no GPU is held twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

import modelzoo
from protos.offload.v1 import broker_pb2 as pb
from tests.cluster_support import THREE_NODES, Cluster, EdgeClient, cluster_agrees, wait_for_log

NODE_A, _NODE_B, NODE_C = THREE_NODES


@pytest.fixture
async def cluster(tmp_path: Path, broker_state: str) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path, state=broker_state)
    try:
        await cluster.start_broker()
        await asyncio.gather(cluster.start_node(NODE_A), cluster.start_node(NODE_C))
        yield cluster
    finally:
        await cluster.stop()


async def _until(condition: object, timeout_s: float = 60) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_a_deploy_whose_caller_gives_up_still_ends_serving(cluster: Cluster) -> None:
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("resnet18"))).sha256
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await alice.stub.Deploy(
                pb.DeployRequest(model_sha256=sha, model_name="resnet18", gpus=4, site="site-a"),
                metadata=alice.metadata,
                timeout=0.2,
            )
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The start goes on without its caller and ends running, its GPUs its own.
        (deployment,) = await cluster_agrees(cluster)
        assert (deployment.state, deployment.node_id) == ("running", "node-a")
        # node-a is full: the next deployment goes elsewhere, never on the same GPUs.
        other = await alice.deploy(model_sha256=sha, model_name="resnet18", gpus=4, site="site-a")
        assert other.node_id == "node-c"
    assert len(await cluster_agrees(cluster)) == 2


async def _deploy_started(cluster: Cluster, alice: EdgeClient, sha: str) -> str:
    """A Deploy of resnet18 to site-a, the broker SIGKILLed once it is placed (its replica
    starting); the deployment's id."""
    offset = cluster.broker_log.stat().st_size
    call = asyncio.create_task(
        alice.deploy(model_sha256=sha, model_name="resnet18", gpus=1, site="site-a"),
        name="deploy",
    )
    placed = await wait_for_log(cluster.broker_log, r"deployment=d-\w+ placed", after=offset)
    cluster.kill_broker()
    with pytest.raises(grpc.aio.AioRpcError):
        await call
    return placed.split("=")[1].split()[0]


async def test_a_broker_killed_while_a_replica_starts_places_it_again(cluster: Cluster) -> None:
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("resnet18"))).sha256
        deployment_id = await _deploy_started(cluster, alice, sha)
    await cluster.start_broker()
    (deployment,) = await cluster_agrees(cluster)
    assert deployment.deployment_id == deployment_id
    assert deployment.state in ("running", "pending")
    log = cluster.broker_log.read_text()
    assert f"deployment={deployment_id} was starting at restart: pending" in log


@pytest.mark.parametrize("step", ["preparing", "draining"])
async def test_a_broker_killed_mid_migration_restarts_with_every_deployment_serving(
    cluster: Cluster, step: str
) -> None:
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
        deployment = await alice.deploy(model_sha256=sha, model_name="mlp", gpus=1, site="site-a")
        migration = await alice.stub.Migrate(
            pb.MigrateRequest(deployment_id=deployment.deployment_id, to_node="node-c"),
            metadata=alice.metadata,
        )

        async def reached() -> bool:
            listed = await alice.stub.ListMigrations(
                pb.ListMigrationsRequest(deployment_id=deployment.deployment_id),
                metadata=alice.metadata,
            )
            (m,) = listed.migrations
            # No client acks the switch: the drain waits out its timeout (5 s).
            order = ["preparing", "switching", "draining", "completed"]
            return order.index(m.state) >= order.index(step)

        await _until(reached)
    cluster.kill_broker()
    await cluster.start_broker()
    (settled,) = await cluster_agrees(cluster)
    assert settled.state == "running"
    async with cluster.edge("alice") as alice:
        listed = await alice.stub.ListMigrations(
            pb.ListMigrationsRequest(deployment_id=deployment.deployment_id),
            metadata=alice.metadata,
        )
    (record,) = listed.migrations
    assert record.migration_id == migration.migration_id
    assert record.state in ("completed", "rolled_back")
    assert settled.node_id == ("node-c" if record.state == "completed" else "node-a")


async def test_a_failover_whose_target_cannot_start_waits_pending_for_a_node(
    tmp_path: Path, broker_state: str
) -> None:
    """node-c takes no model over 100 bytes: a failover to it fails; the deployment waits
    pending and is placed when node-a is back."""
    cluster = Cluster(tmp_path, state=broker_state)
    try:
        await cluster.start_broker()
        await cluster.start_node(NODE_A)
        await cluster.start_node(NODE_C, "process", "--max-model-bytes", "100")
        async with cluster.edge("alice") as alice:
            sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
            deployment = await alice.deploy(
                model_sha256=sha, model_name="mlp", gpus=1, site="site-a"
            )
            assert deployment.node_id == "node-a"
            record = tmp_path / "node-a-state" / "replicas" / f"{deployment.deployment_id}-1"
            pid = json.loads((record / "replica.json").read_text())["pid"]
            cluster.nodes["node-a"].send_signal(signal.SIGKILL)
            cluster.nodes["node-a"].wait()
            os.kill(pid, signal.SIGKILL)

            async def failed_over() -> bool:
                listed = await alice.stub.ListMigrations(
                    pb.ListMigrationsRequest(deployment_id=deployment.deployment_id),
                    metadata=alice.metadata,
                )
                return any(m.outcome == "failed" for m in listed.migrations)

            await _until(failed_over)
            (migration,) = (
                await alice.stub.ListMigrations(
                    pb.ListMigrationsRequest(deployment_id=deployment.deployment_id),
                    metadata=alice.metadata,
                )
            ).migrations
            assert (migration.trigger, migration.strategy) == ("node_lost", "failover")

            async def pending() -> bool:
                return (await alice.get(deployment.deployment_id)).state == "pending"

            await _until(pending)
            await cluster.start_node(NODE_A)

            async def running() -> bool:
                return (await alice.get(deployment.deployment_id)).state == "running"

            await _until(running)
            placed = await alice.get(deployment.deployment_id)
            assert placed.node_id == "node-a" and placed.epoch > 1
        await cluster_agrees(cluster)
    finally:
        await cluster.stop()


async def test_a_node_killed_while_its_replica_starts_leaves_the_deployment_pending(
    cluster: Cluster,
) -> None:
    """node-a's daemon SIGKILLed mid-start: the node did not say the replica cannot run, so
    the deployment is placed again (pending, then running), never `failed`."""
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("resnet18"))).sha256
        offset = cluster.node_log("node-a").stat().st_size
        call = asyncio.create_task(
            alice.deploy(model_sha256=sha, model_name="resnet18", gpus=1, site="site-a"),
            name="deploy",
        )
        await wait_for_log(cluster.node_log("node-a"), r"replica=d-\w+-1 starting", after=offset)
        cluster.nodes["node-a"].send_signal(signal.SIGKILL)
        cluster.nodes["node-a"].wait()
        deployment = await call
        assert deployment.state == "pending", deployment.reason
        assert "node-a" in deployment.reason
        await cluster.start_node(NODE_A)

        async def running() -> bool:
            return (await alice.get(deployment.deployment_id)).state == "running"

        await _until(running)
        assert (await alice.get(deployment.deployment_id)).epoch > 1
    await cluster_agrees(cluster)


async def test_a_migrations_replicas_are_never_taken_for_orphans(
    tmp_path: Path, broker_state: str
) -> None:
    """No client acks the switch, so the old replica drains for the whole drain timeout
    (8 s), well past the orphan grace (3 s): the move holds it, so the migration stops it,
    not reconciliation."""
    cluster = Cluster(tmp_path, state=broker_state)
    try:
        await cluster.start_broker("--drain-timeout", "8")
        await asyncio.gather(cluster.start_node(NODE_A), cluster.start_node(NODE_C))
        async with cluster.edge("alice") as alice:
            sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
            deployment = await alice.deploy(
                model_sha256=sha, model_name="mlp", gpus=1, site="site-a"
            )
            await alice.stub.Migrate(
                pb.MigrateRequest(deployment_id=deployment.deployment_id, to_node="node-c"),
                metadata=alice.metadata,
            )

            async def completed() -> bool:
                listed = await alice.stub.ListMigrations(
                    pb.ListMigrationsRequest(deployment_id=deployment.deployment_id),
                    metadata=alice.metadata,
                )
                return [m.state for m in listed.migrations] == ["completed"]

            await _until(completed)
        (moved,) = await cluster_agrees(cluster)
        assert (moved.node_id, moved.epoch) == ("node-c", 2)
        assert "no deployment claims it" not in cluster.broker_log.read_text()
    finally:
        await cluster.stop()
