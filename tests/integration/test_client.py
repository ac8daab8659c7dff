"""`OffloadClient` against a real broker and node daemons (process runtime) on loopback."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import modelzoo
from edge_client.client import OffloadClient, SyncOffloadClient
from edge_client.errors import (
    InvalidInput,
    NotConnected,
    NotDeployed,
    NotFound,
    Unauthenticated,
    Unavailable,
)
from protos.offload.v1 import broker_pb2 as pb
from tests.cluster_support import (
    THREE_NODES,
    Cluster,
    InferenceLoad,
    free_port,
    until,
    wait_for_log,
)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        await asyncio.gather(
            *(
                cluster.start_node(plan, "process", "--stop-replicas-on-exit")
                for plan in THREE_NODES
            )
        )
        yield cluster
    finally:
        await cluster.stop()


def _reference(model: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


async def test_upload_deploy_infer_gives_onnxruntime_outputs_and_errors_map(
    cluster: Cluster, tmp_path: Path
) -> None:
    model = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(model, batch=3)
    async with OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as client:
        with pytest.raises(NotDeployed):
            await client.infer(inputs)
        sha = await client.upload_model(model)
        assert await client.upload_model(model) == sha  # deduplicated, same address
        deployment = await client.deploy(sha, "mlp", gpus=1, site="site-b")
        assert (deployment.node_id, deployment.state, deployment.epoch) == ("node-b", "running", 1)
        assert client.deployment == deployment
        outputs = await client.infer(inputs)
        expected = _reference(model, inputs)
        assert outputs.keys() == expected.keys()
        for name, array in expected.items():
            np.testing.assert_allclose(outputs[name], array, rtol=1e-5, atol=1e-6)
        name = next(iter(inputs))
        with pytest.raises(InvalidInput, match="INVALID_ARGUMENT"):
            await client.infer({name: inputs[name][..., :1]})
        with pytest.raises(NotFound):
            await client.attach("d-does-not-exist")
        garbage = tmp_path / "garbage.onnx"
        garbage.write_bytes(b"not a model" * 1000)
        with pytest.raises(InvalidInput, match="ONNX"):
            await client.upload_model(garbage)
        stats = client.stats()
        assert (stats.requests, stats.failures, stats.retried) == (2, 1, 0)
        assert stats.latency_p50_ms is not None and stats.latency_p50_ms > 0
    async with OffloadClient(cluster.broker_address, "alice.wrong-secret-0123456789") as client:
        with pytest.raises(Unauthenticated, match="API key"):
            await client.attach(deployment.deployment_id)


async def test_a_deploy_whose_first_start_is_lost_returns_once_placed_again(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """node-a's daemon SIGKILLed while the replica starts: the broker answers the deploy
    pending (see test_broker_faults), and the client's deploy waits for the placement after
    it, so the first request finds a replica (CI's demo once failed its first two)."""
    caplog.set_level(logging.INFO, logger="edge_client.client")
    model = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(model)
    async with OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as client:
        sha = await client.upload_model(model)
        offset = cluster.node_log("node-a").stat().st_size
        call = asyncio.create_task(client.deploy(sha, "mlp", gpus=1, site="site-a"))
        await wait_for_log(cluster.node_log("node-a"), r"replica=d-\w+-1 starting", after=offset)
        cluster.nodes["node-a"].send_signal(signal.SIGKILL)
        cluster.nodes["node-a"].wait()
        deployment = await call
        assert "the broker places it again" in caplog.text
        assert deployment.state == "running" and deployment.epoch > 1, deployment
        assert deployment.endpoint and deployment.node_id in {"node-b", "node-c"}, deployment
        assert client.deployment == deployment
        outputs = await client.infer(inputs)
        expected = _reference(model, inputs)
        for name, array in expected.items():
            np.testing.assert_allclose(outputs[name], array, rtol=1e-5, atol=1e-6)
        assert client.stats().failures == 0


async def test_inference_outlives_a_broker_restart_and_follows_a_replaced_replica(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edge_client.client")
    model = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(model)
    async with OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as client:
        first = await client.deploy(await client.upload_model(model), "mlp", site="site-a")
        load = InferenceLoad(client, inputs)
        try:
            await until(lambda: load.successes > 10, "inference before the kill")
            cluster.kill_broker()
            during = load.successes
            await until(lambda: load.successes > during + 20, "inference, broker down")
            await cluster.start_broker()
            await until(
                lambda: "watch deployment=" in caplog.text and " reopened " in caplog.text,
                "the watch stream reopened",
            )
            assert not load.failures, load.failures
            assert client.deployment == first
            # The reopened stream carries the next update: the replica dies, the broker
            # places it again at epoch 2, and the client moves there by itself.
            killed = cluster.replica_pid(first)
            os.kill(killed, signal.SIGKILL)
            await until(
                lambda: client.deployment is not None and client.deployment.epoch == 2,
                "the switch to epoch 2",
            )
            after = load.successes
            await until(lambda: load.successes > after + 10, "inference on epoch 2")
            await until(
                lambda: client.deployment is not None and client.deployment.node_id != "",
                "the node of epoch 2",
            )
        finally:
            await load.stop()
    moved = client.deployment
    assert moved is not None
    # A new process serves epoch 2, though perhaps on the killed one's port.
    assert moved.state == "running" and cluster.replica_pid(moved) != killed
    # An unplanned loss may fail requests (at most those in flight until the switch), and
    # every failure is one of ours, never a grpc error.
    stats = client.stats()
    assert stats.failures == len(load.failures)
    assert all(f.startswith("Unavailable: ") for f in load.failures), load.failures
    assert "switched to epoch=2" in caplog.text


async def test_moving_the_client_migrates_with_no_failed_request_and_reports_the_gap(
    cluster: Cluster,
) -> None:
    model = modelzoo.model_path("resnet18")
    inputs = modelzoo.sample_inputs(model)
    async with OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as client:
        first = await client.deploy(await client.upload_model(model), "resnet18", site="site-a")
        assert first.node_id == "node-a"
        load = InferenceLoad(client, inputs)
        try:
            await until(lambda: load.successes > 10, "inference before the move")
            assert await client.report_location("site-a") is None  # already there
            migration_id = await client.report_location("site-b")
            assert migration_id is not None
            await until(lambda: len(client.stats().migrations) == 1, "the observation")
        finally:
            await load.stop()
        moved = client.deployment
    assert load.failures == []
    assert moved is not None and (moved.epoch, moved.node_id) == (2, "node-b")
    (observation,) = client.stats().migrations
    assert (observation.migration_id, observation.deployment_id) == (
        migration_id,
        first.deployment_id,
    )
    assert observation.failed_requests == 0 and observation.requests > 0
    # The broker's record carries what the client reported.
    async with cluster.edge("alice") as alice:
        for _ in range(200):
            listed = await alice.stub.ListMigrations(
                pb.ListMigrationsRequest(deployment_id=first.deployment_id),
                metadata=alice.metadata,
            )
            (record,) = listed.migrations
            if record.downtime_ms >= 0 and record.state == "completed":
                break
            await asyncio.sleep(0.05)
    assert (record.migration_id, record.source_node, record.target_node) == (
        migration_id,
        "node-a",
        "node-b",
    )
    assert "client_acknowledged" in [e.event for e in record.timeline]
    assert record.downtime_ms == pytest.approx(observation.longest_gap_ms)
    assert record.failed_requests == 0
    # And the worst gap over the whole migration, the target's start included (issue 12).
    assert observation.span_gap_ms is not None
    assert observation.span_gap_ms >= observation.longest_gap_ms
    assert record.span_gap_ms == pytest.approx(observation.span_gap_ms)
    # The client timed its report to its first answer from the new replica (issue 14): that
    # holds the target's whole start, as the broker timed it.
    at = {e.event: e.at for e in record.timeline}
    assert observation.moved_to_served_ms is not None
    assert observation.moved_to_served_ms >= (at["target_ready"] - at["target_started"]) * 1000


def _script(broker: str, api_key: str, model: Path) -> tuple[dict[str, np.ndarray], int]:
    """What a user's blocking script does, with no event loop of its own."""
    inputs = modelzoo.sample_inputs(model)
    with SyncOffloadClient(broker, api_key, call_timeout_s=5.0) as client:
        sha = client.upload_model(model)
        deployment = client.deploy(sha, "mlp", site="site-c", priority="critical")
        assert deployment.node_id == "node-c"
        assert client.attach(deployment.deployment_id) == deployment
        outputs = client.infer(inputs)
        return outputs, client.stats().requests


async def test_sync_client_works_in_a_plain_function(cluster: Cluster) -> None:
    model = modelzoo.model_path("mlp")
    outputs, requests = await asyncio.to_thread(
        _script, cluster.broker_address, cluster.api_keys["bob"], model
    )
    expected = _reference(model, modelzoo.sample_inputs(model))
    for name, array in expected.items():
        np.testing.assert_allclose(outputs[name], array, rtol=1e-5, atol=1e-6)
    assert requests == 1


async def test_an_unreachable_broker_is_our_unavailable_after_the_retries() -> None:
    client = OffloadClient(f"127.0.0.1:{free_port()}", "alice.key", broker_retry_s=0.5)
    with pytest.raises(NotConnected):
        await client.report_location("site-a")
    async with client:
        with pytest.raises(Unavailable, match="UNAVAILABLE") as caught:
            await client.report_location("site-a")
        assert caught.value.__cause__ is not None  # raised from the gRPC error
    with pytest.raises(NotConnected):
        await client.attach("d-1")
