"""A replica's batching as its node samples it: a real process replica of the MLP (a model
that batches) for a critical deployment, under concurrent closed-loop calls, shows its
batches, their queue delay, and all their compute in the critical class (the deployment's
priority, passed to the replica) in the node's sample and in the usage message the
heartbeat carries to the broker, read back as the broker reads it.

On a CPU the MLP's requests never queue (the event loop is theirs while each computes, and
a lone request runs at once: `runtime.batching`), so its batches are of one row here; the
figures of merged batches are checked from a real metrics page in
tests/unit/test_node_telemetry.py.

The node agent is driven in this process, sample by sample, as the daemon's sampling loop
drives it (tests/integration/test_node_telemetry.py does the same for CPU figures).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

import modelzoo
from broker.rpc.convert import node_sample_from_proto
from edge_client.rpc.tensors import infer_request
from node_daemon.agent import NodeAgent, StartRequest
from node_daemon.inventory import cpu_only_inventory
from node_daemon.model_cache import ModelCache
from node_daemon.rpc import convert
from node_daemon.runtimes import ProcessRuntime
from node_daemon.telemetry import NodeSample, Telemetry
from protos.inference import grpc_service_pb2_grpc as infer_grpc

MODEL = "mlp"
TOKEN = "batching-telemetry-token-0123"
CRITICAL = 3
SAMPLE_S = 0.5
LOOPS = 16
"""Closed loops of calls, concurrent."""
DEADLINE_S = 60.0


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[NodeAgent]:
    agent = NodeAgent(
        "batching-node", "site-a", cpu_only_inventory(), ProcessRuntime(tmp_path / "replicas"),
        ModelCache(tmp_path / "models"), telemetry=Telemetry(cpu_cores=2.0),
    )  # fmt: skip
    try:
        yield agent
    finally:
        await agent.close(stop_replicas=True)


async def call_until(endpoint: str, stop: asyncio.Event) -> int:
    """Inferences one after another until `stop`; how many were answered (a failed one
    fails the test)."""
    request = infer_request(MODEL, modelzoo.sample_inputs(modelzoo.model_path(MODEL)))
    answered = 0
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = infer_grpc.GRPCInferenceServiceStub(channel)
        while not stop.is_set():
            await stub.ModelInfer(
                request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30
            )
            answered += 1
    return answered


def batched(sample: NodeSample) -> bool:
    """Whether the replica ran batches in the sample's interval (0: none ran)."""
    (replica,) = sample.replicas
    return replica.requests is not None and replica.requests.batch_size_mean >= 1


async def test_a_critical_replica_under_concurrent_calls_reports_its_batches(
    agent: NodeAgent,
) -> None:
    sha = (await asyncio.to_thread(agent.cache.put_file, modelzoo.model_path(MODEL))).sha256
    view = await agent.start_replica(
        StartRequest(
            deployment_id="batched", epoch=1, model_sha256=sha, model_name=MODEL, token=TOKEN,
            priority=CRITICAL,
        )
    )  # fmt: skip
    await agent.usage()  # a first scrape has nothing to take a difference from
    stop = asyncio.Event()
    loops = [
        asyncio.create_task(call_until(view.endpoint, stop), name=f"calls-{i}")
        for i in range(LOOPS)
    ]
    seen: list[float | None] = []
    try:
        for _ in range(int(DEADLINE_S / SAMPLE_S)):
            await asyncio.sleep(SAMPLE_S)  # the sampling interval, as the daemon's
            sample = await agent.usage()
            if batched(sample):
                break
            requests = sample.replicas[0].requests
            seen.append(None if requests is None else requests.batch_size_mean)
        else:
            raise AssertionError(f"no batch in a sample in {DEADLINE_S:.0f}s: {seen}")
    finally:
        stop.set()
        answered = await asyncio.gather(*loops)
    assert all(n > 0 for n in answered)
    (replica,) = sample.replicas
    figures = replica.requests
    assert figures is not None and figures.rate_per_s > 0
    assert figures.queue_delay_p99_ms > 0
    assert [(c.name, c.compute_share) for c in figures.classes] == [("critical", 1.0)]
    assert figures.classes[0].requests_per_s > 0
    # As the heartbeat carries it and the broker reads it.
    (load,) = node_sample_from_proto(convert.usage(sample)).replicas
    assert load.requests is not None and load.requests.batch_size_mean is not None
    assert load.requests.batch_size_mean >= 1
    assert load.requests.class_shares == (("critical", 1.0),)
