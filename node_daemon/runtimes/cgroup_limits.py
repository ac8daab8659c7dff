"""Limiting a process's CPU and memory with cgroups of its own (the process runtime's).

A replica process is moved into a cgroup named after it, created on its first limit:

- cgroup v1 (a `cpu` hierarchy): `<its cpu cgroup>/edge-offload/<name>`, e.g.
  `/sys/fs/cgroup/cpu/edge-offload/r-1` for a daemon in the root cgroup; the limit is
  `cpu.cfs_quota_us` over `cpu.cfs_period_us`.
- cgroup v2 (the unified hierarchy offers `cpu`): a child of the process's own cgroup,
  `<its cgroup>/edge-offload/<name>`, with `cpu.max`. The kernel allows it only where the
  `cpu` controller can be enabled below the process's cgroup, which needs that cgroup to
  hold no processes of its own unless it is the root (the "no internal processes" rule):
  where it cannot, nothing is changed and `CgroupUnavailable` says why.

Memory (`memory_group`, `limit_memory`) goes the same way: v1, a `memory` hierarchy,
`<its memory cgroup>/edge-offload/<name>` with `memory.limit_in_bytes` (and
`memory.memsw.limit_in_bytes`, where the kernel accounts swap, to the same: no swap beyond
it); v2, the same child as for CPU with `memory.max` (and `memory.swap.max` 0). A process
that passes its limit is killed by the kernel's OOM killer (`oom_kills` counts it). The
process runtime makes a replica's memory cgroup before it spawns the replica and the
replica joins it before its interpreter starts, so everything it allocates is charged
there; memory a process allocated before it is moved in later (`limit_memory` on a running
one) stays charged where it was.

Writing the pid to `cgroup.procs` moves the whole process, every thread of it (ONNX
Runtime's pools included), and the threads it starts later are created inside. The cgroup
is found again from `/proc/<pid>/cgroup` (a daemon restarted finds the cgroup of a replica
it adopts) and removed once the process has exited (`remove_group`). Every call is blocking
file I/O on cgroupfs (microseconds); none waits on anything else.

`weigh_replicas` is the Docker runtime's: a top-level cgroup with a CPU weight, for the
engine to create the replicas' containers in (`--replica-cpu-shares`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from node_daemon.runtimes.cgroups import ROOT, cgroup_dirs

PARENT = "edge-offload"
PERIOD_US = 100_000
"""The CFS period the quota is a share of (the kernel's default, 100 ms)."""
MIN_QUOTA_US = 1_000
"""The kernel's smallest CFS quota (1 ms)."""


MIB = 1024 * 1024


class CgroupUnavailable(Exception):
    """This host gives no writable cgroup to limit the process's CPU or memory; the message
    says why."""


def _quota_us(cores: float) -> int:
    return max(MIN_QUOTA_US, round(cores * PERIOD_US))


def _own(directory: Path, name: str) -> bool:
    """Whether `directory` is the cgroup made for `name` here."""
    return directory.name == name and directory.parent.name == PARENT


def _v2_has(directory: Path, controller: str) -> bool:
    try:
        return controller in (directory / "cgroup.controllers").read_text().split()
    except OSError:
        return False


def _v2_has_cpu(directory: Path) -> bool:
    return _v2_has(directory, "cpu")


def _enable(directory: Path, controller: str) -> None:
    """Make `controller` available to the children of `directory` (v2)."""
    control = directory / "cgroup.subtree_control"
    if controller not in control.read_text().split():
        control.write_text(f"+{controller}")


def _enable_cpu(directory: Path) -> None:
    _enable(directory, "cpu")


def _v2_group(v2: Path, name: str, controller: str) -> Path:
    """The v2 cgroup made for `name` below `v2` (a process's own cgroup; `v2` itself when
    it is that one already), with `controller` enabled for it."""
    if _own(v2, name):
        _enable(v2.parent, controller)
        return v2
    parent = v2 / PARENT
    _enable(v2, controller)
    parent.mkdir(exist_ok=True)
    _enable(parent, controller)
    group = parent / name
    group.mkdir(exist_ok=True)
    return group


def limit_cpu(pid: int, name: str, cores: float, root: Path = ROOT) -> Path:
    """Limit `pid` (every thread) to `cores` CPUs in its cgroup named `name`, creating it and
    moving the process in on the first call; returns the cgroup's directory. Idempotent.
    CgroupUnavailable when neither hierarchy lets it (not root, read-only cgroupfs, a v2
    cgroup whose subtree cannot get the `cpu` controller); ProcessLookupError when the
    process is gone."""
    if not (cores > 0):
        raise ValueError(f"cores must be positive, got {cores!r:.12}")
    dirs = cgroup_dirs(pid, root)
    if not dirs:
        raise ProcessLookupError(f"no process {pid}")
    cpu = dirs.get("cpu")
    try:
        if cpu is not None and (cpu / "cpu.cfs_quota_us").exists():  # v1
            group = cpu if _own(cpu, name) else cpu / PARENT / name
            group.mkdir(parents=True, exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(_quota_us(cores)))
            if group != cpu:
                (group / "cgroup.procs").write_text(str(pid))
            return group
        v2 = dirs.get("")
        if v2 is not None and (_v2_has_cpu(v2) or (_own(v2, name) and _v2_has_cpu(v2.parent))):
            group = _v2_group(v2, name, "cpu")
            (group / "cpu.max").write_text(f"{_quota_us(cores)} {PERIOD_US}")
            if group != v2:
                (group / "cgroup.procs").write_text(str(pid))
            return group
    except OSError as err:
        if err.errno == errno.ESRCH:
            raise ProcessLookupError(f"no process {pid}") from err
        raise _unavailable("CPU", err) from err
    raise CgroupUnavailable(
        "no cgroup CPU controller this process can use (neither a v1 `cpu` hierarchy nor "
        "`cpu` in its v2 cgroup); use the Docker runtime"
    )


def _write_memory_limit(group: Path, limit_bytes: int) -> None:
    """Set a memory cgroup's limit, v1 or v2, swap included where the kernel accounts it."""
    if (group / "memory.limit_in_bytes").exists():  # v1
        swap = group / "memory.memsw.limit_in_bytes"
        # memsw may never be below the memory limit: raise it first, lower it last.
        if swap.exists() and limit_bytes > int(swap.read_text()):
            swap.write_text(str(limit_bytes))
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        if swap.exists():
            swap.write_text(str(limit_bytes))
        return
    (group / "memory.max").write_text(str(limit_bytes))
    if (group / "memory.swap.max").exists():
        (group / "memory.swap.max").write_text("0")


def _unavailable(what: str, err: OSError) -> CgroupUnavailable:
    return CgroupUnavailable(
        f"cannot limit {what} with a cgroup here ({err.strerror or err}: "
        f"{str(err.filename)[:120]}); run the daemon as root with a writable cgroupfs, "
        "or use the Docker runtime"
    )


def memory_group(name: str, mib: int, pid: int | None = None, root: Path = ROOT) -> Path:
    """Create (or find) the memory cgroup made for `name` below the memory cgroup of `pid`
    (default: this process, whose children start in its cgroups), limit it to `mib` MiB,
    and return its directory; a process joins it by writing its pid to `cgroup.procs`.
    Idempotent. CgroupUnavailable when neither hierarchy lets it (not root, a read-only
    cgroupfs, no memory controller, a v2 cgroup whose subtree cannot get `memory`)."""
    if mib <= 0:
        raise ValueError(f"mib must be positive, got {mib!r:.12}")
    dirs = cgroup_dirs(os.getpid() if pid is None else pid, root)
    memory = dirs.get("memory")
    try:
        if memory is not None and (memory / "memory.limit_in_bytes").exists():  # v1
            group = memory if _own(memory, name) else memory / PARENT / name
            group.mkdir(parents=True, exist_ok=True)
            _write_memory_limit(group, mib * MIB)
            return group
        v2 = dirs.get("")
        if v2 is not None and (
            _v2_has(v2, "memory") or (_own(v2, name) and _v2_has(v2.parent, "memory"))
        ):
            group = _v2_group(v2, name, "memory")
            _write_memory_limit(group, mib * MIB)
            return group
    except OSError as err:
        raise _unavailable("memory", err) from err
    raise CgroupUnavailable(
        "no cgroup memory controller this process can use (neither a v1 `memory` hierarchy "
        "nor `memory` in its v2 cgroup); use the Docker runtime"
    )


def limit_memory(pid: int, name: str, mib: int, root: Path = ROOT) -> Path:
    """Limit `pid` to `mib` MiB in its memory cgroup named `name`, creating it and moving
    the process in on the first call; returns the cgroup's directory. Idempotent. What the
    process allocated before its move stays charged where it was. CgroupUnavailable as
    `memory_group` (and when the kernel refuses a limit below what the cgroup uses now);
    ProcessLookupError when the process is gone."""
    if not cgroup_dirs(pid, root):
        raise ProcessLookupError(f"no process {pid}")
    group = memory_group(name, mib, pid, root)
    if group in cgroup_dirs(pid, root).values():
        return group
    try:
        (group / "cgroup.procs").write_text(str(pid))
    except OSError as err:
        if err.errno == errno.ESRCH:
            raise ProcessLookupError(f"no process {pid}") from err
        raise _unavailable("memory", err) from err
    return group


def oom_kills(group: Path) -> int:
    """How many processes the kernel's OOM killer killed in the memory cgroup `group` for
    passing its limit; 0 when it cannot tell (the cgroup gone, an old kernel)."""
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        try:
            lines = (group / name).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return 0


def leftover_groups(name: str, root: Path = ROOT) -> list[Path]:
    """The cgroups made for `name` below this process's cgroups that exist now: what a
    daemon killed between making a replica's cgroup and spawning it left behind."""
    found = []
    for directory in cgroup_dirs(os.getpid(), root).values():
        group = directory / PARENT / name
        if group.is_dir():
            found.append(group)
    return found


def can_limit_cpu(pid: int | None = None, root: Path = ROOT) -> bool:
    """Whether `limit_cpu` can be expected to work for `pid` (default: this process) here: its
    v1 `cpu` cgroup is writable, or its v2 cgroup offers `cpu` and can be written. Changes
    nothing; a v2 cgroup that holds processes of its own can still refuse (see the module
    docstring)."""
    dirs = cgroup_dirs(os.getpid() if pid is None else pid, root)
    cpu = dirs.get("cpu")
    if cpu is not None and (cpu / "cpu.cfs_quota_us").exists():
        return os.access(cpu, os.W_OK)
    v2 = dirs.get("")
    return v2 is not None and _v2_has_cpu(v2) and os.access(v2 / "cgroup.subtree_control", os.W_OK)


def can_limit_memory(pid: int | None = None, root: Path = ROOT) -> bool:
    """Whether `memory_group` can be expected to work below `pid`'s (default: this
    process's) cgroups here: its v1 `memory` cgroup is writable, or its v2 cgroup offers
    `memory` and can be written. Changes nothing; a v2 cgroup that holds processes of its
    own can still refuse (see the module docstring)."""
    dirs = cgroup_dirs(os.getpid() if pid is None else pid, root)
    memory = dirs.get("memory")
    if memory is not None and (memory / "memory.limit_in_bytes").exists():
        return os.access(memory, os.W_OK)
    v2 = dirs.get("")
    return (
        v2 is not None
        and _v2_has(v2, "memory")
        and os.access(v2 / "cgroup.subtree_control", os.W_OK)
    )


def own_groups(pid: int, name: str, root: Path = ROOT) -> list[Path]:
    """The cgroups made for `name` that `pid` is in now (none when it was never limited)."""
    return [d for d in cgroup_dirs(pid, root).values() if _own(d, name)]


def remove_group(group: Path) -> bool:
    """Remove a cgroup made by `limit_cpu` or `memory_group` once nothing runs in it; True
    when it is gone (or was never there). Its parent `edge-offload` stays, shared by the
    others."""
    if group.parent.name != PARENT:
        return False
    try:
        os.rmdir(group)
    except FileNotFoundError:
        return True
    except OSError:  # a process still in it (exiting), or not ours to remove
        return False
    return True


REPLICAS_PARENT = "edge-offload-replicas"
"""The Docker runtime's cgroup parent for replicas when the node weighs them
(`weigh_replicas`): a child of the hierarchy's root, beside Docker's own `docker`."""
MAX_SHARES = 262_144
"""cgroup v1's largest `cpu.shares`."""


def shares_to_weight(shares: int) -> int:
    """cgroup v2's `cpu.weight` that weighs against the default 100 as `shares` (v1) weigh
    against the default 1024."""
    return min(10_000, max(1, round(shares * 100 / 1024)))


def weigh_replicas(shares: int, root: Path = ROOT) -> Path:
    """Create (or find) the top-level cgroup `REPLICAS_PARENT` with this CPU weight, in v1
    `cpu.shares` units (v2: `shares_to_weight`), and return its `cpu` directory. Containers
    created under it compete as one group with that weight against the host's other
    top-level entities: each of the root cgroup's runnable threads (dockerd, containerd,
    the node and broker daemons when they run there) weighs 1024, as does Docker's own
    `docker` group, all of whose containers share it. Idempotent; the cgroup is left in
    place (it outlives any one daemon). CgroupUnavailable when it cannot be written."""
    if not 2 <= shares <= MAX_SHARES:
        raise ValueError(f"CPU shares must be 2 to {MAX_SHARES}, got {shares!r:.12}")
    try:
        if (root / "cpu" / "cpu.shares").exists():  # v1
            group = root / "cpu" / REPLICAS_PARENT
            group.mkdir(exist_ok=True)
            (group / "cpu.shares").write_text(str(shares))
            return group
        if _v2_has_cpu(root):
            _enable_cpu(root)
            group = root / REPLICAS_PARENT
            group.mkdir(exist_ok=True)
            (group / "cpu.weight").write_text(str(shares_to_weight(shares)))
            return group
    except OSError as err:
        raise CgroupUnavailable(
            f"cannot weigh the replicas' cgroup ({err.strerror or err}: "
            f"{str(err.filename)[:120]}); run the node as root on the engine's host with a "
            "writable cgroupfs"
        ) from err
    raise CgroupUnavailable("no cgroup CPU controller at the hierarchy's root to weigh with")
