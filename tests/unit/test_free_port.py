"""`free_port`: ports the clusters of the demo, the tests and the benches listen on."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_client.demo import cluster
from edge_client.demo.cluster import FIRST_PORT, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the range the kernel gives outgoing connections, so a process restarted on its
    port finds it free again."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("20000\t60999\n")
    monkeypatch.setattr(cluster, "EPHEMERAL_RANGE", ranges)
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(FIRST_PORT <= port < 20_000 for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised


def test_a_port_in_use_or_handed_out_already_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = free_port()
    given = free_port()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", taken))
        listening.listen()
        cluster._handed_out.discard(taken)  # only the socket keeps it now
        picks: Iterator[int] = iter([taken, given, taken, given])
        real_choice = random.choice

        def choose(ports: range) -> int:
            return next(picks, None) or real_choice(ports)

        monkeypatch.setattr(random, "choice", choose)
        port = free_port()
    assert port not in (taken, given)


def test_no_free_port_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = free_port()
    monkeypatch.setattr(random, "choice", lambda ports: taken)
    with pytest.raises(OSError, match="no free TCP port on loopback"):
        free_port()
