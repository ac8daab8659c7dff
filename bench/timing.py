"""Timing helpers the latency benchmarks share, free of our protobuf code.

`bench.peers_client` runs tritonclient, whose generated `inference.*` protobuf symbols collide
with ours in one process; it imports these from here, as `bench.runtime_latency` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import grpc

from bench import echo_server


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)
    return {
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "n": len(ordered),
    }


async def timed(call: Callable[[], Awaitable[object]], warmup: int, n: int) -> list[float]:
    for _ in range(warmup):
        await call()
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def channel_to(endpoint: str) -> grpc.aio.Channel:
    limit = echo_server.MAX_MESSAGE
    return grpc.aio.insecure_channel(
        endpoint,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ],
    )


@contextlib.asynccontextmanager
async def loopback_server(
    module: str, *args: str
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """`python -m module PORT_FILE *args` (a server that listens on a free loopback port and
    writes the port to PORT_FILE: `bench.echo_server`, `bench.null_registry`) as (its
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
