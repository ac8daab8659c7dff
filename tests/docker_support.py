"""Access to the local Docker engine for tests marked `docker`."""

from __future__ import annotations

import os

import docker
import docker.errors
import pytest


def require_docker() -> docker.DockerClient:
    """A client of the Docker engine that DOCKER_HOST (or the default socket) points at.

    Without a reachable engine the calling test or fixture is skipped, or failed under CI=true,
    where the engine is part of the test environment. The caller closes the client.
    """
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        message = (
            f"no Docker engine is reachable ({exc}); "
            "start one with `make docker-engine` (or `sudo dockerd &`)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return client
