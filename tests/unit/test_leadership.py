"""`broker.leadership`: the lease's holder text, the leader that gives up when its lease is
lost, and the standby's refusals; with a real store (SQLite: the lease logic is the store's,
tested on both backends in test_state.py)."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import pytest

from broker.leadership import LEASE_NAME, Holder, Leadership, Standby, acquire
from broker.server import config_from_args
from broker.state.opener import open_store
from edge_client.cli import build_parser
from tests.cluster_support import until


def test_the_holder_text_round_trips_and_foreign_text_is_no_holder() -> None:
    holder = Holder.new("b1:7000", "b1:7001")
    assert Holder.parse(holder.text()) == holder
    assert holder.id != Holder.new("b1:7000", "b1:7001").id
    for text in ("", "broker-a", "[]", '{"id": "x"}'):
        assert Holder.parse(text) is None


async def test_a_leader_whose_lease_was_taken_gives_up(tmp_path: Path) -> None:
    with open_store("", tmp_path) as store:
        holder, other = Holder.new("b1:1", "b1:2"), Holder.new("b2:1", "b2:2")
        standby = Standby()
        lease, sent = await acquire(store, holder, 0.6, standby)
        assert standby.leader is None  # it took the lease at once
        reasons: list[str] = []
        leadership = Leadership(store, lease, sent, 0.6, lose=reasons.append)
        keeping = asyncio.create_task(leadership.keep())
        await until(lambda: leadership.lease.expires_at != lease.expires_at, "a renewal")
        # Taken behind its back (as after a pause): its next renewal finds it gone.
        assert store.release_lease(leadership.lease)
        assert store.acquire_lease(LEASE_NAME, other.text(), 60) is not None
        await asyncio.wait_for(keeping, 5)
        assert reasons == [f"term {lease.term} was taken over or expired"]
        # A standby names the holder, for its kind of port.
        waiting = asyncio.create_task(acquire(store, holder, 0.6, standby))
        await until(lambda: standby.leader is not None, "the standby learns the leader")
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        leader_at = "standby broker; the leader is at"
        assert standby.message(node_port=False) == (f"{leader_at} b2:1", "b2:1")
        assert standby.message(node_port=True) == (f"{leader_at} b2:2", "b2:2")
        await leadership.release()


async def test_a_leader_not_renewed_for_a_whole_ttl_gives_up(tmp_path: Path) -> None:
    now = [time.monotonic()]
    with open_store("", tmp_path) as store:
        lease = store.acquire_lease(LEASE_NAME, Holder.new("b1:1", "b1:1").text(), 60)
        assert lease is not None
        reasons: list[str] = []
        leadership = Leadership(store, lease, now[0], 60, reasons.append, lambda: now[0])
        keeping = asyncio.create_task(leadership.keep())
        now[0] += 61  # as after a SIGSTOP: the watchdog thread sees the deadline passed
        await until(lambda: bool(reasons), "the watchdog gives up")
        assert reasons == [f"not renewed for 60 s (term {lease.term})"]
        keeping.cancel()
        await asyncio.gather(keeping, return_exceptions=True)
    assert Standby().message(node_port=False) == (
        "standby broker; no leader yet, try again shortly",
        "",
    )


def _broker_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    (tmp_path / "join-token").write_text("join-token-for-tests-0123456789")
    return build_parser().parse_args(
        [
            "broker", "--ops-listen", "127.0.0.1:8080", "--state-dir", str(tmp_path),
            "--cluster", str(tmp_path / "cluster.yaml"),
            "--join-token-file", str(tmp_path / "join-token"), *extra,
        ]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--listen", "127.0.0.1:0"], "needs a fixed port"),
        (["--listen", "0.0.0.0:7000", "--insecure"], "--advertise HOST is needed"),
        (["--listen", "127.0.0.1:7000", "--lease-ttl", "0.1"], "--lease-ttl 0.1 must be"),
        (["--listen", "127.0.0.1:7000", "--lease-ttl", "nan"], "--lease-ttl nan must be"),
        (["--listen", "127.0.0.1:7000", "--advertise", "b1:7000"], "without a port"),
        (["--listen", "127.0.0.1:7000", "--advertise", "::1"], "IPv6 address in brackets"),
        (["--listen", "127.0.0.1:7000", "--advertise", "0.0.0.0"], "not a wildcard"),
    ],
)
def test_a_broker_sharing_postgresql_refuses_what_a_standby_could_not_name(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args(_broker_args(tmp_path, *argv, "--state", "postgresql://u@db/offload"))


def test_the_advertised_addresses_use_the_listening_ports(tmp_path: Path) -> None:
    config = config_from_args(
        _broker_args(
            tmp_path,
            "--listen", "0.0.0.0:7000", "--node-listen", "0.0.0.0:7001", "--insecure",
            "--state", "postgresql://u@db/offload", "--advertise", "broker-1.example",
        )
    )  # fmt: skip
    assert config.shared_state
    holder = config.holder()
    assert (holder.broker, holder.nodes) == ("broker-1.example:7000", "broker-1.example:7001")
    sqlite = config_from_args(_broker_args(tmp_path, "--listen", "127.0.0.1:0"))
    assert not sqlite.shared_state
    assert sqlite.holder().nodes == "127.0.0.1:0"
