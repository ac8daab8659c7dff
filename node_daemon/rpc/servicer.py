"""`offload.v1.NodeAgent`: thin methods over `NodeAgent`, errors mapped in one table."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from node_daemon.agent import MAX_GRACE_MS, NodeAgent, check_number
from node_daemon.errors import InvalidRequest
from node_daemon.model_cache import Upload
from node_daemon.rpc import convert
from node_daemon.rpc.status import mapped_errors
from protos.offload.v1 import node_pb2 as pb
from protos.offload.v1 import node_pb2_grpc as pb_grpc

DEFAULT_GRACE_MS = 10_000


class NodeAgentServicer(pb_grpc.NodeAgentServicer):
    def __init__(self, agent: NodeAgent) -> None:
        self._agent = agent

    @mapped_errors
    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        agent = self._agent
        return pb.DescribeResponse(
            node_id=agent.node_id,
            site=agent.site,
            inventory=convert.inventory(agent.inventory),
            runtimes=[agent.runtime.name],
            topology=agent.topology.describe(),
        )

    @mapped_errors
    async def StartReplica(
        self, request: pb.StartReplicaRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartReplicaResponse:
        view = await self._agent.start_replica(convert.start_request(request.spec))
        return pb.StartReplicaResponse(replica=convert.replica(view))

    @mapped_errors
    async def StopReplica(
        self, request: pb.StopReplicaRequest, context: grpc.aio.ServicerContext
    ) -> pb.StopReplicaResponse:
        check_number("grace_ms", request.grace_ms, 0, MAX_GRACE_MS)
        grace_ms = request.grace_ms or DEFAULT_GRACE_MS
        await self._agent.stop_replica(request.replica_id, grace_ms / 1000)
        return pb.StopReplicaResponse()

    @mapped_errors
    async def ListReplicas(
        self, request: pb.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListReplicasResponse:
        views = await self._agent.list_replicas()
        return pb.ListReplicasResponse(replicas=[convert.replica(v) for v in views])

    @mapped_errors
    async def UpdateResources(
        self, request: pb.UpdateResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateResourcesResponse:
        await self._agent.update_resources(request.replica_id, request.cpus, request.memory_mib)
        return pb.UpdateResourcesResponse()

    @mapped_errors
    async def Usage(
        self, request: pb.UsageRequest, context: grpc.aio.ServicerContext
    ) -> pb.UsageResponse:
        return convert.usage(await self._agent.recent_usage(), self._agent.resizer)

    @mapped_errors
    async def SetReplicaClients(
        self, request: pb.SetReplicaClientsRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetReplicaClientsResponse:
        await self._agent.set_replica_clients(
            request.replica_id, convert.replica_clients(request.clients)
        )
        return pb.SetReplicaClientsResponse()

    @mapped_errors
    async def PutModel(
        self, request_iterator: AsyncIterator[pb.ModelChunk], context: grpc.aio.ServicerContext
    ) -> pb.PutModelResponse:
        upload: Upload | None = None
        try:
            async for chunk in request_iterator:
                if upload is None:
                    if not chunk.sha256:
                        raise InvalidRequest("the first chunk must carry the model's sha256")
                    upload = self._agent.cache.upload(chunk.sha256)
                elif chunk.sha256 and chunk.sha256 != upload.sha256:
                    raise InvalidRequest("a later chunk declares a different sha256")
                await asyncio.to_thread(upload.write, chunk.data)
            if upload is None:
                raise InvalidRequest("the upload stream is empty")
            result = await asyncio.to_thread(upload.commit)
        except BaseException:
            if upload is not None:
                upload.abort()
            raise
        return pb.PutModelResponse(
            sha256=result.sha256, size_bytes=result.size_bytes, deduplicated=result.deduplicated
        )
