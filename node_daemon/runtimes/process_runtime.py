"""`ProcessRuntime`: each replica is a `python -m runtime.server` subprocess.

For hosts where no Docker engine is reachable (and for fast tests). It runs the same server
code as the container, on the same interface as `DockerRuntime`; it gives no isolation and
no resource limits, and says so in the log when chosen.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from node_daemon.runtimes.base import LISTENING, Replica, ReplicaFailed, ReplicaSpec, wait_ready

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class _Running:
    process: asyncio.subprocess.Process
    workdir: Path

    @property
    def log_path(self) -> Path:
        return self.workdir / "replica.log"


class ProcessRuntime:
    name = "process"

    def __init__(self, workdir: Path | None = None) -> None:
        """`workdir`: where each replica's folder (token, log) goes. When given, logs stay
        there after a replica stops (the caller owns the folder); by default each replica
        gets a temporary folder that is removed when it stops."""
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
        log = (workdir / "replica.log").open("wb")
        try:
            process = await asyncio.create_subprocess_exec(
                *command, stdout=log, stderr=log, stdin=asyncio.subprocess.DEVNULL,
                cwd=_REPO_ROOT,
            )  # fmt: skip
        finally:
            log.close()
        running = _Running(process, workdir)
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
            tail = self.log_tail(spec.replica_id)
            await self.stop(spec.replica_id, grace_s=0)
            raise ReplicaFailed(f"replica {spec.replica_id}: {err}\n{tail}") from err
        logger.info("replica=%s pid=%d ready at %s", spec.replica_id, process.pid, endpoint)
        return Replica(spec.replica_id, endpoint, self.name, str(process.pid))

    async def _port(self, running: _Running, timeout_s: float) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            text = running.log_path.read_text(errors="replace")
            if match := LISTENING.search(text):
                return int(match.group(1))
            if running.process.returncode is not None:
                raise ReplicaFailed(f"exited with code {running.process.returncode}")
            await asyncio.sleep(0.02)
        raise TimeoutError(f"the replica did not listen within {timeout_s:.0f}s")

    async def _check_alive(self, replica_id: str) -> None:
        running = self._running[replica_id]
        if running.process.returncode is not None:
            raise ReplicaFailed(f"exited with code {running.process.returncode}")

    def log_tail(self, replica_id: str, lines: int = 40) -> str:
        """The last `lines` lines of the replica's log ("" when it is gone)."""
        running = self._running.get(replica_id)
        if running is None or not running.log_path.exists():
            return ""
        return "\n".join(running.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def stop(self, replica_id: str, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to `grace_s` (plus a margin for exit), then SIGKILL.

        Returns the exit code; None when no such replica runs here (idempotent).
        """
        running = self._running.get(replica_id)
        if running is None:
            return None
        process = running.process
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace_s + 5.0)
            except TimeoutError:
                logger.warning("replica=%s did not exit after SIGTERM: killing", replica_id)
                process.kill()
                await process.wait()
        del self._running[replica_id]
        if self._workdir is None:
            shutil.rmtree(running.workdir, ignore_errors=True)
        else:
            (running.workdir / "token").unlink(missing_ok=True)
        return process.returncode

    async def close(self) -> None:
        """Stop every replica this runtime started."""
        for replica_id in list(self._running):
            await self.stop(replica_id)
