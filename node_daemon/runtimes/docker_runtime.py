"""`DockerRuntime`: each replica is a container of the runtime image.

The Docker SDK is blocking: every call here runs in `asyncio.to_thread`. `docker.errors`
never leave this module: they become `RuntimeUnavailable` or `ReplicaFailed`.

Everything needed to adopt a container after a daemon restart is in its labels
(`offload.*`): the replica id, the caller's labels, the host address and the folder of
its token on the host. The labels are set when the container is created, so a daemon killed
at any step of a start leaves a container the next one finds: one that was created but never
started is removed then; one that runs is adopted (and so listed, for the broker to claim or
stop).

A replica started with `background` is created with the lowest CPU weight
(`cpu_shares=2`, cgroup v2 `cpu.weight` 1, against 100 for its siblings, the replica serving
among them) and given the default weight back (`container.update(cpu_shares=1024)`) once
ready, or after `BACKGROUND_LIMIT_S`, before `start` returns. Its `offload.background` label
says it was started so: a daemon that adopts a running one gives it the default weight
again (idempotent), in case the daemon that started it died before it could.

A replica being stopped is put back at that lowest weight first (`stop`). The broker stops
a replica once its deployment no longer routes to it (a migration's source after the switch,
the client's ack and the straggler grace; a deleted deployment's), so its drain and exit
(the interpreter's, ONNX Runtime's teardown) yield the CPU to the replicas that serve; a
call still in flight finishes at that weight, later only where the CPU is contended. The
engine's own work on the stop (network, mounts) runs outside the container's cgroup and is
not lowered.

On a cgroup v2 host the OCI runtime converts the shares: runc from 1.3.2 (and crun from
1.23) maps 1024 to `cpu.weight` 100, the default, but runc before it (Debian 12's 1.1.5, for
one) maps it to 39, so a raised replica would weigh two fifths of a container never lowered
or of a host service. After the raise the runtime reads the container's `cpu.weight`: 39
has it ask for 2,598 shares instead, which that formula maps to 100 (Docker keeps the value,
so a later `docker update`, a CPU resize, applies it again); another value than 100 is
logged as a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
import docker.types
import requests.exceptions
from docker.models.containers import Container

from images.engine import EngineUnavailable, connect_engine
from node_daemon.runtimes import cgroup_limits, cgroups
from node_daemon.runtimes.base import (
    BACKGROUND_LIMIT_S,
    CLIENTS_FILE,
    LABEL_PREFIX,
    LISTENING,
    METRICS_SERVED,
    Replica,
    ReplicaFailed,
    ReplicaSpec,
    ReplicaStats,
    ReplicaStatus,
    RuntimeUnavailable,
    priority_args,
    tls_args,
    uncancellable,
    write_clients_file,
    write_tls_files,
)
from node_daemon.runtimes.readiness import wait_ready
from runtime.clients import RELOAD_SIGNAL, format_clients

logger = logging.getLogger(__name__)

CONTAINER_PORT = 8001
METRICS_CONTAINER_PORT = 8002
"""The runtime's Prometheus port in the container (bridge networking), published like 8001."""
NETWORKS = ("bridge", "host")
RUNTIME_UID = 10001  # the image's `offload` user
CPU_PERIOD_US = 100_000
BACKGROUND_CPU_SHARES = 2
"""Docker's smallest CPU weight (cgroup v2 cpu.weight 1)."""
NORMAL_CPU_SHARES = 1024
"""Docker's default CPU weight (cgroup v2: see the module's docstring)."""
DEFAULT_CPU_WEIGHT = 100
"""cgroup v2's default `cpu.weight`."""
LINEAR_WEIGHT_OF_NORMAL = 39
"""What runc before 1.3.2 makes of `NORMAL_CPU_SHARES`: 1 + (shares - 2) * 9999 // 262142."""
LINEAR_SHARES_FOR_DEFAULT = 2598
"""The shares that formula maps to `DEFAULT_CPU_WEIGHT`."""
# Labels this runtime owns (the caller's labels must not use them).
_OWN = ("replica", "host", "secrets", "gpu-mode", "background", "metrics-port")

SECRETS = "/run/secrets"
"""Where a container finds its token, certificate and key (mounted read-only)."""
CLIENTS_DIR = f"{SECRETS}/offload-clients"
"""Where a container finds its clients file: the folder is mounted (read-only), not the
file, so that a file renamed over the old one on the host is the one the replica reads."""


def connect_docker() -> docker.DockerClient:
    """A client for the local engine (`images.engine.connect_engine`); RuntimeUnavailable
    (saying how to get one) if none.

    Blocking. When it raises, it leaves nothing open: no client, no socket."""
    try:
        return connect_engine()
    except EngineUnavailable as err:
        raise RuntimeUnavailable(str(err)) from err


def require_images(client: docker.DockerClient, tags: Iterable[str]) -> None:
    """RuntimeUnavailable naming the first of `tags` the engine does not have."""
    for tag in tags:
        try:
            client.images.get(tag)
        except docker.errors.ImageNotFound as err:
            raise RuntimeUnavailable(
                f"image {tag} is not built here; build it with `offload image build`"
            ) from err


def weighed_parent(client: docker.DockerClient, shares: int) -> str:
    """The cgroup parent for containers that weigh `shares` together (`weigh_replicas`).
    RuntimeUnavailable when the engine's cgroup driver is not cgroupfs (systemd's wants a
    slice, which systemd manages) or the cgroup cannot be written."""
    try:
        driver = client.info().get("CgroupDriver")
    except (docker.errors.APIError, requests.exceptions.RequestException) as err:
        raise RuntimeUnavailable(f"cannot read the engine's cgroup driver: {err}") from err
    if driver != "cgroupfs":
        raise RuntimeUnavailable(
            f"a CPU weight for the replicas needs the engine's cgroupfs cgroup driver; this "
            f"engine uses {str(driver)[:40]!r}"
        )
    try:
        group = cgroup_limits.weigh_replicas(shares)
    except cgroup_limits.CgroupUnavailable as err:
        raise RuntimeUnavailable(str(err)) from err
    logger.info("replicas' containers go in cgroup %s, CPU weight %d shares", group, shares)
    return f"/{cgroup_limits.REPLICAS_PARENT}"


@dataclass(slots=True)
class _Started:
    container: Container
    secrets: Path
    replica: Replica | None = None


class DockerRuntime:
    name = "docker"
    reads_clients = True
    model_file_mode = 0o644  # the image's user reads it through a bind mount

    def __init__(
        self,
        image: str,
        client: docker.DockerClient,
        network: str = "bridge",
        gpu_image: str | None = None,
        cpuset: str = "",
        cgroup_parent: str = "",
    ) -> None:
        """`network`: "bridge" publishes the container's port 8001 on the replica's host
        address (a port Docker picks); "host" shares the node's network namespace and the
        server binds a free port on that address itself: no Docker proxy on the data path
        (see docs/BENCHMARKS.md for what that saves), no network isolation.
        `gpu_image` (the cuda variant) runs replicas that get GPUs, when the engine has the
        NVIDIA runtime; otherwise they run `image` on the CPU, and a warning says so.
        `cpuset`: the CPUs every replica runs on ("0-3,8"; empty: any). `cgroup_parent`:
        the cgroup the engine creates each container under (empty: the engine's default,
        `docker`); `connect` makes it with `replica_shares`."""
        if network not in NETWORKS:
            raise ValueError(f"unknown network {network!r}; use one of {', '.join(NETWORKS)}")
        self.image = image
        self.gpu_image = gpu_image
        self.network = network
        self.cpuset = cpuset
        self.cgroup_parent = cgroup_parent
        self.cgroup_root = cgroups.ROOT
        """Where the cgroup file system is mounted (tests point it elsewhere)."""
        self._client = client
        self._started: dict[str, _Started] = {}
        self._nvidia: bool | None = None
        self._warned_no_nvidia = False

    @classmethod
    def connect(
        cls,
        image: str,
        network: str = "bridge",
        gpu_image: str | None = None,
        cpuset: str = "",
        replica_shares: int = 0,
    ) -> DockerRuntime:
        """Blocking. RuntimeUnavailable when there is no engine or no such image, or when
        `replica_shares` (a CPU weight for all replicas together, v1 `cpu.shares` units; 0:
        none, the engine's `docker` group) cannot be had: the engine must use the cgroupfs
        driver and run on this host, the daemon as root."""
        client = connect_docker()
        try:
            require_images(client, filter(None, (image, gpu_image)))
            cgroup_parent = weighed_parent(client, replica_shares) if replica_shares else ""
        except RuntimeUnavailable:
            client.close()
            raise
        return cls(image, client, network, gpu_image, cpuset, cgroup_parent)

    def _engine_has_nvidia(self) -> bool:
        if self._nvidia is None:
            self._nvidia = "nvidia" in (self._client.info().get("Runtimes") or {})
        return self._nvidia

    async def start(self, spec: ReplicaSpec, ready_timeout_s: float = 60.0) -> Replica:
        """Start a container and return once it is ready. ReplicaFailed (exit code and log
        tail) when it exits or is not ready in time. On any exception, cancellation
        included, the container is removed first (see `Runtime`)."""
        if spec.replica_id in self._started:
            raise ValueError(f"replica {spec.replica_id} is already running here")
        if clash := set(spec.labels) & set(_OWN):
            raise ValueError(f"labels {sorted(clash)} are the runtime's own")
        secrets = Path(tempfile.mkdtemp(prefix=f"offload-{spec.replica_id}-"))
        try:
            await uncancellable(self._create(spec, secrets))
            container = self._started[spec.replica_id].container
            lowered = time.monotonic() if spec.background else None

            async def alive() -> None:
                nonlocal lowered
                if lowered is not None and time.monotonic() - lowered > BACKGROUND_LIMIT_S:
                    logger.warning(
                        "replica=%s not ready after %.0fs at background priority: raising it",
                        spec.replica_id,
                        BACKGROUND_LIMIT_S,
                    )
                    await self._raise(spec.replica_id, container)
                    lowered = None
                await asyncio.to_thread(self._check_alive, container)

            endpoint = await self._endpoint(container, spec.host, ready_timeout_s)
            await wait_ready(
                endpoint, spec.token, spec.model_name, ready_timeout_s, alive=alive, tls=spec.tls
            )
            if lowered is not None:
                await self._raise(spec.replica_id, container)
                logger.info(
                    "replica=%s back at normal priority (ready) after %.2fs",
                    spec.replica_id,
                    time.monotonic() - lowered,
                )
        except BaseException as err:
            tail = await uncancellable(self._discard(spec.replica_id, secrets))
            if isinstance(err, ReplicaFailed | TimeoutError | docker.errors.APIError):
                raise ReplicaFailed(f"replica {spec.replica_id}: {err}\n{tail}") from err
            raise
        metrics_endpoint = await self._metrics_endpoint(container, spec.host)
        logger.info(
            "replica=%s container=%s ready at %s (metrics %s)",
            spec.replica_id,
            container.short_id,
            endpoint,
            metrics_endpoint or "-",
        )
        replica = Replica(
            spec.replica_id,
            endpoint,
            self.name,
            container.id,
            dict(spec.labels),
            metrics_endpoint,
        )
        self._started[spec.replica_id].replica = replica
        return replica

    async def _create(self, spec: ReplicaSpec, secrets: Path) -> None:
        """Write the token and an empty clients file, run the container, and track it."""
        token_file = secrets / "token"
        token_file.write_text(spec.token)
        if os.geteuid() == 0:
            os.chown(token_file, RUNTIME_UID, RUNTIME_UID)
            token_file.chmod(0o400)
        else:  # the directory stays private to this user on the host
            token_file.chmod(0o444)
        for path in write_tls_files(spec, secrets) or ():
            if os.geteuid() == 0:  # as the token: readable by the runtime's user only
                os.chown(path, RUNTIME_UID, RUNTIME_UID)
                path.chmod(0o400)
            else:
                path.chmod(0o444)
        await asyncio.to_thread(self._write_clients, secrets, format_clients(()))
        container = await asyncio.to_thread(self._run, spec, secrets)
        self._started[spec.replica_id] = _Started(container, secrets)

    async def _discard(self, replica_id: str, secrets: Path) -> str:
        """After a failed start: remove the container if there is one (returns its log
        tail), else the token folder. ReplicaFailed when removing fails (it stays tracked)."""
        started = self._started.get(replica_id)
        if started is None:
            shutil.rmtree(secrets, ignore_errors=True)
            return ""
        tail = await asyncio.to_thread(self._log_tail, started.container)
        await self.stop(replica_id, grace_s=0)
        return tail

    async def _raise(self, replica_id: str, container: Container) -> None:
        """The default CPU weight again. ReplicaFailed when the engine refuses: a replica
        must not serve at background priority."""
        try:
            await asyncio.to_thread(container.update, cpu_shares=NORMAL_CPU_SHARES)
        except (docker.errors.APIError, requests.exceptions.RequestException) as err:
            raise ReplicaFailed(
                f"cannot raise replica {replica_id} from background priority: {err}"
            ) from err
        if cgroups.unified(self.cgroup_root):
            await asyncio.to_thread(self._default_weight, replica_id, container)

    def _default_weight(self, replica_id: str, container: Container) -> None:
        """On cgroup v2: the default `cpu.weight` for a raised replica whatever the OCI
        runtime's conversion (the module's docstring); a warning when it cannot be had."""
        try:
            container.reload()
            pid = int(container.attrs["State"]["Pid"])
            weight = cgroups.cpu_weight(pid, self.cgroup_root)
            if weight == LINEAR_WEIGHT_OF_NORMAL:
                container.update(cpu_shares=LINEAR_SHARES_FOR_DEFAULT)
                weight = cgroups.cpu_weight(pid, self.cgroup_root)
        except (docker.errors.APIError, requests.exceptions.RequestException) as err:
            logger.warning("replica=%s: cannot check its CPU weight: %s", replica_id, err)
            return
        if weight is not None and weight != DEFAULT_CPU_WEIGHT:
            logger.warning(
                "replica=%s runs at cgroup v2 cpu.weight %d, not the default %d: the OCI "
                "runtime converts Docker's CPU shares in a way this daemon does not know",
                replica_id,
                weight,
                DEFAULT_CPU_WEIGHT,
            )

    def _run(self, spec: ReplicaSpec, secrets: Path) -> Container:
        image = self.image
        gpu_mode = "none"
        kwargs: dict[str, object] = {}
        if spec.gpu_uuids:
            if self._engine_has_nvidia():
                gpu_mode = "device-request"
                image = self.gpu_image or self.image
                kwargs["device_requests"] = [
                    docker.types.DeviceRequest(
                        driver="nvidia", device_ids=list(spec.gpu_uuids), capabilities=[["gpu"]]
                    )
                ]
            else:
                gpu_mode = "cpu-fallback"
                log = logger.warning if not self._warned_no_nvidia else logger.info
                self._warned_no_nvidia = True
                log(
                    "replica=%s: the engine has no NVIDIA runtime; starting on the CPU "
                    "(intended GPUs %s recorded in its labels)",
                    spec.replica_id,
                    ",".join(spec.gpu_uuids),
                )
        command = [
            "--model", "/models/model.onnx", "--name", spec.model_name,
            *self._listen_args(spec.host),
            "--token-file", "/run/secrets/offload-token",
            "--concurrency", str(spec.concurrency),
            *tls_args(spec, f"{SECRETS}/offload-tls-cert.pem", f"{SECRETS}/offload-tls-key.pem"),
            "--clients-file", f"{CLIENTS_DIR}/{CLIENTS_FILE}",
            *priority_args(spec),
        ]  # fmt: skip
        if spec.gpu_memory_mib and gpu_mode == "device-request":
            command += ["--gpu-mem-limit-mib", str(spec.gpu_memory_mib)]
        volumes = {
            str(spec.model_path.resolve()): {"bind": "/models/model.onnx", "mode": "ro"},
            str(secrets / "token"): {"bind": "/run/secrets/offload-token", "mode": "ro"},
            str(secrets / CLIENTS_FILE): {"bind": CLIENTS_DIR, "mode": "ro"},
        }
        if spec.tls is not None:
            for name in ("tls-cert.pem", "tls-key.pem"):
                volumes[str(secrets / name)] = {
                    "bind": f"/run/secrets/offload-{name}",
                    "mode": "ro",
                }
        if spec.warmup_inputs is not None:
            volumes[str(spec.warmup_inputs.resolve())] = {
                "bind": "/models/warmup.npz",
                "mode": "ro",
            }
            command += ["--warmup-inputs", "/models/warmup.npz"]
        labels = {f"{LABEL_PREFIX}{k}": v for k, v in spec.labels.items()}
        labels |= {
            f"{LABEL_PREFIX}replica": spec.replica_id,
            f"{LABEL_PREFIX}host": spec.host,
            f"{LABEL_PREFIX}secrets": str(secrets),
            f"{LABEL_PREFIX}gpu-mode": gpu_mode,
            # What --metrics-port the runtime was given: an adopting daemon looks for it.
            f"{LABEL_PREFIX}metrics-port": self._metrics_port_arg(),
        }
        if spec.background:
            labels[f"{LABEL_PREFIX}background"] = "1"
            kwargs["cpu_shares"] = BACKGROUND_CPU_SHARES
        if spec.cpus > 0:
            kwargs |= {"cpu_period": CPU_PERIOD_US, "cpu_quota": int(spec.cpus * CPU_PERIOD_US)}
        if spec.memory_mib > 0:
            kwargs |= {"mem_limit": f"{spec.memory_mib}m", "memswap_limit": f"{spec.memory_mib}m"}
        if self.cpuset:
            kwargs["cpuset_cpus"] = self.cpuset
        if self.cgroup_parent:
            kwargs["cgroup_parent"] = self.cgroup_parent
        name = f"offload-{spec.replica_id}"
        try:
            return self._client.containers.run(
                image,
                command,
                name=name,
                detach=True,
                labels=labels,
                volumes=volumes,
                **self._network_kwargs(spec.host),
                **kwargs,
            )
        except docker.errors.ImageNotFound as err:
            raise ReplicaFailed(
                f"image {image} not found; build it with `offload image build`"
            ) from err
        except docker.errors.APIError as err:
            # A container whose start failed (a GPU device request, say) stays Created.
            with contextlib.suppress(docker.errors.NotFound):
                self._client.containers.get(name).remove(force=True)
            raise ReplicaFailed(f"cannot start a container of {image}: {err}") from err

    def _listen_args(self, host: str) -> list[str]:
        metrics = ["--metrics-port", self._metrics_port_arg()]
        if self.network == "host":
            return ["--host", host, "--port", "0", *metrics]
        return ["--host", "0.0.0.0", "--port", str(CONTAINER_PORT), *metrics]

    def _metrics_port_arg(self) -> str:
        return "0" if self.network == "host" else str(METRICS_CONTAINER_PORT)

    def _network_kwargs(self, host: str) -> dict[str, object]:
        if self.network == "host":
            return {"network_mode": "host"}
        return {
            "ports": {
                f"{CONTAINER_PORT}/tcp": (host, None),
                f"{METRICS_CONTAINER_PORT}/tcp": (host, None),
            }
        }

    async def _endpoint(self, container: Container, host: str, timeout_s: float) -> str:
        """host:port of the replica: the published port (bridge), or the port the server
        logs (host networking: it picks a free one)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            await asyncio.to_thread(container.reload)
            if container.attrs["HostConfig"]["NetworkMode"] != "host":
                bindings = container.attrs["NetworkSettings"]["Ports"].get(f"{CONTAINER_PORT}/tcp")
                if not bindings:
                    raise ReplicaFailed(f"container {container.short_id} has no published port")
                return f"{host}:{bindings[0]['HostPort']}"
            logs = await asyncio.to_thread(container.logs)
            if match := LISTENING.search(logs.decode(errors="replace")):
                return f"{host}:{match.group(1)}"
            await asyncio.to_thread(self._check_alive, container)
            await asyncio.sleep(0.02)
        raise TimeoutError(f"the replica did not listen within {timeout_s:.0f}s")

    @staticmethod
    async def _metrics_endpoint(container: Container, host: str) -> str:
        """host:port of the replica's metrics: the published port (bridge), or the port the
        server logs (host networking); empty when there is none. Call it once `_endpoint`
        answered: the attributes it read are fresh, and the server logs its metrics port
        before its gRPC one."""
        if container.attrs["HostConfig"]["NetworkMode"] != "host":
            ports = container.attrs["NetworkSettings"]["Ports"] or {}
            bindings = ports.get(f"{METRICS_CONTAINER_PORT}/tcp")
            return f"{host}:{bindings[0]['HostPort']}" if bindings else ""
        logs = await asyncio.to_thread(container.logs)
        match = METRICS_SERVED.search(logs.decode(errors="replace"))
        return f"{host}:{match.group(1)}" if match else ""

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

    async def adopt(self, selector: Mapping[str, str]) -> list[Replica]:
        """Take over the containers (running or exited) whose labels include `selector`,
        e.g. {"node": node_id}: they keep serving through a daemon restart."""
        filters = {"label": [f"{LABEL_PREFIX}{k}={v}" for k, v in selector.items()]}
        try:
            containers = await asyncio.to_thread(
                self._client.containers.list, all=True, filters=filters
            )
        except docker.errors.APIError as err:
            raise RuntimeUnavailable(f"cannot list containers: {err}") from err
        adopted = []
        for container in containers:
            labels = {
                k.removeprefix(LABEL_PREFIX): v
                for k, v in container.labels.items()
                if k.startswith(LABEL_PREFIX)
            }
            replica_id = labels.get("replica")
            if not replica_id or replica_id in self._started:
                continue
            started = _Started(container, Path(labels.get("secrets", "")))
            self._started[replica_id] = started
            if container.status == "created":
                logger.warning(
                    "replica=%s container=%s was created but never started (its start was "
                    "cut short): removing it",
                    replica_id,
                    container.short_id,
                )
                try:
                    await self.stop(replica_id, grace_s=0)
                    continue
                except ReplicaFailed as err:  # adopted as it is: listed, so reconciled
                    logger.error("replica=%s: %s", replica_id, err)
            endpoint = metrics_endpoint = ""
            if container.status == "running":
                if labels.get("background") == "1":
                    try:  # its daemon may have died before it raised it
                        await self._raise(replica_id, container)
                    except ReplicaFailed as err:
                        logger.error("replica=%s: %s", replica_id, err)
                try:
                    endpoint = await self._endpoint(container, labels.get("host", ""), 5.0)
                except (ReplicaFailed, TimeoutError) as err:
                    logger.warning("replica=%s adopted without an endpoint: %s", replica_id, err)
                # Containers started before the metrics port have no such label (and none).
                if endpoint and "metrics-port" in labels:
                    metrics_endpoint = await self._metrics_endpoint(
                        container, labels.get("host", "")
                    )
            caller_labels = {k: v for k, v in labels.items() if k not in _OWN}
            started.replica = Replica(
                replica_id, endpoint, self.name, container.id, caller_labels, metrics_endpoint
            )
            adopted.append(started.replica)
            logger.info(
                "replica=%s container=%s adopted (%s) at %s",
                replica_id,
                container.short_id,
                container.status,
                endpoint or "-",
            )
        return adopted

    async def status(self, replica_id: str) -> ReplicaStatus | None:
        """Running or not, with the exit code and log tail once it exited; None if unknown."""
        started = self._started.get(replica_id)
        if started is None:
            return None
        try:
            await asyncio.to_thread(started.container.reload)
        except docker.errors.NotFound:
            return ReplicaStatus(False, None, "the container was removed outside the daemon")
        except docker.errors.APIError as err:  # the engine does not answer: assume it runs
            logger.warning("replica=%s: cannot read its container's state: %s", replica_id, err)
            return ReplicaStatus(running=True)
        # Paused (`docker pause`: frozen, as a SIGSTOPped process replica) is not dead: it
        # keeps its GPUs and serves again once unpaused.
        if started.container.status in ("running", "created", "restarting", "paused"):
            return ReplicaStatus(running=True)
        code = started.container.attrs["State"]["ExitCode"]
        tail = await asyncio.to_thread(self._log_tail, started.container)
        return ReplicaStatus(False, int(code), tail)

    async def stats(self, replica_id: str) -> ReplicaStats | None:
        """CPU time, throttling, quota and memory, from the container's cgroup when this
        daemon sees it (microseconds), else from one Docker stats sample (about half a
        second); None when not running."""
        started = self._started.get(replica_id)
        if started is None:
            return None
        pid = started.container.attrs.get("State", {}).get("Pid") or 0
        if pid > 0 and (read := _cgroup_stats(pid, started.container.id)) is not None:
            return read
        try:
            sample = await asyncio.to_thread(started.container.stats, stream=False, one_shot=True)
            await asyncio.to_thread(started.container.reload)
        except (docker.errors.APIError, requests.exceptions.RequestException):
            return None  # e.g. removed meanwhile: the engine answers an empty sample
        return _stats_from(sample, started.container.attrs.get("HostConfig", {}))

    async def update(self, replica_id: str, cpus: float, memory_mib: int) -> None:
        """Change a running container's CPU (cores) and memory limits; 0 leaves one as is.
        KeyError when no such replica runs here."""
        started = self._started[replica_id]
        kwargs: dict[str, object] = {}
        if cpus > 0:
            kwargs |= {"cpu_period": CPU_PERIOD_US, "cpu_quota": int(cpus * CPU_PERIOD_US)}
        if memory_mib > 0:
            kwargs |= {"mem_limit": f"{memory_mib}m", "memswap_limit": f"{memory_mib}m"}
        try:
            await asyncio.to_thread(started.container.update, **kwargs)
        except docker.errors.APIError as err:
            raise ReplicaFailed(f"cannot update replica {replica_id}: {err}") from err

    async def write_clients(self, replica_id: str, text: str) -> bool:
        """Replace the clients file in the container's clients folder (its own secrets
        folder's, mounted at `CLIENTS_DIR`); False for a replica it runs nothing of. A
        container adopted from a daemon that predates clients files has none mounted and
        does not read it."""
        started = self._started.get(replica_id)
        if started is None or not started.secrets.name.startswith("offload-"):
            return False
        await asyncio.to_thread(self._write_clients, started.secrets, text)
        return True

    async def reload_clients(self, replica_id: str) -> bool:
        """SIGHUP to the container's main process, the runtime (the engine's kill with that
        signal; see `Runtime.reload_clients`); False when it runs nothing of that id or the
        engine refuses (logged)."""
        started = self._started.get(replica_id)
        if started is None:
            return False
        try:
            await asyncio.to_thread(started.container.kill, signal=RELOAD_SIGNAL.name)
        except (docker.errors.APIError, requests.exceptions.RequestException) as err:
            logger.warning("replica=%s: cannot signal it to read its clients: %s", replica_id, err)
            return False
        return True

    @staticmethod
    def _write_clients(secrets: Path, text: str) -> None:
        """Write `secrets`' clients file (and its folder, the first time). As the token: the
        runtime's user's own (0700 folder, 0600 file) when the daemon is root, else readable
        by all (0755, 0644) inside the secrets folder, which stays private to this user on
        the host. Blocking."""
        folder = secrets / CLIENTS_FILE
        root = os.geteuid() == 0
        if not folder.is_dir():
            folder.mkdir()
            if root:
                os.chown(folder, RUNTIME_UID, RUNTIME_UID)
            folder.chmod(0o700 if root else 0o755)
        if root:
            write_clients_file(folder, text, 0o600, RUNTIME_UID)
        else:
            write_clients_file(folder, text, 0o644)

    async def stop(self, replica_id: str, grace_s: float = 10.0) -> int | None:
        """`docker stop` (SIGTERM, then SIGKILL after `grace_s`), then remove.

        Returns the exit code; None when no such replica runs here (idempotent).
        ReplicaFailed when the engine fails to stop or remove it: it stays tracked.
        """
        started = self._started.get(replica_id)
        if started is None:
            return None
        try:
            code = await asyncio.to_thread(self._stop, started.container, grace_s)
        except (docker.errors.APIError, requests.exceptions.RequestException) as err:
            raise ReplicaFailed(f"cannot stop replica {replica_id}: {err}") from err
        self._started.pop(replica_id, None)
        if started.secrets.name.startswith("offload-"):
            shutil.rmtree(started.secrets, ignore_errors=True)
        return code

    @staticmethod
    def _stop(container: Container, grace_s: float) -> int | None:
        try:
            # Lowered first: its drain and exit yield the CPU to the replicas that serve.
            # A refusal is no reason not to stop it (NotFound: the stop below says so).
            with contextlib.suppress(docker.errors.APIError):
                container.update(cpu_shares=BACKGROUND_CPU_SHARES)
            container.stop(timeout=max(0, round(grace_s)))
            code = container.wait(timeout=grace_s + 30)["StatusCode"]
            container.remove(force=True)
        except docker.errors.NotFound:
            return None
        return int(code)

    async def close(self) -> None:
        """Stop every replica this runtime runs (one that will not stop is logged), then
        close the client."""
        for replica_id in list(self._started):
            try:
                await self.stop(replica_id)
            except ReplicaFailed as err:
                logger.error("replica=%s: %s", replica_id, err)
        await asyncio.to_thread(self._client.close)

    async def detach(self) -> None:
        """Forget every replica without stopping it (they keep serving, to be adopted by the
        next daemon), then close the client."""
        self._started.clear()
        await asyncio.to_thread(self._client.close)


def _cgroup_stats(pid: int, container_id: str | None) -> ReplicaStats | None:
    """From the container's cgroup files; None when they are not visible here. A pid is
    trusted only while its cgroup names the container: a daemon in another pid namespace
    would see another process under that number (and its cgroup paths name no container)."""
    dirs = cgroups.cgroup_dirs(pid)
    if not container_id or not any(container_id in str(d) for d in dirs.values()):
        return None
    cpu = cgroups.cpu_accounting(pid)
    memory = cgroups.memory_used_mib(pid)
    if cpu is None or cpu.cpu_seconds is None or memory is None:
        return None
    return ReplicaStats(
        cpu_seconds=cpu.cpu_seconds,
        memory_used_mib=memory,
        periods=cpu.periods,
        throttled_periods=cpu.throttled_periods,
        cpu_limit=cpu.limit_cores,
    )


def _stats_from(sample: Mapping, host_config: Mapping) -> ReplicaStats:
    cpu = sample.get("cpu_stats", {})
    throttling = cpu.get("throttling_data", {})
    memory = sample.get("memory_stats", {})
    stats = memory.get("stats", {})
    # Page cache the kernel can drop: "inactive_file" (cgroup v2), "total_inactive_file" (v1).
    used = memory.get("usage", 0) - stats.get("inactive_file", stats.get("total_inactive_file", 0))
    quota, period = host_config.get("CpuQuota") or 0, host_config.get("CpuPeriod") or 0
    nano = host_config.get("NanoCpus") or 0
    return ReplicaStats(
        cpu_seconds=cpu.get("cpu_usage", {}).get("total_usage", 0) / 1e9,
        memory_used_mib=max(0, used) >> 20,
        periods=throttling.get("periods", 0),
        throttled_periods=throttling.get("throttled_periods", 0),
        cpu_limit=quota / period if quota > 0 and period > 0 else nano / 1e9,
    )
