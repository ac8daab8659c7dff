"""`NullRuntime`: accepts replicas without running anything, for hollow nodes
(`node_daemon.hollow`), as kubemark's hollow kubelet runs pods on a fake container runtime.

Everything above the runtime is the real node daemon: the agent validates the start, fetches
the model from the broker into its cache, allocates GPUs, records the replica STARTING, and
reports it in every heartbeat; only the process or container is missing.

Readiness. The broker never probes a replica: the node answers StartReplica once its runtime
says the replica is ready (`DockerRuntime` and `ProcessRuntime` poll ServerReady and
ModelReady with `wait_ready`), and the broker records the deployment `running` with the
endpoint in that answer. A null replica has nothing to load or warm up, so `start` returns
ready at once and makes no probe: a shared stub inference server that answered every probe
would measure gRPC channel set-up on this machine, not anything the control plane does, and
would cost the hollow process a connection per start. The endpoint reported is
`<host>:NULL_PORT`, where nothing serves inference: a client that called it would get
UNAVAILABLE, as from a replica that died. Control-plane benchmarks never call it.

Every method is in memory and never blocks; nothing survives the process, so `adopt` finds
only the replicas this runtime object itself holds (a daemon restarted in the same process).
"""

from __future__ import annotations

from collections.abc import Mapping

from common.private_files import PRIVATE_FILE
from node_daemon.runtimes.base import Replica, ReplicaSpec, ReplicaStats, ReplicaStatus

NULL_PORT = 9
"""The port null replicas are reported on: the discard service's, which nothing on a node
serves, so that no client mistakes a hollow replica for a real one."""


class NullRuntime:
    """Replicas that are ready at once and use nothing (see the module docstring)."""

    name = "null"
    reads_clients = False
    model_file_mode = PRIVATE_FILE

    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}

    @property
    def replica_ids(self) -> frozenset[str]:
        """The replicas it holds now."""
        return frozenset(self._replicas)

    async def start(self, spec: ReplicaSpec, ready_timeout_s: float = 60.0) -> Replica:
        """Record the replica and return it, ready. ValueError when it holds one with this
        id already (as `ProcessRuntime` does); `ready_timeout_s` is accepted for the
        interface and never reached."""
        if spec.replica_id in self._replicas:
            raise ValueError(f"replica {spec.replica_id} is already running here")
        replica = Replica(
            replica_id=spec.replica_id,
            endpoint=f"{spec.host}:{NULL_PORT}",
            runtime=self.name,
            ref=f"null-{spec.replica_id}",
            labels=dict(spec.labels),
        )
        self._replicas[spec.replica_id] = replica
        return replica

    async def stop(self, replica_id: str, grace_s: float = 10.0) -> int | None:
        """Forget the replica at once (nothing drains); its exit code, 0, or None when it
        held none with this id (already gone, which is not an error)."""
        return None if self._replicas.pop(replica_id, None) is None else 0

    async def status(self, replica_id: str) -> ReplicaStatus | None:
        """Running while it is held; None for a replica it holds nothing of."""
        return ReplicaStatus(running=True) if replica_id in self._replicas else None

    async def stats(self, replica_id: str) -> ReplicaStats | None:
        """Zero CPU and memory for a held replica; None otherwise."""
        if replica_id not in self._replicas:
            return None
        return ReplicaStats(cpu_seconds=0.0, memory_used_mib=0)

    async def update(self, replica_id: str, cpus: float, memory_mib: int) -> None:
        """Accept a new limit: there is nothing to limit. ValueError for an unknown replica
        (the agent checks it holds the replica before it asks)."""
        if replica_id not in self._replicas:
            raise ValueError(f"no replica {replica_id} here")

    async def adopt(self, selector: Mapping[str, str]) -> list[Replica]:
        """The held replicas whose labels include every pair of `selector`."""
        return [
            r
            for r in self._replicas.values()
            if all(r.labels.get(key) == value for key, value in selector.items())
        ]

    async def write_clients(self, replica_id: str, text: str) -> bool:
        """Accept a clients file for a held replica (nothing reads it: nothing is written);
        False for one it holds nothing of."""
        return replica_id in self._replicas

    async def reload_clients(self, replica_id: str) -> bool:
        """Nothing reads the file: whether it holds the replica."""
        return replica_id in self._replicas

    async def detach(self) -> None:
        """Nothing runs outside this object: leaving the replicas means forgetting them."""
        self._replicas.clear()

    async def close(self) -> None:
        """Stop every replica (forget them)."""
        self._replicas.clear()
