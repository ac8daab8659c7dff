"""`offload image build` against a real Docker engine: the cpu runtime image and the broker's
image, each built once.

The first run debootstraps the base image and downloads the wheels (about a minute with a fast
mirror); later runs find everything up to date. The broker's image runs as the non-root
`offload` user and is a working broker: a node daemon on the host joins it, a client deploys a
model through it and infers on the replica, and its state lands in the volume.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import docker
import grpc
import pytest

import modelzoo
from images import build
from images.build import HASH_LABEL, VARIANT_LABEL, ImageBuildError, build_image
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.cluster_support import CLUSTER_YAML, JOIN_TOKEN, THREE_NODES, Cluster, infer_once
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


def test_the_client_library_runs_on_the_runtime_image(
    docker_client: docker.DockerClient, cpu_image: str
) -> None:
    """bench.offload's emulated device is the runtime image with this repository mounted: the
    client library (without TLS) must import with the image's packages alone."""
    output = docker_client.containers.run(
        cpu_image,
        ["-c", "import bench.offload_device, edge_client.client; print('imported')"],
        entrypoint="/opt/venv/bin/python",
        environment={"PYTHONPATH": "/src"},
        volumes={str(build.REPO_ROOT): {"bind": "/src", "mode": "ro"}},
        working_dir="/src",
        remove=True,
    )
    assert output.decode().splitlines()[-1] == "imported"


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
        # Plaintext on the container's 0.0.0.0 (published on loopback only).
        ["--model", "/models/probe.onnx", "--token-file", "/run/token", "--insecure"],
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


# --- the broker's image ---------------------------------------------------------------------

OFFLOAD_UID = 10001


@pytest.fixture(scope="module")
def broker_image(docker_client: docker.DockerClient) -> str:
    """The tag of the broker image, built (or found up to date) once for the module."""
    return build_image("broker", progress=print)


def test_broker_image_configuration(docker_client: docker.DockerClient, broker_image: str) -> None:
    config = docker_client.images.get(broker_image).attrs["Config"]
    assert config["Labels"][VARIANT_LABEL] == "broker"
    assert len(config["Labels"][HASH_LABEL]) == 64
    assert config["User"] == f"{OFFLOAD_UID}:{OFFLOAD_UID}"
    assert config["Entrypoint"] == ["/opt/venv/bin/python", "-m", "broker"]
    assert set(config["ExposedPorts"]) == {"7000/tcp", "8080/tcp"}
    assert set(config["Volumes"]) == {"/var/lib/edge-offload"}
    # The broker needs neither ONNX Runtime nor Docker: they are not in its image.
    modules = ("onnxruntime", "docker", "broker.server", "psycopg")
    script = f"import importlib.util as u; print([m for m in {modules} if u.find_spec(m)])"
    output = run(docker_client, broker_image, "/opt/venv/bin/python", "-c", script)
    assert output.splitlines()[-1] == "['broker.server', 'psycopg']"


def test_help_and_keygen_run_without_the_client(
    docker_client: docker.DockerClient, broker_image: str
) -> None:
    usage = docker_client.containers.run(broker_image, ["broker", "--help"], remove=True).decode()
    assert usage.startswith("usage: offload broker")
    assert "--state-dir" in usage
    key = docker_client.containers.run(broker_image, ["keygen", "alice"], remove=True).decode()
    assert key.startswith("alice.") and len(key.strip()) > 30
    with pytest.raises(docker.errors.ContainerError) as refused:
        docker_client.containers.run(broker_image, ["demo"], remove=True)
    assert refused.value.exit_status == 2
    assert b"invalid choice: 'demo'" in refused.value.stderr


def _private_for_offload(path: Path, text: str) -> None:
    path.write_text(text)
    os.chown(path, OFFLOAD_UID, OFFLOAD_UID)
    path.chmod(0o600)


@pytest.fixture
def broker_container(
    docker_client: docker.DockerClient, broker_image: str, tmp_path: Path
) -> Iterator[tuple[Cluster, Path]]:
    """A broker container on the host's network, listening; its cluster (no node yet) and its
    state directory (the volume). The container sees tmp_path at the same path (read-only), so
    node daemons are started for it exactly as for a broker process."""
    cluster = Cluster(tmp_path)
    tmp_path.chmod(0o755)
    _private_for_offload(tmp_path / "join-token", JOIN_TOKEN)
    cluster.api_keys["alice"] = "alice.secret-key-of-alice-0123456789"
    _private_for_offload(tmp_path / "api-keys", cluster.api_keys["alice"] + "\n")
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    state = tmp_path / "broker-state"
    state.mkdir(mode=0o700)
    os.chown(state, OFFLOAD_UID, OFFLOAD_UID)
    container = docker_client.containers.run(
        broker_image,
        [
            "broker", "--listen", cluster.broker_address,
            "--ops-listen", f"127.0.0.1:{cluster.ops_port}",
            "--state-dir", "/var/lib/edge-offload",
            "--cluster", str(tmp_path / "cluster.yaml"),
            "--join-token-file", str(tmp_path / "join-token"),
            "--api-keys-file", str(tmp_path / "api-keys"),
            "--heartbeat-interval", "0.2",
        ],
        detach=True,
        network_mode="host",
        volumes={
            str(tmp_path): {"bind": str(tmp_path), "mode": "ro"},
            str(state): {"bind": "/var/lib/edge-offload", "mode": "rw"},
        },
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while b"broker listening on" not in container.logs():
            container.reload()
            assert container.status == "running", container.logs().decode()[-2000:]
            assert time.monotonic() < deadline, container.logs().decode()[-2000:]
            time.sleep(0.2)
        yield cluster, state
    finally:
        container.stop(timeout=10)
        logs = container.logs().decode()
        container.remove()
    assert "Traceback" not in logs, logs[-3000:]


async def test_the_image_is_a_working_broker(broker_container: tuple[Cluster, Path]) -> None:
    cluster, state = broker_container
    try:
        await cluster.start_node(THREE_NODES[0], "process")
        async with cluster.edge("alice") as edge:
            upload = await edge.upload(modelzoo.model_path("mlp"))
            deployment = await edge.deploy(
                model_sha256=upload.sha256, model_name="mlp", site="site-a"
            )
            assert deployment.node_id == THREE_NODES[0].node_id
            await infer_once(deployment)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{cluster.ops_port}/healthz") as health,
        ):
            assert health.status == 200
    finally:
        await cluster.stop()
    database = state / "broker.sqlite3"
    assert database.stat().st_uid == OFFLOAD_UID
    assert database.stat().st_mode & 0o077 == 0
