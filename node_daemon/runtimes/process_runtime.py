"""`ProcessRuntime`: each replica is a `python -m runtime.server` subprocess.

For hosts where no Docker engine is reachable (and for fast tests). It runs the same server
code as the container, on the same interface as `DockerRuntime`; it gives no isolation. It
limits CPU (a replica's `cpus` from its start, and `update`) and memory (its `memory_mib`,
and `update`) with cgroups of the replica's own where the host lets it write them
(`node_daemon.runtimes.cgroup_limits`). Where it cannot, a CPU quota is left unset (said
once: the node's resource manager shares CPU by other means), but a replica that asks for
`memory_mib` is refused before anything starts (`LimitUnavailable`): a limit asked for and
silently not kept (a replica given 512 MiB used 4,046) is worse than a clear no.

A replica's memory cgroup is made before it is spawned, and the replica joins it through a
`sh` launcher (it writes its own pid to the cgroup's `cgroup.procs`, then execs the rest),
so the limit holds from its interpreter's first allocation; a replica the kernel kills for
passing it fails its start saying so. Its cgroups are removed when it stops, after a failed
start, and, for one a killed daemon left behind, by the next daemon's `adopt`.

Each replica has a folder (token, clients file, log, `replica.json`). Folders are 0700 and
files 0600, whatever the umask: the token is the deployment's secret. Replicas run in their
own session, so they outlive the daemon; a daemon started again with the same `workdir`
adopts those still running (`adopt`). Without a `workdir`, folders are temporary and nothing
is adopted.

`replica.json` is written before the process is spawned and rewritten (atomically) with its
pid and then its endpoint, so a daemon killed between any two steps leaves a folder the next
one finds: a replica that never became ready (no endpoint) is stopped and removed then, its
process found by its pid or, killed before the pid was written, by its token path.

A replica is spawned through util-linux's `taskset` (its node's `cpuset`) and, started with
`background`, `chrt --idle`: each sets itself and execs the next, so the interpreter's first
instruction already runs on its CPUs and at its priority, with the pid the spawn returned.
Without them a replica would run on the daemon's CPUs at normal priority until the daemon
pinned and lowered it after the spawn, its interpreter starting meanwhile, perhaps on the
CPU of a replica that serves. Where they are missing (said once) that is what happens.
Scheduling policy and affinity are per thread on Linux, and a new thread takes its
creator's, so ONNX Runtime's pools, created later, inherit both; every thread of the
process (`/proc/PID/task`) is set again right after the spawn and once it listens, which
changes nothing after the launchers and is all there is without them.

A replica started with `background` runs at SCHED_IDLE until it is ready. Once ready (or
after `BACKGROUND_LIMIT_S`) every thread is put back to SCHED_OTHER, before `start` returns
and so before the replica record carries an endpoint: an adopted replica with an endpoint
was raised, and one without is stopped.
Leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE of 20; a daemon with neither
starts every replica at normal priority (and says so once). A replica being stopped is put
at SCHED_IDLE before its SIGTERM (entering it needs no capability): the broker stops a
replica once its deployment no longer routes to it (a migration's source after the switch;
a deleted deployment's), so its drain and exit yield the CPU to the replicas that serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from common.private_files import PRIVATE_DIR, PRIVATE_FILE, open_private, private_dir
from node_daemon.runtimes import cgroup_limits, cgroups
from node_daemon.runtimes.base import (
    BACKGROUND_LIMIT_S,
    CLIENTS_FILE,
    LISTENING,
    METRICS_SERVED,
    LimitUnavailable,
    Replica,
    ReplicaFailed,
    ReplicaSpec,
    ReplicaStats,
    ReplicaStatus,
    ResourceUpdateUnsupported,
    priority_args,
    tls_args,
    uncancellable,
    write_clients_file,
    write_tls_files,
)
from node_daemon.runtimes.readiness import wait_ready
from runtime.clients import RELOAD_SIGNAL, format_clients

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]
_RECORD = "replica.json"
_LOG = "replica.log"


@dataclass(slots=True)
class _Running:
    replica: Replica
    workdir: Path
    process: asyncio.subprocess.Process | None
    """Our child; None for a replica adopted from an earlier daemon (not our child)."""
    started_ticks: int | None = None
    """An adopted process's start time (clock ticks after boot), which tells it from a
    later process given the same pid."""
    background_since: float | None = None
    """time.monotonic() when its threads were put at background priority; None when it
    runs at normal priority."""

    @property
    def pid(self) -> int:
        return int(self.replica.ref)

    def exit_code(self) -> int | None:
        """The exit code once it exited; None while it runs (or exited unknown: adopted)."""
        if self.process is not None:
            return self.process.returncode
        return None

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.returncode is None
        # Not by its command line: that reads empty while the process exits, before it is
        # gone (and so before its GPUs are free).
        stat = _stat(self.pid)
        return stat is not None and stat[0] not in "ZX" and int(stat[19]) == self.started_ticks


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (0-based: state 0, utime 11,
    stime 12, starttime 19); None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _pid_runs_replica(pid: int, workdir: Path) -> bool:
    """Whether `pid` is still the runtime server of the replica in `workdir` (not a reused
    pid of some other program)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX" and str(workdir / "token").encode() in cmdline


def _find_pid(workdir: Path) -> int | None:
    """The process running the replica in `workdir`, found by its token path; None if none."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        pid = int(cmdline.parent.name)
        if _pid_runs_replica(pid, workdir):
            return pid
    return None


def _write_record(
    workdir: Path,
    pid: int | None,
    endpoint: str,
    labels: Mapping[str, str],
    metrics_endpoint: str = "",
) -> None:
    """Replace `replica.json` atomically: a reader sees the old record or the new one."""
    tmp = workdir / f".{_RECORD}.tmp"
    record = {
        "pid": pid,
        "endpoint": endpoint,
        "labels": dict(labels),
        "metrics_endpoint": metrics_endpoint,
    }
    with open_private(tmp) as out:
        out.write(json.dumps(record).encode())
    os.replace(tmp, workdir / _RECORD)


_CAP_SYS_NICE = 23


def can_leave_background() -> bool:
    """Whether this process may take a thread out of SCHED_IDLE again: Linux allows it
    with CAP_SYS_NICE, or with an RLIMIT_NICE of at least 20 (nice 0)."""
    try:
        status = Path("/proc/self/status").read_text()
        caps = next(line for line in status.splitlines() if line.startswith("CapEff:"))
        if int(caps.split()[1], 16) >> _CAP_SYS_NICE & 1:
            return True
    except (OSError, StopIteration, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or soft >= 20


def set_background(pid: int, background: bool) -> int:
    """Put every thread of `pid` at SCHED_IDLE (`background`) or back at SCHED_OTHER (its
    nice value untouched); returns how many threads were changed. Threads that exit
    meanwhile, or a process that is gone, are skipped. PermissionError when the kernel
    refuses (see `can_leave_background`)."""
    policy = os.SCHED_IDLE if background else os.SCHED_OTHER
    param = os.sched_param(0)
    return _each_thread(pid, lambda tid: os.sched_setscheduler(tid, policy, param))


def set_affinity(pid: int, cpus: frozenset[int]) -> int:
    """Run every thread of `pid` on `cpus` only (threads it starts later inherit it);
    returns how many threads were changed, skipping those that exit meanwhile."""
    return _each_thread(pid, lambda tid: os.sched_setaffinity(tid, cpus))


THREAD_PASSES = 8
"""Passes over a process's threads at most (`_each_thread`)."""


def _each_thread(pid: int, apply: Callable[[int], object]) -> int:
    """`apply` to each thread id of `pid`, listing them again until a listing shows none
    it has not seen (at most `THREAD_PASSES`): a thread that one not yet changed started
    during a pass took its creator's old setting, and shows up in the next listing; how
    many it was applied to (0: the process is gone)."""
    seen: set[int] = set()
    changed = 0
    for _ in range(THREAD_PASSES):
        try:
            tids = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            break
        new = [tid for tid in tids if tid not in seen]
        if not new:
            break
        for tid in new:
            seen.add(tid)
            try:
                apply(tid)
            except ProcessLookupError:
                continue
            changed += 1
    return changed


def _metrics_port(workdir: Path) -> int | None:
    """The metrics port the replica logged; None when it logged none. The runtime logs it
    before the line `_port` waits for, so once that one is there, this one is too."""
    text = (workdir / _LOG).read_text(errors="replace")
    match = METRICS_SERVED.search(text)
    return int(match.group(1)) if match else None


def _log_tail(workdir: Path, lines: int = 40) -> str:
    path = workdir / _LOG
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _proc_stats(pid: int) -> ReplicaStats | None:
    """CPU time and resident memory from /proc (never blocks on disk), the CPU quota and its
    throttling from the process's cgroup when it has one of its own (`update`)."""
    fields = _stat(pid)
    if fields is None:
        return None
    try:
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except OSError:
        return None
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    memory_mib = rss_pages * os.sysconf("SC_PAGE_SIZE") // (1024 * 1024)
    quota = cgroups.cpu_accounting(pid)
    if quota is None or quota.limit_cores == 0:
        return ReplicaStats(cpu_seconds=cpu_s, memory_used_mib=memory_mib)
    return ReplicaStats(
        cpu_seconds=cpu_s,
        memory_used_mib=memory_mib,
        periods=quota.periods,
        throttled_periods=quota.throttled_periods,
        cpu_limit=quota.limit_cores,
    )


class ProcessRuntime:
    name = "process"
    reads_clients = True
    model_file_mode = PRIVATE_FILE

    def __init__(
        self,
        workdir: Path | None = None,
        cpuset: frozenset[int] = frozenset(),
        cgroup_root: Path = cgroups.ROOT,
    ) -> None:
        """`workdir`: where each replica's folder goes; see the module docstring. `cpuset`: the
        CPUs every replica runs on (empty: those this process may use), as Docker's
        `--cpuset-cpus` pins a container. `cgroup_root`: where the cgroup hierarchies are
        mounted."""
        self._workdir = workdir
        self._cpuset = cpuset
        self._cgroup_root = cgroup_root
        self._running: dict[str, _Running] = {}
        self._cgroups: dict[str, set[Path]] = {}
        """replica_id -> the cgroups made for it: its memory cgroup (recorded before it is
        spawned), its CPU cgroup (at its start, or by `update`)."""
        self._memory_groups: dict[str, Path] = {}
        """replica_id -> its memory cgroup, while it runs (what a failed start reads its OOM
        kills from)."""
        self._background = can_leave_background()
        self._warned_background = False
        self._warned_cgroup = False
        self._taskset = shutil.which("taskset")
        self._chrt = shutil.which("chrt")
        self._warned_launcher = False

    async def start(self, spec: ReplicaSpec, ready_timeout_s: float = 60.0) -> Replica:
        """Start the replica and return once it is ready. ReplicaFailed (with its log tail)
        when it exits or is not ready in time. On any exception, cancellation included,
        what was started is stopped first (see `Runtime`)."""
        if spec.replica_id in self._running:
            raise ValueError(f"replica {spec.replica_id} is already running here")
        if self._workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix=f"offload-{spec.replica_id}-"))
        else:
            workdir = self._workdir / spec.replica_id
            if workdir.exists():  # left by a replica that is gone: its log is stale
                shutil.rmtree(workdir)
            private_dir(self._workdir)
            workdir.mkdir(mode=PRIVATE_DIR)
        try:
            await uncancellable(self._spawn(spec, workdir))
            running = self._running[spec.replica_id]
            if self._cpuset:
                set_affinity(running.pid, self._cpuset)
            if spec.cpus > 0:
                self._limit(spec.replica_id, running.pid, spec.cpus)
            if spec.background:
                self._lower(running)
            port = await self._port(running, ready_timeout_s)
            # Threads that raced the first pass (set before any model is loaded).
            if self._cpuset:
                set_affinity(running.pid, self._cpuset)
            if running.background_since is not None:
                set_background(running.pid, True)
            elif spec.background and self._background:
                # Raised as overdue before it listened: the launcher (chrt) may have set
                # SCHED_IDLE after that raise, and the interpreter it execs keeps it.
                set_background(running.pid, False)
            endpoint = f"{spec.host}:{port}"
            metrics_port = _metrics_port(workdir)
            await wait_ready(
                endpoint,
                spec.token,
                spec.model_name,
                ready_timeout_s,
                alive=lambda: self._check_alive(spec.replica_id),
                tls=spec.tls,
            )
            self._raise(running, "ready")
        except BaseException as err:
            tail = _log_tail(workdir)
            killed = self._oom_killed(spec)
            await uncancellable(self._discard(spec.replica_id, workdir))
            if isinstance(err, ReplicaFailed | TimeoutError):
                raise ReplicaFailed(f"replica {spec.replica_id}: {err}{killed}\n{tail}") from err
            raise
        metrics_endpoint = f"{spec.host}:{metrics_port}" if metrics_port is not None else ""
        running.replica = replace(
            running.replica, endpoint=endpoint, metrics_endpoint=metrics_endpoint
        )
        _write_record(workdir, running.pid, endpoint, spec.labels, metrics_endpoint)
        logger.info(
            "replica=%s pid=%d ready at %s (metrics %s)",
            spec.replica_id,
            running.pid,
            endpoint,
            metrics_endpoint or "-",
        )
        return running.replica

    async def _spawn(self, spec: ReplicaSpec, workdir: Path) -> None:
        """Write the token, an empty clients file and the record, start the process, and
        track it."""
        token_file = workdir / "token"
        with open_private(token_file) as out:
            out.write(spec.token.encode())
        write_clients_file(workdir, format_clients(()))
        tls_files = write_tls_files(spec, workdir)
        _write_record(workdir, None, "", spec.labels)
        join = self._join_memory_group(spec) if spec.memory_mib else []
        command = [
            *join,
            *self._launcher(spec.background),
            sys.executable, "-m", "runtime.server",
            "--model", str(spec.model_path), "--name", spec.model_name,
            "--host", spec.host, "--port", "0", "--metrics-port", "0",
            "--token-file", str(token_file), "--concurrency", str(spec.concurrency),
            "--clients-file", str(workdir / CLIENTS_FILE),
            *tls_args(spec, *(str(path) for path in tls_files or ("", ""))),
            *priority_args(spec),
        ]  # fmt: skip
        if spec.warmup_inputs is not None:
            command += ["--warmup-inputs", str(spec.warmup_inputs)]
        if spec.gpu_memory_mib:
            command += ["--gpu-mem-limit-mib", str(spec.gpu_memory_mib)]
        env = dict(os.environ)
        # The replica sees exactly its GPUs (none: no GPU at all).
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_uuids)
        with open_private(workdir / _LOG) as log:
            process = await asyncio.create_subprocess_exec(
                *command, stdout=log, stderr=log, stdin=asyncio.subprocess.DEVNULL,
                cwd=_REPO_ROOT, env=env, start_new_session=True,
            )  # fmt: skip
        replica = Replica(spec.replica_id, "", self.name, str(process.pid), dict(spec.labels))
        self._running[spec.replica_id] = _Running(replica, workdir, process)
        _write_record(workdir, process.pid, "", spec.labels)

    def _join_memory_group(self, spec: ReplicaSpec) -> list[str]:
        """Make the replica's memory cgroup (recorded first, so that whatever ends the start
        removes it) and return the launcher that moves the replica into it before anything
        else runs. LimitUnavailable when this host gives no memory cgroup to write."""
        self._cgroups.setdefault(spec.replica_id, set())
        try:
            group = cgroup_limits.memory_group(
                spec.replica_id, spec.memory_mib, root=self._cgroup_root
            )
        except cgroup_limits.CgroupUnavailable as err:
            raise LimitUnavailable(f"the process runtime has no memory cgroup: {err}") from err
        self._cgroups[spec.replica_id].add(group)
        self._memory_groups[spec.replica_id] = group
        # `exec` keeps the shell's pid: the replica's pid is the one the spawn returns.
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs")]

    def _oom_killed(self, spec: ReplicaSpec) -> str:
        """What to add to a failed start's reason when the kernel killed the replica for
        passing its memory limit; empty otherwise."""
        group = self._memory_groups.get(spec.replica_id)
        if group is None or not cgroup_limits.oom_kills(group):
            return ""
        return (
            f" (killed by the kernel for passing its memory limit, memory_mib "
            f"{spec.memory_mib}: ask for more)"
        )

    def _launcher(self, background: bool) -> list[str]:
        """The commands that put the replica on its CPUs and, for a `background` start, at
        SCHED_IDLE before its interpreter starts (see the module docstring); each execs the
        next. Empty when there is nothing to set, or nothing here to set it with."""
        launcher = []
        missing = []
        if self._cpuset:
            if self._taskset is None:
                missing.append("taskset")
            else:
                cpus = ",".join(str(cpu) for cpu in sorted(self._cpuset))
                launcher += [self._taskset, "--cpu-list", cpus]
        if background and self._background:
            if self._chrt is None:
                missing.append("chrt")
            else:
                launcher += [self._chrt, "--idle", "0"]
        if missing and not self._warned_launcher:
            self._warned_launcher = True
            logger.warning(
                "no %s on PATH (util-linux): replicas run on this daemon's CPUs at normal "
                "priority until it has spawned them",
                " or ".join(missing),
            )
        return launcher

    async def _discard(self, replica_id: str, workdir: Path) -> None:
        """After a failed start: stop the process if one was started, else drop the folder.
        ReplicaFailed when the process would not stop (it stays tracked)."""
        if replica_id in self._running:
            await self.stop(replica_id, grace_s=0)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            self._memory_groups.pop(replica_id, None)
            for group in self._cgroups.pop(replica_id, set()):
                await self._remove_cgroup(replica_id, group)

    def _limit(self, replica_id: str, pid: int, cpus: float) -> None:
        """Give a replica just spawned its CPU quota before it loads anything, as Docker gives
        a container its `--cpus`; where this host gives the daemon no writable cgroup it runs
        unlimited, said once (a process that already exited is found by the start's wait)."""
        try:
            group = cgroup_limits.limit_cpu(pid, replica_id, cpus, root=self._cgroup_root)
            self._cgroups.setdefault(replica_id, set()).add(group)
        except ProcessLookupError:
            return
        except cgroup_limits.CgroupUnavailable as err:
            if not self._warned_cgroup:
                self._warned_cgroup = True
                logger.warning("process replicas run without their CPU quota: %s", err)

    def _lower(self, running: _Running) -> None:
        """Put a replica just spawned at background priority, if it can be raised again."""
        if not self._background:
            if not self._warned_background:
                self._warned_background = True
                logger.warning(
                    "replicas start at normal priority: leaving SCHED_IDLE again needs "
                    "CAP_SYS_NICE or an RLIMIT_NICE of 20, which this daemon lacks"
                )
            return
        set_background(running.pid, True)
        running.background_since = time.monotonic()

    def _raise(self, running: _Running, why: str) -> None:
        """Back to normal priority (every thread); nothing when it runs there already.
        ReplicaFailed when the kernel refuses: a replica must not serve at background
        priority, so its start fails (and it is stopped)."""
        if running.background_since is None:
            return
        try:
            set_background(running.pid, False)
        except PermissionError as err:
            raise ReplicaFailed(f"cannot raise it from background priority: {err}") from err
        logger.info(
            "replica=%s back at normal priority (%s) after %.2fs",
            running.replica.replica_id,
            why,
            time.monotonic() - running.background_since,
        )
        running.background_since = None

    def _raise_if_overdue(self, running: _Running) -> None:
        since = running.background_since
        if since is not None and time.monotonic() - since > BACKGROUND_LIMIT_S:
            logger.warning(
                "replica=%s not ready after %.0fs at background priority: raising it",
                running.replica.replica_id,
                BACKGROUND_LIMIT_S,
            )
            self._raise(running, "overdue")

    async def _port(self, running: _Running, timeout_s: float) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            self._raise_if_overdue(running)
            text = (running.workdir / _LOG).read_text(errors="replace")
            if match := LISTENING.search(text):
                return int(match.group(1))
            if not running.alive():
                raise ReplicaFailed(f"exited with code {running.exit_code()}")
            await asyncio.sleep(0.02)
        raise TimeoutError(f"the replica did not listen within {timeout_s:.0f}s")

    async def _check_alive(self, replica_id: str) -> None:
        running = self._running[replica_id]
        self._raise_if_overdue(running)
        if not running.alive():
            raise ReplicaFailed(f"exited with code {running.exit_code()}")

    async def adopt(self, selector: Mapping[str, str]) -> list[Replica]:
        """Take over the replicas an earlier daemon left running in `workdir` whose labels
        include `selector`. Folders of replicas that are gone are removed; a replica that
        never became ready (its start was cut short) is stopped and removed."""
        if self._workdir is None or not self._workdir.is_dir():
            return []
        adopted = []
        for record_file in sorted(self._workdir.glob(f"*/{_RECORD}")):
            workdir = record_file.parent
            replica_id = workdir.name
            if replica_id in self._running:
                continue
            record = json.loads(record_file.read_text())
            labels = record["labels"]
            if any(labels.get(k) != v for k, v in selector.items()):
                continue
            pid = record["pid"]
            if pid is None or not _pid_runs_replica(pid, workdir):
                pid = await asyncio.to_thread(_find_pid, workdir)
            if pid is None:
                logger.warning("replica=%s is gone: dropping it", replica_id)
                shutil.rmtree(workdir, ignore_errors=True)
                for group in cgroup_limits.leftover_groups(replica_id, self._cgroup_root):
                    await self._remove_cgroup(replica_id, group)
                continue
            replica = Replica(
                replica_id,
                record["endpoint"],
                self.name,
                str(pid),
                labels,
                # A record written by a daemon older than the metrics port has none.
                record.get("metrics_endpoint", ""),
            )
            stat = _stat(pid)
            if stat is None:  # exited since it was found
                shutil.rmtree(workdir, ignore_errors=True)
                continue
            self._running[replica_id] = _Running(replica, workdir, None, int(stat[19]))
            if not replica.endpoint:
                logger.warning(
                    "replica=%s pid=%d never became ready (its start was cut short): stopping it",
                    replica_id,
                    pid,
                )
                try:
                    await self.stop(replica_id, grace_s=0)
                    continue
                except ReplicaFailed as err:  # adopted as it is: listed, so reconciled
                    logger.error("replica=%s: %s", replica_id, err)
            adopted.append(replica)
            logger.info("replica=%s pid=%d adopted at %s", replica_id, pid, replica.endpoint)
        return adopted

    async def write_clients(self, replica_id: str, text: str) -> bool:
        """Replace the clients file in the replica's folder (0600: the replica runs as this
        daemon's user); False for a replica it runs nothing of. A replica adopted from a
        daemon that predates clients files was started without one and does not read it."""
        running = self._running.get(replica_id)
        if running is None:
            return False
        await asyncio.to_thread(write_clients_file, running.workdir, text)
        return True

    async def reload_clients(self, replica_id: str) -> bool:
        """SIGHUP to the replica's process (see `Runtime.reload_clients`); False when it runs
        nothing of that id or the process is gone."""
        running = self._running.get(replica_id)
        if running is None or not running.alive():
            return False
        try:
            os.kill(running.pid, RELOAD_SIGNAL)
        except ProcessLookupError:
            return False
        return True

    async def status(self, replica_id: str) -> ReplicaStatus | None:
        """Running or not, with the exit code and log tail once it exited; None if unknown."""
        running = self._running.get(replica_id)
        if running is None:
            return None
        if running.alive():
            return ReplicaStatus(running=True)
        return ReplicaStatus(False, running.exit_code(), _log_tail(running.workdir))

    async def stats(self, replica_id: str) -> ReplicaStats | None:
        """CPU time and resident memory (and its CPU quota's, when it has one); None when it
        is not running."""
        running = self._running.get(replica_id)
        if running is None or not running.alive():
            return None
        return _proc_stats(running.pid)

    async def update(self, replica_id: str, cpus: float, memory_mib: int) -> None:
        """Limit the replica to `cpus` cores and `memory_mib` MiB (0: leave that one as it
        is) with cgroups of its own, created on the first call and moved into with every
        thread (`node_daemon.runtimes.cgroup_limits`); removed at `stop`.
        ResourceUpdateUnsupported where this host has no writable cgroup, or the kernel
        refuses a memory limit below what the replica uses now (the reason in the message);
        ReplicaFailed when the replica is not running."""
        running = self._running.get(replica_id)
        if running is None or not running.alive():
            raise ReplicaFailed(f"replica {replica_id} is not running")
        groups = []
        try:
            if cpus:
                groups.append(
                    cgroup_limits.limit_cpu(running.pid, replica_id, cpus, root=self._cgroup_root)
                )
            if memory_mib:
                memory = cgroup_limits.limit_memory(
                    running.pid, replica_id, memory_mib, root=self._cgroup_root
                )
                self._memory_groups[replica_id] = memory
                groups.append(memory)
        except cgroup_limits.CgroupUnavailable as err:
            raise ResourceUpdateUnsupported(f"the process runtime: {err}") from err
        except ProcessLookupError as err:
            raise ReplicaFailed(f"replica {replica_id} exited") from err
        finally:
            self._cgroups.setdefault(replica_id, set()).update(groups)
        logger.info(
            "replica=%s pid=%d cpus=%.2f memory_mib=%d (%s)",
            replica_id,
            running.pid,
            cpus,
            memory_mib,
            ", ".join(str(g) for g in groups),
        )

    async def stop(self, replica_id: str, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to `grace_s` (plus a margin for exit), then SIGKILL; then its
        folder and its cgroups go. Returns the exit code (None when unknown:
        adopted, or no such replica here: idempotent). ReplicaFailed when it still runs
        after SIGKILL: it stays tracked."""
        running = self._running.get(replica_id)
        if running is None:
            return None
        # Found before it exits: an adopted replica's cgroup is known only from its pid.
        groups = set(
            cgroup_limits.own_groups(running.pid, replica_id, self._cgroup_root)
            if running.alive()
            else ()
        )
        groups |= self._cgroups.get(replica_id, set())
        if running.alive():
            # Lowered first: its drain and exit yield the CPU to the replicas that serve.
            with contextlib.suppress(PermissionError):
                set_background(running.pid, True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(running.pid, signal.SIGTERM)
            if not await self._wait_exit(running, grace_s + 5.0):
                logger.warning("replica=%s did not exit after SIGTERM: killing", replica_id)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(running.pid, signal.SIGKILL)
                if not await self._wait_exit(running, 10.0):
                    raise ReplicaFailed(
                        f"replica {replica_id} (pid {running.pid}) still runs after SIGKILL"
                    )
        self._running.pop(replica_id, None)
        self._cgroups.pop(replica_id, None)
        self._memory_groups.pop(replica_id, None)
        for group in groups:
            await self._remove_cgroup(replica_id, group)
        if self._workdir is None:
            shutil.rmtree(running.workdir, ignore_errors=True)
        else:  # keep the log of a stopped replica; the rest goes
            (running.workdir / "token").unlink(missing_ok=True)
            (running.workdir / CLIENTS_FILE).unlink(missing_ok=True)
            (running.workdir / _RECORD).unlink(missing_ok=True)
        return running.exit_code()

    @staticmethod
    async def _remove_cgroup(replica_id: str, group: Path) -> None:
        """Remove a replica's cgroup once it is empty (an exited process can linger in it a
        moment); one still busy after a few seconds is logged and left."""
        deadline = time.monotonic() + 5.0
        while not cgroup_limits.remove_group(group):
            if time.monotonic() > deadline:
                logger.warning("replica=%s: its cgroup %s could not be removed", replica_id, group)
                return
            await asyncio.sleep(0.05)

    @staticmethod
    async def _wait_exit(running: _Running, timeout_s: float) -> bool:
        if running.process is not None:
            try:
                await asyncio.wait_for(running.process.wait(), timeout_s)
            except TimeoutError:
                return False
            return True
        deadline = time.monotonic() + timeout_s
        while running.alive():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def close(self) -> None:
        """Stop every replica this runtime runs (one that will not stop is logged)."""
        for replica_id in list(self._running):
            try:
                await self.stop(replica_id)
            except ReplicaFailed as err:
                logger.error("replica=%s: %s", replica_id, err)

    async def detach(self) -> None:
        """Forget every replica without stopping it (a daemon shutting down that leaves its
        replicas serving, to be adopted by the next one; it finds their cgroups from their
        pids)."""
        self._running.clear()
        self._cgroups.clear()
        self._memory_groups.clear()
