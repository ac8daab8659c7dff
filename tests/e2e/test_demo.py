"""`offload demo` as a user runs it: with Docker, and without (falling back, and saying so)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.docker_support import require_docker


def run_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edge_client.cli", "demo", "--quick", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def assert_report(output: str, runtime: str, requests: int) -> None:
    assert f"runtime            {runtime}" in output, output
    assert f"requests           {requests} sent, {requests} ok, 0 failed" in output, output
    assert re.search(r"latency p50 / p99  [\d.]+ / [\d.]+ ms", output), output
    assert "equal to in-process ONNX Runtime" in output


@pytest.mark.docker
def test_demo_offloads_to_a_container() -> None:
    require_docker().close()
    done = run_demo("--requests", "12")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_report(done.stdout, "docker", 12)


def test_demo_without_docker_says_so_and_uses_a_process() -> None:
    done = run_demo("--requests", "12", env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Docker is not usable here" in done.stdout
    assert "make docker-engine" in done.stdout
    assert_report(done.stdout, "process", 12)


def test_demo_refuses_bad_request_count() -> None:
    done = run_demo("--requests", "0")
    assert done.returncode == 2
    assert "--requests must be at least 1" in done.stderr
