"""A node's liveness as the registry keeps it (`broker.nodes`, issue 51 item 4): a lease that
renewals, heartbeats and beacons extend, and a heartbeat stream whose break counts once the
node has not replaced it within the grace. Real registry, real SQLite store, real UDP
datagrams on a real socket (`broker.beacons`); the times are the registry's own
(`lost_after_s`, `stream_grace_s`), waited for, never asserted."""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.beacons import BeaconReceiver
from broker.errors import NotFound
from broker.nodes import NodeRegistry
from broker.server import DEFAULT_NODE_LEASE_S, config_from_args
from broker.service import Broker
from broker.state import NodeState
from broker.values import BrokerSettings
from common.beacons import beacon
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
    """A broker whose nodes are on a port of their own (`--node-listen`) that takes beacons on
    a real UDP socket (read by the test: `BeaconReceiver.drain`): a node's lease is
    `--node-lease` while its stream awaits its first beacon."""
    settings = BrokerSettings(lost_after_s=1.0, node_lease_s=600.0)
    async with local_broker(tmp_path, settings) as running:
        receiver = BeaconReceiver.bind("127.0.0.1", 0, running.registry.beaconed, running.metrics)
        running.registry.use_beacons(receiver, 0.1)
        await running.register_node(
            "n1", "127.0.0.1:1000", "site-a", NO_GPUS, ["process"], [], secret=new_secret()
        )
        try:
            yield running
        finally:
            await receiver.close()


def keyed_stream(registry: NodeRegistry) -> tuple[BeaconReceiver, object, tuple[bytes, bytes]]:
    """n1's stream opened and given a beacon key: the receiver, the stream, (id, key)."""
    receiver = registry.beacons
    assert receiver is not None
    stream = object()
    registry.stream_opened("n1", stream)
    issued = registry.issue_beacon("n1", stream)
    assert issued is not None
    return receiver, stream, issued


async def taken(receiver: BeaconReceiver, datagrams: list[bytes]) -> int:
    """Send `datagrams` to `receiver`'s port over loopback UDP and read them all: the beacons
    it took."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        for data in datagrams:
            sender.sendto(data, ("127.0.0.1", receiver.port))
    seen, took = 0, 0
    deadline = time.monotonic() + 5.0
    while seen < len(datagrams) and time.monotonic() < deadline:
        before = receiver.taken + sum(receiver.refused.values())
        took += receiver.drain()
        seen += receiver.taken + sum(receiver.refused.values()) - before
        await asyncio.sleep(0.01)
    assert seen == len(datagrams), f"{seen} of {len(datagrams)} datagrams arrived"
    return took


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


async def test_a_node_lost_for_a_broken_stream_registers_again_without_its_old_break(
    broker: Broker,
) -> None:
    """A daemon restarted (or a new one for a retired id) registers before it opens its
    stream: the stream its previous life broke does not lose it again in between."""
    registry = broker.registry
    secret = new_secret()
    await broker.register_node(
        "n2", "127.0.0.1:1001", "site-a", NO_GPUS, ["process"], [], secret=secret
    )
    stream = object()
    registry.stream_opened("n2", stream)
    registry.stream_closed("n2", stream)
    assert "n2" in await lost_within(broker, registry.lost_after_s - 0.5)
    await broker.register_node(
        "n2", "127.0.0.1:1002", "site-a", NO_GPUS, ["process"], [], secret=secret
    )
    assert broker.nodes["n2"].record.state is NodeState.READY
    deadline = time.monotonic() + registry.stream_grace_s + 0.5
    while time.monotonic() < deadline:
        registry.renew("n1")  # n1 stays live: only n2 is watched
        assert await registry.find_lost() == []
        await asyncio.sleep(0.05)
    assert broker.nodes["n2"].record.state is NodeState.READY


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
    """Without a node port nothing takes beacons: a node that offers them renews as often."""
    registry = broker.registry
    assert registry.beacons is None
    assert 0 < registry.renew_s(beacons=True) == registry.renew_s(beacons=False)
    assert registry.renew_s(beacons=False) < registry.lost_after_s / 2


async def test_a_stream_awaiting_beacons_holds_the_long_lease_and_a_broken_one_the_grace(
    pinged: Broker,
) -> None:
    """Silent past `--lost-after`, a node whose stream was given a beacon key none of whose
    beacons came (UDP filtered) is live (its renewals are rare there); past `--node-lease`
    it is lost. Its stream broken, the grace counts as on a shared port."""
    registry = pinged.registry
    assert registry.node_lease_s == 600.0
    stream = object()
    registry.stream_opened("n1", stream)
    assert registry.issue_beacon("n1", stream) is not None
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


async def test_on_the_node_port_a_stream_broken_long_after_a_renewal_still_has_its_grace(
    pinged: Broker,
) -> None:
    """Renewals are rare there: a node last heard 10 leases of `--lost-after` ago whose stream
    breaks (a reset; it reconnects at once) has the grace to open another, not an instant
    loss; replaced in time, it stays."""
    registry = pinged.registry
    old, new = object(), object()
    registry.stream_opened("n1", old)
    assert registry.issue_beacon("n1", old) is not None
    pinged.nodes["n1"].last_heartbeat = time.monotonic() - 10 * registry.lost_after_s
    registry.stream_closed("n1", old)
    assert await lost_within(pinged, registry.stream_grace_s / 2) == []
    registry.stream_opened("n1", new)
    registry.renew("n1")
    assert registry.issue_beacon("n1", new) is not None
    assert await lost_within(pinged, registry.stream_grace_s + 0.5) == []


async def test_on_the_node_port_a_node_that_cannot_beacon_renews_often_on_the_short_lease(
    pinged: Broker,
) -> None:
    """An older daemon (no beacons asked): its open stream alone keeps it no longer than
    `--lost-after`, and it is asked to renew often enough for that."""
    registry = pinged.registry
    registry.stream_opened("n1", object())
    assert registry.renew_s(beacons=False) < registry.lost_after_s / 2
    assert registry.renew_s(beacons=True) > registry.lost_after_s
    assert await lost_within(pinged, registry.lost_after_s + 1.0) == ["n1"]


async def test_a_node_s_beacons_are_its_liveness_and_their_silence_loses_it(
    pinged: Broker,
) -> None:
    """Beacons under its stream's key renew the node's lease; once they came, the lease is
    `--lost-after` again (a daemon paused stops beaconing): silent that long, it is lost,
    its stream still open; its next beacon brings it back."""
    registry = pinged.registry
    receiver, stream, (beacon_id, key) = keyed_stream(registry)
    entry = pinged.nodes["n1"]
    entry.last_heartbeat = time.monotonic() - 10 * registry.lost_after_s
    assert await taken(receiver, [beacon(beacon_id, key, 1), beacon(beacon_id, key, 2)]) == 2
    assert entry.beaconing
    assert registry.is_live(entry)
    assert await lost_within(pinged, registry.lost_after_s + 1.0) == ["n1"]
    assert entry.stream is stream
    assert await taken(receiver, [beacon(beacon_id, key, 3)]) == 1
    assert entry.record.state is NodeState.READY


async def test_a_node_lost_for_silent_beacons_and_heard_on_its_stream_holds_the_long_lease(
    pinged: Broker,
) -> None:
    """Its UDP path lost, not its life: back on its stream's next message, it keeps the long
    lease (not lost again `--lost-after` later) until a beacon comes again."""
    registry = pinged.registry
    receiver, _, issued = keyed_stream(registry)
    assert await taken(receiver, [beacon(*issued, 1)]) == 1
    assert await lost_within(pinged, registry.lost_after_s + 1.0) == ["n1"]
    entry = registry.renew("n1")  # a message on its stream
    assert entry.record.state is NodeState.READY and not entry.beaconing
    assert await lost_within(pinged, registry.lost_after_s + 1.0) == []
    assert await taken(receiver, [beacon(*issued, 2)]) == 1
    assert entry.beaconing
    assert await lost_within(pinged, registry.lost_after_s + 1.0) == ["n1"]


async def test_forged_replayed_unknown_and_malformed_datagrams_renew_nothing(
    pinged: Broker,
) -> None:
    """Only the next beacon of a key the broker issued, under its MAC, counts: a forged MAC,
    a counter not above the last taken, a key withdrawn with its stream, and a datagram of
    another shape are each dropped and counted, and the node's lease is not renewed."""
    registry = pinged.registry
    _, _, old_key = keyed_stream(registry)
    # A new stream: the old stream's key is withdrawn.
    receiver, _, (beacon_id, key) = keyed_stream(registry)
    assert await taken(receiver, [beacon(beacon_id, key, 5)]) == 1
    entry = pinged.nodes["n1"]
    heard = entry.last_heartbeat = time.monotonic() - 10 * registry.lost_after_s
    forged = bytearray(beacon(beacon_id, key, 6))
    forged[-1] ^= 1
    bad = [
        bytes(forged),
        beacon(beacon_id, bytes(32), 7),  # the right id, another key
        beacon(beacon_id, key, 5),  # replayed
        beacon(beacon_id, key, 4),  # older
        beacon(*old_key, 1),  # its stream's key was withdrawn
        b"not a beacon",
        b"\x02" + beacon(beacon_id, key, 8)[1:],  # another version
    ]
    assert await taken(receiver, bad) == 0
    assert receiver.refused == {"forged": 2, "replayed": 2, "unknown": 1, "malformed": 2}
    exposed = pinged.metrics.render()[0].decode()
    for result, count in [("taken", 1), ("forged", 2), ("replayed", 2), ("unknown", 1)]:
        assert f'offload_node_beacons_total{{result="{result}"}} {count}.0' in exposed
    assert entry.last_heartbeat == heard
    assert await lost_within(pinged, registry.lost_after_s + 1.0) == ["n1"]


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
