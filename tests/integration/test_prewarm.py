"""Predictive pre-warm in a real cluster (issue 14, item 3): a standby replica at the client's
predicted next site, the move there switching to it, the budget, lapse, preemption by a real
deployment, and a broker killed with a standby up."""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import modelzoo
from protos.offload.v1 import broker_pb2 as pb
from tests.cluster_support import THREE_NODES, Cluster, EdgeClient, node_replicas
from tests.integration.test_migration import Stream, until
from tests.ops_support import ops_headers

NODE_A, NODE_B, NODE_C = THREE_NODES


async def started(*extra: str, root: Path) -> Cluster:
    cluster = Cluster(root)
    cluster.api_keys = {c: f"{c}.secret-key-of-{c}-0123456789" for c in ("alice", "bob", "carol")}
    await cluster.start_broker("--cooldown", "0", *extra)
    await asyncio.gather(*(cluster.start_node(plan) for plan in THREE_NODES))
    return cluster


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = await started("--prewarm-budget", "1", root=tmp_path)
    try:
        yield cluster
    finally:
        await cluster.stop()


async def ops(cluster: Cluster, path: str) -> Any:
    headers = ops_headers(cluster.root / "broker-state" / "ops-token")
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.get(f"http://127.0.0.1:{cluster.ops_port}{path}") as response,
    ):
        assert response.status == 200, await response.text()
        if path == "/metrics":
            return await response.text()
        return await response.json()


async def standbys(cluster: Cluster) -> list[dict[str, Any]]:
    info = await ops(cluster, "/api/prewarm")
    assert len(info["standbys"]) <= info["budget"]
    return list(info["standbys"])


async def wait_standbys(
    cluster: Cluster, check: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 60
) -> list[dict[str, Any]]:
    """Poll /api/prewarm (asserting the budget on every read) until `check` holds."""
    for _ in range(int(timeout_s / 0.1)):
        held = await standbys(cluster)
        if check(held):
            return held
        await asyncio.sleep(0.1)
    raise AssertionError(f"standbys never matched; last: {held}")


async def drive(client: EdgeClient, *sites: str) -> list[str]:
    """Report `sites` in turn; the migrations started."""
    started = []
    for site in sites:
        reply = await client.stub.ReportLocation(
            pb.ReportLocationRequest(site=site), metadata=client.metadata
        )
        started.append(reply.migration_id)
    return started


async def finished(client: EdgeClient, deployment_id: str, migration_id: str) -> pb.Migration:
    for _ in range(1200):
        listed = await client.stub.ListMigrations(
            pb.ListMigrationsRequest(deployment_id=deployment_id), metadata=client.metadata
        )
        record = next(m for m in listed.migrations if m.migration_id == migration_id)
        if record.state in ("completed", "rolled_back", "failed"):
            return record
        await asyncio.sleep(0.05)
    raise AssertionError(f"migration {migration_id} did not finish")


async def deploy_mlp(client: EdgeClient, site: str, gpus: int = 1) -> pb.Deployment:
    sha = (await client.upload(modelzoo.model_path("mlp"))).sha256
    return await client.deploy(model_sha256=sha, model_name="mlp", gpus=gpus, site=site)


async def alice_with_a_standby(
    cluster: Cluster, bob: EdgeClient, alice: EdgeClient
) -> tuple[pb.Deployment, dict[str, Any]]:
    """Bob (no deployment) drives site-a -> site-b -> site-c, and everyone's model learns
    the road; Alice deploys at site-a and reports it: her standby for site-b is then ready
    on node-b. Her deployment and the standby."""
    assert await drive(bob, "site-a", "site-b", "site-c") == ["", "", ""]
    ours = await deploy_mlp(alice, "site-a")
    assert ours.node_id == "node-a"
    assert await drive(alice, "site-a") == [""]
    (standby,) = await wait_standbys(cluster, lambda s: bool(s) and s[0]["state"] == "ready")
    assert (standby["deployment_id"], standby["node_id"]) == (ours.deployment_id, "node-b")
    return ours, standby


def starts(cluster: Cluster, node_id: str, replica: str) -> int:
    """How often the node log says it started `replica`."""
    log = cluster.node_log(node_id).read_text()
    return len(re.findall(rf"replica={re.escape(replica)} starting ", log))


async def test_a_predicted_move_switches_to_the_standby_started_before_it(
    cluster: Cluster,
) -> None:
    # Bob, with no deployment, drives a -> b -> c: everyone's model learns the road.
    async with cluster.edge("bob") as bob, cluster.edge("alice") as alice:
        # Alice's report of where she is plans her standby: from site-a, site-b is next.
        deployment, standby = await alice_with_a_standby(cluster, bob, alice)
        d = deployment.deployment_id
        assert (standby["replica_id"], standby["site"], standby["probability"]) == (
            f"{d}-2",
            "site-b",
            1.0,
        )
        assert f"{d}-2" in (await node_replicas(cluster))["node-b"]

        stream = Stream(alice, deployment, "mlp", endpoint=deployment.endpoint, epoch=1)
        stop = asyncio.Event()
        follower = asyncio.create_task(stream.follow())
        load = asyncio.create_task(stream.run(stop))
        try:
            await until(lambda: len(stream.ok) >= 10)
            (migration_id,) = await drive(alice, "site-b")
            record = await finished(alice, d, migration_id)
            await until(lambda: stream.epoch == 2)
            served = len(stream.ok)
            await until(lambda: len(stream.ok) >= served + 10)
        finally:
            stop.set()
            await load
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
        assert (record.outcome, record.target_node, record.prewarmed) == (
            "succeeded",
            "node-b",
            True,
        )
        assert stream.failed == []
        # The switch went to the replica started before the report: node-b started it once.
        assert starts(cluster, "node-b", f"{d}-2") == 1
        assert (await alice.get(d)).node_id == "node-b"
        explanation = (await alice.get(d)).explanation_json
        assert "client moved to site-b, as predicted" in explanation

        # From site-b, having come from site-a, site-c is next: a standby there now.
        (standby,) = await wait_standbys(
            cluster, lambda s: bool(s) and s[0]["replica_id"] == f"{d}-3"
        )
        assert (standby["node_id"], standby["site"]) == ("node-c", "site-c")
        await wait_standbys(cluster, lambda s: s[0]["state"] == "ready")
        # Alice turns back instead: the standby lapses and is stopped; the move is cold.
        (migration_id,) = await drive(alice, "site-a")
        record = await finished(alice, d, migration_id)
        assert (record.outcome, record.target_node, record.prewarmed) == (
            "succeeded",
            "node-a",
            False,
        )
        await until(lambda: starts(cluster, "node-a", f"{d}-3") == 1)
        replicas = await node_replicas(cluster)
        assert f"{d}-3" not in replicas["node-c"]
        metrics = await ops(cluster, "/metrics")
        assert 'offload_standby_events_total{event="hit"} 1.0' in metrics
        assert 'offload_standby_events_total{event="lapsed"} 1.0' in metrics
        assert "offload_standby_budget 1.0" in metrics


async def test_the_budget_caps_standbys_across_clients(cluster: Cluster) -> None:
    async with cluster.edge("bob") as bob, cluster.edge("alice") as alice:
        assert await drive(bob, "site-a", "site-b", "site-c") == ["", "", ""]
        ours = await deploy_mlp(alice, "site-a")
        theirs = await deploy_mlp(bob, "site-a")
        assert await drive(alice, "site-a") == [""]
        assert await drive(bob, "site-a") == [""]
        (standby,) = await wait_standbys(cluster, lambda s: len(s) == 1)
        # The sweep plans again every 5 s: still one, and the other was refused.
        metrics = ""
        for _ in range(150):
            assert len(await standbys(cluster)) == 1
            metrics = await ops(cluster, "/metrics")
            if 'offload_standby_events_total{event="refused"} 0.0' not in metrics:
                break
            await asyncio.sleep(0.1)
        assert 'offload_standby_events_total{event="refused"} 0.0' not in metrics
        held = {ours.deployment_id, theirs.deployment_id} - {standby["deployment_id"]}
        assert len(held) == 1  # the one without a standby
        assert "offload_standbys 1.0" in metrics


async def test_a_deployment_takes_the_gpus_of_a_standby_as_if_it_were_not_there(
    cluster: Cluster,
) -> None:
    async with cluster.edge("bob") as bob, cluster.edge("alice") as alice:
        ours, _ = await alice_with_a_standby(cluster, bob, alice)
        # Eight GPUs for a client at site-b: node-b's, whose one the standby holds, and not
        # node-c's eight free ones 10 ms further: a standby costs a deployment nothing.
        big = await deploy_mlp(bob, "site-b", gpus=8)
        assert (big.state, big.node_id) == ("running", "node-b")
        assert ours.deployment_id not in {s["deployment_id"] for s in await standbys(cluster)}
        replicas = await node_replicas(cluster)
        assert replicas["node-b"] == [f"{big.deployment_id}-1"]
        assert (await alice.get(ours.deployment_id)).node_id == "node-a"  # untouched
        metrics = await ops(cluster, "/metrics")
        assert 'offload_standby_events_total{event="preempted"} 1.0' in metrics


async def test_a_restarted_broker_stops_the_standby_its_predecessor_left(
    cluster: Cluster,
) -> None:
    async with cluster.edge("bob") as bob, cluster.edge("alice") as alice:
        deployment, _ = await alice_with_a_standby(cluster, bob, alice)
    standby_replica = f"{deployment.deployment_id}-2"
    assert standby_replica in (await node_replicas(cluster))["node-b"]
    cluster.kill_broker()
    await cluster.start_broker("--cooldown", "0", "--prewarm-budget", "1")
    # Its record says it is the broker's own: stopped as such. The broker logs it once the
    # node has answered the stop, a moment after the node stops listing it.
    retired = f"standby {standby_replica} on node=node-b retired: the broker restarted"
    for _ in range(600):
        gone = standby_replica not in (await node_replicas(cluster))["node-b"]
        if gone and retired in cluster.broker_log.read_text():
            break
        await asyncio.sleep(0.05)
    assert standby_replica not in (await node_replicas(cluster))["node-b"]
    assert retired in cluster.broker_log.read_text()
    async with cluster.edge("alice") as alice:
        assert (await alice.get(deployment.deployment_id)).node_id == "node-a"


async def test_a_migration_takes_the_gpus_of_a_standby_and_stops_it_first(
    cluster: Cluster,
) -> None:
    async with cluster.edge("bob") as bob, cluster.edge("alice") as alice:
        ours, _ = await alice_with_a_standby(cluster, bob, alice)
        big = await deploy_mlp(bob, "site-c", gpus=8)
        assert big.node_id == "node-c"
        # Bob moves to site-b: node-b's eight GPUs are his, one of them under the standby,
        # which is stopped before his target starts there.
        (migration_id,) = await drive(bob, "site-b")
        record = await finished(bob, big.deployment_id, migration_id)
        assert (record.outcome, record.target_node, record.prewarmed) == (
            "succeeded",
            "node-b",
            False,
        )
        # Alice's is gone (Bob's own, planned once the budget freed, may be there now).
        assert ours.deployment_id not in {s["deployment_id"] for s in await standbys(cluster)}
        replicas = await node_replicas(cluster)
        assert replicas["node-b"] == [f"{big.deployment_id}-2"]
        assert (await alice.get(ours.deployment_id)).node_id == "node-a"
        metrics = await ops(cluster, "/metrics")
        assert 'offload_standby_events_total{event="preempted"} 1.0' in metrics


async def test_a_standby_goes_with_its_deployment_and_with_its_node(cluster: Cluster) -> None:
    async with cluster.edge("bob") as bob, cluster.edge("alice") as alice:
        ours, standby = await alice_with_a_standby(cluster, bob, alice)
        # Deleted: its standby is stopped with it.
        await alice.stub.DeleteDeployment(
            pb.DeleteDeploymentRequest(deployment_id=ours.deployment_id), metadata=alice.metadata
        )
        assert await standbys(cluster) == []
        assert standby["replica_id"] not in (await node_replicas(cluster))["node-b"]
        # A new one, whose standby's node dies: it is retired as lost, its deployment
        # untouched (the broker is told by the missing heartbeats, 3 s here).
        ours, standby = await alice_with_a_standby(cluster, bob, alice)
        cluster.nodes["node-b"].send_signal(signal.SIGKILL)
        cluster.nodes["node-b"].wait()
        await wait_standbys(cluster, lambda s: s == [])
        metrics = await ops(cluster, "/metrics")
        assert 'offload_standby_events_total{event="lost"} 1.0' in metrics
        after = await alice.get(ours.deployment_id)
        assert (after.state, after.node_id, after.epoch) == ("running", "node-a", 1)


async def test_a_standby_the_client_does_not_reach_expires(tmp_path: Path) -> None:
    cluster = await started("--prewarm-budget", "1", "--prewarm-ttl", "2", root=tmp_path)
    try:
        async with cluster.edge("bob") as bob, cluster.edge("alice") as alice:
            ours, _ = await alice_with_a_standby(cluster, bob, alice)
            # Alice stays at site-a past the TTL: the standby is retired as expired (the
            # sweep plans her the same one again a few seconds later).
            metrics = ""
            for _ in range(600):
                metrics = await ops(cluster, "/metrics")
                if 'offload_standby_events_total{event="expired"} 0.0' not in metrics:
                    break
                await asyncio.sleep(0.1)
            assert 'offload_standby_events_total{event="expired"} 1.0' in metrics
            assert (
                "retired: the client did not reach site-b in 2s" in cluster.broker_log.read_text()
            )
            assert (await alice.get(ours.deployment_id)).node_id == "node-a"
    finally:
        await cluster.stop()
