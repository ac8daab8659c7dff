"""Each runtime tells the node where its replica's Prometheus metrics are, also after a
daemon restart (`adopt`): real processes and containers, real gRPC and HTTP."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge_client.rpc.tensors import infer_request
from images.build import build_image
from node_daemon.runtimes import DockerRuntime, ProcessRuntime, ReplicaSpec, Runtime
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.docker_support import require_docker

TOKEN = "replica-metrics-test-token"
MODEL = "probe"

KINDS = [
    "process",
    pytest.param("docker", marks=pytest.mark.docker),
    pytest.param("docker-host", marks=pytest.mark.docker),
]


async def make_runtime(kind: str, workdir: Path) -> Runtime:
    """A fresh runtime of `kind`, as a (re)started daemon makes it."""
    if kind == "process":
        return ProcessRuntime(workdir)
    client = require_docker()
    image = await asyncio.to_thread(build_image, "cpu", progress=lambda _line: None)
    return DockerRuntime(image, client, network="host" if kind == "docker-host" else "bridge")


def scrape(metrics_endpoint: str) -> dict[tuple[str, frozenset], float]:
    url = f"http://{metrics_endpoint}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert TOKEN not in text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def requests_answered(metrics_endpoint: str) -> float:
    samples = await asyncio.to_thread(scrape, metrics_endpoint)
    return samples[("offload_runtime_requests_total", frozenset({("model", MODEL)}))]


async def infer(endpoint: str, probe_inputs: dict) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        await stub.ModelInfer(infer_request(MODEL, probe_inputs), metadata=metadata, timeout=30)


@pytest.mark.parametrize("kind", KINDS)
async def test_the_metrics_endpoint_is_known_after_start_and_adopt(
    kind: str, tmp_path: Path, probe_model: Path, probe_inputs
) -> None:
    node = f"metrics-{uuid.uuid4().hex[:8]}"
    spec = ReplicaSpec(
        replica_id=f"{node}-r1",
        model_path=probe_model,
        model_name=MODEL,
        token=TOKEN,
        labels={"node": node},
    )
    first = await make_runtime(kind, tmp_path / "replicas")
    adopting: Runtime | None = None
    try:
        replica = await first.start(spec)
        assert replica.metrics_endpoint.startswith("127.0.0.1:")
        assert replica.metrics_endpoint != replica.endpoint
        assert await requests_answered(replica.metrics_endpoint) == 0
        await infer(replica.endpoint, probe_inputs)
        assert await requests_answered(replica.metrics_endpoint) == 1

        await first.detach()  # the daemon goes; the replica keeps serving
        adopting = await make_runtime(kind, tmp_path / "replicas")
        [adopted] = await adopting.adopt({"node": node})
        assert adopted.replica_id == spec.replica_id
        assert adopted.endpoint == replica.endpoint
        assert adopted.metrics_endpoint == replica.metrics_endpoint
        assert adopted.labels["node"] == node
        assert "metrics-port" not in adopted.labels  # the runtime's own label stays its own
        await infer(adopted.endpoint, probe_inputs)
        assert await requests_answered(adopted.metrics_endpoint) == 2
    finally:
        if adopting is not None:
            await adopting.close()
        else:
            await first.close()
