"""The broker's client of one node's NodeAgent: every call with the node's secret and a
deadline, over mutual TLS when the broker has a certificate; gRPC errors become the broker's
own (they never leave this module)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from broker.errors import (
    MESSAGE_CHARS,
    NodeUnavailable,
    ReplicaFailed,
    ResourceExhausted,
    Unfit,
    client_text,
)
from broker.node_link import ReplicaResources
from common.certs import TlsIdentity
from common.replica_memory import REFUSALS
from protos.offload.v1 import node_pb2 as pb
from protos.offload.v1 import node_pb2_grpc as pb_grpc
from runtime.clients import ClientEntry
from runtime.tls import open_channel

START_TIMEOUT_S = 120.0
_REPLICA_FAULTS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
"""What a node answers when the replica itself cannot run (StartFailed: its model does not
load or it exits; a spec the node refuses)."""
CALL_TIMEOUT_S = 15.0


class NodeClient:
    def __init__(
        self, node_id: str, address: str, secret: str | None, tls: TlsIdentity | None = None
    ) -> None:
        """`secret`: the node's secret (`common.node_identity`), which its NodeAgent takes
        as the bearer token: only the node and the broker have it; None until the broker
        has seen it (a broker that restarted: the node's next heartbeat shows it), when a
        plaintext node refuses the calls. `tls`: the broker's certificate (presented to the
        node, which requires a broker certificate) and the CA the node's certificate must
        chain to; None: plaintext."""
        self.node_id = node_id
        self.address = address
        self.secret = secret
        self._channel = open_channel(address, tls)
        self._stub = pb_grpc.NodeAgentStub(self._channel)

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.secret}"),) if self.secret else ()

    async def close(self) -> None:
        await self._channel.close()

    def _error(self, action: str, err: grpc.aio.AioRpcError) -> Exception:
        """The broker's error for a failed node call. The node's details reach clients (in
        the status and the deployment's reason), so they pass through `client_text`."""
        details = client_text(err.details() or "", limit=MESSAGE_CHARS // 2, hide_addresses=True)
        message = f"node {self.node_id} could not {action}: {err.code().name} {details}"
        if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ResourceExhausted(message)
        if err.code() == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(REFUSALS):
            # The node refused the replica's spec (`common.replica_memory`): said as it is.
            return Unfit(f"{details} (node {self.node_id})")
        if err.code() in _REPLICA_FAULTS:
            return ReplicaFailed(message)
        # The node unreachable or gone mid-call, its model fetch failed, a deadline: none of
        # it says the replica cannot run, so the deployment is placed again.
        return NodeUnavailable(message)

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
        """Start a replica and return its endpoint once it is ready (the node fetches the
        model from the broker when its cache lacks it). ReplicaFailed when the replica itself
        failed (Unfit when the node refused its spec: a GPU memory share below the model's
        need, a memory limit it cannot enforce), NodeUnavailable when the node did not
        answer or could not get the model, ResourceExhausted when it lacks the GPUs.
        `background_start`: at background CPU priority until ready (node.proto,
        `ReplicaSpec.background_start`)."""
        spec = pb.ReplicaSpec(
            deployment_id=deployment_id,
            epoch=epoch,
            model_sha256=model_sha256,
            model_name=model_name,
            gpu_uuids=gpu_uuids,
            gpu_memory_mib=resources.gpu_memory_mib,
            cpus=resources.cpus,
            memory_mib=resources.memory_mib,
            priority=resources.priority,
            cpus_min=resources.cpus_min,
            cpus_max=resources.cpus_max,
            token=token,
            background_start=background_start,
        )
        try:
            reply = await self._stub.StartReplica(
                pb.StartReplicaRequest(spec=spec), metadata=self._metadata, timeout=START_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as err:
            raise self._error("start a replica", err) from err
        return reply.replica.endpoint

    async def stop_replica(self, replica_id: str, grace_ms: int) -> bool:
        """Stop a replica; False when the node does not have it (already gone)."""
        try:
            await self._stub.StopReplica(
                pb.StopReplicaRequest(replica_id=replica_id, grace_ms=grace_ms),
                metadata=self._metadata,
                timeout=CALL_TIMEOUT_S + grace_ms / 1000,
            )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise self._error(f"stop replica {replica_id}", err) from err
        return True

    async def set_replica_clients(self, replica_id: str, clients: Sequence[ClientEntry]) -> bool:
        """Replace the set of clients a replica takes (node.proto `SetReplicaClients`; the
        replica refuses a client removed from its next call on). False when the node does
        not have the replica; ReplicaFailed when it refuses a client (INVALID_ARGUMENT),
        NodeUnavailable when it does not answer."""
        request = pb.SetReplicaClientsRequest(
            replica_id=replica_id,
            clients=[
                pb.ReplicaClient(
                    client_id=c.client_id,
                    priority_class=str(c.priority_class),
                    token_sha256=c.token_sha256,
                    max_rps=c.max_rps,
                )
                for c in clients
            ],
        )
        try:
            await self._stub.SetReplicaClients(
                request, metadata=self._metadata, timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise self._error(f"set the clients of replica {replica_id}", err) from err
        return True
