"""`bench.relay.SourceRelay`: a gRPC server reached through it sees the relay's source address,
not 127.0.0.1, and leaving the relay closes what it still relays."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.relay import SourceRelay


async def test_a_grpc_server_sees_the_relays_source_address() -> None:
    async def who(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return context.peer().encode()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Peer", {"Who": grpc.unary_unary_rpc_method_handler(who)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with (
            SourceRelay("127.0.0.1", port, "127.0.0.12") as relay,
            grpc.aio.insecure_channel(relay.address) as channel,
        ):
            peer = await channel.unary_unary("/test.Peer/Who")(b"", timeout=10)
        assert peer.decode().startswith("ipv4:127.0.0.12:"), peer
    finally:
        await server.stop(None)


async def test_leaving_the_relay_closes_the_connections_it_relays() -> None:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        await reader.read()  # until the relay goes
        writer.close()

    target = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = target.sockets[0].getsockname()[1]
    try:
        async with SourceRelay("127.0.0.1", port, "127.0.0.13") as relay:
            host, _, relay_port = relay.address.rpartition(":")
            reader, writer = await asyncio.open_connection(host, int(relay_port))
            assert await reader.readexactly(5) == b"hello"
        assert await asyncio.wait_for(reader.read(), timeout=10) == b""
        writer.close()
        await writer.wait_closed()
    finally:
        target.close()
        await target.wait_closed()


async def test_a_source_address_not_of_this_machine_is_refused_at_once() -> None:
    with pytest.raises(OSError):
        async with SourceRelay("127.0.0.1", 1, "192.0.2.1"):
            pass
