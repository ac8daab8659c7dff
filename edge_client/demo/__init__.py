"""`offload demo`: a whole edge cloud on this machine, a real model offloaded, a client moving.

It starts a broker and three node daemons on loopback, one at each of three sites, whose GPUs
come from real `nvidia-smi topo -m` captures (a 4-GPU PCIe server, an 8-GPU NVLink hybrid
cube, an 8-GPU NVSwitch machine). Replicas run in Docker containers when an engine is
reachable (the runtime image is built first if needed), else as local processes (it says
so). The client uploads the ResNet-18-shaped CNN, deploys it, sends steady inferences
(checking every answer against in-process ONNX Runtime) and moves along a mobility trace;
the broker migrates the deployment make-before-break as the client moves. A live view shows
the nodes and their GPUs, where the deployment runs, the request rate and latency and each
migration; the report at the end has the placement explanations, each migration's timeline
and client-observed downtime, latency percentiles, failed requests and the dashboard URL.

Exit status: 0 when every request and every migration succeeded, 1 otherwise, 2 for bad
arguments, 130 after Ctrl-C. Ctrl-C stops everything it started (containers, processes,
its temporary folder) before it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from rich.console import Console

import modelzoo
from broker.network import load_cluster_network
from edge_client.demo.cluster import CLUSTER_FILE
from edge_client.demo.run import DemoFailed, DemoOptions, install_stop_signals, run_demo
from edge_client.demo.trace import DEFAULT_TRACE, TraceError, load_trace
from node_daemon.runtimes.cgroup_limits import MAX_SHARES

QUICK_DWELL_FACTOR = 0.25
QUICK_MIN_DWELL_S = 1.5
BACKGROUND_FETCH_MB_S = 25.0
"""The demo's nodes' `--background-fetch-rate`: the three sites share this machine's CPUs,
so a target's model fetch at full speed takes them from the replica serving the client
(docs/benchmarks-history.md, the demo)."""
REPLICA_CPU_SHARES = 4096
"""The demo's nodes' `--replica-cpu-shares` (Docker runtime): the replicas' cgroup weighs as
four of the root cgroup's threads, so the engine's work on a migration target's container
does not take the CPU from the replica serving the client (docs/benchmarks-history.md, the
demo)."""


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="a whole edge cloud on this machine: offload a real model, move the client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run (CI): each stay of the trace x{QUICK_DWELL_FACTOR:g}, at least "
        f"{QUICK_MIN_DWELL_S:g} s",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="the mobility trace, a YAML file of {site, dwell_s} waypoints, or a generated "
        "vehicle trace (.json, `offload trace generate`) (default: the commute through site-a, "
        "site-b, site-c and back)",
    )
    parser.add_argument(
        "--vehicle",
        help="with a generated trace: the vehicle to follow (default: the one with the most "
        "handovers)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="F",
        help=f"multiply every stay of the trace by F (at least {QUICK_MIN_DWELL_S:g} s): 0.2 "
        "makes a generated trace's handovers several a minute (default 1)",
    )
    parser.add_argument(
        "--prewarm",
        type=int,
        nargs="?",
        const=2,
        default=0,
        metavar="N",
        help="predictive pre-warm: the broker keeps up to N standby replicas (default 2) at "
        "the sites clients are predicted to reach next; with a generated trace the demo first "
        "reports the other vehicles' handovers, so the broker has learned the roads. The "
        "report shows which moves were pre-warmed and the time from each move to the first "
        "answer at the new site",
    )
    parser.add_argument(
        "--background-fetch-rate",
        type=float,
        default=BACKGROUND_FETCH_MB_S,
        metavar="MB/S",
        help="each node's --background-fetch-rate: a migration's target node fetches the "
        "model from the broker at this average rate, so that the copy does not take the "
        "CPU from the replica serving the client on the same machine; 0: as fast as it comes "
        f"(default {BACKGROUND_FETCH_MB_S:g})",
    )
    parser.add_argument(
        "--replica-cpu-shares",
        type=int,
        default=REPLICA_CPU_SHARES,
        metavar="N",
        help="each node's --replica-cpu-shares (Docker runtime, as root, with the engine's "
        "cgroupfs driver; otherwise the demo says why it does without): the replicas' "
        "containers weigh N against the engine's and the daemons' threads (1024 each), so "
        "a migration target's container start does not take the CPU from the replica serving "
        f"the client; 0: the engine's default group (default {REPLICA_CPU_SHARES})",
    )
    parser.add_argument(
        "--share-cpus",
        action="store_true",
        help="run every site's node on every CPU; by default, where this machine has a CPU "
        "per site (three), each site gets CPUs of its own, as separate machines would, so a "
        "migration's target does not start on the CPUs serving the client",
    )
    parser.add_argument("--model", default="resnet18", choices=modelzoo.ALL)
    parser.add_argument(
        "--runtime",
        choices=["auto", "docker", "process"],
        default="auto",
        help="auto: Docker when an engine is reachable, else local processes",
    )
    parser.add_argument(
        "--rate", type=float, default=20.0, help="inferences per second (default 20)"
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="after the report, leave the cluster running for the dashboard until Ctrl-C",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="no live view, only timestamped lines (the default when stdout is not a terminal)",
    )
    parser.set_defaults(func=_main)


def _options(args: argparse.Namespace, console: Console) -> DemoOptions:
    if not 0 < args.rate <= 1000:
        raise ValueError(f"--rate must be in (0, 1000] inferences per second, got {args.rate:g}")
    if not 0 < args.time_scale <= 100:
        raise ValueError(f"--time-scale must be in (0, 100], got {args.time_scale:g}")
    if not 0 <= args.prewarm <= 64:
        raise ValueError(f"--prewarm must be 0 to 64 standby replicas, got {args.prewarm}")
    if not 0 <= args.background_fetch_rate <= 100_000:  # also refuses nan
        raise ValueError(
            f"--background-fetch-rate must be 0 to 100000 MB/s, got {args.background_fetch_rate:g}"
        )
    if args.replica_cpu_shares and not 2 <= args.replica_cpu_shares <= MAX_SHARES:
        raise ValueError(
            f"--replica-cpu-shares must be 0 or 2 to {MAX_SHARES}, got {args.replica_cpu_shares}"
        )
    sites = load_cluster_network(CLUSTER_FILE).sites
    trace = load_trace(args.trace, sites, args.vehicle)
    factor = args.time_scale * (QUICK_DWELL_FACTOR if args.quick else 1.0)
    if factor != 1.0:
        trace = trace.scaled(factor, QUICK_MIN_DWELL_S)
    return DemoOptions(
        trace=trace,
        trace_file=args.trace,
        model=args.model,
        runtime=args.runtime,
        rate=args.rate,
        keep=args.keep,
        live=console.is_terminal and not args.plain,
        prewarm=args.prewarm,
        background_fetch_mb_s=args.background_fetch_rate,
        replica_shares=args.replica_cpu_shares,
        share_cpus=args.share_cpus,
    )


async def _run(options: DemoOptions, console: Console) -> int:
    task = asyncio.create_task(run_demo(options, console))
    install_stop_signals(task, lambda message: console.print(message, markup=False))
    try:
        return await task
    except asyncio.CancelledError:
        return 130


def _main(args: argparse.Namespace) -> int:
    if not args.verbose:  # the demo narrates; the client's INFO lines would repeat it
        logging.getLogger().setLevel(logging.WARNING)
    console = Console(soft_wrap=True)  # long lines stay whole in logs
    if not console.is_terminal:
        console.width = 160  # rich's default of 80 would fold the report's tables in logs
    try:
        options = _options(args, console)
    except (TraceError, ValueError) as err:
        print(f"offload demo: {err}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(options, console))
    except DemoFailed as err:
        print(f"offload demo: {err}", file=sys.stderr)
        return 1
