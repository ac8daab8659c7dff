"""`python -m bench [--quick] [--json FILE]`: run every benchmark, print each figure beside
its baseline from the same run, and write all results to one JSON file."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench import gpu_allocation, migration, placement, replica_start, runtime_latency

BENCHMARKS = {
    "runtime_latency": runtime_latency.main,
    "replica_start": replica_start.main,
    "gpu_allocation": gpu_allocation.main,
    "placement": placement.main,
    "migration": migration.main,
}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short mode (fewer iterations)")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path("bench/results.json"),
        help="where to write the results (default bench/results.json)",
    )
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in BENCHMARKS.items():
            print(f"== {name}", flush=True)
            out = Path(tmp) / f"{name}.json"
            code = run([*(["--quick"] if args.quick else []), "--json", str(out)])
            if code != 0:
                print(f"{name} failed with exit code {code}", file=sys.stderr)
                return code
            results[name] = json.loads(out.read_text())
    args.json.write_text(json.dumps(results, indent=2))
    print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
