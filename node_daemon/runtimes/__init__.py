"""Where replicas run: `DockerRuntime` (a container per replica) or `ProcessRuntime` (a
subprocess per replica, where no Docker engine is reachable). Both start the same
`runtime.server` and answer with the same `Replica` handle.
"""

from node_daemon.runtimes.base import (
    Replica,
    ReplicaFailed,
    ReplicaSpec,
    RuntimeUnavailable,
    wait_ready,
)
from node_daemon.runtimes.docker_runtime import DockerRuntime
from node_daemon.runtimes.process_runtime import ProcessRuntime

__all__ = [
    "DockerRuntime",
    "ProcessRuntime",
    "Replica",
    "ReplicaFailed",
    "ReplicaSpec",
    "RuntimeUnavailable",
    "wait_ready",
]
