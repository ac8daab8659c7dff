"""Live load in a real cluster (issue 13): real replicas under real inference load raise
their node's load in the broker's view within two heartbeats and it falls when the load
stops; placement avoids the busy node; a node kept hot is relieved by a rebalance
(make-before-break, zero failed requests) that is not undone within the cooldown; a node's
resource manager resizes a throttled replica, and the resize's reason reaches
`offload explain` and `/metrics`."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import modelzoo
from node_daemon.runtimes.cgroup_limits import can_limit_cpu
from protos.offload.v1 import broker_pb2 as pb
from tests.cluster_support import THREE_NODES, Cluster, EdgeClient
from tests.integration.test_migration import Stream
from tests.ops_support import ops_headers

NODE_A = THREE_NODES[0]
NODE_A2 = replace(NODE_A, node_id="node-a2")
"""A second machine like node-a at the same site: equally near every client there."""
PINNED_A = replace(NODE_A, flags=("--cpuset", "0"))
PINNED_A2 = replace(NODE_A2, flags=("--cpuset", "1"))
"""The same two, each offering one CPU of its own: a node's load is its replicas' share of
that core, whatever else this machine runs."""
HEARTBEAT_S = 0.2
BUSY = 0.3
"""A node whose replicas use more than this share of its cores is busy here."""


async def ops(cluster: Cluster, path: str) -> Any:
    headers = ops_headers(cluster.root / "broker-state" / "ops-token")
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.get(f"http://127.0.0.1:{cluster.ops_port}{path}") as response,
    ):
        assert response.status == 200, await response.text()
        return await response.json()


async def node_points(cluster: Cluster, node_id: str) -> list[list[float]]:
    load = await ops(cluster, "/api/load")
    return next((n["points"] for n in load["nodes"] if n["node_id"] == node_id), [])


async def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    """Poll `check` (a function, or a coroutine function) every heartbeat until it returns a
    truthy value, and return that."""
    for _ in range(int(timeout_s / HEARTBEAT_S)):
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        await asyncio.sleep(HEARTBEAT_S)
    raise AssertionError(f"never: {what}")


@asynccontextmanager
async def loaded(client: EdgeClient, deployment: pb.Deployment) -> AsyncIterator[Stream]:
    """A closed loop of ResNet-18 inferences on the deployment, following its moves."""
    stream = Stream(
        client, deployment, "resnet18", endpoint=deployment.endpoint, epoch=deployment.epoch
    )
    stop = asyncio.Event()
    tasks = [asyncio.create_task(stream.follow()), asyncio.create_task(stream.run(stop))]
    try:
        yield stream
    finally:
        stop.set()
        await tasks[1]
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)


async def deploy(client: EdgeClient, priority: int = pb.PRIORITY_CLASS_STANDARD) -> pb.Deployment:
    sha = (await client.upload(modelzoo.model_path("resnet18"))).sha256
    return await client.deploy(
        model_sha256=sha, model_name="resnet18", gpus=1, site="site-a", priority=priority
    )


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Two pinned nodes: one loaded core is unmistakably busy (on two shared cores CI saw one
    closed loop as 0.41, less than packing's pull towards the node already in use)."""
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        await asyncio.gather(cluster.start_node(PINNED_A), cluster.start_node(PINNED_A2))
        yield cluster
    finally:
        await cluster.stop()


async def test_a_busy_nodes_load_rises_within_two_heartbeats_falls_and_placement_avoids_it(
    cluster: Cluster,
) -> None:
    async with cluster.edge("alice") as alice:
        first = await deploy(alice)
        second = await deploy(alice)
        # Idle nodes, equally near: the second packs next to the first (the control).
        assert first.node_id == second.node_id
        busy = first.node_id
        idle = ({"node-a", "node-a2"} - {busy}).pop()
        async with loaded(alice, first) as stream:
            await wait_for(lambda: len(stream.ok) >= 3, "answers")
            before = (await node_points(cluster, busy))[-1][0]

            async def risen() -> list[list[float]] | None:
                after = [p for p in await node_points(cluster, busy) if p[0] > before]
                return after if any(p[1] > BUSY for p in after) else None

            after = await wait_for(risen, f"{busy}'s load above {BUSY}")
            # The first sample past the threshold is at most the second heartbeat after the
            # load was on (one sample may straddle its start).
            assert next(i for i, p in enumerate(after) if p[1] > BUSY) <= 2, after
            assert (await node_points(cluster, idle))[-1][1] < BUSY
            third = await deploy(alice)
            explanation = json.loads(third.explanation_json)
            assert third.node_id == idle, explanation["text"]
            loads = {c["node_id"]: c["terms"]["load"]["value"] for c in explanation["top"]}
            assert loads[busy] > BUSY > loads[idle], loads
            assert not stream.failed

        async def fallen() -> bool:
            return (await node_points(cluster, busy))[-1][1] < BUSY / 3

        await wait_for(fallen, f"{busy}'s load back down")

        async def rates() -> list[float] | None:
            load = await ops(cluster, "/api/load")
            (ours,) = [d for d in load["deployments"] if d["deployment_id"] == first.deployment_id]
            found = [p[1] for p in ours["points"] if p[1] is not None]
            return found if found and found[-1] == 0.0 else None

        # Its runtime's request rate came through the node, and fell to 0 with the load.
        assert max(await wait_for(rates, "its request rate back to 0")) > 1.0


@pytest.fixture
async def hot_cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Rebalancing on: hot at 0.6 for 2 s, targets at or under 0.3, a 5 min cooldown. Each
    node offers one core of its own (as in `cluster`): on two shared cores CI twice saw the
    moved replica's two closed loops stay under 0.6 of the node for a whole minute."""
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker(
            "--rebalance", "1", "--rebalance-hot-load", "0.6", "--rebalance-sustain", "2",
            "--rebalance-target-max-load", "0.3", "--rebalance-cooldown", "300",
        )  # fmt: skip
        await cluster.start_node(PINNED_A)
        yield cluster
    finally:
        await cluster.stop()


async def migrations(client: EdgeClient, deployment_id: str) -> list[pb.Migration]:
    listed = await client.stub.ListMigrations(
        pb.ListMigrationsRequest(deployment_id=deployment_id), metadata=client.metadata
    )
    return list(listed.migrations)


async def test_a_hot_node_is_relieved_by_one_rebalance_that_is_not_undone(
    hot_cluster: Cluster,
) -> None:
    cluster = hot_cluster
    async with cluster.edge("alice") as alice:
        critical = await deploy(alice, pb.PRIORITY_CLASS_CRITICAL)
        best_effort = await deploy(alice, pb.PRIORITY_CLASS_BEST_EFFORT)
        assert critical.node_id == best_effort.node_id == "node-a"  # the only node yet
        await cluster.start_node(PINNED_A2)
        async with loaded(alice, critical) as hot, loaded(alice, best_effort) as cheap:

            async def moved() -> pb.Migration | None:
                done = [
                    m
                    for m in await migrations(alice, best_effort.deployment_id)
                    if m.state == "completed"
                ]
                return done[0] if done else None

            migration = await wait_for(moved, "the rebalance", timeout_s=90)
            # The policy names the best-effort deployment, not the critical one.
            assert await migrations(alice, critical.deployment_id) == []
            assert (migration.trigger, migration.source_node, migration.target_node) == (
                "rebalance",
                "node-a",
                "node-a2",
            )
            assert (migration.strategy, migration.outcome) == ("make_before_break", "succeeded")
            assert "node node-a load" in migration.reason, migration.reason
            assert "best-effort" in migration.reason, migration.reason
            settled_at = len(cheap.ok)
            await wait_for(lambda: len(cheap.ok) > settled_at + 5, "answers")
            assert hot.failed == cheap.failed == []
        # Now node-a2 carries the load and node-a idles: moving it back would look right
        # to the policy but for the cooldown. Two closed loops on node-a2's one core, as the
        # two deployments made node-a hot before the move.
        moved = await alice.get(best_effort.deployment_id)
        async with loaded(alice, moved) as cheap, loaded(alice, moved) as cheap_too:

            async def hot_a2() -> bool:
                points = await node_points(cluster, "node-a2")
                return len(points) >= 15 and all(p[1] >= 0.6 for p in points[-15:])

            await wait_for(hot_a2, "node-a2 hot for 3 s")
            # The policy sees the heat (2 s of it after the move, by its own samples: on a
            # loaded machine later than the test's view) and says why it leaves the
            # deployment there.
            cooling = f"{best_effort.deployment_id} on node-a2: cooling down"

            def said_why() -> bool:
                log = cluster.broker_log.read_text()
                return "node node-a2 load" in log and cooling in log

            await wait_for(said_why, "the policy's verdict on node-a2", timeout_s=60)
            assert len(await migrations(alice, best_effort.deployment_id)) == 1
            assert cheap.failed == cheap_too.failed == []


@pytest.fixture
async def managed_cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """One node whose resource manager re-divides its CPU by measured use (`usage`)."""
    if not can_limit_cpu():
        pytest.skip("process replicas get a CPU quota only where a cgroup is writable (root)")
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        await cluster.start_node(replace(NODE_A, flags=("--resize-policy", "usage")))
        yield cluster
    finally:
        await cluster.stop()


async def test_a_resize_and_its_reason_reach_explain_and_metrics(
    managed_cluster: Cluster, tmp_path: Path
) -> None:
    cluster = managed_cluster
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("resnet18"))).sha256
        critical = await alice.deploy(
            model_sha256=sha, model_name="resnet18", site="site-a", cpus=0.5, cpus_min=0.25,
            cpus_max=1.5, priority=pb.PRIORITY_CLASS_CRITICAL,
        )  # fmt: skip

        async def resizes(grown: bool) -> list[pb.ResizeEvent] | None:
            found = list((await alice.get(critical.deployment_id)).resizes)
            last = found[-1] if found else None
            if last is None or (last.cpus_after > last.cpus_before) != grown:
                return None
            return found

        # Throttled at its 0.5 cores under load, it gets more; idle again, it gives some back.
        async with loaded(alice, critical) as stream:
            grow = (await wait_for(lambda: resizes(grown=True), "a resize up"))[-1]
            assert not stream.failed
        assert grow.policy == "usage" and grow.cpus_before == pytest.approx(0.5, abs=0.01)
        assert 0.5 < grow.cpus_after <= 1.5
        # Grown because its quota throttled it, or because it used all of it (a loaded
        # machine may give it too little CPU to be throttled): the policy says which.
        assert re.match(r"(throttled \d+%|used [\d.]+ cores) ", grow.reason), grow.reason
        assert "critical" in grow.reason, grow.reason
        shrink = (await wait_for(lambda: resizes(grown=False), "a resize down"))[-1]
        assert 0.25 <= shrink.cpus_after < shrink.cpus_before
        assert "used" in shrink.reason, shrink.reason
    key_file = tmp_path / "alice.key"
    key_file.write_text(cluster.api_keys["alice"])
    explained = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "edge_client.cli", "explain", critical.deployment_id],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        env={**os.environ, "OFFLOAD_BROKER": cluster.broker_address,
             "OFFLOAD_API_KEY_FILE": str(key_file)},
    )  # fmt: skip
    assert explained.returncode == 0, explained.stderr
    assert "CPU resizes by the node's resource manager" in explained.stdout
    assert f"0.50 -> {grow.cpus_after:.2f} cores (usage): {grow.reason}" in explained.stdout
    headers = ops_headers(cluster.root / "broker-state" / "ops-token")
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.get(f"http://127.0.0.1:{cluster.ops_port}/metrics") as response,
    ):
        metrics = await response.text()
    counted = {
        direction: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("offload_resizes_total{") and 'policy="usage"' in line
        for direction in ("up", "down")
        if f'direction="{direction}"' in line
    }
    assert counted["up"] >= 1 and counted["down"] >= 1, counted
