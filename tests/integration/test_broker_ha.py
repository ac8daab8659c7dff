"""Two brokers on one PostgreSQL state (issue 15, item 2): one leads, the other stands by and
takes over when the leader stops renewing its lease; nodes and clients, given both addresses,
follow the leader; a leader paused past its lease and resumed commits nothing."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psycopg
import pytest

import modelzoo
from broker.leadership import EXIT_LEASE_LOST
from edge_client.client import OffloadClient
from protos.offload.v1 import broker_pb2 as pb
from tests.cluster_support import (
    THREE_NODES,
    Cluster,
    EdgeClient,
    InferenceLoad,
    cluster_agrees,
    until,
    wait_for_log,
)

NODE_A, _NODE_B, NODE_C = THREE_NODES
LEASE_TTL_S = 2.0
TAKEOVER_LIMIT_S = 5.0
"""What the issue asks; it follows from the lease's ttl (2 s here) and the standby's polling
(every ttl/4), not from this machine's speed."""


@pytest.fixture
async def brokers(tmp_path: Path, postgresql_url: str) -> AsyncIterator[tuple[Cluster, Cluster]]:
    """The leader (first) and the standby (second), one state, one state dir (so one model
    store), nodes A and C given both addresses."""
    first = Cluster(tmp_path, state=postgresql_url)
    second = Cluster(tmp_path, state=postgresql_url, broker_name="broker-2")
    first.peer_registries = (second.registry_address,)
    second.nodes = first.nodes
    flags = ("--lease-ttl", f"{LEASE_TTL_S:g}")
    try:
        await first.start_broker(*flags)
        second.api_keys = first.api_keys
        await second.start_broker(*flags, ready=r"broker standing by")
        await asyncio.gather(first.start_node(NODE_A), first.start_node(NODE_C))
        yield first, second
    finally:
        await first.stop()
        await second.stop()


async def _takeover_s(standby: Cluster, since: float) -> float:
    """Seconds from `since` (monotonic) to the first broker call the standby answers."""
    async with standby.edge("alice") as alice:
        while True:
            try:
                await alice.stub.ListDeployments(
                    pb.ListDeploymentsRequest(), metadata=alice.metadata, timeout=1
                )
            except grpc.aio.AioRpcError as err:
                # CANCELLED: the call reached the standby's server as it closed to lead.
                assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err
                assert time.monotonic() - since < 30, "the standby never took over"
                await asyncio.sleep(0.02)
                continue
            return time.monotonic() - since


async def _migrations(edge: EdgeClient, deployment_id: str) -> list[pb.Migration]:
    listed = await edge.stub.ListMigrations(
        pb.ListMigrationsRequest(deployment_id=deployment_id), metadata=edge.metadata, timeout=5
    )
    return list(listed.migrations)


async def test_the_standby_takes_over_a_killed_leader_under_load(
    brokers: tuple[Cluster, Cluster],
) -> None:
    first, second = brokers
    model = modelzoo.model_path("mlp")
    addresses = [first.broker_address, second.broker_address]
    async with OffloadClient(addresses, first.api_keys["alice"]) as client:
        sha = await client.upload_model(model)
        other = await client.deploy(sha, "mlp", gpus=1, site="site-c")
        moving = await client.deploy(sha, "mlp", gpus=1, site="site-a")
        before = sorted([other.deployment_id, moving.deployment_id])
        load = InferenceLoad(client, modelzoo.sample_inputs(model))
        try:
            await until(lambda: load.successes > 10, "inference before the kill")
            async with first.edge("alice") as alice:
                migration = await alice.stub.Migrate(
                    pb.MigrateRequest(deployment_id=moving.deployment_id, to_node="node-c"),
                    metadata=alice.metadata,
                )
                states: list[str] = []
                while not states or states[0] not in ("preparing", "switching", "draining"):
                    states = [m.state for m in await _migrations(alice, moving.deployment_id)]
                    assert states != ["completed"], "the migration ended before the kill"
                    await asyncio.sleep(0.02)
            killed_at = time.monotonic()
            first.kill_broker()
            during = load.successes
            takeover_s = await _takeover_s(second, killed_at)
            print(f"takeover after SIGKILL: {takeover_s:.2f} s (lease ttl {LEASE_TTL_S:g} s)")
            assert takeover_s < TAKEOVER_LIMIT_S
            await until(lambda: load.successes > during + 50, "inference after the takeover")
            async with second.edge("alice") as alice:
                while True:
                    (record,) = await _migrations(alice, moving.deployment_id)
                    if record.state in ("completed", "rolled_back"):
                        break
                    await asyncio.sleep(0.05)
            assert record.migration_id == migration.migration_id
            print(f"the migration in flight at the kill: {record.state}")
        finally:
            await load.stop()
        assert load.failures == []
        after = await cluster_agrees(second)
        assert sorted(d.deployment_id for d in after) == before
        moved = next(d for d in after if d.deployment_id == moving.deployment_id)
        assert moved.node_id == ("node-c" if record.state == "completed" else "node-a")
        # A new deploy through the client, whose first address is the dead broker's.
        added = await client.deploy(sha, "mlp", gpus=1, site="site-a")
        assert added.state == "running"
    assert len(await cluster_agrees(second)) == 3
    # The old leader comes back: it stands by, naming the new one.
    await first.start_broker("--lease-ttl", f"{LEASE_TTL_S:g}", ready=r"broker standing by")
    await wait_for_log(first.broker_log, rf"the leader is \S+ \(clients {second.broker_address}")
    assert len(await cluster_agrees(second)) == 3


async def test_a_leader_paused_past_its_lease_commits_nothing_when_resumed(
    brokers: tuple[Cluster, Cluster], postgresql_url: str
) -> None:
    first, second = brokers
    assert first.broker is not None
    async with first.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
        deployment = await alice.deploy(model_sha256=sha, model_name="mlp", gpus=1, site="site-a")
    offset = second.broker_log.stat().st_size
    first.broker.send_signal(signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        takeover_s = await _takeover_s(second, stopped_at)
        print(f"takeover after SIGSTOP: {takeover_s:.2f} s (lease ttl {LEASE_TTL_S:g} s)")
        assert takeover_s < TAKEOVER_LIMIT_S
        await wait_for_log(second.broker_log, r"broker listening on", after=offset)
        (settled,) = await cluster_agrees(second)
        # Paused well past the lost-node timeout (3 s): resumed, the old leader's first
        # thought is that every node is lost, a write the fence must refuse.
        await until(lambda: time.monotonic() - stopped_at > 4.5, "past the lost-node timeout")
    finally:
        first.broker.send_signal(signal.SIGCONT)
    code = await asyncio.to_thread(first.broker.wait, 30)
    assert code == EXIT_LEASE_LOST
    assert "lost the broker lease" in first.broker_log.read_text()
    async with await psycopg.AsyncConnection.connect(postgresql_url) as connection:
        nodes = await (await connection.execute("SELECT node_id, state FROM nodes")).fetchall()
        lease = await (
            await connection.execute("SELECT holder, term FROM leases WHERE name = 'broker'")
        ).fetchone()
    assert sorted(nodes) == [("node-a", "ready"), ("node-c", "ready")]
    assert lease is not None and '"broker": "' + second.broker_address + '"' in lease[0]
    (after,) = await cluster_agrees(second)
    assert (after.deployment_id, after.node_id, after.epoch) == (
        deployment.deployment_id,
        settled.node_id,
        settled.epoch,
    )
