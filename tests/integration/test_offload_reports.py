"""Adaptive offload reports end to end (issue 16): a real `OffloadClient` with a local model
reports where its requests ran, and the broker's ops API, /metrics and `offload status` show
it; what the broker refuses of such reports, over real gRPC."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

import modelzoo
from edge_client.client import OffloadClient
from edge_client.ops_commands import _status
from protos.offload.v1 import broker_pb2 as pb
from tests.cluster_support import THREE_NODES, Cluster
from tests.ops_support import ops_headers


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        await cluster.start_node(THREE_NODES[0], "process")
        yield cluster
    finally:
        await cluster.stop()


def _token_file(cluster: Cluster) -> Path:
    return cluster.root / "broker-state" / "ops-token"


async def _ops(cluster: Cluster, path: str) -> Any:
    async with (
        aiohttp.ClientSession(headers=ops_headers(_token_file(cluster))) as http,
        http.get(f"http://127.0.0.1:{cluster.ops_port}{path}") as response,
    ):
        assert response.status == 200, f"{path}: {response.status} {await response.text()}"
        return await (response.json() if path.startswith("/api/") else response.text())


async def _offload(cluster: Cluster, deployment_id: str) -> list[dict[str, Any]]:
    deployments = await _ops(cluster, "/api/deployments")
    return next(d["offload"] for d in deployments if d["deployment_id"] == deployment_id)


async def _until(condition: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := await condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.1)
    return result


async def test_a_devices_decisions_reach_the_ops_api_metrics_and_status(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    model = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(model)
    async with OffloadClient(
        cluster.broker_address,
        cluster.api_keys["alice"],
        local_model=model,
        policy="fastest",
        offload_report_s=0.2,
    ) as client:
        deployment = await client.deploy(await client.upload_model(model), "mlp", site="site-a")
        for _ in range(40):
            await client.infer(inputs)
        stats = client.stats().offload
        expected = {(d.target.value, d.reason.value): d.requests for d in stats.decisions}

        async def reported() -> list[dict[str, Any]] | None:
            sessions = await _offload(cluster, deployment.deployment_id)
            if (
                sessions
                and {(c["target"], c["reason"]): c["requests"] for c in sessions[0]["decisions"]}
                == expected
            ):
                return sessions
            return None

        (session,) = await _until(reported, "the client's counts in /api/deployments")
    assert session["policy"] == "fastest" and session["local_model"] == model.name
    assert (session["remote_requests"], session["local_requests"]) == (
        stats.remote_requests,
        stats.local_requests,
    )
    assert session["remote_requests"] + session["local_requests"] == 40
    assert expected[("remote", "measuring")] == 2  # fastest measures the replica first
    assert session["fallbacks"] == 0 and session["remote_reachable"] is True
    assert session["remote_share"] == round(stats.remote_requests / 40, 4)
    assert session["remote_estimate_ms"] > 0 and session["local_estimate_ms"] > 0
    assert 0 <= session["reported_age_s"] < 60 and session["reported_at"] <= time.time() + 1

    metrics = await _ops(cluster, "/metrics")
    series = f'deployment="{deployment.deployment_id}"'
    for (target, reason), count in expected.items():
        line = f'offload_client_requests_total{{{series},reason="{reason}",target="{target}"}}'
        assert f"{line} {float(count)}" in metrics, line
    assert f"offload_client_remote_reachable{{{series}}} 1.0" in metrics

    ops_url = f"http://127.0.0.1:{cluster.ops_port}"
    args = argparse.Namespace(ops=ops_url, ops_token_file=str(_token_file(cluster)), json=True)
    assert await _status(args) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["offload"] == {
        "deployments": 1,
        "remote_requests": stats.remote_requests,
        "local_requests": stats.local_requests,
        "fallbacks": 0,
        "replica_unreachable": [],
    }

    # Deleting the deployment drops its reports (and its series).
    async with cluster.edge("alice") as alice:
        await alice.stub.DeleteDeployment(
            pb.DeleteDeploymentRequest(deployment_id=deployment.deployment_id),
            metadata=alice.metadata,
            timeout=30,
        )
    assert deployment.deployment_id not in await _ops(cluster, "/metrics")


async def test_close_reports_the_last_decisions(cluster: Cluster) -> None:
    """A period that never elapsed (an hour) loses nothing: close() sends the counts."""
    model = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(model)
    async with OffloadClient(
        cluster.broker_address,
        cluster.api_keys["alice"],
        local_model=model,
        policy="local",
        offload_report_s=3600,
    ) as client:
        deployment = await client.deploy(await client.upload_model(model), "mlp", site="site-a")
        for _ in range(7):
            await client.infer(inputs)
        assert await _offload(cluster, deployment.deployment_id) == []
    (session,) = await _offload(cluster, deployment.deployment_id)
    assert (session["policy"], session["local_requests"], session["remote_requests"]) == (
        "local",
        7,
        0,
    )


async def test_reports_the_broker_refuses(cluster: Cluster) -> None:
    summary = pb.OffloadSummary(
        session="0123456789abcdef",
        policy="fastest",
        decisions=[pb.OffloadDecisionCount(target="local", reason="faster", requests=5)],
        local_requests=5,
        local_estimate_ms=0.5,
        remote_reachable=True,
    )
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
        deployment = await alice.deploy(model_sha256=sha, model_name="mlp", site="site-a")
        report = alice.stub.ReportObservation
        did = deployment.deployment_id
        cases: list[tuple[pb.ObservationReport, grpc.StatusCode, str]] = [
            (
                pb.ObservationReport(deployment_id=did),
                grpc.StatusCode.INVALID_ARGUMENT,
                "neither a migration_id",
            ),
            (
                pb.ObservationReport(deployment_id=did, longest_gap_ms=5.0, offload=summary),
                grpc.StatusCode.INVALID_ARGUMENT,
                "give its migration_id",
            ),
            (
                pb.ObservationReport(deployment_id="d-0123456789", offload=summary),
                grpc.StatusCode.NOT_FOUND,
                "deployment d-0123456789 not found",
            ),
            # Both parts: the migration's is checked first, and nothing is kept when it fails.
            (
                pb.ObservationReport(deployment_id=did, migration_id="m-1", offload=summary),
                grpc.StatusCode.NOT_FOUND,
                "migration m-1",
            ),
        ]
        for request, code, text in cases:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await report(request, metadata=alice.metadata, timeout=30)
            assert caught.value.code() == code, caught.value.details()
            assert text in (caught.value.details() or "")
        assert await _offload(cluster, did) == []
        await report(
            pb.ObservationReport(deployment_id=did, offload=summary),
            metadata=alice.metadata,
            timeout=30,
        )
    # Another client's deployment looks like no deployment at all.
    async with cluster.edge("bob") as bob:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await bob.stub.ReportObservation(
                pb.ObservationReport(deployment_id=did, offload=summary),
                metadata=bob.metadata,
                timeout=30,
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    (stored,) = await _offload(cluster, did)
    assert (stored["session"], stored["local_requests"], stored["remote_share"]) == (
        "0123456789abcdef",
        5,
        0.0,
    )
    assert stored["remote_estimate_ms"] is None and stored["local_estimate_ms"] == 0.5
