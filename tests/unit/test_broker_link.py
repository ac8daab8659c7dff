"""The node's link to the broker (`node_daemon.broker_link`) as the agent sees it when the
daemon is stopping."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.agent import NodeAgent
from node_daemon.broker_link import BrokerLink
from node_daemon.errors import ModelNotCached
from node_daemon.inventory import GpuSpec, inventory_from_capture
from node_daemon.model_cache import ModelCache
from node_daemon.runtimes.null_runtime import NullRuntime
from tests.data import TOPOLOGIES


async def test_a_fetch_on_a_closed_link_is_a_model_not_cached_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A start that needs a model while the daemon closes its link (it is stopping) gets
    the node's own error (NOT_FOUND to the broker, which places the deployment again), not
    gRPC's UsageError (which reached the broker as INTERNAL), and no partial upload."""
    inventory = inventory_from_capture(
        next(TOPOLOGIES.glob("12_*.txt")), GpuSpec("A100-SXM4-40GB", 40960)
    )
    cache = ModelCache(tmp_path / "models")
    agent = NodeAgent("n1", "site-a", inventory, NullRuntime(), cache)
    link = BrokerLink("127.0.0.1:1", "join-token", agent, "127.0.0.1:2")
    await link.close()
    with pytest.raises(ModelNotCached, match="this node is leaving the broker"):
        await link.fetch_model("ab" * 32)
    with pytest.raises(ModelNotCached):
        cache.path("ab" * 32)
    assert not [p for p in (tmp_path / "models").rglob("*") if p.is_file()]
