"""The local Docker engine, for what builds images (`images.build`) and what runs them
(`node_daemon.runtimes.docker_runtime`): a client, or an error that says how to start one."""

from __future__ import annotations

import socket

import docker
import docker.errors
import requests.exceptions

_ENGINE_HINT = (
    "start one with `make docker-engine` (installs and starts Debian's engine, as root) or "
    "`sudo dockerd &`, or point DOCKER_HOST at a running engine"
)


class EngineUnavailable(Exception):
    """No Docker engine is reachable here; the message says how to start one."""


def connect_engine() -> docker.DockerClient:
    """A client for the local engine (`DOCKER_HOST`, else the default socket);
    EngineUnavailable if none answers.

    Blocking. When it raises, it leaves nothing open: no client, no socket."""
    client: docker.DockerClient | None = None
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as err:
        if client is not None:
            client.close()
        _close_sockets_left_in(err)
        raise EngineUnavailable(f"no Docker engine is reachable ({err}); {_ENGINE_HINT}") from err
    return client


def _close_sockets_left_in(err: BaseException) -> None:
    """Close the sockets still held by the frames of `err`'s tracebacks (and its causes').

    docker-py's unix-socket connection opens its socket and leaves it open when the connect
    fails (no engine listening; docker/docker-py#3356, not merged): the socket lives on in
    the traceback, out of reach of `client.close()`, and is reported unclosed (a
    ResourceWarning, an error under `-W error`) wherever it is collected, far from here."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [err]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            for value in tb.tb_frame.f_locals.values():
                if isinstance(value, socket.socket):
                    value.close()
            tb = tb.tb_next
        pending += [current.__cause__, current.__context__]
