"""Reading a process's CPU and memory accounting from its cgroup (v1 or v2).

A replica's container (or a process the node put in a cgroup of its own) is accounted by
the kernel in its cgroup: CPU time used, the CFS quota, how many periods the quota
throttled it, memory in use. `/proc/<pid>/cgroup` names the cgroup, for each v1 controller
(`4:cpu:/docker/<id>`) or for the v2 hierarchy (`0::/system.slice/docker-<id>.scope`); the
files are read under `/sys/fs/cgroup`. Reading them takes microseconds, where Docker's
stats call takes about half a second a container.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class CpuAccounting:
    cpu_seconds: float | None
    """CPU time used by everything in the cgroup; None when not readable."""
    periods: int
    throttled_periods: int
    limit_cores: float
    """The CFS quota in cores; 0 when unlimited."""


def cgroup_dirs(pid: int, root: Path = ROOT) -> dict[str, Path]:
    """controller ("cpu", "cpuacct", "memory", or "" for the v2 hierarchy) -> the directory
    of `pid`'s cgroup for it; empty when the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return {}
    found: dict[str, Path] = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if not controllers:
            # v2: mounted at the root (unified) or beside the v1 ones (hybrid).
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            found[""] = base / relative
            continue
        for controller in controllers.split(","):
            found[controller] = root / controller / relative
    return found


def unified(root: Path = ROOT) -> bool:
    """Whether the host mounts cgroup v2 alone (its controllers, `cpu` among them, in the
    one hierarchy)."""
    return (root / "cgroup.controllers").exists()


def cpu_weight(pid: int, root: Path = ROOT) -> int | None:
    """`pid`'s cgroup v2 `cpu.weight` (1..10000, default 100); None on a cgroup v1 host
    (or hybrid: the v2 hierarchy then has no cpu controller) and when it is not readable."""
    v2 = cgroup_dirs(pid, root).get("")
    if v2 is None:
        return None
    try:
        return int((v2 / "cpu.weight").read_text())
    except (OSError, ValueError):
        return None


def _keyed(path: Path) -> dict[str, int]:
    values = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            values[key] = int(value)
    return values


def cpu_accounting(pid: int, root: Path = ROOT) -> CpuAccounting | None:
    """The CPU accounting of `pid`'s cgroup; None when neither hierarchy has it readable."""
    dirs = cgroup_dirs(pid, root)
    cpu, acct = dirs.get("cpu"), dirs.get("cpuacct")
    try:
        if cpu is not None and (cpu / "cpu.stat").exists():  # v1
            stat = _keyed(cpu / "cpu.stat")
            quota = int((cpu / "cpu.cfs_quota_us").read_text())
            period = int((cpu / "cpu.cfs_period_us").read_text())
            used = None
            if acct is not None and (acct / "cpuacct.usage").exists():
                used = int((acct / "cpuacct.usage").read_text()) / 1e9
            return CpuAccounting(
                used,
                stat.get("nr_periods", 0),
                stat.get("nr_throttled", 0),
                quota / period if quota > 0 and period > 0 else 0.0,
            )
        v2 = dirs.get("")
        if v2 is not None and (v2 / "cpu.stat").exists():
            stat = _keyed(v2 / "cpu.stat")
            limit = 0.0
            if (v2 / "cpu.max").exists():
                most, _, per = (v2 / "cpu.max").read_text().partition(" ")
                if most != "max":
                    limit = int(most) / int(per)
            usage = stat.get("usage_usec")
            return CpuAccounting(
                None if usage is None else usage / 1e6,
                stat.get("nr_periods", 0),
                stat.get("nr_throttled", 0),
                limit,
            )
    except (OSError, ValueError):
        return None
    return None


def memory_used_mib(pid: int, root: Path = ROOT) -> int | None:
    """Memory in use by `pid`'s cgroup, page cache that can be dropped left out; None when
    not readable."""
    dirs = cgroup_dirs(pid, root)
    try:
        memory = dirs.get("memory")
        if memory is not None and (memory / "memory.usage_in_bytes").exists():  # v1
            used = int((memory / "memory.usage_in_bytes").read_text())
            inactive = _keyed(memory / "memory.stat").get("total_inactive_file", 0)
            return max(0, used - inactive) >> 20
        v2 = dirs.get("")
        if v2 is not None and (v2 / "memory.current").exists():
            used = int((v2 / "memory.current").read_text())
            inactive = _keyed(v2 / "memory.stat").get("inactive_file", 0)
            return max(0, used - inactive) >> 20
    except (OSError, ValueError):
        return None
    return None
