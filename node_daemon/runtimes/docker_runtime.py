"""`DockerRuntime`: each replica is a container of the runtime image.

The Docker SDK is blocking: every call here runs in `asyncio.to_thread`. `docker.errors`
never leave this module: they become `RuntimeUnavailable` or `ReplicaFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
from docker.models.containers import Container

from node_daemon.runtimes.base import (
    LABEL_PREFIX,
    LISTENING,
    Replica,
    ReplicaFailed,
    ReplicaSpec,
    RuntimeUnavailable,
    wait_ready,
)

logger = logging.getLogger(__name__)

CONTAINER_PORT = 8001
NETWORKS = ("bridge", "host")
RUNTIME_UID = 10001  # the image's `offload` user
_ENGINE_HINT = (
    "start one with `make docker-engine` (installs and starts Debian's engine, as root) or "
    "`sudo dockerd &`, or point DOCKER_HOST at a running engine"
)


def connect_docker() -> docker.DockerClient:
    """A client for the local engine; RuntimeUnavailable (saying how to get one) if none."""
    try:
        client = docker.from_env(timeout=30)
    except docker.errors.DockerException as err:
        raise RuntimeUnavailable(f"no Docker engine is reachable ({err}); {_ENGINE_HINT}") from err
    try:
        client.ping()
    except docker.errors.DockerException as err:
        client.close()
        raise RuntimeUnavailable(f"no Docker engine is reachable ({err}); {_ENGINE_HINT}") from err
    return client


@dataclass(slots=True)
class _Started:
    container: Container
    secrets: Path


class DockerRuntime:
    name = "docker"

    def __init__(self, image: str, client: docker.DockerClient, network: str = "bridge") -> None:
        """`network`: "bridge" publishes the container's port 8001 on the replica's host
        address (a port Docker picks); "host" shares the node's network namespace and the
        server binds a free port on that address itself: no Docker proxy on the data path
        (see docs/BENCHMARKS.md for what that saves), no network isolation."""
        if network not in NETWORKS:
            raise ValueError(f"unknown network {network!r}; use one of {', '.join(NETWORKS)}")
        self.image = image
        self.network = network
        self._client = client
        self._started: dict[str, _Started] = {}

    @classmethod
    def connect(cls, image: str, network: str = "bridge") -> DockerRuntime:
        """Blocking. RuntimeUnavailable when there is no engine or no such image."""
        client = connect_docker()
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound as err:
            client.close()
            raise RuntimeUnavailable(
                f"image {image} is not built here; build it with `offload image build`"
            ) from err
        return cls(image, client, network)

    async def start(self, spec: ReplicaSpec, ready_timeout_s: float = 60.0) -> Replica:
        """Start a container and return once it is ready. ReplicaFailed (exit code and log
        tail) when it exits or is not ready in time; the container is removed then."""
        if spec.replica_id in self._started:
            raise ValueError(f"replica {spec.replica_id} is already running here")
        secrets = Path(tempfile.mkdtemp(prefix=f"offload-{spec.replica_id}-"))
        token_file = secrets / "token"
        token_file.write_text(spec.token)
        if os.geteuid() == 0:
            os.chown(token_file, RUNTIME_UID, RUNTIME_UID)
            token_file.chmod(0o400)
        else:  # the directory stays private to this user on the host
            token_file.chmod(0o444)
        try:
            container = await asyncio.to_thread(self._run, spec, token_file)
        except BaseException:
            shutil.rmtree(secrets, ignore_errors=True)
            raise
        self._started[spec.replica_id] = _Started(container, secrets)
        try:
            if self.network == "host":
                endpoint = await self._logged_endpoint(container, spec.host, ready_timeout_s)
            else:
                endpoint = await asyncio.to_thread(self._published_endpoint, container, spec.host)
            await wait_ready(
                endpoint,
                spec.token,
                spec.model_name,
                ready_timeout_s,
                alive=lambda: asyncio.to_thread(self._check_alive, container),
            )
        except (ReplicaFailed, TimeoutError, docker.errors.APIError) as err:
            tail = await asyncio.to_thread(self._log_tail, container)
            await self.stop(spec.replica_id, grace_s=0)
            raise ReplicaFailed(f"replica {spec.replica_id}: {err}\n{tail}") from err
        logger.info(
            "replica=%s container=%s ready at %s", spec.replica_id, container.short_id, endpoint
        )
        return Replica(spec.replica_id, endpoint, self.name, container.id)

    def _run(self, spec: ReplicaSpec, token_file: Path) -> Container:
        command = [
            "--model", "/models/model.onnx", "--name", spec.model_name,
            *self._listen_args(spec.host),
            "--token-file", "/run/secrets/offload-token",
            "--concurrency", str(spec.concurrency),
        ]  # fmt: skip
        volumes = {
            str(spec.model_path.resolve()): {"bind": "/models/model.onnx", "mode": "ro"},
            str(token_file): {"bind": "/run/secrets/offload-token", "mode": "ro"},
        }
        if spec.warmup_inputs is not None:
            volumes[str(spec.warmup_inputs.resolve())] = {
                "bind": "/models/warmup.npz",
                "mode": "ro",
            }
            command += ["--warmup-inputs", "/models/warmup.npz"]
        labels = {f"{LABEL_PREFIX}{k}": v for k, v in spec.labels.items()}
        labels[f"{LABEL_PREFIX}replica"] = spec.replica_id
        labels[f"{LABEL_PREFIX}model"] = spec.model_name
        try:
            return self._client.containers.run(
                self.image,
                command,
                name=f"offload-{spec.replica_id}",
                detach=True,
                labels=labels,
                **self._network_kwargs(spec.host),
                volumes=volumes,
            )
        except docker.errors.ImageNotFound as err:
            raise ReplicaFailed(
                f"image {self.image} not found; build it with `offload image build`"
            ) from err
        except docker.errors.APIError as err:
            self._remove_named(f"offload-{spec.replica_id}")
            raise ReplicaFailed(f"cannot start a container of {self.image}: {err}") from err

    def _remove_named(self, name: str) -> None:
        # A container whose start failed stays in Created state: remove it.
        with contextlib.suppress(docker.errors.NotFound):
            self._client.containers.get(name).remove(force=True)

    def _listen_args(self, host: str) -> list[str]:
        if self.network == "host":
            return ["--host", host, "--port", "0"]
        return ["--host", "0.0.0.0", "--port", str(CONTAINER_PORT)]

    def _network_kwargs(self, host: str) -> dict[str, object]:
        if self.network == "host":
            return {"network_mode": "host"}
        return {"ports": {f"{CONTAINER_PORT}/tcp": (host, None)}}

    async def _logged_endpoint(self, container: Container, host: str, timeout_s: float) -> str:
        """With host networking the server picks its port and logs it; wait for that line."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            logs = await asyncio.to_thread(container.logs)
            if match := LISTENING.search(logs.decode(errors="replace")):
                return f"{host}:{match.group(1)}"
            await asyncio.to_thread(self._check_alive, container)
            await asyncio.sleep(0.02)
        raise TimeoutError(f"the replica did not listen within {timeout_s:.0f}s")

    @staticmethod
    def _published_endpoint(container: Container, host: str) -> str:
        container.reload()
        bindings = container.attrs["NetworkSettings"]["Ports"].get(f"{CONTAINER_PORT}/tcp")
        if not bindings:
            raise ReplicaFailed(f"container {container.short_id} has no published port")
        return f"{host}:{bindings[0]['HostPort']}"

    @staticmethod
    def _check_alive(container: Container) -> None:
        container.reload()
        if container.status in ("exited", "dead"):
            code = container.attrs["State"]["ExitCode"]
            raise ReplicaFailed(f"container exited with code {code}")

    @staticmethod
    def _log_tail(container: Container, lines: int = 40) -> str:
        try:
            return container.logs(tail=lines).decode(errors="replace")
        except docker.errors.APIError:
            return ""

    def log_tail(self, replica_id: str, lines: int = 40) -> str:
        """Blocking. The last `lines` lines of the replica's log ("" when it is gone)."""
        started = self._started.get(replica_id)
        return "" if started is None else self._log_tail(started.container, lines)

    async def stop(self, replica_id: str, grace_s: float = 10.0) -> int | None:
        """`docker stop` (SIGTERM, then SIGKILL after `grace_s`), then remove.

        Returns the exit code; None when no such replica runs here (idempotent).
        """
        started = self._started.pop(replica_id, None)
        if started is None:
            return None
        try:
            return await asyncio.to_thread(self._stop, started.container, grace_s)
        finally:
            shutil.rmtree(started.secrets, ignore_errors=True)

    @staticmethod
    def _stop(container: Container, grace_s: float) -> int | None:
        try:
            container.stop(timeout=max(0, round(grace_s)))
            code = container.wait(timeout=grace_s + 30)["StatusCode"]
            container.remove(force=True)
        except docker.errors.NotFound:
            return None
        return int(code)

    async def close(self) -> None:
        """Stop every replica this runtime started, then close the client."""
        for replica_id in list(self._started):
            await self.stop(replica_id)
        await asyncio.to_thread(self._client.close)
