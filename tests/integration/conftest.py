"""Fixtures the integration tests share."""

from __future__ import annotations

import pytest

from images.build import build_image
from tests.docker_support import require_docker


@pytest.fixture(params=["process", pytest.param("docker", marks=pytest.mark.docker)])
def runtime(request: pytest.FixtureRequest) -> str:
    """Each node runtime's name: "process", and "docker" where an engine answers (its cpu
    image built first; skipped without an engine, failed under CI=true)."""
    if request.param == "docker":
        require_docker().close()
        build_image("cpu", progress=lambda _line: None)
    return request.param
