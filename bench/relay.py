"""`SourceRelay`: a TCP relay on loopback that reaches a server from another loopback address,
so that the server tells its callers apart as it would tell real devices apart.

Every address of 127.0.0.0/8 is this machine's (on Linux), and a socket may bind any of them
as its source. A client connects to the relay (`address`, on 127.0.0.1); the relay opens its
own connection to the target from `source` (127.0.0.12, say) and copies the bytes both ways,
so the server sees the peer `ipv4:127.0.0.12:<port>`. Nothing is parsed: gRPC, TLS or
anything else passes through unchanged.

The chaos suite's deploy storm gives each of its clients one: the broker throttles failed API
key checks per address, and one address flooding bogus keys must not stand for every device.

    async with SourceRelay("127.0.0.1", port, "127.0.0.12") as relay:
        channel = grpc.aio.insecure_channel(relay.address)

Leaving the block closes the listener and every connection it relays.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from types import TracebackType

CHUNK = 64 * 1024


class SourceRelay:
    def __init__(self, target_host: str, target_port: int, source: str) -> None:
        """Relay to `target_host:target_port` from the local address `source` (a loopback
        address such as 127.0.0.12); not listening until entered."""
        self.target = (target_host, target_port)
        self.source = source
        self.address = ""
        """host:port to connect to, once entered."""
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], list[asyncio.StreamWriter]] = {}
        """Each relayed connection's task -> its two sides, once open."""

    async def __aenter__(self) -> SourceRelay:
        """OSError at once where `source` is not this machine's (loopback beyond 127.0.0.1
        is Linux's), rather than a closed connection for every call later."""
        with socket.socket() as probe:
            probe.bind((self.source, 0))
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.close()
        # Closed, not cancelled: asyncio logs a connection task that ends cancelled, and
        # closing both sides ends its copies as the peers closing them would.
        for sides in self._connections.values():
            for side in sides:
                side.close()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client's connection: until either side closes it (or the relay does)."""
        task = asyncio.current_task()
        assert task is not None
        sides = self._connections[task] = [writer]
        upstream: asyncio.StreamWriter | None = None
        try:
            up_reader, upstream = await asyncio.open_connection(
                *self.target, local_addr=(self.source, 0)
            )
            sides.append(upstream)
            # Either direction ending ends the connection: gRPC never half-closes.
            copies = [
                asyncio.create_task(_copy(reader, upstream)),
                asyncio.create_task(_copy(up_reader, writer)),
            ]
            try:
                await asyncio.wait(copies, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for copy in copies:
                    copy.cancel()
                await asyncio.gather(*copies, return_exceptions=True)
        except OSError:
            pass  # the target refused or reset: the client sees its connection closed
        finally:
            del self._connections[task]
            for side in (writer, upstream):
                if side is not None:
                    side.close()
                    with contextlib.suppress(OSError):
                        await side.wait_closed()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Bytes from `reader` to `writer` until end of stream (or a reset)."""
    with contextlib.suppress(OSError):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
