"""`common.brokers`: the broker addresses nodes and clients are given, and the leader hint."""

from __future__ import annotations

import pytest

from common.brokers import (
    LEADER_METADATA_KEY,
    MAX_ADDRESSES,
    BrokerAddresses,
    leader_hint,
    parse_broker_addresses,
    refused_by_standby,
)


def test_one_address_or_several_in_order_without_duplicates() -> None:
    assert parse_broker_addresses("b1:7000") == ("b1:7000",)
    assert parse_broker_addresses(" b1:7000, [::1]:7001 ,b1:7000") == ("b1:7000", "[::1]:7001")
    assert parse_broker_addresses(["b2:1", "b1:2"]) == ("b2:1", "b1:2")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "'' is not host:port"),
        ("b1:7000,", "'' is not host:port"),
        ("b1", "'b1' is not host:port"),
        (":7000", "':7000' is not host:port"),
        ("b1:0", "'b1:0' is not host:port"),
        ("b1:65536", "'b1:65536' is not host:port"),
        ("b1:http", "'b1:http' is not host:port"),
        (",".join(f"b{i}:1" for i in range(MAX_ADDRESSES + 1)), "17 addresses, at most 16"),
    ],
)
def test_a_bad_address_list_says_which_entry(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"--broker: {message}"):
        parse_broker_addresses(text)
    with pytest.raises(ValueError, match="no broker address given"):
        parse_broker_addresses([])


def test_the_leader_hint_is_read_from_trailing_metadata() -> None:
    assert leader_hint(None) is None
    assert leader_hint((("other", "x"),)) is None
    assert leader_hint((("other", "x"), (LEADER_METADATA_KEY, "b2:7000"))) == "b2:7000"
    assert leader_hint(((LEADER_METADATA_KEY, b"b2:7000"),)) == "b2:7000"
    assert leader_hint(((LEADER_METADATA_KEY, "b2:7000,b3:7000"),)) is None
    assert leader_hint(((LEADER_METADATA_KEY, "not an address"),)) is None
    assert refused_by_standby("standby broker; the leader is at b2:7000")
    assert not refused_by_standby("failed to connect to all addresses")
    assert not refused_by_standby(None)


def test_a_failed_broker_gives_way_to_the_named_leader_else_the_next() -> None:
    brokers = BrokerAddresses(("b1:1", "b2:1", "b3:1"))
    assert brokers.current == "b1:1"
    assert brokers.failed(None) == "b2:1"
    assert brokers.failed("b1:1") == "b1:1"  # a standby named the leader
    assert brokers.failed("b1:1") == "b2:1"  # the named leader itself failed: move on
    assert brokers.failed(None) == "b3:1"
    assert brokers.failed(None) == "b1:1"  # round-robin
    # A leader outside the list (another advertised address) is followed, and kept.
    assert brokers.failed("b9:1") == "b9:1"
    assert brokers.all == ("b1:1", "b2:1", "b3:1", "b9:1")
    assert brokers.failed(None) == "b1:1"
    with pytest.raises(ValueError, match="no broker address"):
        BrokerAddresses(())
