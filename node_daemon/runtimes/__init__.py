"""Where replicas run: `DockerRuntime` (a container per replica) or `ProcessRuntime` (a
subprocess per replica, where no Docker engine is reachable). Both start the same
`runtime.server`, answer with the same `Replica` handle, and share one interface: start,
stop, status, stats, update, adopt (after a daemon restart), detach, close.
"""

from node_daemon.runtimes.base import (
    LimitUnavailable,
    Replica,
    ReplicaFailed,
    ReplicaSpec,
    ReplicaStats,
    ReplicaStatus,
    ResourceUpdateUnsupported,
    Runtime,
    RuntimeUnavailable,
    uncancellable,
)
from node_daemon.runtimes.docker_runtime import DockerRuntime
from node_daemon.runtimes.process_runtime import ProcessRuntime
from node_daemon.runtimes.readiness import wait_ready

__all__ = [
    "DockerRuntime",
    "LimitUnavailable",
    "ProcessRuntime",
    "Replica",
    "ReplicaFailed",
    "ReplicaSpec",
    "ReplicaStats",
    "ReplicaStatus",
    "ResourceUpdateUnsupported",
    "Runtime",
    "RuntimeUnavailable",
    "uncancellable",
    "wait_ready",
]
