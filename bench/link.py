"""An emulated network link: a small HTTP CONNECT proxy that delays and rate-limits what it
carries, in both directions.

`tc netem` does not work on the machines we benchmark on (no `sch_netem` module in their
kernels, no CAP_NET_ADMIN in their containers), so the offload benchmark emulates the
device's link with this proxy instead. gRPC clients use it with no code change: gRPC honours
the `grpc_proxy` environment variable (`grpc_proxy=http://HOST:PORT`) and tunnels every
channel through `CONNECT`. Each direction is a queue: a chunk read at `t` leaves the link at
`max(t, link free) + len/rate` and is delivered `delay_ms` later (one way; a round trip pays
it twice). With neither delay nor limit set (the `lan` link) and nothing queued, a chunk is
written on at once, with no queue and no timer: the proxy then costs about what any
user-space relay does (well under a millisecond for a 602 KB request on loopback), so `lan`
measures the path, not the emulator. The conditions can be changed while it runs (`set`),
in-process or by a line ``DELAY_MS RATE_MBIT`` on the control port (answered ``ok``).

    python -m bench.link [--delay-ms 50] [--rate-mbit 20]   # prints its two ports
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
"""Largest read per chunk; also the streams' buffer limit, so a large request is carried in
a few reads rather than one per 64 KiB (asyncio's default)."""


@dataclass(frozen=True, slots=True)
class Conditions:
    delay_ms: float = 0.0
    """Added one-way delay."""
    rate_mbit: float = 0.0
    """Bandwidth in Mbit/s, each direction; 0: not limited."""

    def describe(self) -> str:
        if not self.delay_ms and not self.rate_mbit:
            return "no added delay, no bandwidth limit"
        rate = f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unlimited"
        return f"+{self.delay_ms:g} ms one way, {rate}"


class DelayLink:
    """The proxy (module docstring). Start with `start()`, stop with `close()`."""

    def __init__(self, conditions: Conditions = Conditions()) -> None:
        self.conditions = conditions
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.control_port = 0

    def set(self, conditions: Conditions) -> None:
        """New conditions for every chunk read from now on."""
        self.conditions = conditions
        logger.info("link: %s", conditions.describe())

    async def start(self, host: str = "127.0.0.1") -> None:
        proxy = await asyncio.start_server(self._connect, host, 0, limit=CHUNK_BYTES)
        control = await asyncio.start_server(self._control, host, 0)
        self._servers = [proxy, control]
        self.port = proxy.sockets[0].getsockname()[1]
        self.control_port = control.sockets[0].getsockname()[1]

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                delay, rate = (float(x) for x in line.split())
                self.set(Conditions(delay, rate))
                writer.write(b"ok\n")
                await writer.drain()
        except (ValueError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, target, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
            if method != b"CONNECT":
                writer.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
                writer.close()
                return
            host, _, port = target.decode().rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(
                host.strip("[]"), int(port), limit=CHUNK_BYTES
            )
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError):
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        self._spawn(self._pump(reader, up_writer), f"link-up-{target!r}")
        self._spawn(self._pump(up_reader, writer), f"link-down-{target!r}")

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Carry one direction: read, schedule by the link's rate and delay, deliver. A chunk
        read while the link is neutral and nothing is still queued is written on directly."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        queued = 0  # chunks put and not yet written: the fast path must not overtake them
        free_at = 0.0

        async def deliver() -> None:
            nonlocal queued
            while True:
                at, data = await queue.get()
                if not data:
                    break
                if (wait := at - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                queued -= 1

        delivering = asyncio.create_task(deliver())
        try:
            while data := await reader.read(CHUNK_BYTES):
                now = loop.time()
                conditions = self.conditions
                if not (conditions.delay_ms or conditions.rate_mbit or queued):
                    free_at = now
                    writer.write(data)
                    await writer.drain()
                    continue
                if conditions.rate_mbit > 0:
                    free_at = max(now, free_at) + len(data) * 8 / (conditions.rate_mbit * 1e6)
                else:
                    free_at = max(now, free_at)
                queued += 1
                queue.put_nowait((free_at + conditions.delay_ms / 1000, data))
            queue.put_nowait((0.0, b""))  # end of stream, after what is still queued
            await delivering
        except (ConnectionError, OSError):
            pass
        finally:
            delivering.cancel()
            await asyncio.gather(delivering, return_exceptions=True)
            writer.close()


async def _serve(conditions: Conditions) -> None:
    link = DelayLink(conditions)
    await link.start()
    print(f"proxy 127.0.0.1:{link.port} control 127.0.0.1:{link.control_port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await link.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.link", description=__doc__)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--rate-mbit", type=float, default=0.0)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(Conditions(args.delay_ms, args.rate_mbit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
