"""What the broker's domain calls a node with, as plain Python: `NodeLink` (the calls),
`ReplicaResources` (what a replica is given) and `NodeLinkFactory` (how the domain gets a
link for a node). The gRPC implementation is `broker.node_client.NodeClient`, handed to the
`Broker` by the server (`broker.server`) and by tests: the domain imports no gRPC."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from runtime.clients import ClientEntry


@dataclass(frozen=True, slots=True)
class ReplicaResources:
    """What a replica is given (node.proto `ReplicaSpec`): GPU memory share, CPU and memory
    limits, and what the node's resource manager needs to re-divide CPU (priority class,
    CPU floor and ceiling; 0: the node's defaults)."""

    gpu_memory_mib: int = 0
    cpus: float = 0.0
    memory_mib: int = 0
    priority: int = 0
    cpus_min: float = 0.0
    cpus_max: float = 0.0


class NodeLink(Protocol):
    """The broker's calls to one node's NodeAgent. Errors are the broker's own
    (`broker.errors`): ReplicaFailed, Unfit, NodeUnavailable, ResourceExhausted."""

    node_id: str
    address: str
    secret: str | None
    """The node's secret, its NodeAgent's bearer token; None until the broker has seen it."""

    async def close(self) -> None: ...

    async def start_replica(
        self,
        *,
        deployment_id: str,
        epoch: int,
        model_sha256: str,
        model_name: str,
        gpu_uuids: Sequence[str],
        resources: ReplicaResources,
        token: str,
        background_start: bool = False,
    ) -> str:
        """Start a replica; its endpoint once it is ready."""
        ...

    async def stop_replica(self, replica_id: str, grace_ms: int) -> bool:
        """Stop a replica; False when the node does not have it."""
        ...

    async def set_replica_clients(self, replica_id: str, clients: Sequence[ClientEntry]) -> bool:
        """Replace the set of clients a replica takes (idempotent; each as a line of the
        replica's clients file, `runtime.clients`); False when the node does not have the
        replica."""
        ...


class NodeLinkFactory(Protocol):
    """A link to the node `node_id` at `address`, calling with `secret` (None: not known
    yet)."""

    def __call__(self, node_id: str, address: str, secret: str | None) -> NodeLink: ...
