"""`python -m bench.migration` stopped mid-run (SIGTERM, as a CI job's timeout or `kill`
sends): it stops the replicas its node daemons started, which run in sessions of their
own and would outlive it, and exits 130."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench_processes() -> list[int]:
    """The pids of replica servers whose command line names a bench.migration folder, and
    of the bench's load client."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        replica = b"runtime.server" in argv and any(b"bench-migration-" in a for a in argv)
        if replica or b"bench.migration_client" in argv:
            found.append(int(proc.name))
    return found


def test_a_sigterm_mid_run_stops_every_replica_it_started_and_exits_130() -> None:
    assert bench_processes() == []
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench.migration", "--runtime", "process", "--network", "host",
         "--models", "mlp", "--migrations", "100", "--targets", "background"],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not bench_processes():
            assert bench.poll() is None, bench.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no replica started within 120 s"
            time.sleep(0.2)
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 130, err[-2000:]
    assert "SIGTERM: stopping the cluster" in err
    assert bench_processes() == []
