"""Several brokers, one leader: the addresses nodes and clients are given, and the leader
hint a standby broker answers with.

Brokers sharing one PostgreSQL state elect a leader (`broker.leadership`); the others stand
by and refuse every call with UNAVAILABLE, naming the leader in the trailing metadata key
`LEADER_METADATA_KEY` (its address for the port that was called: clients' or nodes'). Nodes
and clients are given every broker's address (`parse_broker_addresses`: "A,B,...") and keep
calling one until it fails; `BrokerAddresses` says which to call next: the leader a standby
named, else the next in the list. Plain data: no gRPC here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from runtime.errors import quote

LEADER_METADATA_KEY = "offload-leader"
"""Trailing metadata of a standby's refusal: host:port of the leader, for the same kind of
port (EdgeBroker for clients, NodeRegistry for nodes)."""
STANDBY_MESSAGE = "standby broker"
"""How a standby's refusal begins: the call was not acted upon, any call may be sent again."""
MAX_ADDRESSES = 16


def parse_broker_addresses(text: str | Sequence[str], what: str = "--broker") -> tuple[str, ...]:
    """The broker addresses of `text`: one host:port, several separated by commas, or a
    sequence of them; in order, duplicates dropped. ValueError naming `what` for an empty
    list, an entry that is not host:port (port 1..65535) or more than `MAX_ADDRESSES`."""
    entries = text.split(",") if isinstance(text, str) else list(text)
    addresses: list[str] = []
    for entry in entries:
        address = entry.strip()
        host, colon, port = address.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{what}: {quote(address)} is not host:port")
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise ValueError(f"{what}: no broker address given")
    if len(addresses) > MAX_ADDRESSES:
        raise ValueError(f"{what}: {len(addresses)} addresses, at most {MAX_ADDRESSES}")
    return tuple(addresses)


def leader_hint(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The leader's host:port a standby named in `metadata` (a call's trailing metadata);
    None when there is none or it is not host:port."""
    for key, value in metadata or ():
        if key != LEADER_METADATA_KEY:
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        try:
            (address,) = parse_broker_addresses(text, LEADER_METADATA_KEY)
        except ValueError:
            return None
        return address
    return None


def refused_by_standby(details: str | None) -> bool:
    """Whether an UNAVAILABLE with these details is a standby's refusal (nothing was done)."""
    return (details or "").startswith(STANDBY_MESSAGE)


class BrokerAddresses:
    """Which broker to call: `current`, until a call fails; then `failed` moves to the
    leader a standby named (kept among the addresses from then on, so a leader outside the
    configured list is followed too) or to the next configured address, round-robin."""

    def __init__(self, addresses: Sequence[str]) -> None:
        """`addresses`: as `parse_broker_addresses` returns them (at least one)."""
        if not addresses:
            raise ValueError("no broker address")
        self._addresses = list(addresses)
        self._index = 0

    @property
    def current(self) -> str:
        return self._addresses[self._index]

    @property
    def all(self) -> tuple[str, ...]:
        return tuple(self._addresses)

    def failed(self, hint: str | None) -> str:
        """The address to call after `current` failed, with `hint` the leader it named (None:
        it named none, or could not be reached). Returns the new `current`."""
        if hint is not None and hint != self.current:
            if hint not in self._addresses:
                self._addresses.append(hint)
            self._index = self._addresses.index(hint)
        else:
            self._index = (self._index + 1) % len(self._addresses)
        return self.current
