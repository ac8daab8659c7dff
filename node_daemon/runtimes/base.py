"""What both runtimes share and the node agent plans with: the replica spec and handle, the
`Runtime` protocol and its errors. Plain Python (no gRPC, Docker or NVML): the readiness
probe, which speaks gRPC to a replica, is `node_daemon.runtimes.readiness`."""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from common.private_files import PRIVATE_FILE
from runtime.pem import TlsIdentity

T = TypeVar("T")

LABEL_PREFIX = "offload."
# The runtime server's log line naming the port it listens on (see runtime.server).
LISTENING = re.compile(r"runtime listening on [^ ]+:(\d+)")
# ... and the one naming its metrics port, logged before that one (see runtime.server).
METRICS_SERVED = re.compile(r"metrics served at http://\S+:(\d+)/metrics")


class RuntimeUnavailable(Exception):
    """The runtime cannot be used here (no Docker engine, no image); the message says how
    to get one."""


class LimitUnavailable(Exception):
    """A limit the spec asks for cannot be enforced by this runtime here (a process
    replica's `memory_mib` where no memory cgroup can be written); `start` raises it before
    anything runs. The message says why."""


class ReplicaFailed(Exception):
    """A replica could not start or become ready; the message carries the exit code and
    the tail of its log when there is one."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One inference server to run."""

    replica_id: str
    model_path: Path
    model_name: str
    token: str
    labels: Mapping[str, str] = field(default_factory=dict)
    """Extra labels, without the `offload.` prefix (node, deployment, epoch ...)."""
    warmup_inputs: Path | None = None
    host: str = "127.0.0.1"
    """The address the replica's port is published on."""
    concurrency: int = 2
    gpu_uuids: tuple[str, ...] = ()
    """Exactly these GPUs go into the replica; empty: CPU."""
    gpu_memory_mib: int = 0
    """GPU memory share per GPU (ONNX Runtime's gpu_mem_limit); 0: no limit."""
    cpus: float = 0.0
    """CPU limit in cores; 0: none."""
    memory_mib: int = 0
    """Memory limit, MiB (the container's, or the process's memory cgroup's: RAM, swap
    included where the kernel accounts it); 0: none."""
    background: bool = False
    """Start at background CPU priority and raise it to normal once the replica is ready,
    before `start` returns (see `BACKGROUND_LIMIT_S`). For a migration's target: its start
    (imports, model load, warm-up) must not take CPU from the replica serving meanwhile.
    Raising at ready rather than at the switch costs nothing (a ready target takes no calls
    until the switch) and leaves no window in which a replica that serves could still be at
    background priority, whoever dies when: the broker needs no call to raise it."""
    tls: TlsIdentity | None = None
    """The node's certificate and key, which the replica serves TLS with (files only it and
    the node can read: `write_tls_files`), and the CA the readiness probe checks it by.
    None: the replica serves plaintext, started with `--insecure` (a container listens on
    0.0.0.0)."""
    priority: int = 0
    """The deployment's priority class as broker.proto numbers it (`PriorityClass`: 1
    best-effort, 2 standard, 3 critical; 0 unspecified, a pre-warmed standby): the class of
    the calls made with `token` inside the replica (`priority_args`)."""


PRIORITY_CLASSES = {1: "best-effort", 2: "standard", 3: "critical"}
"""broker.proto's `PriorityClass` numbers -> the runtime's `--priority-class` names
(`runtime.batching.PriorityClass`). 0, unspecified (a pre-warmed standby), is standard: a
standby promoted to serve keeps the class it started with, and standard is what a deployment
that does not say gets."""


def priority_args(spec: ReplicaSpec) -> list[str]:
    """The runtime server's `--priority-class` flag for `spec`: the class its batcher gives
    the deployment's calls."""
    return ["--priority-class", PRIORITY_CLASSES.get(spec.priority, "standard")]


def tls_args(spec: ReplicaSpec, cert_file: str, key_file: str) -> list[str]:
    """The runtime server's TLS flags for `spec`: its certificate and key files (as the
    replica sees them) when the node serves TLS, else `--insecure`: a plaintext node passes
    it, so that the replica, whatever address it listens on, starts as the node does."""
    if spec.tls is None:
        return ["--insecure"]
    return ["--tls-cert", cert_file, "--tls-key", key_file]


def write_tls_files(spec: ReplicaSpec, folder: Path) -> tuple[Path, Path] | None:
    """Write `spec`'s certificate and key into `folder` (`tls-cert.pem`, `tls-key.pem`, both
    0600 from their creation); None (nothing written) when it serves plaintext. Blocking."""
    if spec.tls is None:
        return None
    paths = folder / "tls-cert.pem", folder / "tls-key.pem"
    for path, data in zip(paths, (spec.tls.cert, spec.tls.key), strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    return paths


CLIENTS_FILE = "clients"
"""The name of a replica's clients file (`runtime.clients`) in its folder."""


def write_clients_file(
    folder: Path, text: str, mode: int = PRIVATE_FILE, owner: int | None = None
) -> None:
    """Replace `folder`/`CLIENTS_FILE` with `text` atomically: a temporary file in `folder`,
    flushed to disk with `mode` (and `owner` as its user and group, when given), renamed over
    the old one, and the folder flushed: the replica, which reads it whenever it changes,
    sees the old file or the new one, never a part, and a crash leaves one of them. Blocking.
    """
    fd, temporary = tempfile.mkstemp(prefix=f".{CLIENTS_FILE}-", dir=folder)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fchmod(out.fileno(), mode)
            if owner is not None:
                os.fchown(out.fileno(), owner, owner)
            os.fsync(out.fileno())
        os.replace(temporary, folder / CLIENTS_FILE)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@dataclass(frozen=True, slots=True)
class Replica:
    """A started (or adopted) replica. `ref` is the container id or the process id."""

    replica_id: str
    endpoint: str
    """host:port for Open Inference Protocol calls."""
    runtime: str
    ref: str
    labels: Mapping[str, str] = field(default_factory=dict)
    """The labels it was started with, without the `offload.` prefix."""
    metrics_endpoint: str = ""
    """host:port of its Prometheus metrics (`GET /metrics`, plain HTTP, no token; names in
    `runtime.metrics`); empty when it serves none (a replica adopted from a daemon older
    than this field, or one whose port could not be read)."""


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    running: bool
    exit_code: int | None = None
    """Set once it exited; None while running or when unknown (an adopted process)."""
    log_tail: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """Cumulative counters: the node turns two readings into figures over the interval
    (`node_daemon.telemetry`)."""

    cpu_seconds: float
    """CPU time the replica used since it started."""
    memory_used_mib: int
    periods: int = 0
    """CFS periods its CPU quota was enforced over (0: no quota, or not readable)."""
    throttled_periods: int = 0
    """Of those, the periods in which the quota stopped it."""
    cpu_limit: float = 0.0
    """Its CPU quota now, cores; 0 when unlimited (or not readable)."""


BACKGROUND_LIMIT_S = 20.0
"""A replica started at background priority is raised to normal after this long even if it
is not ready yet: on CPUs that the serving load keeps busy it would otherwise barely run,
and a migration whose target never starts helps nobody."""


class ResourceUpdateUnsupported(Exception):
    """This runtime cannot change a running replica's limits."""


class Runtime(Protocol):
    """What the node daemon needs of a runtime; `DockerRuntime` and `ProcessRuntime` are it.

    `start` leaves nothing running when it raises, whatever ends it (an error, a failed
    probe, `CancelledError`): it stops what it started, shielded from cancellation. `stop`
    forgets a replica only once it is gone; when stopping fails it raises `ReplicaFailed`
    and the replica stays known (`status` answers for it), so its GPUs stay held. `status`
    answers None only for a replica this runtime runs nothing of.
    """

    name: str
    reads_clients: bool
    """Whether its replicas read their clients file (False: `NullRuntime`, which runs
    nothing: a clients file it accepts has nothing to confirm)."""
    model_file_mode: int
    """The mode the node's model cache gives its files, so that this runtime's replicas can
    read them: 0600 for a replica running as the daemon's user; a container runs as the
    image's user and reads its model through a bind mount (0644, in 0700 folders)."""

    async def start(self, spec: ReplicaSpec, ready_timeout_s: float = 60.0) -> Replica: ...
    async def stop(self, replica_id: str, grace_s: float = 10.0) -> int | None: ...
    async def status(self, replica_id: str) -> ReplicaStatus | None: ...
    async def stats(self, replica_id: str) -> ReplicaStats | None: ...
    async def update(self, replica_id: str, cpus: float, memory_mib: int) -> None: ...
    async def adopt(self, selector: Mapping[str, str]) -> list[Replica]: ...
    async def write_clients(self, replica_id: str, text: str) -> bool:
        """Replace the replica's clients file (`runtime.clients`; every replica is started
        with one, empty at first) with `text`, atomically (`write_clients_file`). False when
        this runtime runs nothing of that id."""
        ...

    async def reload_clients(self, replica_id: str) -> bool:
        """Tell the replica to read its clients file again now (`runtime.clients.
        RELOAD_SIGNAL`, SIGHUP, to its process). Only for a replica whose runtime handles
        the signal (its metrics page reports a clients generation): SIGHUP's default ends a
        process. False when it could not be told (it runs nothing of that id, the process is
        gone, the engine refused: logged); the replica still reads the file within its
        poll."""
        ...

    async def detach(self) -> None: ...
    async def close(self) -> None: ...


async def uncancellable(awaitable: Awaitable[T]) -> T:
    """Await `awaitable` to its end even when the caller is cancelled meanwhile (cleanup, or
    a step whose effect must be recorded before anything else happens); a cancellation that
    arrived is raised once it is done."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return result
