"""The node's side of leases (`node_daemon.broker_link`, issue 51 item 4): to a broker that
asks for renewals, a full heartbeat (sample and replicas) first and then on change or every
sample interval, lease renewals between; to one that does not, a full heartbeat every
interval as before; a stream that broke replaced at once. Real gRPC on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from broker.beacons import BeaconReceiver
from node_daemon.broker_link import BrokerLink
from node_daemon.model_cache import ModelCache
from protos.offload.v1 import broker_pb2 as bpb
from tests.cluster_support import until
from tests.unit.test_broker_link import Registry, null_node, serve


class LeaseRegistry(Registry):
    """Gives leases (`renew_ms`; 0: none, as an older broker) and counts what comes."""

    def __init__(self, renew_ms: int, end_first_after: int = 0) -> None:
        super().__init__(streams=True)
        self.renew_ms = renew_ms
        self.end_first_after = end_first_after
        self.kinds: list[str] = []
        """"full" or "renewal", per message, in order."""

    async def Register(self, request: bpb.RegisterRequest, context: object) -> object:
        self.registers += 1
        return bpb.RegisterResponse(
            heartbeat_interval_ms=self.interval_ms,
            lost_after_ms=5000,
            lease_renew_ms=self.renew_ms,
        )

    async def Heartbeats(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        self.opened += 1
        first = self.opened == 1
        taken = 0
        async for request in requests:
            self.kinds.append("renewal" if request.lease_only else "full")
            if request.lease_only:
                assert not request.HasField("usage") and not request.replicas
            taken += 1
            yield bpb.HeartbeatResponse()
            if first and taken == self.end_first_after:
                return  # the broker ends the stream (as a restart or a reset would)


async def run(tmp_path: Path, registry: LeaseRegistry, done: Any, sample_s: float) -> None:
    server, port = await serve(registry)
    link = BrokerLink(
        f"127.0.0.1:{port}",
        "join-token",
        null_node(ModelCache(tmp_path / "m")),
        "127.0.0.1:2",
        sample_interval_s=sample_s,
    )
    running = asyncio.create_task(link.run())
    try:
        await until(lambda: done() or running.done(), "the link's heartbeats", timeout_s=30)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await link.close()
        await server.stop(None)


async def test_a_quiet_node_sends_its_sample_then_renewals_then_its_sample_again(
    tmp_path: Path,
) -> None:
    registry = LeaseRegistry(renew_ms=100)
    await run(
        tmp_path,
        registry,
        lambda: registry.kinds.count("full") >= 2,
        sample_s=1.0,
    )
    kinds = registry.kinds
    assert kinds[0] == "full"
    second = kinds.index("full", 1)
    assert kinds[1:second] and set(kinds[1:second]) == {"renewal"}
    assert registry.opened == 1


async def test_a_broker_without_leases_gets_a_full_heartbeat_each_interval(
    tmp_path: Path,
) -> None:
    registry = LeaseRegistry(renew_ms=0)
    await run(tmp_path, registry, lambda: len(registry.kinds) >= 5, sample_s=3600)
    assert set(registry.kinds) == {"full"}


async def test_a_stream_that_ends_is_replaced_and_renewed_on(tmp_path: Path) -> None:
    registry = LeaseRegistry(renew_ms=100, end_first_after=2)
    await run(
        tmp_path,
        registry,
        lambda: registry.opened >= 2 and len(registry.kinds) >= 5,
        sample_s=3600,
    )
    assert registry.registers == 1
    assert registry.kinds[0] == "full" and "renewal" in registry.kinds[2:]


async def test_a_broker_back_from_a_restart_hears_from_the_node_long_before_its_renewal(
    tmp_path: Path,
) -> None:
    """Renewals 10 minutes apart (a node port's are 10 s): when the broker goes away and
    comes back on its port, the node, whose heartbeats failed meanwhile, tries again every
    interval and opens a stream to it at once, not at its next renewal (the broker counts
    it lost after --lost-after without one)."""
    first = LeaseRegistry(renew_ms=600_000)
    server, port = await serve(first)
    link = BrokerLink(
        f"127.0.0.1:{port}",
        "join-token",
        null_node(ModelCache(tmp_path / "m")),
        "127.0.0.1:2",
        sample_interval_s=3600,
    )
    running = asyncio.create_task(link.run())
    again: grpc.aio.Server | None = None
    try:
        await until(lambda: first.kinds == ["full"], "the first heartbeat")
        await server.stop(None)
        await asyncio.sleep(0.5)  # a heartbeat interval or more without a broker
        back = LeaseRegistry(renew_ms=600_000)
        again, _ = await serve(back, port)
        await until(
            lambda: back.opened >= 1 and len(back.kinds) >= 1, "a heartbeat to the broker back"
        )
        assert not running.done()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await link.close()
        if again is not None:
            await again.stop(None)


class BeaconRegistry(LeaseRegistry):
    """Takes beacons on a real UDP socket (`BeaconReceiver`, read each time the test looks):
    each stream whose first message asks for them is answered with a key of its own; the
    first stream ends after `end_first_after` messages (renewals every 100 ms)."""

    def __init__(self, end_first_after: int) -> None:
        super().__init__(renew_ms=100, end_first_after=end_first_after)
        self.beacons = BeaconReceiver.bind("127.0.0.1", 0, self.on_beacon)
        self.asked: list[bool] = []
        """Per stream: whether its first message asked for beacons."""
        self.keys: list[bytes] = []
        """The beacon id given to each stream."""
        self.heard: list[bytes] = []
        """The beacon id of each beacon taken, in order."""

    def on_beacon(self, node_id: str, beacon_id: bytes) -> None:
        self.heard.append(beacon_id)

    def second_key_heard(self) -> bool:
        """Whether the last three beacons (read now) were under the second stream's key."""
        self.beacons.drain()
        return len(self.keys) >= 2 and self.heard[-3:] == [self.keys[1]] * 3

    async def Register(self, request: bpb.RegisterRequest, context: object) -> object:
        assert request.beacons
        return await super().Register(request, context)

    async def Heartbeats(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        self.opened += 1
        first = self.opened == 1
        taken = 0
        async for request in requests:
            answer = bpb.HeartbeatResponse()
            if taken == 0:
                self.asked.append(request.beacons)
                # Earlier keys stay good: the node alone stops using a stream's key.
                beacon_id, key = self.beacons.issue(request.node_id)
                self.keys.append(beacon_id)
                answer.beacon.CopyFrom(
                    bpb.Beacon(port=self.beacons.port, id=beacon_id, key=key, interval_ms=50)
                )
            taken += 1
            yield answer
            if first and taken == self.end_first_after:
                return


async def test_a_node_beacons_under_its_stream_s_key_and_a_new_stream_gets_a_new_one(
    tmp_path: Path,
) -> None:
    """The node asks for beacons at registration and on each stream's first message; once
    given a key it sends authentic beacons, numbered on, under it (the receiver takes them:
    MAC and counter checked), until the stream ends; the next stream's key takes over."""
    registry = BeaconRegistry(end_first_after=3)
    try:
        await run(
            tmp_path,
            registry,
            registry.second_key_heard,
            sample_s=3600,
        )
    finally:
        await registry.beacons.close()
    first, second = registry.keys[:2]
    heard = registry.heard
    assert registry.asked[:2] == [True, True]
    assert heard.count(first) >= 1
    # Once the second key's beacons start, the first's have stopped.
    assert first not in heard[heard.index(second) :]
    assert registry.beacons.refused["forged"] == registry.beacons.refused["replayed"] == 0
