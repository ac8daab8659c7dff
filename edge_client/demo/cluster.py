"""A whole cluster on this machine: a broker process and node daemon processes on loopback.

Everything lives in one folder (`root`): the broker's state, each node's model cache, the
logs, and the temporary folders of the replicas (the children get TMPDIR inside `root`), so
removing `root` removes every file the cluster made. The children run in their own session
(a Ctrl-C in the terminal reaches only the demo, which then stops them in order: nodes
first, which stop their replicas, then the broker) and get SIGTERM if the demo dies
(PR_SET_PDEATHSIG). `stop` ends with a sweep: any process whose command line names `root`,
and any container of the demo's deployments, is killed; what the sweep had to kill is
returned, since after an orderly stop there should be none.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from broker.state.api_keys import new_api_key
from common.cli import PARENT_ENV
from common.node_identity import SECRET_FILE
from node_daemon.runtimes.base import LABEL_PREFIX, RuntimeUnavailable

HERE = Path(__file__).resolve().parent
CAPTURES = HERE / "topologies"
CLUSTER_FILE = HERE / "cluster.yaml"


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One node daemon: its id, its site, and the `nvidia-smi topo -m` capture (with the
    GPU model and memory) that stands in for its GPUs."""

    node_id: str
    site: str
    capture: Path
    gpu_spec: str
    flags: tuple[str, ...] = ()
    """More `offload node` flags (e.g. `--cpuset`, `--resize-policy`)."""


DEMO_NODES = (
    NodePlan("node-a", "site-a", CAPTURES / "24_asus-esc8000a-e12-4xRTX6000Ada-2socket-4nic.txt",
             "RTX 6000 Ada:49140"),
    NodePlan("node-b", "site-b", CAPTURES / "21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt",
             "Tesla V100-SXM2-16GB:16384"),
    NodePlan("node-c", "site-c", CAPTURES / "12_dgx-a100-8gpu-nv12-10nic-nps4.txt",
             "A100-SXM4-40GB:40960"),
)  # fmt: skip
"""A 4-GPU PCIe server, an 8-GPU NVLink hybrid cube and an 8-GPU NVSwitch machine."""


class ClusterError(Exception):
    """A process of the cluster did not come up; the message has its log's tail."""


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_PORT = 10_000
"""`free_port` picks from here up to the ephemeral range (below: many services' usual ports)."""
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on loopback now, below the kernel's ephemeral range and not handed
    out before by this process. Why not port 0's: a process killed and started again on its
    port (a broker restarted, a node back) must find it free, and while its owner is down
    the kernel may give a port of the ephemeral range to any outgoing connection on the
    machine, which the restart then cannot bind (CI met it: a broker restarted on its ops
    port). OSError when none is found."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768  # Linux's default
    ports = range(FIRST_PORT, max(low, FIRST_PORT + 1_000))
    for _ in range(1_000):
        port = random.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free TCP port on loopback in {ports.start}..{ports.stop - 1}")


def spawn(
    command: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `command` (an `offload` command line) with stdout and stderr appended to `log`,
    in its own session, to get SIGTERM when this process dies
    (`common.cli.exit_with_parent`). Call it from the main thread: the death signal follows
    the thread that spawned the child."""
    with log.open("ab") as out:
        return subprocess.Popen(
            list(command),
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            env={**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())},
            start_new_session=True,
        )


def log_tail(log: Path, lines: int = 30) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


async def wait_for_log(
    log: Path,
    pattern: str,
    after: int = 0,
    timeout_s: float = 60,
    process: subprocess.Popen[bytes] | None = None,
) -> str:
    """The first match of `pattern` in `log` past byte `after`, waiting up to `timeout_s`.
    AssertionError with the log's tail on timeout, or as soon as `process` has exited."""
    regex = re.compile(pattern)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            data = await asyncio.to_thread(log.read_bytes)
        except FileNotFoundError:
            data = b""
        if match := regex.search(data[after:].decode(errors="replace")):
            return match.group(0)
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"{log.stem} exited with code {process.returncode} before {pattern!r}; "
                f"the end of {log}:\n{log_tail(log)}"
            )
        if loop.time() > deadline:
            raise AssertionError(
                f"no {pattern!r} in {log} within {timeout_s:.0f}s; its end:\n{log_tail(log)}"
            )
        await asyncio.sleep(0.05)


class LocalCluster:
    """A broker and node daemons as child processes, all under `root`."""

    def __init__(
        self,
        root: Path,
        *,
        runtime: str,
        image: str = "",
        nodes: Sequence[NodePlan] = DEMO_NODES,
        cluster_file: Path = CLUSTER_FILE,
        broker_flags: Sequence[str] = (),
        client_id: str = "demo",
        more_api_keys: Sequence[str] = (),
        node_flags: Sequence[str] = (),
    ) -> None:
        """`runtime` is "docker" or "process" (each node's `--runtime`); `image` the runtime
        image of Docker replicas; `broker_flags` more `offload broker` flags; `more_api_keys`
        keys of other clients the broker accepts beside `client_id`'s; `node_flags` more
        `offload node` flags for every node (before each plan's own)."""
        self.root = root
        self.runtime = runtime
        self.image = image
        self.nodes = tuple(nodes)
        self.cluster_file = cluster_file
        self.broker_flags = tuple(broker_flags)
        self.node_flags = tuple(node_flags)
        self.client_id = client_id
        self.more_api_keys = tuple(more_api_keys)
        self.broker_port = free_port()
        self.node_port = free_port()
        self.ops_port = free_port()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.api_key_file = root / "api-key"
        self.api_keys_file = root / "api-keys"
        self.join_token_file = root / "join-token"
        self.ops_token_file = root / "ops-token"
        self._tmp = root / "tmp"

    @property
    def broker_address(self) -> str:
        return f"127.0.0.1:{self.broker_port}"

    @property
    def registry_address(self) -> str:
        """The broker's NodeRegistry port (`--node-listen`), where the nodes register: a
        port of their own, as in production, whose number on UDP takes their beacons."""
        return f"127.0.0.1:{self.node_port}"

    @property
    def ops_url(self) -> str:
        return f"http://127.0.0.1:{self.ops_port}/"

    @property
    def api_key(self) -> str:
        return self.api_key_file.read_text().strip()

    @property
    def ops_headers(self) -> dict[str, str]:
        """What reads the broker's ops API (`/api/...`): its ops token."""
        return {"Authorization": f"Bearer {self.ops_token_file.read_text().strip()}"}

    def node_secret(self, node_id: str) -> str:
        """The node secret `node_id` keeps in its state dir (made when it first started):
        what the broker shows its NodeAgent, which the join token no longer opens."""
        return (self.root / f"{node_id}-state" / SECRET_FILE).read_text().strip()

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def _env(self) -> dict[str, str]:
        return {**os.environ, "TMPDIR": str(self._tmp), "PYTHONUNBUFFERED": "1"}

    def _cli(self) -> list[str]:
        return [sys.executable, "-m", "edge_client.cli"]

    async def start(self, say: Callable[[str], None]) -> None:
        """Start the broker, then every node, each once it is up; ClusterError (with the
        log's tail) when one exits or does not come up within a minute."""
        self._tmp.mkdir(parents=True, exist_ok=True)
        for secret in (self.join_token_file, self.ops_token_file):
            secret.write_text(secrets.token_urlsafe(24) + "\n")
            secret.chmod(0o600)
        self.api_key_file.write_text(new_api_key(self.client_id) + "\n")
        self.api_key_file.chmod(0o600)
        keys = (self.api_key, *self.more_api_keys)
        self.api_keys_file.write_text("".join(f"{key}\n" for key in keys))
        self.api_keys_file.chmod(0o600)
        await self.start_broker()
        say(f"broker: gRPC {self.broker_address}, dashboard {self.ops_url}")
        for plan in self.nodes:
            await self.start_node(plan)
            say(
                f"{plan.node_id} at {plan.site}: {plan.gpu_spec.split(':')[0]} GPUs from "
                f"{plan.capture.name} ({self.runtime} runtime)"
            )

    async def start_broker(self) -> None:
        """Start the broker (again, after `kill`: on the same port and state dir) and return
        once it listens; ClusterError as for `start`. Needs `start`'s files."""
        broker = [
            *self._cli(), "broker",
            "--listen", self.broker_address,
            "--node-listen", self.registry_address,
            "--ops-listen", f"127.0.0.1:{self.ops_port}",
            "--state-dir", str(self.root / "broker-state"),
            "--cluster", str(self.cluster_file),
            "--join-token-file", str(self.join_token_file),
            "--api-keys-file", str(self.api_keys_file),
            "--ops-token-file", str(self.ops_token_file),
            *self.broker_flags,
        ]  # fmt: skip
        await self._start("broker", broker, r"broker listening on")

    async def start_node(self, plan: NodePlan) -> None:
        """Start a node daemon (again, after `kill`: with the same id and state dir, so it
        adopts its replicas) and return once it has registered with the broker."""
        command = [
            *self._cli(), "node",
            "--listen", "127.0.0.1:0",
            "--site", plan.site,
            "--node-id", plan.node_id,
            "--runtime", self.runtime,
            "--topology-file", str(plan.capture),
            "--gpu-spec", plan.gpu_spec,
            "--state-dir", str(self.root / f"{plan.node_id}-state"),
            "--broker", self.registry_address,
            "--join-token-file", str(self.join_token_file),
            "--stop-replicas-on-exit",
            *(["--image", self.image] if self.image else []),
            *self.node_flags,
            *plan.flags,
        ]  # fmt: skip
        await self._start(plan.node_id, command, r"registered with broker")

    async def _start(self, name: str, command: list[str], ready: str) -> None:
        log = self.log(name)
        after = log.stat().st_size if log.exists() else 0  # a restart: only its own lines
        process = spawn(command, log, self._env())
        self.processes[name] = process
        try:
            await wait_for_log(log, ready, after=after, process=process, timeout_s=60)
        except AssertionError as err:
            raise ClusterError(str(err)) from None

    async def kill(self, name: str) -> None:
        """SIGKILL the broker or a node daemon (by node id) and reap it; its replicas, in
        their own sessions, run on."""
        process = self.processes[name]
        if process.poll() is None:
            process.kill()
        await asyncio.to_thread(process.wait)

    async def stop(self, deployment_ids: Iterable[str] = ()) -> list[str]:
        """SIGTERM the nodes (they stop their replicas), then the broker; SIGKILL whatever
        has not exited after 30 s. Then sweep (see the module docstring); returns what the
        sweep found, which should be nothing."""
        names = [n for n in self.processes if n != "broker"]
        for group in (names, ["broker"]):
            running = [self.processes[n] for n in group if n in self.processes]
            for process in running:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in running:
                try:
                    await asyncio.to_thread(process.wait, 30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    await asyncio.to_thread(process.wait)
        return [*_kill_processes_naming(self.root), *await _remove_containers(deployment_ids)]


def processes_naming(root: Path) -> list[tuple[int, str]]:
    """(pid, command line) of every process but this one whose command line contains
    `root`. Zombies have an empty command line, so exited children never count."""
    needle = str(root).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def _kill_processes_naming(root: Path) -> list[str]:
    """SIGKILL every process (but this one) whose command line contains `root`."""
    killed = []
    for pid, command in processes_naming(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.append(f"process {pid}: {command[:120]}")
    return killed


async def _remove_containers(deployment_ids: Iterable[str]) -> list[str]:
    """Force-remove the containers of these deployments, if a Docker engine is reachable."""
    ids = list(deployment_ids)
    if not ids:
        return []

    def remove() -> list[str]:
        import docker.errors

        from node_daemon.runtimes.docker_runtime import connect_docker

        removed: list[str] = []
        try:
            with contextlib.closing(connect_docker()) as client:
                for deployment_id in ids:
                    label = f"{LABEL_PREFIX}deployment={deployment_id}"
                    for container in client.containers.list(all=True, filters={"label": label}):
                        container.remove(force=True)
                        removed.append(f"container {container.name}")
        except (RuntimeUnavailable, docker.errors.DockerException, OSError):
            pass  # no engine: no container
        return removed

    return await asyncio.to_thread(remove)
