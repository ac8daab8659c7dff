"""A raw grpc.aio echo on loopback: the cost of moving a payload through gRPC, no more.

Run as `python -m bench.echo_server PORT_FILE [RESPONSE_FILE]`; it listens on a free
loopback port, writes the port to PORT_FILE, and answers `/bench.Echo/Echo` with as many
bytes as the first 8 bytes of the request ask for (so a request and a response can differ in
size, like an inference's). No protobuf parsing on either side. `/bench.Echo/EchoAfter`
answers the same after waiting as many microseconds as the next 8 bytes ask for, as a
server computing that long would (`bench.loopback_stall`).

With RESPONSE_FILE it also answers the Open Inference Protocol's ModelInfer
(`FLOOR_METHOD`) with that file's bytes, whatever the request: a serialized
ModelInferResponse, so that a real client (tritonclient) can call it like a model server.
That is the floor of a KServe-v2 server in Python: the client's own work and the call's
metadata included, the server's parsing, checks and inference left out (`bench.peers`'s
`floor` contender).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from bench.loopback import serve_until_stopped

METHOD = "/bench.Echo/Echo"
AFTER_METHOD = "/bench.Echo/EchoAfter"
FLOOR_SERVICE = "inference.GRPCInferenceService"
FLOOR_METHOD = f"/{FLOOR_SERVICE}/ModelInfer"
MAX_MESSAGE = 256 * 1024 * 1024


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return bytes(int.from_bytes(request[:8], "little"))


async def _echo_after(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await asyncio.sleep(int.from_bytes(request[8:16], "little") / 1e6)
    return await _echo(request, context)


def _answering(response: bytes) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
    """A handler that answers any request with `response`."""

    async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return response

    return answer


async def serve(port_file: Path, response: bytes | None = None) -> None:
    """Serve the echo, and ModelInfer answered with `response` when given."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
        ]
    )
    echoes = {
        "Echo": grpc.unary_unary_rpc_method_handler(_echo),
        "EchoAfter": grpc.unary_unary_rpc_method_handler(_echo_after),
    }
    handlers = [grpc.method_handlers_generic_handler("bench.Echo", echoes)]
    if response is not None:
        floor = grpc.unary_unary_rpc_method_handler(_answering(response))
        handlers.append(grpc.method_handlers_generic_handler(FLOOR_SERVICE, {"ModelInfer": floor}))
    server.add_generic_rpc_handlers(handlers)
    await serve_until_stopped(server, port_file)


if __name__ == "__main__":
    floor = Path(sys.argv[2]).read_bytes() if len(sys.argv) > 2 else None
    asyncio.run(serve(Path(sys.argv[1]), floor))
