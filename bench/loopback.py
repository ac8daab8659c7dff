"""The benches' helper servers on loopback: a module run as `python -m module PORT_FILE ...`
listens on a free port and writes it to PORT_FILE (`serve_until_stopped`); the bench starts
it and learns its address (`loopback_server`). Used by `bench.echo_server` and
`bench.null_registry`; free of our protobuf code, as `bench.timing` is.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc


async def serve_until_stopped(server: grpc.aio.Server, port_file: Path) -> None:
    """Listen on a free loopback port, write it to `port_file`, and serve until SIGTERM or
    SIGINT."""
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await asyncio.to_thread(port_file.write_text, str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


@contextlib.asynccontextmanager
async def loopback_server(
    module: str, *args: str
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """`python -m module PORT_FILE *args` (a server that listens on a free loopback port and
    writes the port to PORT_FILE: `serve_until_stopped`) as (its
    address, its process), stopped with SIGTERM on the way out. RuntimeError when it exits
    or writes no port within 30 s."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, str(port_file), *args, stdin=asyncio.subprocess.DEVNULL
        )
        try:
            for _ in range(3000):
                if port_file.exists() and (port := port_file.read_text()):
                    break
                if process.returncode is not None:
                    raise RuntimeError(f"{module} exited with status {process.returncode}")
                await asyncio.sleep(0.01)
            else:
                raise RuntimeError(f"{module} wrote no port within 30 s")
            yield f"127.0.0.1:{port}", process
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            await process.wait()
