"""`connect_docker` without an engine: RuntimeUnavailable saying how to get one, and nothing
left open behind it (docker-py leaves the socket of a failed unix connect open: under
`filterwarnings = error` its ResourceWarning failed whichever test ran when it was collected).
Runs whether or not this machine has an engine: DOCKER_HOST points elsewhere."""

from __future__ import annotations

import gc
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_client.demo import cluster
from node_daemon.runtimes.base import RuntimeUnavailable
from node_daemon.runtimes.docker_runtime import connect_docker


@pytest.fixture
def stale_socket(tmp_path: Path) -> Iterator[Path]:
    """A unix socket file nothing listens on, as a dead engine leaves it (ECONNREFUSED)."""
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        yield path


@pytest.mark.parametrize("where", ["missing", "stale"])
def test_a_missing_engine_is_unavailable_and_leaves_no_socket_open(
    where: str, stale_socket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = "/nonexistent.sock" if where == "missing" else str(stale_socket)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeUnavailable, match="no Docker engine is reachable") as info:
            connect_docker()
        assert "make docker-engine" in str(info.value)
        # The socket would be held by the error's traceback: drop it, then collect.
        del info
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


async def test_the_demos_sweep_without_an_engine_finds_nothing_and_leaves_no_socket_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent.sock")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert await cluster._remove_containers(["d-1"]) == []
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []
