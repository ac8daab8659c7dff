"""The load of `python -m bench.migration`: an independent closed-loop client in a process of
its own, as an edge device would be.

    python -m bench.migration_client --broker HOST:PORT --api-key KEY --model NAME
        [--concurrency N]

It uploads the model, deploys it at site-a and runs `--concurrency` closed-loop inference
loops on it through one `OffloadClient` (each loop sends its next request as soon as the
last one completed), so the broker's and the nodes' work (placement, starting a target,
readiness probes) competes with it only for the CPUs, as it would with a real device, never
for its event loop. Its protocol, one JSON object per line:

- stdout: `{"deployed": {"deployment_id": ..., "node_id": ...}}` once deployed; then, every
  `FLUSH_S` while anything completed, `{"ok": [t, ...], "failed": n}`: the
  `time.monotonic()` of each successful response since the last line, in completion order
  (CLOCK_MONOTONIC, which every process on the host shares), and how many requests raised;
  at the end `{"stats": {...}}`: the client's own `stats()` (its counters, latency and one
  observation per migration window it closed, as it reported them to the broker);
- stdin: end of file (or any line) stops the loops; the stats follow and it exits.

Logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

import modelzoo
from edge_client.client import OffloadClient
from edge_client.errors import OffloadError

FLUSH_S = 0.05
"""How often completion times go to the parent."""
FAILED_PAUSE_S = 0.01


class Loops:
    """Closed-loop inference; completion times are buffered until `flush`."""

    def __init__(self, client: OffloadClient, inputs: dict[str, np.ndarray]) -> None:
        self.client = client
        self.inputs = inputs
        self.ok_at: list[float] = []
        self.failed = 0

    async def loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.client.infer(self.inputs)
            except OffloadError:
                self.failed += 1
                # The client already waited for a switch before its retry; this only keeps
                # a loop that fails at once from spinning.
                await asyncio.sleep(FAILED_PAUSE_S)
            else:
                self.ok_at.append(time.monotonic())

    def flush(self) -> None:
        if self.ok_at or self.failed:
            emit({"ok": self.ok_at, "failed": self.failed})
            self.ok_at, self.failed = [], 0

    async def flusher(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(FLUSH_S)
            self.flush()


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def run(broker: str, api_key: str, model: str, concurrency: int) -> None:
    path = modelzoo.model_path(model)
    async with OffloadClient(broker, api_key) as client:
        sha = await client.upload_model(path)
        deployment = await client.deploy(sha, model, gpus=1, site="site-a")
        emit(
            {
                "deployed": {
                    "deployment_id": deployment.deployment_id,
                    "node_id": deployment.node_id,
                }
            }
        )
        loops = Loops(client, modelzoo.sample_inputs(path))
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(loops.loop(stop), name=f"load-{i}") for i in range(concurrency)
        ]
        tasks.append(asyncio.create_task(loops.flusher(stop), name="flush"))
        try:
            # Any line, or the end of stdin, stops the load.
            await asyncio.to_thread(sys.stdin.readline)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        loops.flush()
        stats = client.stats()
    emit(
        {
            "stats": {
                "requests": stats.requests,
                "failures": stats.failures,
                "retried": stats.retried,
                "latency_p50_ms": stats.latency_p50_ms,
                "latency_p99_ms": stats.latency_p99_ms,
                "migrations": [asdict(o) for o in stats.migrations],
            }
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--broker", required=True, help="host:port")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True, choices=modelzoo.ALL)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(run(args.broker, args.api_key, args.model, args.concurrency))
    return 0


if __name__ == "__main__":
    sys.exit(main())
