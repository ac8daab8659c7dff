"""Running a benchmark as its users do, for the tests of `bench/`."""

from __future__ import annotations

import subprocess
import sys


def run_bench(module: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m MODULE ARGS...` (`module` whole, as ``"bench.NAME"``: the string
    `tests/unit/test_ci_benchmarks.py` looks for), with no standard input; its output
    captured as text."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
    )  # fmt: skip
