"""Timing helpers the latency benchmarks share, free of our protobuf code.

`bench.peers_client` runs tritonclient, whose generated `inference.*` protobuf symbols collide
with ours in one process; it imports these from here, as `bench.runtime_latency` does.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from bench import echo_server


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)
    return {
        "p50": statistics.median(ordered),
        "p99": ordered[p99_index(len(ordered))],
        "n": len(ordered),
    }


def tail_percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    """p50, p99, p99.9 (nearest rank: with fewer than 1,000 samples p99.9 is the maximum)
    and n."""
    ordered = sorted(samples_ms)
    tail = ordered[min(len(ordered) - 1, round(0.999 * (len(ordered) - 1)))]
    return {**percentiles(ordered), "p99.9": tail}


BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_LEVEL = 0.95

T = TypeVar("T")


def paired_bootstrap(
    pairs: Sequence[T],
    statistic: Callable[[Sequence[T]], float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """The `BOOTSTRAP_LEVEL` (95 %) interval of `statistic` over `pairs` drawn again with
    replacement `resamples` times: a paired block bootstrap. Each pair holds two contenders'
    blocks timed side by side, so a stretch of this machine's noise stays with both, and the
    interval is how far the statistic (a ratio of the two) moves with which stretches a run
    happened to get. A ratio whose interval holds 1 is one this run cannot tell from a tie.
    Seeded: the same figures give the same interval."""
    if not pairs:
        raise ValueError("no pairs to resample")
    rng = random.Random(seed)
    n = len(pairs)
    values = sorted(
        statistic([pairs[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples)
    )
    tail = (1 - BOOTSTRAP_LEVEL) / 2
    return values[round(tail * (resamples - 1))], values[round((1 - tail) * (resamples - 1))]


def p99_index(n: int) -> int:
    """Where `percentiles`' p99 of `n` sorted samples is (nearest rank)."""
    return min(n - 1, round(0.99 * (n - 1)))


def p99_is_the_maximum(n: int) -> bool:
    """Whether `percentiles`' p99 of `n` samples is their largest: up to 51 it is, so a
    single sample sets it."""
    return p99_index(n) == n - 1


async def timed(call: Callable[[], Awaitable[object]], warmup: int, n: int) -> list[float]:
    for _ in range(warmup):
        await call()
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def sample_calls(call_s: float, seconds: float, least: int, most: int) -> int:
    """Timed calls per contender when none are asked for: as many as take about `seconds`
    at `call_s` a call, never fewer than `least` nor more than `most`. A p99 is the worst
    hundredth of the samples: 1,000 calls of a 1 ms model span about a second, so one stall
    of this machine decides it; ResNet-18's 1,000 span about 20 s. `least` wins over a
    smaller `most`."""
    return max(least, min(most, round(seconds / max(call_s, 1e-9))))


def block_calls(iterations: int, min_blocks: int, block_s: float, call_s: float) -> int:
    """Calls per alternating block: as many as take about `block_s` at `call_s` a call, so a
    slow model's contenders alternate as often in time as a fast one's (this machine's noise
    drifts over seconds, and a block that outlasts a drift gives it to one contender alone),
    and never fewer than `min_blocks` blocks; at least one call."""
    return sample_calls(call_s, block_s, 1, iterations // min_blocks)


def channel_to(endpoint: str) -> grpc.aio.Channel:
    limit = echo_server.MAX_MESSAGE
    return grpc.aio.insecure_channel(
        endpoint,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ],
    )
