"""Reconciling nodes shares reads of the running deployments: however many nodes report at
once, one read of the store serves them, and a node that reports after a read started waits
for the next one (`broker.service.RECONCILE_READ_GAP_S`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker import service
from broker.model_store import ModelStore
from broker.network import EdgeNetwork
from broker.ops.metrics import BrokerMetrics
from broker.service import Broker, BrokerSettings
from broker.state import StateStore
from edge_client.demo.cluster import CLUSTER_FILE


class CountingStore(StateStore):
    """The real SQLite store, counting the reads of deployments."""

    reads = 0

    def list_deployments(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        return super().list_deployments(*args, **kwargs)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[tuple[Broker, CountingStore]]:
    store = CountingStore(tmp_path / "state")
    network = EdgeNetwork.from_yaml(CLUSTER_FILE.read_text(), str(CLUSTER_FILE))
    models = ModelStore(tmp_path / "models", 1 << 20)
    broker = Broker(store, models, network, "join-token", BrokerSettings(), BrokerMetrics())
    try:
        yield broker, store
    finally:
        await broker.close()
        store.close()


async def test_nodes_reporting_together_share_one_read(
    broker: tuple[Broker, CountingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "RECONCILE_READ_GAP_S", 0.2)
    node, store = broker
    first = await asyncio.gather(*(node._expected() for _ in range(50)))
    assert store.reads == 1
    assert all(found is first[0] for found in first)
    # Asked after that read: a read of its own, after the gap; again shared.
    second = await asyncio.gather(*(node._expected() for _ in range(50)))
    assert store.reads == 2
    assert second[0] is not first[0] and all(found is second[0] for found in second)
