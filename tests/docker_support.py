"""Access to the local Docker engine for tests marked `docker`."""

from __future__ import annotations

import os

import docker
import pytest

from node_daemon.runtimes.base import RuntimeUnavailable
from node_daemon.runtimes.docker_runtime import connect_docker


def require_docker() -> docker.DockerClient:
    """A client of the Docker engine that DOCKER_HOST (or the default socket) points at.

    Without a reachable engine the calling test or fixture is skipped, or failed under CI=true,
    where the engine is part of the test environment. The caller closes the client.
    """
    try:
        return connect_docker()
    except RuntimeUnavailable as err:
        if os.environ.get("CI") == "true":
            pytest.fail(str(err))
        pytest.skip(str(err))
