"""`offload image build` against a real Docker engine: the cpu runtime image, built once.

The first run debootstraps the base image and downloads the wheels (about a minute with a fast
mirror); later runs find everything up to date.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import grpc
import pytest

from images import build
from images.build import HASH_LABEL, VARIANT_LABEL, ImageBuildError, build_image
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.docker_support import require_docker

pytestmark = pytest.mark.docker

TOKEN = "image-test-token"


@pytest.fixture(scope="module")
def docker_client() -> Iterator[docker.DockerClient]:
    client = require_docker()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def cpu_image(docker_client: docker.DockerClient) -> str:
    """The tag of the cpu runtime image, built (or found up to date) once for the module."""
    return build_image("cpu", progress=print)


def run(client: docker.DockerClient, image: str, entrypoint: str, *command: str) -> str:
    """Run a command in a throwaway container of `image`; return its output."""
    output = client.containers.run(image, list(command), entrypoint=entrypoint, remove=True)
    return output.decode()


def test_second_build_is_up_to_date(docker_client: docker.DockerClient, cpu_image: str) -> None:
    before = docker_client.images.get(cpu_image).id
    messages: list[str] = []
    assert build_image("cpu", progress=messages.append) == cpu_image
    assert docker_client.images.get(cpu_image).id == before
    assert any(f"{cpu_image} is up to date" in message for message in messages)
    assert not any("Step " in message for message in messages)


def test_failed_build_is_reported_and_keeps_the_image(
    docker_client: docker.DockerClient,
    cpu_image: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = docker_client.images.get(cpu_image).id
    images = tmp_path / "images"
    shutil.copytree(build.IMAGES_DIR, images, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    (images / "Dockerfile").write_text("ARG BASE\nFROM ${BASE}\nRUN echo about to fail; exit 3\n")
    monkeypatch.setattr(build, "IMAGES_DIR", images)
    with pytest.raises(ImageBuildError) as failure:
        build_image("cpu", progress=print)
    message = str(failure.value)
    assert message.startswith(f"docker build of {cpu_image} failed: The command")
    assert "returned a non-zero code: 3" in message
    assert "about to fail" in message
    assert docker_client.images.get(cpu_image).id == before


def test_image_configuration(docker_client: docker.DockerClient, cpu_image: str) -> None:
    config = docker_client.images.get(cpu_image).attrs["Config"]
    assert config["Labels"][VARIANT_LABEL] == "cpu"
    assert len(config["Labels"][HASH_LABEL]) == 64
    assert config["User"] == "10001:10001"
    assert "8001/tcp" in config["ExposedPorts"]
    assert config["Entrypoint"] == ["/opt/venv/bin/python", "-m", "runtime.server"]
    assert {"PYTHONPATH=/app", "PYTHONUNBUFFERED=1"} <= set(config["Env"])
    assert not any(variable.startswith("NVIDIA_") for variable in config["Env"])


def test_runs_as_the_non_root_offload_user(
    docker_client: docker.DockerClient, cpu_image: str
) -> None:
    assert run(docker_client, cpu_image, "id").split()[:2] == [
        "uid=10001(offload)",
        "gid=10001(offload)",
    ]


def test_runtime_dependencies_import(docker_client: docker.DockerClient, cpu_image: str) -> None:
    script = (
        "import json, grpc, numpy, onnxruntime; "
        "print(json.dumps(onnxruntime.get_available_providers()))"
    )
    output = run(docker_client, cpu_image, "/opt/venv/bin/python", "-c", script)
    assert "CPUExecutionProvider" in json.loads(output.splitlines()[-1])


def test_image_holds_sources_but_no_wheels(
    docker_client: docker.DockerClient, cpu_image: str
) -> None:
    listing = run(docker_client, cpu_image, "find", "/app", "/opt", "/tmp").split()
    assert {"/app/runtime/__init__.py", "/app/protos/__init__.py"} <= set(listing)
    assert not [path for path in listing if path.startswith("/app/") and path.endswith(".pyc")]
    assert not [path for path in listing if path.endswith(".whl") or path.startswith("/tmp/")]


def test_serves_a_model_over_grpc(
    docker_client: docker.DockerClient, cpu_image: str, probe_model: Path, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    container = docker_client.containers.run(
        cpu_image,
        ["--model", "/models/probe.onnx", "--token-file", "/run/token"],
        detach=True,
        ports={"8001/tcp": ("127.0.0.1", None)},
        volumes={
            str(probe_model): {"bind": "/models/probe.onnx", "mode": "ro"},
            str(token_file): {"bind": "/run/token", "mode": "ro"},
        },
    )
    try:
        container.reload()
        port = int(container.ports["8001/tcp"][0]["HostPort"])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            deadline = time.monotonic() + 60
            while True:
                try:
                    ready = stub.ModelReady(
                        pb.ModelReadyRequest(name="probe"),
                        metadata=(("authorization", f"Bearer {TOKEN}"),),
                        timeout=2,
                    ).ready
                except grpc.RpcError:
                    ready = False
                if ready or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            logs = container.logs().decode()
            assert ready, f"the model never became ready; container log:\n{logs}"
            assert stub.ServerLive(pb.ServerLiveRequest(), timeout=5).live
    finally:
        container.remove(force=True)
