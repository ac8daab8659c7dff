"""Liveness beacons: the UDP datagram a node sends its broker every heartbeat interval, and
how the broker checks one (issue 51: liveness that costs the broker little).

A beacon is 33 bytes: a version byte (`VERSION`), the 8-byte id the broker gave the node's
heartbeat stream, an 8-byte big-endian counter, and the first 16 bytes of the HMAC-SHA256 of
those 17 bytes under the stream's 32-byte key. The broker takes a beacon only under a key it
issued and not yet withdrew, with a valid MAC, and with a counter above the last it took for
that key (a recorded beacon replayed proves nothing). A key lives as long as its stream; the
node numbers its beacons from 1 under each key.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

VERSION = 1
ID_BYTES = 8
KEY_BYTES = 32
MAC_BYTES = 16
_HEADER = struct.Struct(">B8sQ")
BEACON_BYTES = _HEADER.size + MAC_BYTES


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.digest(key, body, "sha256")[:MAC_BYTES]


def beacon(beacon_id: bytes, key: bytes, counter: int) -> bytes:
    """Beacon number `counter` (1, 2, ...) under `beacon_id` and `key`. ValueError for an id
    or key of the wrong size, or a counter outside 1..2**64-1."""
    if len(beacon_id) != ID_BYTES or len(key) != KEY_BYTES:
        raise ValueError(
            f"a beacon id is {ID_BYTES} bytes and its key {KEY_BYTES}: got "
            f"{len(beacon_id)} and {len(key)}"
        )
    if not 0 < counter < 1 << 64:
        raise ValueError(f"a beacon counter is 1..2**64-1: {counter}")
    body = _HEADER.pack(VERSION, beacon_id, counter)
    return body + _mac(key, body)


@dataclass(frozen=True, slots=True)
class Received:
    """A datagram that has a beacon's shape, not yet authenticated (`authentic`)."""

    beacon_id: bytes
    counter: int
    body: bytes
    mac: bytes

    def authentic(self, key: bytes) -> bool:
        """Whether it was made under `key` (constant time)."""
        return hmac.compare_digest(_mac(key, self.body), self.mac)


def parse(data: bytes) -> Received | None:
    """The beacon in `data`; None for a datagram of another size or version."""
    if len(data) != BEACON_BYTES:
        return None
    version, beacon_id, counter = _HEADER.unpack_from(data)
    if version != VERSION:
        return None
    return Received(beacon_id, counter, data[: _HEADER.size], data[_HEADER.size :])
