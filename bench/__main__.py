"""`python -m bench [--quick] [--json FILE] [--only NAME ...]`: run the benchmarks, each
printing its figures beside its baseline from the same run, and write every result, with
the machine they were taken on, to one JSON file.

`make bench` is the short mode (a few minutes), `make bench-full` the full one (the figures
in docs/BENCHMARKS.md). A benchmark that fails is reported and the others still run; the
exit status is then 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import onnxruntime

from bench import (
    batcher_cost,
    control_plane,
    gpu_allocation,
    key_reload,
    loopback_stall,
    metrics_page,
    migration,
    mobility,
    node_failure,
    offload,
    peers,
    ping_cost,
    placement,
    prewarm,
    rebalance,
    replica_start,
    resize,
    runtime_latency,
    services,
    serving,
    upload_memory,
)

BENCHMARKS: dict[str, Callable[[Sequence[str] | None], int]] = {
    "runtime_latency": runtime_latency.main,
    "replica_start": replica_start.main,
    "gpu_allocation": gpu_allocation.main,
    "placement": placement.main,
    "migration": migration.main,
    "loopback_stall": loopback_stall.main,
    "mobility": mobility.main,
    "prewarm": prewarm.main,
    "resize": resize.main,
    "rebalance": rebalance.main,
    "offload": offload.main,
    "peers": peers.main,
    "serving": serving.main,
    "batcher_cost": batcher_cost.main,
    "metrics_page": metrics_page.main,
    "control_plane": control_plane.main,
    "key_reload": key_reload.main,
    "upload_memory": upload_memory.main,
    "node_failure": node_failure.main,
    "ping_cost": ping_cost.main,
    "services": services.main,
}


def machine() -> dict[str, Any]:
    """What the figures were taken on."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        first = Path("/proc/meminfo").read_text().splitlines()[0]
        memory_gib = round(int(first.split()[1]) / 2**20, 1)
    docker = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        docker = done.stdout.strip() or None
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        commit = done.stdout.strip() or None
    return {
        "taken_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": memory_gib,
        "system": platform.platform(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "docker_engine": docker,
        "commit": commit,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="short mode (fewer iterations)")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path("bench/results.json"),
        help="where to write the results (default bench/results.json)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(BENCHMARKS),
        metavar="NAME",
        help=f"run only these ({', '.join(BENCHMARKS)})",
    )
    args = parser.parse_args()
    names = args.only or list(BENCHMARKS)
    results: dict[str, Any] = {"machine": machine(), "mode": "quick" if args.quick else "full"}
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, name in enumerate(names, start=1):
            print(f"== [{index}/{len(names)}] {name}", flush=True)
            started = time.monotonic()
            out = Path(tmp) / f"{name}.json"
            code = BENCHMARKS[name]([*(["--quick"] if args.quick else []), "--json", str(out)])
            took = time.monotonic() - started
            if code != 0 or not out.exists():
                print(f"== {name} FAILED (exit code {code}) after {took:.0f}s", file=sys.stderr)
                failed.append(name)
                results[name] = {"failed": True, "exit_code": code}
                continue
            print(f"== {name} done in {took:.0f}s", flush=True)
            results[name] = json.loads(out.read_text())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    partial = args.json.with_name(args.json.name + ".part")
    partial.write_text(json.dumps(results, indent=2))
    partial.replace(args.json)
    print(f"results written to {args.json}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
