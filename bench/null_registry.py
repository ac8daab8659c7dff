"""A broker that only takes heartbeats: the floor under the broker's cost per heartbeat.

Run as `python -m bench.null_registry PORT_FILE INTERVAL_MS LOST_AFTER_MS`; it listens on a
free loopback port, writes the port to PORT_FILE, and serves `offload.v1.NodeRegistry` as a
broker would on the wire: `Register` accepts any node and asks it to heartbeat every
INTERVAL_MS (its lost-after: LOST_AFTER_MS, which it never acts on), `Heartbeats` and
`Heartbeat` parse each message (grpc's deserializer, as the broker's servicer has it) and
answer it, `FetchModel` answers NOT_FOUND. It checks no token, validates nothing and keeps
nothing: what is left is what gRPC and asyncio in Python cost per heartbeat, the part of the
broker's that no change to its own code can remove. `bench.control_plane --floor` runs the
same hollow nodes against it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from bench.loopback import serve_until_stopped
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from protos.offload.v1 import node_pb2 as npb


class NullRegistry(pb_grpc.NodeRegistryServicer):
    def __init__(self, interval_ms: int, lost_after_ms: int) -> None:
        self._registered = pb.RegisterResponse(
            heartbeat_interval_ms=interval_ms, lost_after_ms=lost_after_ms
        )

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        return self._registered

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse()

    async def Heartbeats(
        self, requests: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        async for _ in requests:
            yield pb.HeartbeatResponse()

    async def FetchModel(
        self, request: pb.FetchModelRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[npb.ModelChunk]:
        await context.abort(grpc.StatusCode.NOT_FOUND, "the null registry holds no model")
        yield npb.ModelChunk()  # never reached: makes this a server-streaming handler


async def serve(port_file: Path, interval_ms: int, lost_after_ms: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_NodeRegistryServicer_to_server(NullRegistry(interval_ms, lost_after_ms), server)
    await serve_until_stopped(server, port_file)


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
