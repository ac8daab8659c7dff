"""`offload trace generate` and `offload simulate`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from edge_client.mobility import cluster as sim_cluster
from edge_client.mobility import generate, simulator, trace_import, traces
from migration.policy import Hysteresis, PrewarmSettings


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    trace = subparsers.add_parser(
        "trace", help="mobility traces: generate them with Eclipse SUMO, or import SUMO output"
    )
    trace_sub = trace.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    gen = trace_sub.add_parser(
        "generate",
        help="vehicle traces from SUMO as site sequences (seeded, reproducible)",
        description=generate.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.add_generate_arguments(gen)
    gen.set_defaults(func=generate.run_generate)
    imp = trace_sub.add_parser(
        "import",
        help="a trace from a SUMO FCD file (XML or CSV, gzipped or not) and a sites file",
        description=trace_import.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    trace_import.add_import_arguments(imp)
    imp.set_defaults(func=trace_import.run_import)

    sim = subparsers.add_parser(
        "simulate",
        help="replay a trace through the real placement and migration policy",
        description=simulator.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_simulate_arguments(sim)
    sim.add_argument(
        "--trace",
        type=Path,
        required=True,
        help="a trace JSON (`offload trace generate` or `offload trace import` writes it)",
    )
    sim.add_argument(
        "--captures",
        type=Path,
        default=sim_cluster.DEMO_CAPTURES,
        help="directory of `nvidia-smi topo -m` captures (default: the demo's: 12, 21, 24)",
    )
    sim.set_defaults(func=_run_simulate)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's options, shared with `python -m bench.mobility`."""
    h = Hysteresis()
    c = simulator.CostModel()
    o = simulator.SimOptions()
    parser.add_argument("--nodes", type=int, default=10_000, help="cluster nodes (10,000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the cluster and demand (1)")
    parser.add_argument(
        "--fill",
        type=float,
        default=o.fill,
        help=f"GPUs held by other tenants before the clients arrive (default {o.fill:g})",
    )
    parser.add_argument(
        "--share-fraction",
        type=float,
        default=o.share_fraction,
        help=f"clients asking for a GPU memory share (default {o.share_fraction:g})",
    )
    parser.add_argument("--min-gain-ms", type=float, default=h.min_gain_ms)
    parser.add_argument("--min-gain-ratio", type=float, default=h.min_gain_ratio)
    parser.add_argument("--cooldown", type=float, default=h.cooldown_s, help="seconds")
    parser.add_argument(
        "--start-s", type=float, default=c.start_s, help=f"target start (default {c.start_s:g})"
    )
    parser.add_argument("--switch-s", type=float, default=c.switch_s)
    parser.add_argument("--drain-s", type=float, default=c.drain_s)
    w = PrewarmSettings()
    parser.add_argument(
        "--prewarm-budget",
        type=int,
        default=w.budget,
        metavar="N",
        help="standby replicas held at once, cluster-wide, in a third run: today's policy with "
        "pre-warm (0: no such run; default: 0 for `offload simulate`, a quarter of the "
        "clients for bench.mobility)",
    )
    parser.add_argument(
        "--prewarm-min-probability",
        type=float,
        default=w.min_probability,
        metavar="P",
        help=f"a predicted next site less likely than this warms nothing (default "
        f"{w.min_probability:g})",
    )
    parser.add_argument(
        "--prewarm-ttl",
        type=float,
        default=w.ttl_s,
        metavar="SECONDS",
        help=f"a standby the client has not reached after this long is released (default "
        f"{w.ttl_s:g})",
    )
    parser.add_argument(
        "--check-every",
        type=int,
        default=0,
        help="also take every Nth decision with `place` itself and compare (default: never)",
    )
    jobs = min(2, os.cpu_count() or 1)
    parser.add_argument(
        "--jobs",
        type=int,
        default=jobs,
        metavar="N",
        help=f"run the policies in N worker processes (same figures; 1: one after the other; "
        f"default min(2, CPUs) = {jobs})",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")


def options_from(args: argparse.Namespace) -> simulator.SimOptions:
    return simulator.SimOptions(
        hysteresis=Hysteresis(args.min_gain_ms, args.min_gain_ratio, args.cooldown),
        costs=simulator.CostModel(args.start_s, args.switch_s, args.drain_s),
        share_fraction=args.share_fraction,
        fill=args.fill,
        seed=args.seed,
        check_every=args.check_every,
    )


def prewarm_from(args: argparse.Namespace) -> PrewarmSettings:
    return PrewarmSettings(args.prewarm_budget, args.prewarm_min_probability, args.prewarm_ttl)


def run(
    trace: traces.MobilityTrace, args: argparse.Namespace, captures: Path, specs: dict
) -> list[simulator.Figures]:
    """Build the cluster, simulate, print the table (and write --json)."""
    started = time.perf_counter()
    options = options_from(args)
    prewarm = prewarm_from(args)
    topologies = sim_cluster.load_topologies(captures, specs)
    built = sim_cluster.build_cluster(trace, topologies, args.nodes, args.seed)
    handovers = sum(v.handovers for v in trace.vehicles)
    print(
        f"trace {trace.name}: {len(trace.vehicles):,} vehicles, {handovers:,} handovers, "
        f"{len(trace.sites)} sites, {trace.duration_s:g} s; cluster: {len(built.nodes):,} "
        f"nodes, {built.gpus:,} GPUs, fill {options.fill:.0%}; start {options.costs.start_s:g} s, "
        f"switch {options.costs.switch_s:g} s, drain {options.costs.drain_s:g} s; pre-warm: "
        + (
            f"{prewarm.budget:,} standbys, p >= {prewarm.min_probability:g}, "
            f"TTL {prewarm.ttl_s:g} s"
            if prewarm.enabled
            else "off"
        )
        + f"; {args.jobs} job(s)",
        flush=True,
    )
    results = simulator.simulate(trace, built.network, built.nodes, options, prewarm, args.jobs)
    print(simulator.render(results))
    print(f"total wall time {time.perf_counter() - started:.1f} s")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "trace": trace.name,
                    "nodes": args.nodes,
                    "options": {
                        "seed": options.seed,
                        "fill": options.fill,
                        "share_fraction": options.share_fraction,
                        "hysteresis": asdict(options.hysteresis),
                        "costs": asdict(options.costs),
                        "prewarm": asdict(prewarm),
                    },
                    "results": [
                        {**asdict(r), "migrations_per_client_hour": r.migrations_per_client_hour}
                        for r in results
                    ],
                },
                indent=2,
            )
        )
    return results


def _run_simulate(args: argparse.Namespace) -> int:
    try:
        trace = traces.load(args.trace)
        run(trace, args, args.captures, sim_cluster.DEMO_SPECS)
    except ValueError as err:
        print(f"offload simulate: {err}", file=sys.stderr)
        return 2
    return 0
