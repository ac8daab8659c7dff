"""Large gRPC requests over this machine's loopback, side by side with the same over a
network namespace's own loopback at an Ethernet MTU: how often a call stalls.

The evidence for `bench.private_net`, the network `bench.migration` runs in by default. The
same worker runs in both networks, in blocks that take turns (which network goes first
alternates from block to block, so a slow minute of the machine falls on both): it starts
`bench.echo_server` and runs `--loops` closed loops of grpc.aio calls, each sending
`--request-kb` KB (a ResNet-18 input is 602 KB) and answered with 4 KB after `--delay-ms`
(`/bench.Echo/EchoAfter`, as a replica computing that long would). A call that takes more
than `--delay-ms` + `STALL_MARGIN_MS` is a stall: nothing else runs in it, so the time over
the wait is the network's.

    host      this process's network namespace: the machine's loopback (MTU 65536 here)
    private   `unshare --net`, its loopback at MTU 1500 (`bench.private_net`): as an edge
              device's link to a node would be

Both use the namespace's TCP congestion control (BBR on this machine); the report names the
MTU and the congestion control each network had. Needs root, `unshare` and `ip`.

    python -m bench.loopback_stall [--quick] [--blocks N] [--block-seconds S] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import echo_server, private_net
from bench.loopback import loopback_server
from bench.timing import channel_to, percentiles

STALL_MARGIN_MS = 30.0
"""A call over its server's wait by more than this is a stall."""
RESPONSE_BYTES = 4000
NETWORKS = ("host", "private")


def stall_threshold_ms(delay_ms: float) -> float:
    return delay_ms + STALL_MARGIN_MS


def summarize(latencies_ms: Sequence[float], threshold_ms: float) -> dict[str, Any]:
    """The calls of one network: how many, how many stalled (over `threshold_ms`), their
    p50 / p99 / max."""
    if not latencies_ms:
        raise ValueError("no call finished")
    stalls = sum(1 for latency in latencies_ms if latency > threshold_ms)
    spread = percentiles(latencies_ms)
    return {
        "calls": len(latencies_ms),
        "stalls": stalls,
        "stalls_per_10k": round(1e4 * stalls / len(latencies_ms), 2),
        "p50": spread["p50"],
        "p99": spread["p99"],
        "max": max(latencies_ms),
    }


def describe(network: dict[str, Any]) -> str:
    where = (
        "a private namespace's loopback" if network["private_namespace"] else "the host's loopback"
    )
    return f"{where} (MTU {network['loopback_mtu']}, {network['tcp_congestion_control']})"


def verdict(host: dict[str, Any], private: dict[str, Any]) -> str:
    """One line: the two networks' stalls side by side."""
    counts = (
        f"{host['stalls']} of {host['calls']:,} calls on the host's loopback, "
        f"{private['stalls']} of {private['calls']:,} at MTU {private_net.ETHERNET_MTU}"
    )
    if host["stalls"] == private["stalls"] == 0:
        return f"stalls: none in either network ({counts})"
    return f"stalls: {counts}"


async def _calls(
    seconds: float, loops: int, request_kb: int, delay_ms: float
) -> tuple[list[float], float]:
    """The latencies (ms) of `loops` closed loops of EchoAfter calls for `seconds`, and how
    long they ran."""
    request = (
        RESPONSE_BYTES.to_bytes(8, "little")
        + round(delay_ms * 1000).to_bytes(8, "little")
        + os.urandom(request_kb * 1024 - 16)
    )
    latencies: list[float] = []
    async with (
        loopback_server(echo_server.__name__) as (address, _),
        channel_to(address) as channel,
    ):
        call = channel.unary_unary(echo_server.AFTER_METHOD)
        await call(request)  # the connection's set-up and first window, untimed
        started = time.monotonic()
        stop = started + seconds

        async def loop() -> None:
            while time.monotonic() < stop:
                sent = time.perf_counter()
                await call(request)
                latencies.append((time.perf_counter() - sent) * 1000)

        await asyncio.gather(*(loop() for _ in range(loops)))
    return latencies, time.monotonic() - started


def _worker(args: argparse.Namespace) -> int:
    """One block in the network this process runs in: a JSON line on standard output."""
    latencies, ran_s = asyncio.run(
        _calls(args.block_seconds, args.loops, args.request_kb, args.delay_ms)
    )
    print(
        json.dumps(
            {
                "network": private_net.network_description(),
                "ran_s": round(ran_s, 2),
                "latencies_ms": [round(x, 3) for x in latencies],
            }
        ),
        flush=True,
    )
    return 0


def _block(network: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one block of the worker in `network`; its JSON. RuntimeError when it fails."""
    command = [
        sys.executable, "-m", "bench.loopback_stall", "--worker",
        "--block-seconds", str(args.block_seconds),
        "--loops", str(args.loops),
        "--request-kb", str(args.request_kb),
        "--delay-ms", str(args.delay_ms),
    ]  # fmt: skip
    if network == "private":
        command = private_net.private_network_argv(command)
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=args.block_seconds + 120,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the {network} block did not end within its time") from None
    if done.returncode != 0:
        tail = done.stderr.strip()[-600:]
        raise RuntimeError(f"the {network} block exited with status {done.returncode}: {tail}")
    try:
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(
            f"the {network} block printed no figures: {done.stdout[-200:]!r}"
        ) from None
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    threshold = stall_threshold_ms(args.delay_ms)
    latencies: dict[str, list[float]] = {network: [] for network in NETWORKS}
    networks: dict[str, dict[str, Any]] = {}
    blocks: dict[str, list[dict[str, Any]]] = {network: [] for network in NETWORKS}
    for index in range(args.blocks):
        order = NETWORKS if index % 2 == 0 else NETWORKS[::-1]
        for network in order:
            block = _block(network, args)
            networks[network] = block["network"]
            latencies[network] += block["latencies_ms"]
            figures = summarize(block["latencies_ms"], threshold)
            blocks[network].append({"ran_s": block["ran_s"], **figures})
            print(
                f"  block {index + 1}/{args.blocks} {network:<7} {figures['calls']:>6} calls, "
                f"{figures['stalls']} stalled, max {figures['max']:.1f} ms",
                flush=True,
            )
    return {
        "settings": {
            "blocks": args.blocks,
            "block_seconds": args.block_seconds,
            "loops": args.loops,
            "request_kb": args.request_kb,
            "response_bytes": RESPONSE_BYTES,
            "delay_ms": args.delay_ms,
            "stall_threshold_ms": threshold,
        },
        "networks": {
            network: {
                "network": networks[network],
                **summarize(latencies[network], threshold),
                "blocks": blocks[network],
            }
            for network in NETWORKS
        },
    }


def report(result: dict[str, Any]) -> None:
    settings = result["settings"]
    print(
        f"\n{settings['loops']} loops of {settings['request_kb']} KB calls, each answered "
        f"after {settings['delay_ms']:g} ms; a stall is a call over "
        f"{settings['stall_threshold_ms']:g} ms"
    )
    print(
        f"{'network':<48} {'calls':>7} {'stalls':>7} {'per 10k':>8} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}"
    )
    for figures in result["networks"].values():
        print(
            f"{describe(figures['network']):<48} {figures['calls']:>7,} {figures['stalls']:>7} "
            f"{figures['stalls_per_10k']:>8} {figures['p50']:>7.1f} {figures['p99']:>7.1f} "
            f"{figures['max']:>7.1f}"
        )
    print(verdict(result["networks"]["host"], result["networks"]["private"]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.loopback_stall",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="2 blocks of 4 s per network")
    parser.add_argument("--blocks", type=int, help="blocks per network (default 6)")
    parser.add_argument(
        "--block-seconds", type=float, help="seconds of calls per block (default 40)"
    )
    parser.add_argument("--loops", type=int, default=2, help="closed loops (default 2)")
    parser.add_argument(
        "--request-kb", type=int, default=602, help="request size, KB (default 602)"
    )
    parser.add_argument(
        "--delay-ms", type=float, default=40.0, help="the server's wait per call (default 40)"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.blocks is None:
        args.blocks = 2 if args.quick else 6
    if args.block_seconds is None:
        args.block_seconds = 4.0 if args.quick else 40.0
    if args.blocks < 1 or args.block_seconds <= 0 or args.loops < 1 or args.delay_ms < 0:
        parser.error(
            "--blocks and --loops must be at least 1, --block-seconds over 0, --delay-ms 0 or more"
        )
    if args.request_kb < 1:
        parser.error(f"--request-kb must be at least 1, got {args.request_kb}")
    if args.worker:
        return _worker(args)
    cannot = private_net.unavailable_reason()
    if cannot is not None:
        parser.error(f"the private network to compare against: {cannot}")
    if private_net.inside():
        parser.error("already in a private network namespace: run it from the host's")
    print(
        f"loopback stalls: {args.blocks} blocks of {args.block_seconds:g} s per network, "
        "taking turns",
        flush=True,
    )
    try:
        result = run(args)
    except RuntimeError as err:
        print(f"bench.loopback_stall: {err}", file=sys.stderr)
        return 1
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
