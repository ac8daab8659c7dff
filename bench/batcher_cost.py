"""What batching on costs each call of a model that runs inline, apart from gRPC (issue 48's
on/off throughput for the MLP on a CPU).

The MLP computes in tens of microseconds, runs on the replica's event loop, and its calls
reach the batcher one at a time, as fast as the loop parses them: no batch forms (mean
batch 1.0 in `bench.serving` at 64 clients), so batching can only add its own cost. That
cost is the batcher's lone-request path (`runtime.batching.Batcher.infer`: the run, the
client's compute, and the bookkeeping folded in after the calls: the priority classes'
accounting, the compute histogram, the batch, queue-delay and class metrics; the fold is
timed with them) against the unbatched inline path of `runtime.rpc.servicer` (the run, its
compute histogram, the client's compute), both on one warm session with one metrics
object, in this process, alternating, `--repeats` times `--calls` calls each; the medians
are printed.

    python -m bench.batcher_cost [--quick] [--model mlp] [--calls N] [--repeats R]
                                 [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import modelzoo
from runtime.batching import Batcher, BatchPolicy, PriorityClass
from runtime.metrics import RuntimeMetrics
from runtime.model import OnnxModel

CLIENT = "bench-client"


async def measure(model_name: str, calls: int, repeats: int) -> dict[str, float]:
    """Microseconds a call, unbatched and through the batcher (medians over `repeats`)."""
    path = modelzoo.model_path(model_name)
    feeds = modelzoo.sample_inputs(path)
    model = OnnxModel.load(path, model_name, "cpu", 0, 1)
    compute_s = model.warm_up(feeds) / 1000
    names = model.output_names([])
    metrics = RuntimeMetrics().for_model(model_name)
    metrics.use_clients([CLIENT])
    batcher = Batcher(
        [model],
        BatchPolicy(max_batch_size=16),
        compute_s,
        1.0,  # inline, as `runtime.server` makes it for a model this small on a CPU
        metrics.observe_batch,
        on_refused=metrics.refused_full,
        on_client_compute=metrics.client_computed,
        observe_alone=metrics.observe_alone,
    )

    def unbatched() -> None:
        started = time.perf_counter()
        model.run(feeds, names)
        seconds = time.perf_counter() - started
        metrics.compute.observe(seconds)
        metrics.client_computed(CLIENT, seconds)

    async def batched() -> None:
        await batcher.infer(feeds, names, PriorityClass.STANDARD, None, CLIENT)

    off: list[float] = []
    on: list[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            unbatched()
        off.append((time.perf_counter() - started) / calls * 1e6)
        started = time.perf_counter()
        for _ in range(calls):
            await batched()
        batcher.compute_seconds(PriorityClass.STANDARD)  # folds what the calls left (timed)
        on.append((time.perf_counter() - started) / calls * 1e6)
    batcher.close()
    return {
        "unbatched_us": statistics.median(off),
        "batched_us": statistics.median(on),
        "added_us": statistics.median(b - a for a, b in zip(off, on, strict=True)),
        "compute_us": compute_s * 1e6,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.batcher_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="2,000 calls x 3 (make bench)")
    parser.add_argument("--model", default="mlp", help="a model of the zoo (default mlp)")
    parser.add_argument("--calls", type=int, help="calls per repeat (20,000; quick 2,000)")
    parser.add_argument("--repeats", type=int, help="alternating repeats (7; quick 3)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    calls = (2_000 if args.quick else 20_000) if args.calls is None else args.calls
    repeats = (3 if args.quick else 7) if args.repeats is None else args.repeats
    if not 1 <= calls <= 10_000_000 or not 1 <= repeats <= 1_000:
        parser.error(f"--calls 1..10,000,000 and --repeats 1..1,000, not {calls}, {repeats}")
    if args.model not in modelzoo.ALL:
        parser.error(f"--model {args.model[:40]!r}: one of {', '.join(modelzoo.ALL)}")
    figures = asyncio.run(measure(args.model, calls, repeats))
    print(
        f"{args.model} ({figures['compute_us']:.0f} us compute): a call unbatched "
        f"{figures['unbatched_us']:.1f} us, through the batcher {figures['batched_us']:.1f} us, "
        f"added {figures['added_us']:.1f} us (median of {repeats} x {calls:,} calls, "
        "alternating; gRPC and parsing not included)"
    )
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, **figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
