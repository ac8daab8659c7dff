"""Mobility policy at scale: never-migrate, today's policy, today's policy with pre-warm and the
nearest-node oracle on SUMO vehicle traces, through the real placement and migration policy
(`edge_client.mobility.simulator`).

The trace: `offload trace generate` with 10,000 vehicles (1,000 with --quick) for an hour
(10 minutes with --quick) on a 30 x 30 grid of 200 m blocks (5.8 km a side, 2 lanes), SUMO's
mesoscopic model, sites on 500 m cells (144), positions every 5 s, departures over the first
5 minutes (1 with --quick), 10 intermediate edges per trip so most vehicles drive the whole
hour. Generated
once per option set into --cache (traces are generated, not committed); --trace replays a
given one. The cluster: 10,000 nodes (1,000 with --quick) of the five 8-GPU captures
`bench.placement` uses, over the trace's sites, 70 % of their GPUs held by other tenants.
Pre-warm runs as a third policy, with a standby budget of a quarter of the clients unless
--prewarm-budget says otherwise (0: no pre-warm run).

    python -m bench.mobility [--quick] [--trace FILE] [--cache DIR] [--json FILE] [...]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.placement import CAPTURES
from edge_client.mobility import generate, traces
from edge_client.mobility.cli import add_simulate_arguments, run
from modelzoo.cache import cache_root
from tests.data import TOPOLOGIES

DEFAULT_CACHE = cache_root() / "traces"
PREWARM_SHARE = 4
"""The default standby budget is the clients over this: standbys then hold at most a quarter
as many GPUs again as the clients' own deployments. On the quick trace the hit rate grows with
the budget up to half the clients, where it stops binding (a tenth: 5.7 %, a quarter: 18 %, a
half: 28 %, with deployments taking standbys' GPUs at will); a quarter keeps the budget
binding, which is what an operator sets it for."""


def bench_options(quick: bool, seed: int) -> generate.GenerateOptions:
    return generate.GenerateOptions(
        seed=seed,
        vehicles=1_000 if quick else 10_000,
        duration_s=600.0 if quick else 3600.0,
        depart_window_s=60.0 if quick else 300.0,
        junctions=30,
        spacing_m=200.0,
        lanes=2,
        intermediate=10,
        period_s=5.0,
        mesoscopic=True,
        cell_m=500.0,
        name=f"bench-{'quick' if quick else 'full'}-s{seed}",
    )


def cached_trace(options: generate.GenerateOptions, cache: Path) -> traces.MobilityTrace:
    """The trace of `options`, generated into `cache` the first time."""
    path = cache / f"{options.name}-v{options.vehicles}-d{options.duration_s:g}.json"
    if path.exists():
        print(f"trace: {path} (cached)", flush=True)
        return traces.load(path)
    cache.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"generating the trace with SUMO into {path} ...", flush=True)
    generated = generate.generate_trace(options)
    path.write_text(generated.trace.dumps(), encoding="utf-8")
    timings = ", ".join(f"{k} {v:.1f}" for k, v in generated.timings_s.items())
    print(f"generated in {time.perf_counter() - started:.1f} s ({timings})", flush=True)
    return generated.trace


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1,000 vehicles, 10 min, 1,000 nodes")
    parser.add_argument("--trace", type=Path, help="replay this trace instead of generating one")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="generated traces")
    add_simulate_arguments(parser)
    parser.set_defaults(fill=0.7, prewarm_budget=None)
    args = parser.parse_args(argv)
    if args.quick and args.nodes == 10_000:
        args.nodes = 1_000
    trace = (
        traces.load(args.trace)
        if args.trace is not None
        else cached_trace(bench_options(args.quick, args.seed), args.cache)
    )
    if args.prewarm_budget is None:
        args.prewarm_budget = max(1, len(trace.vehicles) // PREWARM_SHARE)
    run(trace, args, TOPOLOGIES, CAPTURES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
