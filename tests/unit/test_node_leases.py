"""A node's liveness as the registry keeps it (`broker.nodes`, issue 51 item 4): a lease that
renewals and heartbeats extend, and a heartbeat stream whose break counts once the node has
not replaced it within the grace. Real registry, real SQLite store; the times are the
registry's own (`lost_after_s`, `stream_grace_s`), waited for, never asserted."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.errors import NotFound
from broker.server import DEFAULT_NODE_LEASE_S, config_from_args
from broker.service import Broker
from broker.state import NodeState
from broker.values import BrokerSettings
from common.inventory import Inventory
from common.node_identity import new_secret
from edge_client.cli import build_parser
from tests.broker_support import local_broker

NO_GPUS = Inventory(gpus=(), links={}, driver_version="", cuda_version="")


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    async with local_broker(tmp_path) as running:
        await running.register_node(
            "n1", "127.0.0.1:1000", "site-a", NO_GPUS, ["process"], [], secret=new_secret()
        )
        yield running


@pytest.fixture
async def pinged(tmp_path: Path) -> AsyncIterator[Broker]:
    """A broker whose nodes are on a port that pings them (`--node-listen`): a node's lease
    is `--node-lease` while its stream is open."""
    settings = BrokerSettings(lost_after_s=1.0, node_lease_s=600.0)
    async with local_broker(tmp_path, settings) as running:
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


async def test_on_a_pinged_port_an_open_stream_holds_the_long_lease_and_a_broken_one_the_grace(
    pinged: Broker,
) -> None:
    """Silent past `--lost-after`, a node whose stream the pings keep open is live (its
    renewals are rare there); past `--node-lease` it is lost (a daemon hung while its process
    answers pings). Its stream broken, the grace counts as on a shared port."""
    registry = pinged.registry
    assert registry.node_lease_s == 600.0
    stream = object()
    registry.stream_opened("n1", stream)
    entry = pinged.nodes["n1"]
    entry.last_heartbeat = time.monotonic() - 10 * registry.lost_after_s
    assert registry.is_live(entry)
    assert await lost_within(pinged, registry.stream_grace_s + 0.5) == []
    entry.last_heartbeat = time.monotonic() - registry.node_lease_s - 1
    assert not registry.is_live(entry)
    assert await registry.find_lost() == ["n1"]
    registry.renew("n1")
    registry.stream_closed("n1", stream)
    assert await lost_within(pinged, registry.lost_after_s + 1.0) == ["n1"]


async def test_on_a_pinged_port_a_stream_broken_long_after_a_renewal_still_has_its_grace(
    pinged: Broker,
) -> None:
    """Renewals are rare there: a node last heard 10 leases of `--lost-after` ago whose stream
    breaks (a reset; it reconnects at once) has the grace to open another, not an instant
    loss; replaced in time, it stays."""
    registry = pinged.registry
    old, new = object(), object()
    registry.stream_opened("n1", old)
    pinged.nodes["n1"].last_heartbeat = time.monotonic() - 10 * registry.lost_after_s
    registry.stream_closed("n1", old)
    assert await lost_within(pinged, registry.stream_grace_s / 2) == []
    registry.stream_opened("n1", new)
    registry.renew("n1")
    assert await lost_within(pinged, registry.stream_grace_s + 0.5) == []


async def test_on_a_pinged_port_renewals_are_asked_for_by_the_long_lease(pinged: Broker) -> None:
    registry = pinged.registry
    assert registry.node_lease_s is not None
    assert registry.lost_after_s < registry.renew_s < registry.node_lease_s / 2


def _broker_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    (tmp_path / "join-token").write_text("join-token-for-tests-0123456789")
    return build_parser().parse_args(
        [
            "broker", "--listen", "127.0.0.1:0", "--ops-listen", "127.0.0.1:0",
            "--state-dir", str(tmp_path), "--cluster", str(tmp_path / "cluster.yaml"),
            "--join-token-file", str(tmp_path / "join-token"), *extra,
        ]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--heartbeat-interval", "0"], "--heartbeat-interval 0.0"),
        (["--heartbeat-interval", "nan"], "--heartbeat-interval nan"),
        (["--lost-after", "-1"], "--lost-after -1.0"),
        (["--lost-after", "inf"], "--lost-after inf"),
        (["--lost-after", "0.5"], "--lost-after 0.5"),  # below the heartbeat interval
        (["--node-listen", "127.0.0.1:0", "--node-lease", "2"], "--node-lease 2.0"),
        (["--node-listen", "127.0.0.1:0", "--node-lease", "1e9"], "--node-lease 1000000000.0"),
        (["--node-lease", "30"], "--node-lease needs --node-listen"),
    ],
)
def test_nonsense_liveness_flags_are_refused_naming_the_flag(
    tmp_path: Path, argv: list[str], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        config_from_args(_broker_args(tmp_path, *argv))


def test_the_node_lease_applies_only_where_a_node_port_pings_the_nodes(tmp_path: Path) -> None:
    shared = config_from_args(_broker_args(tmp_path))
    assert shared.settings.node_lease_s is None
    own = config_from_args(_broker_args(tmp_path, "--node-listen", "127.0.0.1:0"))
    assert own.settings.node_lease_s == DEFAULT_NODE_LEASE_S
    longer = ["--node-listen", "127.0.0.1:0", "--node-lease", "60"]
    assert config_from_args(_broker_args(tmp_path, *longer)).settings.node_lease_s == 60
    # A --lost-after past the default lease is no error: the lease follows it.
    slow = ["--lost-after", "60"]
    assert config_from_args(_broker_args(tmp_path, *slow)).settings.node_lease_s is None
    slow_port = [*slow, "--node-listen", "127.0.0.1:0"]
    assert config_from_args(_broker_args(tmp_path, *slow_port)).settings.node_lease_s == 60
