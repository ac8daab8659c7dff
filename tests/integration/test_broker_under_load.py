"""The broker under concurrency and hostile callers (issue 10): liveness never waits behind
clients, concurrent decisions never double-book, and refusals have clear statuses."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

import modelzoo
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from tests.cluster_support import THREE_NODES, Cluster, EdgeClient, cluster_agrees

REFUSALS = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    cluster.api_keys = {
        f"client{i}": f"client{i}.secret-key-of-client{i}-0123456789" for i in range(10)
    }
    try:
        await cluster.start_broker()
        await asyncio.gather(*(cluster.start_node(plan) for plan in THREE_NODES))
        yield cluster
    finally:
        await cluster.stop()


async def _bogus_caller(cluster: Cluster, number: int, calls: int) -> Counter[str]:
    """`calls` ListDeployments with a well-formed key that authenticates no one, on a
    connection of its own; the status of each."""
    seen: Counter[str] = Counter()
    metadata = (("authorization", f"Bearer client{number % 10}.wrong-secret-{number:04}-xyz"),)
    async with grpc.aio.insecure_channel(cluster.broker_address) as channel:
        stub = pb_grpc.EdgeBrokerStub(channel)
        for _ in range(calls):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ListDeployments(pb.ListDeploymentsRequest(), metadata=metadata)
            seen[caught.value.code().name] += 1
    return seen


async def _until_admitted(call: object, refused: Counter[str], deadline: float) -> object:
    """Await `call()` again while it is refused RESOURCE_EXHAUSTED (throttled), as a client
    backing off would; any other status is raised."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return await call()  # type: ignore[operator]
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or loop.time() > deadline:
                raise
            refused[err.code().name] += 1
            await asyncio.sleep(0.2)


async def _first_time_client(
    cluster: Cluster, client: str, refused: Counter[str]
) -> pb.Deployment | grpc.StatusCode:
    """A client whose key the broker has not seen: list (its first call), upload, deploy 4
    GPUs. (An upload refused before its stream is read fails on the client's side as
    INTERNAL "Failed execute_batch", a gRPC client artifact: so the first call is unary.)"""
    deadline = asyncio.get_running_loop().time() + 90
    async with cluster.edge(client) as edge:
        assert await _until_admitted(edge.list, refused, deadline) == []
        uploaded = await edge.upload(modelzoo.model_path("mlp"))
        try:
            # The key is verified now: a refusal is about capacity.
            return await edge.deploy(
                model_sha256=uploaded.sha256, model_name="mlp", gpus=4, site="site-b"
            )
        except grpc.aio.AioRpcError as err:
            return err.code()


async def test_heartbeats_hold_while_bogus_keys_and_first_time_clients_flood(
    cluster: Cluster,
) -> None:
    refused: Counter[str] = Counter()
    bogus = [_bogus_caller(cluster, n, calls=8) for n in range(60)]
    first = [_first_time_client(cluster, f"client{i}", refused) for i in range(10)]
    results = await asyncio.gather(*bogus, *first)
    statuses: Counter[str] = Counter()
    for seen in results[:60]:
        assert isinstance(seen, Counter)
        statuses.update(seen)
    assert set(statuses) <= {code.name for code in REFUSALS}, statuses
    assert statuses["UNAUTHENTICATED"] > 0, statuses
    assert set(refused) <= {"RESOURCE_EXHAUSTED"}, refused
    outcomes = results[60:]
    deployed = [d for d in outcomes if isinstance(d, pb.Deployment)]
    # 20 GPUs in all: five deployments of 4 fit, the others are told nothing fits now.
    assert len(deployed) == 5, outcomes
    assert [o for o in outcomes if not isinstance(o, pb.Deployment)] == [
        grpc.StatusCode.RESOURCE_EXHAUSTED
    ] * 5
    assert {d.state for d in deployed} == {"running"}
    log = cluster.broker_log.read_text()
    assert "lost: no heartbeat" not in log
    settled = await cluster_agrees(cluster)
    assert sorted(d.deployment_id for d in settled) == sorted(d.deployment_id for d in deployed)


async def test_a_known_key_skips_the_check_and_a_throttled_address_is_told_so(
    cluster: Cluster,
) -> None:
    async with cluster.edge("client0") as edge:
        assert await edge.list() == []
        # 60 failures from this address exhaust its budget: RESOURCE_EXHAUSTED, not a hash.
        statuses: Counter[str] = Counter()
        for seen in await asyncio.gather(*(_bogus_caller(cluster, n, 2) for n in range(30))):
            statuses.update(seen)
        assert statuses["RESOURCE_EXHAUSTED"] > 0, statuses
        assert set(statuses) <= {code.name for code in REFUSALS}, statuses
        # A key verified before keeps working from the throttled address.
        assert await edge.list() == []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await EdgeClient(edge.stub, cluster.metadata("client1")).list()
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "API key checks from this address" in (caught.value.details() or "")


async def _statuses(calls: list[object]) -> list[object]:
    """Each call's reply, or the status code it was refused with."""
    out: list[object] = []
    for result in await asyncio.gather(*calls, return_exceptions=True):  # type: ignore[call-overload]
        if isinstance(result, grpc.aio.AioRpcError):
            out.append(result.code())
        elif isinstance(result, BaseException):
            raise result
        else:
            out.append(result)
    return out


async def test_concurrent_migrations_of_one_deployment_start_exactly_one(
    cluster: Cluster,
) -> None:
    async with cluster.edge("client0") as edge:
        sha = (await edge.upload(modelzoo.model_path("mlp"))).sha256
        deployment = await edge.deploy(model_sha256=sha, model_name="mlp", gpus=1, site="site-a")

        def migrate(to_node: str) -> object:
            return edge.stub.Migrate(
                pb.MigrateRequest(deployment_id=deployment.deployment_id, to_node=to_node),
                metadata=edge.metadata,
            )

        async def migrations() -> list[pb.Migration]:
            listed = await edge.stub.ListMigrations(
                pb.ListMigrationsRequest(deployment_id=deployment.deployment_id),
                metadata=edge.metadata,
            )
            return list(listed.migrations)

        # Four reports of the same move at once: one migration.
        reports = await asyncio.gather(
            *(
                edge.stub.ReportLocation(
                    pb.ReportLocationRequest(site="site-c"), metadata=edge.metadata
                )
                for _ in range(4)
            )
        )
        (mobility,) = [r.migration_id for r in reports if r.migration_id]
        # While it runs (nobody acks the switch: its drain waits 5 s), Migrate is refused.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await migrate("node-b")
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "being migrated" in (caught.value.details() or "")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while (await migrations())[0].state != "completed":
            assert loop.time() < deadline, await migrations()
            await asyncio.sleep(0.05)
        # Two Migrates at once: one starts, the other is refused.
        results = await _statuses([migrate("node-a"), migrate("node-b")])
        started = [r for r in results if isinstance(r, pb.Migration)]
        assert len(started) == 1, results
        assert [r for r in results if not isinstance(r, pb.Migration)] == [
            grpc.StatusCode.FAILED_PRECONDITION
        ]
        assert [m.migration_id for m in await migrations()] == [
            mobility,
            started[0].migration_id,
        ]
    (settled,) = await cluster_agrees(cluster)
    assert (settled.epoch, settled.state, settled.node_id) == (
        3,
        "running",
        started[0].target_node,
    )


async def test_concurrent_deploys_of_mixed_priorities_preempt_cleanly(cluster: Cluster) -> None:
    async with cluster.edge("client0") as low, cluster.edge("client1") as high:
        sha_low = (await low.upload(modelzoo.model_path("mlp"))).sha256
        sha_high = (await high.upload(modelzoo.model_path("mlp"))).sha256

        def deploy(edge: EdgeClient, sha: str, priority: int) -> object:
            return edge.deploy(
                model_sha256=sha, model_name="mlp", gpus=4, site="site-a", priority=priority
            )

        # 20 GPUs: five best-effort deployments of 4 fill them; then best-effort, standard and
        # critical ones arrive together, the latter five each able to preempt one.
        filled = await _statuses(
            [deploy(low, sha_low, pb.PRIORITY_CLASS_BEST_EFFORT) for _ in range(5)]
        )
        assert all(isinstance(d, pb.Deployment) and d.state == "running" for d in filled), filled
        burst = await _statuses(
            [deploy(low, sha_low, pb.PRIORITY_CLASS_BEST_EFFORT) for _ in range(2)]
            + [deploy(high, sha_high, pb.PRIORITY_CLASS_STANDARD) for _ in range(2)]
            + [deploy(high, sha_high, pb.PRIORITY_CLASS_CRITICAL) for _ in range(3)]
        )
        assert burst[:2] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2, burst
        winners = [d for d in burst[2:] if isinstance(d, pb.Deployment)]
        assert [d.state for d in winners] == ["running"] * 5, burst
        settled = await cluster_agrees(cluster)
        by_state = Counter(d.state for d in settled if d.client_id == "client0")
        assert by_state == {"pending": 5}, settled
        # Capacity returns: the preempted deployments are placed again.
        for d in winners[:3]:
            await high.stub.DeleteDeployment(
                pb.DeleteDeploymentRequest(deployment_id=d.deployment_id), metadata=high.metadata
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while Counter(d.state for d in await low.list())["running"] < 3:
            assert loop.time() < deadline, await low.list()
            await asyncio.sleep(0.1)
    settled = await cluster_agrees(cluster)
    assert Counter(d.state for d in settled) == {"running": 5, "pending": 2}, settled
