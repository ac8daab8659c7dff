"""A raw grpc.aio echo on loopback: the cost of moving a payload through gRPC, no more.

Run as `python -m bench.echo_server PORT_FILE`; it listens on a free loopback port, writes
the port to PORT_FILE, and answers `/bench.Echo/Echo` with as many bytes as the first 8
bytes of the request ask for (so a request and a response can differ in size, like an
inference's). No protobuf parsing on either side.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc

from bench.loopback import serve_until_stopped

METHOD = "/bench.Echo/Echo"
MAX_MESSAGE = 256 * 1024 * 1024


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return bytes(int.from_bytes(request[:8], "little"))


async def serve(port_file: Path) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
        ]
    )
    handler = grpc.unary_unary_rpc_method_handler(_echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
    )
    await serve_until_stopped(server, port_file)


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1])))
