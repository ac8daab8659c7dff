"""A node's liveness as the registry keeps it (`broker.nodes`, issue 51 item 4): a lease that
renewals and heartbeats extend, and a heartbeat stream whose break counts once the node has
not replaced it within the grace. Real registry, real SQLite store; the times are the
registry's own (`lost_after_s`, `stream_grace_s`), waited for, never asserted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.errors import NotFound
from broker.service import Broker
from broker.state import NodeState
from common.inventory import Inventory
from common.node_identity import new_secret
from tests.broker_support import local_broker

NO_GPUS = Inventory(gpus=(), links={}, driver_version="", cuda_version="")


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    async with local_broker(tmp_path) as running:
        await running.register_node(
            "n1", "127.0.0.1:1000", "site-a", NO_GPUS, ["process"], [], secret=new_secret()
        )
        yield running


async def lost_within(broker: Broker, seconds: float) -> list[str]:
    """The nodes `find_lost` marks within `seconds` (polled), or none."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if lost := await broker.registry.find_lost():
            return list(lost)
        await asyncio.sleep(0.05)
    return []


async def test_a_broken_stream_not_replaced_loses_the_node_before_its_lease_ends(
    broker: Broker,
) -> None:
    registry = broker.registry
    assert registry.stream_grace_s < registry.lost_after_s
    stream = object()
    registry.stream_opened("n1", stream)
    registry.renew("n1")
    registry.stream_closed("n1", stream)
    assert await lost_within(broker, registry.lost_after_s - 0.5) == ["n1"]
    assert broker.nodes["n1"].record.state is NodeState.LOST


async def test_a_stream_replaced_in_time_keeps_the_node_and_an_old_one_ending_is_nothing(
    broker: Broker,
) -> None:
    registry = broker.registry
    old, new = object(), object()
    registry.stream_opened("n1", old)
    registry.stream_closed("n1", old)
    registry.stream_opened("n1", new)  # the node reopened at once
    registry.stream_closed("n1", old)  # the old stream's end, told again late: no matter
    for _ in range(3):
        registry.renew("n1")
        assert await lost_within(broker, registry.stream_grace_s / 2) == []
    assert broker.nodes["n1"].stream is new
    assert broker.nodes["n1"].stream_broken_at is None


async def test_renewals_keep_a_node_live_and_bring_a_lost_one_back(broker: Broker) -> None:
    registry = broker.registry
    broker.nodes["n1"].last_heartbeat = time.monotonic() - 3600  # its lease ran out
    assert await registry.find_lost() == ["n1"]
    registry.renew("n1")
    assert broker.nodes["n1"].record.state is NodeState.READY
    assert registry.is_live(broker.nodes["n1"])
    with pytest.raises(NotFound, match="register again"):
        registry.renew("n2")


async def test_a_node_without_a_stream_is_lost_on_its_lease_alone(broker: Broker) -> None:
    """A node on unary heartbeats (or one that never opened a stream) has no stream to
    break: it is lost when its lease runs out, not before."""
    registry = broker.registry
    assert await lost_within(broker, registry.stream_grace_s + 0.5) == []
    assert await lost_within(broker, registry.lost_after_s + 1.0) == ["n1"]


async def test_the_broker_asks_for_renewals_several_times_a_lease(broker: Broker) -> None:
    registry = broker.registry
    assert 0 < registry.renew_s < registry.lost_after_s / 2
