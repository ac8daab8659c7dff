"""`ProcessRuntime`: each replica is a `python -m runtime.server` subprocess.

For hosts where no Docker engine is reachable (and for fast tests). It runs the same server
code as the container, on the same interface as `DockerRuntime`; it gives no isolation and
cannot limit resources.

Each replica has a folder (token, log, `replica.json`). Replicas run in their own session,
so they outlive the daemon; a daemon started again with the same `workdir` adopts those
still running (`adopt`). Without a `workdir`, folders are temporary and nothing is adopted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from node_daemon.runtimes.base import (
    LISTENING,
    Replica,
    ReplicaFailed,
    ReplicaSpec,
    ReplicaStats,
    ReplicaStatus,
    ResourceUpdateUnsupported,
    wait_ready,
)

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
        return _pid_runs_replica(self.pid, self.workdir)


def _pid_runs_replica(pid: int, workdir: Path) -> bool:
    """Whether `pid` is still the runtime server of the replica in `workdir` (not a reused
    pid of some other program)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and str(workdir / "token").encode() in cmdline


def _proc_stats(pid: int) -> ReplicaStats | None:
    # /proc reads never block on disk.
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    # Fields after the command name, 0-based: utime 11, stime 12, starttime 19.
    cpu_s = (int(fields[11]) + int(fields[12])) / ticks
    age_s = max(1e-3, uptime_s - int(fields[19]) / ticks)
    memory_mib = rss_pages * os.sysconf("SC_PAGE_SIZE") // (1024 * 1024)
    return ReplicaStats(cpu_pct=100.0 * cpu_s / age_s, memory_used_mib=memory_mib)


class ProcessRuntime:
    name = "process"

    def __init__(self, workdir: Path | None = None) -> None:
        """`workdir`: where each replica's folder goes; see the module docstring."""
        self._workdir = workdir
        self._running: dict[str, _Running] = {}

    async def start(self, spec: ReplicaSpec, ready_timeout_s: float = 60.0) -> Replica:
        """Start the replica and return once it is ready. ReplicaFailed (with its log tail)
        when it exits or is not ready in time; nothing is left running then."""
        if spec.replica_id in self._running:
            raise ValueError(f"replica {spec.replica_id} is already running here")
        if self._workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix=f"offload-{spec.replica_id}-"))
        else:
            workdir = self._workdir / spec.replica_id
            if workdir.exists():  # left by a replica that is gone: its log is stale
                shutil.rmtree(workdir)
            workdir.mkdir(parents=True)
        token_file = workdir / "token"
        token_file.write_text(spec.token)
        token_file.chmod(0o600)
        command = [
            sys.executable, "-m", "runtime.server",
            "--model", str(spec.model_path), "--name", spec.model_name,
            "--host", spec.host, "--port", "0", "--token-file", str(token_file),
            "--concurrency", str(spec.concurrency),
        ]  # fmt: skip
        if spec.warmup_inputs is not None:
            command += ["--warmup-inputs", str(spec.warmup_inputs)]
        if spec.gpu_memory_mib:
            command += ["--gpu-mem-limit-mib", str(spec.gpu_memory_mib)]
        env = dict(os.environ)
        # The replica sees exactly its GPUs (none: no GPU at all).
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_uuids)
        with (workdir / _LOG).open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                *command, stdout=log, stderr=log, stdin=asyncio.subprocess.DEVNULL,
                cwd=_REPO_ROOT, env=env, start_new_session=True,
            )  # fmt: skip
        replica = Replica(spec.replica_id, "", self.name, str(process.pid), dict(spec.labels))
        running = _Running(replica, workdir, process)
        self._running[spec.replica_id] = running
        try:
            port = await self._port(running, ready_timeout_s)
            endpoint = f"{spec.host}:{port}"
            await wait_ready(
                endpoint,
                spec.token,
                spec.model_name,
                ready_timeout_s,
                alive=lambda: self._check_alive(spec.replica_id),
            )
        except (ReplicaFailed, TimeoutError) as err:
            tail = self._log_tail(running)
            await self.stop(spec.replica_id, grace_s=0)
            raise ReplicaFailed(f"replica {spec.replica_id}: {err}\n{tail}") from err
        running.replica = Replica(
            spec.replica_id, endpoint, self.name, str(process.pid), dict(spec.labels)
        )
        (workdir / _RECORD).write_text(
            json.dumps({"pid": process.pid, "endpoint": endpoint, "labels": dict(spec.labels)})
        )
        logger.info("replica=%s pid=%d ready at %s", spec.replica_id, process.pid, endpoint)
        return running.replica

    async def _port(self, running: _Running, timeout_s: float) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            text = (running.workdir / _LOG).read_text(errors="replace")
            if match := LISTENING.search(text):
                return int(match.group(1))
            if not running.alive():
                raise ReplicaFailed(f"exited with code {running.exit_code()}")
            await asyncio.sleep(0.02)
        raise TimeoutError(f"the replica did not listen within {timeout_s:.0f}s")

    async def _check_alive(self, replica_id: str) -> None:
        running = self._running[replica_id]
        if not running.alive():
            raise ReplicaFailed(f"exited with code {running.exit_code()}")

    async def adopt(self, selector: Mapping[str, str]) -> list[Replica]:
        """Take over the replicas an earlier daemon left running in `workdir` whose labels
        include `selector`. Folders of replicas that are gone are removed."""
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
            if not _pid_runs_replica(record["pid"], workdir):
                logger.warning("replica=%s pid=%d is gone: dropping it", replica_id, record["pid"])
                shutil.rmtree(workdir, ignore_errors=True)
                continue
            replica = Replica(
                replica_id, record["endpoint"], self.name, str(record["pid"]), labels
            )
            self._running[replica_id] = _Running(replica, workdir, None)
            adopted.append(replica)
            logger.info(
                "replica=%s pid=%d adopted at %s", replica_id, replica.ref, replica.endpoint
            )
        return adopted

    def _log_tail(self, running: _Running, lines: int = 40) -> str:
        path = running.workdir / _LOG
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    async def status(self, replica_id: str) -> ReplicaStatus | None:
        """Running or not, with the exit code and log tail once it exited; None if unknown."""
        running = self._running.get(replica_id)
        if running is None:
            return None
        if running.alive():
            return ReplicaStatus(running=True)
        return ReplicaStatus(False, running.exit_code(), self._log_tail(running))

    async def stats(self, replica_id: str) -> ReplicaStats | None:
        """CPU (average since start) and resident memory; None when it is not running."""
        running = self._running.get(replica_id)
        if running is None or not running.alive():
            return None
        return _proc_stats(running.pid)

    async def update(self, replica_id: str, cpus: float, memory_mib: int) -> None:
        raise ResourceUpdateUnsupported(
            "the process runtime cannot limit CPU or memory; use the Docker runtime"
        )

    async def stop(self, replica_id: str, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to `grace_s` (plus a margin for exit), then SIGKILL; then its
        folder goes. Returns the exit code (None when unknown: adopted, or no such replica
        here: idempotent)."""
        running = self._running.get(replica_id)
        if running is None:
            return None
        if running.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(running.pid, signal.SIGTERM)
            if not await self._wait_exit(running, grace_s + 5.0):
                logger.warning("replica=%s did not exit after SIGTERM: killing", replica_id)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(running.pid, signal.SIGKILL)
                await self._wait_exit(running, 10.0)
        del self._running[replica_id]
        if self._workdir is None:
            shutil.rmtree(running.workdir, ignore_errors=True)
        else:  # keep the log of a stopped replica; the rest goes
            (running.workdir / "token").unlink(missing_ok=True)
            (running.workdir / _RECORD).unlink(missing_ok=True)
        return running.exit_code()

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
        """Stop every replica this runtime runs."""
        for replica_id in list(self._running):
            await self.stop(replica_id)

    async def detach(self) -> None:
        """Forget every replica without stopping it (a daemon shutting down that leaves its
        replicas serving, to be adopted by the next one)."""
        self._running.clear()
