"""Request loads the live-cluster benchmarks share (`bench.resize`, `bench.rebalance`): timed
`OffloadClient` calls counted into a series, closed loop or open loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_client.client import OffloadClient
from edge_client.errors import OffloadError


@dataclass
class Series:
    """The answered requests' latencies (ms) of one load, and how many failed."""

    label: str
    """Names the load in a failed request's line."""
    latencies_ms: list[float] = field(default_factory=list)
    failed: int = 0

    def percentiles(self) -> tuple[float, float]:
        """(p50, p99) in ms; NaN without an answered request."""
        if not self.latencies_ms:
            return float("nan"), float("nan")
        lat = np.array(self.latencies_ms)
        return float(np.percentile(lat, 50)), float(np.percentile(lat, 99))


async def timed_infer(client: OffloadClient, inputs: dict[str, Any], series: Series) -> None:
    """One request; its latency into `series`, or a failure counted and printed."""
    started = time.perf_counter()
    try:
        await client.infer(inputs)
    except OffloadError as err:
        series.failed += 1
        print(f"  request FAILED ({series.label}): {err}", flush=True)
        return
    series.latencies_ms.append((time.perf_counter() - started) * 1000)


async def closed_loop(
    client: OffloadClient, inputs: dict[str, Any], series: Series, stop: asyncio.Event
) -> None:
    """One request after another until `stop`."""
    while not stop.is_set():
        await timed_infer(client, inputs, series)


async def open_loop(
    client: OffloadClient,
    inputs: dict[str, Any],
    stop: asyncio.Event,
    schedule: Callable[[float], tuple[Series, float]],
) -> None:
    """Requests at a fixed rate whether or not earlier ones were answered (as independent
    devices send them) until `stop`, then wait for the ones still out. `schedule(elapsed s)`
    gives the series the next request counts in and the rate (requests/s) until the next."""
    loop = asyncio.get_running_loop()
    out: set[asyncio.Task[None]] = set()
    start = due = loop.time()
    while not stop.is_set():
        series, rate_per_s = schedule(loop.time() - start)
        task = asyncio.create_task(timed_infer(client, inputs, series))
        out.add(task)
        task.add_done_callback(out.discard)
        due += 1 / rate_per_s
        await asyncio.sleep(max(0.0, due - loop.time()))
    await asyncio.gather(*out)


def constant(series: Series, rate_per_s: float) -> Callable[[float], tuple[Series, float]]:
    """`open_loop`'s schedule of one load at one rate."""
    return lambda _elapsed_s: (series, rate_per_s)
