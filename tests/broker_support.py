"""A `Broker` in this process over a real state file and model store, with no nodes and no
servers: for tests that drive its methods directly."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from broker.model_store import ModelStore
from broker.network import EdgeNetwork
from broker.node_client import NodeClient
from broker.ops.metrics import BrokerMetrics
from broker.service import Broker
from broker.state import ModelRecord, OffloadCount, OffloadSummary
from broker.state.api_keys import new_api_key
from broker.state.opener import open_store
from broker.values import BrokerSettings
from edge_client.demo.cluster import CLUSTER_FILE

SHA = "ab" * 32
"""The one model's sha256; client "alice" owns it."""


@contextlib.asynccontextmanager
async def local_broker(
    root: Path, settings: BrokerSettings | None = None
) -> AsyncIterator[Broker]:
    """A broker over the demo's sites, its state and models under `root` (`settings`: the
    defaults' unless given)."""
    store = open_store("", root / "state")
    store.put_client("alice", new_api_key("alice"))
    store.put_model(ModelRecord(SHA, "m", 10, time.time()))
    store.add_model_owner(SHA, "alice")
    network = EdgeNetwork.from_yaml(CLUSTER_FILE.read_text(), str(CLUSTER_FILE))
    broker = Broker(
        store,
        ModelStore(root / "models", 1 << 20),
        network,
        "join-token",
        settings or BrokerSettings(),
        BrokerMetrics(),
        NodeClient,
    )
    try:
        yield broker
    finally:
        await broker.close()
        store.close()


def offload_summary(
    session: str = "s1", remote: int = 3, local: int = 7, **changes: Any
) -> OffloadSummary:
    """A client session's offload summary: `local` requests run locally because faster,
    `remote` sent to the replica as probes."""
    record = OffloadSummary(
        session=session,
        policy="fastest",
        local_model="mlp.onnx",
        decisions=(
            OffloadCount("local", "faster", local),
            OffloadCount("remote", "probe", remote),
        ),
        remote_requests=remote,
        local_requests=local,
        fallbacks=0,
        remote_estimate_ms=12.5,
        local_estimate_ms=None,
        remote_reachable=True,
    )
    return dataclasses.replace(record, **changes)
