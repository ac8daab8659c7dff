"""`/metrics` reads the broker's state through `BrokerOpsView.figures`, counted without
building the dashboard's views (a scrape of a 2,000-node broker built every node's topology
matrix and every load point): its figures are the ones the views show."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.placement import CAPTURES
from broker.ids import replica_id
from broker.nodes import ReplicaState
from broker.ops_view import BrokerOpsView
from broker.placement import PriorityClass
from broker.service import Broker
from broker.state import DeploymentState
from broker.telemetry import NodeSample, ReplicaLoad, RequestFigures
from broker.values import DeploySpec
from common.node_identity import new_secret
from node_daemon.inventory.topo_file import inventory_from_capture
from tests.broker_support import SHA, local_broker, offload_summary
from tests.data import TOPOLOGIES
from tests.ops_support import figures_from_views


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    async with local_broker(tmp_path) as running:
        yield running


def replica_load(replica: str, served: bool) -> ReplicaLoad:
    requests = RequestFigures(12.3456, 0.25, 21.5, 48.25, 1, 0) if served else None
    return ReplicaLoad(replica, 0.61234, 2.0, 0.0, 512, requests)


async def test_the_metric_figures_are_the_ones_the_views_show(broker: Broker) -> None:
    captures = list(CAPTURES.items())
    sites = broker.network.sites
    for i in range(6):
        name, gpu_spec = captures[i % len(captures)]
        inventory = inventory_from_capture(next(TOPOLOGIES.glob(f"{name}_*.txt")), gpu_spec)
        await broker.register_node(
            f"n{i}",
            f"127.0.0.1:{1000 + i}",
            sites[i % len(sites)],
            inventory,
            ["docker"],
            [],
            secret=new_secret(),
        )
    # One node lost (it holds nothing, so nothing is placed again).
    broker.nodes["n5"].last_heartbeat = time.monotonic() - 3600
    assert await broker.mark_lost_nodes() == ["n5"]
    placed = []
    for k in range(6):
        spec = DeploySpec(
            model_sha256=SHA,
            model_name="m",
            gpus=1 + k % 2,
            priority=PriorityClass.STANDARD,
            site=sites[k % len(sites)],
            latency_slo_ms=50.0 * k,
        )
        record, _ = await broker.deployments._reserve(f"d-{k}", "alice", spec, epoch=1)
        placed.append(record)
    for record in placed[:3]:  # running; d-3 stays starting
        await broker.deployments.update(
            record.deployment_id, state=DeploymentState.RUNNING, endpoint="e:1"
        )
    # Neither holds a GPU: one waits for a node, one failed on its node.
    await broker.deployments.write_pending(placed[4].deployment_id, "test")
    await broker.deployments.update(
        placed[5].deployment_id, state=DeploymentState.FAILED, reason="test"
    )
    # Two heartbeats per node: the first has the broker attribute each replica to its
    # deployment, the second's replica figures are then kept as the deployment's.
    for _ in range(2):
        for i in range(5):
            node = f"n{i}"
            mine = [r for r in placed[:3] if r.node_id == node]
            replicas = [replica_id(r.deployment_id, r.epoch) for r in mine]
            sample = NodeSample(
                cpu_cores=8.0,
                cpu_used_cores=1.23456 * (i + 1),
                memory_total_mib=65536,
                memory_used_mib=1000 + i,
                gpu_utilization_pct=(10 * i, 5),
                replicas=tuple(replica_load(r, served=j == 0) for j, r in enumerate(replicas)),
            )
            broker.heartbeat(node, sample, [(r, ReplicaState.READY) for r in replicas])
    for session, (remote, local, reachable) in {
        "s-old": (40, 2, True),
        "s-new": (7, 1, False),
    }.items():
        reported = offload_summary(session, remote, local, remote_reachable=reachable)
        await broker.reports.record_offload("alice", placed[0].deployment_id, reported)
        await asyncio.sleep(0.01)  # distinct report times: the newer session is listed first
    await broker.reports.record_offload(
        "alice", placed[1].deployment_id, offload_summary("s-b", 3, 0)
    )

    view = BrokerOpsView(broker, prewarm_budget=2)
    got = await view.figures()
    expected = figures_from_views(
        await view.nodes(),
        await view.deployments(),
        await view.prewarm(),
        await view.load(),
        await view.services(),
    )
    assert dict(got.services) == dict(expected.services) == {}  # no service here
    assert dict(got.nodes) == dict(expected.nodes) == {"ready": 5, "lost": 1}
    assert dict(got.deployments) == dict(expected.deployments)
    assert dict(got.deployments) == {"running": 3, "starting": 1, "pending": 1, "failed": 1}
    assert (got.gpus_free, got.gpus_used) == (expected.gpus_free, expected.gpus_used)
    failed = broker.deployments._table.get(placed[5].deployment_id)
    assert failed is not None and failed.node_id  # failed where it was placed
    assert got.gpus_used == sum(len(r.gpus) for r in placed[:4])
    assert (got.standbys, got.standby_budget) == (expected.standbys, expected.standby_budget)
    assert dict(got.offload_requests) == dict(expected.offload_requests)
    assert got.offload_requests[placed[0].deployment_id, "remote", "probe"] == 47
    assert dict(got.remote_reachable) == dict(expected.remote_reachable)
    assert got.remote_reachable[placed[0].deployment_id] is False  # the newest session's
    # The views round for display; the figures keep the exact values.
    assert got.load_nodes.keys() == expected.load_nodes.keys() and len(got.load_nodes) == 5
    for node, figures in got.load_nodes.items():
        shown = expected.load_nodes[node]
        assert figures.site == shown.site
        assert figures.memory_used_bytes == shown.memory_used_bytes
        for name in ("load", "cpu_used_cores", "cpu_cores"):
            assert getattr(figures, name) == pytest.approx(getattr(shown, name), abs=1e-3)
    assert got.load_deployments.keys() == expected.load_deployments.keys()
    assert len(got.load_deployments) == 3
    for deployment, served in got.load_deployments.items():
        displayed_figures = expected.load_deployments[deployment]
        for name in DEPLOYMENT_FIGURES:
            value, displayed = getattr(served, name), getattr(displayed_figures, name)
            assert (value is None) == (displayed is None), (deployment, name)
            if value is not None:
                assert value == pytest.approx(displayed, abs=1e-3), (deployment, name)
    assert any(f.request_rate is not None for f in got.load_deployments.values())
    assert any(f.latency_slo_seconds > 0 for f in got.load_deployments.values())


DEPLOYMENT_FIGURES = (
    "latency_slo_seconds",
    "cpu_used_cores",
    "cpu_limit_cores",
    "request_rate",
    "failure_rate",
    "latency_p50_seconds",
    "latency_p99_seconds",
)
