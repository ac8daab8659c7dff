"""The broker's end of the nodes' liveness beacons (`common.beacons`): a UDP socket on the
node port's number, the keys issued to heartbeat streams, and a reader that takes what came.

Why UDP: a live node must say so every second, and the cheapest way a Python broker hears
2,000 nodes say it is a datagram each, read in batches: every `DRAIN_S` the reader takes all
the datagrams waiting in the socket's buffer (11-12 µs each here, MAC and the registry's
renewal included, `python -m bench.ping_cost`; read as each arrives, every datagram would be
an event loop wake-up of its own), where an HTTP/2 ping costs gRPC's core 110-140 µs and a
message on a stream a few hundred (docs/BENCHMARKS.md). A beacon is
sent by the node daemon's event loop, so it proves more than a ping, which gRPC's core
answers even while that loop hangs.

Every key belongs to one heartbeat stream (`issue`, `withdraw`); the registry
(`broker.nodes`) decides what a beacon means. Datagrams that are not a current key's next
beacon are counted by why (`refused`) and dropped: they change nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from broker.ops.metrics import BrokerMetrics
from common.beacons import BEACON_BYTES, ID_BYTES, KEY_BYTES, parse

logger = logging.getLogger(__name__)

DRAIN_S = 0.1
"""How often the reader takes the datagrams waiting: 200 at 2,000 nodes, well within the
socket's buffer (`RECEIVE_BUFFER_BYTES`)."""
RECEIVE_BUFFER_BYTES = 4 << 20
"""The socket's receive buffer asked for: beacons of 2,000 nodes through a few seconds of a
stalled event loop (the kernel may give less: `net.core.rmem_max`, unless root)."""
REFUSALS = ("malformed", "unknown", "forged", "replayed")
"""Why a datagram was dropped: not a beacon; a key not issued, or withdrawn (a stream that
ended, a broker that restarted); a MAC that does not match; a counter not above the last."""


@dataclass(slots=True)
class _Key:
    node_id: str
    key: bytes
    last: int = 0


class BeaconReceiver:
    """Beacons on `sock` (a bound UDP socket, which it owns); `on_beacon(node_id,
    beacon_id)` is told each one taken, on the event loop; `metrics` counts them
    (`offload_node_beacons`)."""

    def __init__(
        self,
        sock: socket.socket,
        on_beacon: Callable[[str, bytes], None],
        metrics: BrokerMetrics | None = None,
    ) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._on_beacon = on_beacon
        self._metrics = metrics
        self._keys: dict[bytes, _Key] = {}
        self.taken = 0
        """Beacons taken since the start."""
        self.refused: Counter[str] = Counter()
        """Datagrams dropped, by why (`REFUSALS`)."""
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    def bind(
        cls,
        host: str,
        port: int,
        on_beacon: Callable[[str, bytes], None],
        metrics: BrokerMetrics | None = None,
    ) -> BeaconReceiver:
        """A receiver on UDP `host`:`port` (the node port's address: a port number is a TCP
        one and a UDP one). OSError when it cannot be bound."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            for option in (getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF):
                if option is not None:
                    with contextlib.suppress(OSError):  # not root: the capped size
                        sock.setsockopt(socket.SOL_SOCKET, option, RECEIVE_BUFFER_BYTES)
                        break
            sock.bind((host.strip("[]") or "0.0.0.0", port))
        except OSError:
            sock.close()
            raise
        return cls(sock, on_beacon, metrics)

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def issue(self, node_id: str) -> tuple[bytes, bytes]:
        """A new key for a heartbeat stream of `node_id`: (beacon id, key)."""
        beacon_id = os.urandom(ID_BYTES)
        key = os.urandom(KEY_BYTES)
        self._keys[beacon_id] = _Key(node_id, key)
        return beacon_id, key

    def withdraw(self, beacon_id: bytes) -> None:
        """Take no more beacons under `beacon_id` (its stream ended)."""
        self._keys.pop(beacon_id, None)

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read_forever(), name="beacon-reader")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close()

    async def _read_forever(self) -> None:
        while True:
            await asyncio.sleep(DRAIN_S)
            self.drain()

    def drain(self) -> int:
        """Take every datagram waiting; the beacons taken."""
        taken = 0
        refused: Counter[str] = Counter()
        while True:
            try:
                data = self._sock.recv(BEACON_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as err:  # an ICMP error queued on the socket: not a beacon
                logger.debug("beacon socket: %s", err)
                continue
            received = parse(data)
            if received is None:
                refused["malformed"] += 1
                continue
            entry = self._keys.get(received.beacon_id)
            if entry is None:
                refused["unknown"] += 1
            elif not received.authentic(entry.key):
                refused["forged"] += 1
            elif received.counter <= entry.last:
                refused["replayed"] += 1
            else:
                entry.last = received.counter
                taken += 1
                self._on_beacon(entry.node_id, received.beacon_id)
        self.taken += taken
        self.refused.update(refused)
        if self._metrics is not None and (taken or refused):
            self._metrics.count_beacons(taken, refused)
        return taken
