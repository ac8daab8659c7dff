"""`bench.link`, the emulated link of `bench.offload`: an HTTP CONNECT proxy that carries bytes
unchanged, in order, both ways, whatever its conditions, and refuses anything but CONNECT."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator

from bench.link import Conditions, DelayLink

PAYLOAD = os.urandom(602_112)  # the CNN's request: 1x3x224x224 FP32


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[int]:
    """A TCP server that sends back what it reads; its port."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def running_link() -> AsyncIterator[DelayLink]:
    link = DelayLink()
    await link.start()
    try:
        yield link
    finally:
        await link.close()


async def tunnel(link: DelayLink, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    writer.write(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return reader, writer


async def test_bytes_pass_unchanged_and_in_order_whatever_the_conditions() -> None:
    async with echo_server() as port, running_link() as link:
        reader, writer = await tunnel(link, port)
        try:
            # Neutral (written on directly), delayed and rate-limited (queued), neutral again:
            # every byte comes back, in order.
            for conditions in (Conditions(), Conditions(5.0, 200.0), Conditions()):
                link.set(conditions)
                writer.write(PAYLOAD)
                await writer.drain()
                assert await reader.readexactly(len(PAYLOAD)) == PAYLOAD
        finally:
            writer.close()
            await writer.wait_closed()


async def test_chunks_queued_by_a_delay_are_not_overtaken_once_the_link_turns_neutral() -> None:
    # The proxy in its own process (`python -m bench.link`, as a user starts it), so that it
    # reads the first payload while it is still delayed, not after this test's next step.
    async with echo_server() as port:
        proxy = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.link", "--delay-ms", "200", stdout=PIPE
        )
        try:
            assert proxy.stdout is not None
            words = (await proxy.stdout.readline()).decode().split()
            link_port, control_port = (int(w.rpartition(":")[2]) for w in (words[1], words[3]))
            reader, writer = await asyncio.open_connection("127.0.0.1", link_port)
            writer.write(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            writer.write(PAYLOAD)
            await writer.drain()
            control_reader, control = await asyncio.open_connection("127.0.0.1", control_port)
            control.write(b"0 0\n")
            assert await control_reader.readline() == b"ok\n"
            writer.write(PAYLOAD[::-1])
            await writer.drain()
            assert await reader.readexactly(2 * len(PAYLOAD)) == PAYLOAD + PAYLOAD[::-1]
            for w in (writer, control):
                w.close()
                await w.wait_closed()
        finally:
            proxy.terminate()
            await proxy.wait()


async def test_the_control_port_sets_the_conditions() -> None:
    async with running_link() as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.control_port)
        writer.write(b"100 10\n")
        assert await reader.readline() == b"ok\n"
        writer.close()
        await writer.wait_closed()
        assert link.conditions == Conditions(delay_ms=100.0, rate_mbit=10.0)


async def test_anything_but_connect_is_refused() -> None:
    async with echo_server() as port, running_link() as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        answer = await reader.read()  # and the proxy closes the connection
        writer.close()
        await writer.wait_closed()
        assert answer.startswith(b"HTTP/1.1 405")
