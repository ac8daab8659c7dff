"""A broker and three node daemons on loopback, as real processes (issue 4's scenarios)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import modelzoo
from tests.cluster_support import THREE_NODES, Cluster, infer_once


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        await asyncio.gather(*(cluster.start_node(plan) for plan in THREE_NODES))
        yield cluster
    finally:
        await cluster.stop()


async def test_placement_follows_the_client_and_the_topology(cluster: Cluster) -> None:
    async with cluster.edge("alice") as alice:
        uploaded = await alice.upload(modelzoo.model_path("mlp"))
        sha = uploaded.sha256
        # 4 GPUs with P2P from site-a: node-a's 4 free PCIe GPUs (NODE/SYS) cannot, so it goes
        # to the nearest NVLink group.
        p2p = await alice.deploy(
            model_sha256=sha, model_name="mlp", gpus=4, p2p_required=True, site="site-a"
        )
        assert p2p.node_id == "node-b"
        assert json.loads(p2p.explanation_json)["chosen"]["gpus"] in ([0, 1, 2, 3], [4, 5, 6, 7])
        explanation = json.loads(p2p.explanation_json)
        assert (
            explanation["rejected_counts"].get(
                "no P2P-capable group (NVLink, PIX or PXB) among its free GPUs"
            )
            == 1
        ), explanation
        await infer_once(p2p)
        # A client at each site lands on the node at that site (the nearest that fits; node-b
        # still has 4 GPUs free).
        for site, node in (("site-a", "node-a"), ("site-b", "node-b"), ("site-c", "node-c")):
            deployment = await alice.deploy(model_sha256=sha, model_name="mlp", gpus=1, site=site)
            assert (deployment.node_id, deployment.state) == (node, "running")
            explanation = json.loads(deployment.explanation_json)
            assert explanation["chosen"]["node_id"] == node
            assert "latency" in explanation["deciding"], explanation
            await infer_once(deployment)
