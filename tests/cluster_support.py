"""A real cluster on loopback for tests: a broker process and node daemon processes.

Ports are picked free up front (the broker keeps its port across a restart, so the nodes find
it again). Logs go to files under the test's tmp_path; `wait_for_log` polls them. The nodes,
the cluster file and the process helpers are the demo's (`edge_client.demo.cluster`); this
class adds what tests need: restarting and killing the broker, per-client API keys, and an
opt-in TLS mode (`Cluster(root, tls=True)`): a CA and certificates made in `<root>/tls`, the
broker serving TLS with NodeRegistry on its own mutual-TLS port, nodes with certificates for
their ids, and the tests' own calls over TLS.

Several brokers on one PostgreSQL state: a second `Cluster` on the same root with its own
`broker_name` (its own ports and log, the same state dir, so the same model store) runs the
other broker; `peer_registries` gives the nodes every broker's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import modelzoo
from common.certs import TlsIdentity, issue, make_ca, write_new
from common.content import file_sha256
from common.node_identity import SECRET_FILE
from edge_client.client import Deployment, OffloadClient
from edge_client.demo.cluster import (
    CLUSTER_FILE,
    DEMO_NODES,
    NodePlan,
    free_port,
    spawn,
    wait_for_log,
)
from edge_client.errors import OffloadError
from edge_client.rpc.tensors import infer_request
from protos.inference import grpc_service_pb2_grpc as infer_grpc
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from protos.offload.v1 import node_pb2 as npb
from protos.offload.v1 import node_pb2_grpc as npb_grpc
from runtime.tls import open_channel

DEFAULT_STATE = ""
"""The `state` of a Cluster that does not name one: SQLite, unless the tests run with
OFFLOAD_TEST_STATE=postgresql (`make test-postgresql`), when `tests/conftest.py` sets it to
a fresh PostgreSQL database for each test."""
JOIN_TOKEN = "join-token-for-tests-0123456789"
CLUSTER_YAML = CLUSTER_FILE.read_text()
THREE_NODES = DEMO_NODES
"""node-a at site-a (4x RTX 6000 Ada, PCIe), node-b at site-b (8x V100, NVLink hybrid cube),
node-c at site-c (8x A100, NVSwitch): the demo's cluster."""


@dataclass
class Cluster:
    root: Path
    cluster_yaml: str = CLUSTER_YAML
    broker_port: int = field(default_factory=free_port)
    ops_port: int = field(default_factory=free_port)
    broker: subprocess.Popen[bytes] | None = None
    nodes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    api_keys: dict[str, str] = field(default_factory=dict)
    tls: bool = False
    """TLS on every channel the cluster serves (default: plaintext, on loopback)."""
    state: str = field(default_factory=lambda: DEFAULT_STATE)
    """The broker's `--state`: "" for SQLite in its state dir, or a PostgreSQL URL. Default:
    `DEFAULT_STATE`."""
    node_port: int = field(default_factory=free_port)
    """The broker's NodeRegistry port of its own (`--node-listen`), with `tls` or
    `node_listen` only."""
    node_listen: bool = False
    """NodeRegistry on `node_port` without TLS too (there the broker pings the nodes)."""
    broker_name: str = "broker"
    """Names the broker's log (`<root>/<broker_name>.log`); another for a second broker."""
    peer_registries: tuple[str, ...] = ()
    """Other brokers' NodeRegistry addresses, given to the nodes after this one's."""

    @property
    def broker_address(self) -> str:
        return f"127.0.0.1:{self.broker_port}"

    @property
    def registry_address(self) -> str:
        """Where nodes register: the node port with TLS or `node_listen`, else the
        broker's port."""
        return f"127.0.0.1:{self.node_port if self.own_node_port else self.broker_port}"

    @property
    def own_node_port(self) -> bool:
        """Whether NodeRegistry is on `node_port` (`--node-listen`)."""
        return self.tls or self.node_listen

    @property
    def tls_dir(self) -> Path:
        return self.root / "tls"

    def certificate(self, name: str) -> TlsIdentity:
        """The CA and a certificate for `name` (made once, for 127.0.0.1 and localhost) in
        `tls_dir`: `<name>.pem`, `<name>-key.pem` and `ca.pem`. "broker" and "operator" (the
        tests' own NodeAgent calls, which stand for the broker's) get the broker role, any
        other name the node role."""
        ca_path, ca_key_path = self.tls_dir / "ca.pem", self.tls_dir / "ca-key.pem"
        if not ca_path.exists():
            self.tls_dir.mkdir(mode=0o700, exist_ok=True)
            ca_cert, ca_key = make_ca("cluster test CA")
            write_new(ca_key_path, ca_key)
            write_new(ca_path, ca_cert, 0o644)
        ca = ca_path.read_bytes()
        cert_path, key_path = self.tls_dir / f"{name}.pem", self.tls_dir / f"{name}-key.pem"
        if not cert_path.exists():
            role = "broker" if name in ("broker", "operator") else "node"
            cert, key = issue(
                ca, ca_key_path.read_bytes(), name, ["localhost"], ["127.0.0.1"], role=role
            )
            write_new(key_path, key)
            write_new(cert_path, cert, 0o644)
        return TlsIdentity(ca=ca, cert=cert_path.read_bytes(), key=key_path.read_bytes())

    def tls_flags(self, name: str) -> list[str]:
        """`--tls-cert/--tls-key/--tls-ca` with `name`'s certificate; [] without `tls`."""
        if not self.tls:
            return []
        self.certificate(name)
        return [
            "--tls-cert", str(self.tls_dir / f"{name}.pem"),
            "--tls-key", str(self.tls_dir / f"{name}-key.pem"),
            "--tls-ca", str(self.tls_dir / "ca.pem"),
        ]  # fmt: skip

    @property
    def client_tls(self) -> TlsIdentity | None:
        """What a client verifies the broker by (the CA only); None without `tls`."""
        return TlsIdentity(ca=self.certificate("broker").ca) if self.tls else None

    @property
    def operator_tls(self) -> TlsIdentity | None:
        """A certificate of the CA for the tests' own NodeAgent calls (mutual TLS); None
        without `tls`."""
        return self.certificate("operator") if self.tls else None

    @property
    def broker_log(self) -> Path:
        return self.root / f"{self.broker_name}.log"

    def node_log(self, node_id: str) -> Path:
        return self.root / f"{node_id}.log"

    def replica_pid(self, deployment: pb.Deployment | Deployment) -> int:
        """The pid of the process its node started for `deployment` at its epoch, from the
        node's replica record (process runtime)."""
        replicas = self.root / f"{deployment.node_id}-state" / "replicas"
        record = replicas / f"{deployment.deployment_id}-{deployment.epoch}" / "replica.json"
        return int(json.loads(record.read_text())["pid"])

    async def start_broker(self, *extra: str, ready: str = r"broker listening on") -> None:
        """Start the broker and wait for `ready` in its log (a standby logs "standing by")."""
        (self.root / "cluster.yaml").write_text(self.cluster_yaml)
        (self.root / "join-token").write_text(JOIN_TOKEN)
        if not self.api_keys:
            for client in ("alice", "bob"):
                self.api_keys[client] = f"{client}.secret-key-of-{client}-0123456789"
        (self.root / "api-keys").write_text("\n".join(self.api_keys.values()) + "\n")
        offset = self.broker_log.stat().st_size if self.broker_log.exists() else 0
        self.broker = spawn(
            [
                sys.executable, "-m", "edge_client.cli", "broker",
                "--listen", self.broker_address, "--ops-listen", f"127.0.0.1:{self.ops_port}",
                "--state-dir", str(self.root / "broker-state"),
                "--cluster", str(self.root / "cluster.yaml"),
                "--join-token-file", str(self.root / "join-token"),
                "--api-keys-file", str(self.root / "api-keys"),
                "--heartbeat-interval", "0.2", "--lost-after", "3", "--orphan-grace", "3",
                *self.tls_flags("broker"),
                *(["--node-listen", self.registry_address] if self.own_node_port else []),
                *(["--state", self.state] if self.state else []),
                *extra,
            ],
            self.broker_log,
        )  # fmt: skip
        await wait_for_log(self.broker_log, ready, after=offset, process=self.broker)

    async def start_node(self, plan: NodePlan, runtime: str = "process", *extra: str) -> None:
        log = self.node_log(plan.node_id)
        offset = log.stat().st_size if log.exists() else 0
        self.nodes[plan.node_id] = spawn(
            [
                sys.executable, "-m", "edge_client.cli", "node", "--listen", "127.0.0.1:0",
                "--site", plan.site, "--node-id", plan.node_id, "--runtime", runtime,
                "--topology-file", str(plan.capture), "--gpu-spec", plan.gpu_spec,
                "--state-dir", str(self.root / f"{plan.node_id}-state"),
                "--broker", ",".join((self.registry_address, *self.peer_registries)),
                "--join-token-file", str(self.root / "join-token"),
                "--stop-replicas-on-exit", *self.tls_flags(plan.node_id), *plan.flags, *extra,
            ],
            log,
        )  # fmt: skip
        await wait_for_log(
            log, r"registered with broker", after=offset, process=self.nodes[plan.node_id]
        )

    def kill_broker(self) -> None:
        assert self.broker is not None
        self.broker.send_signal(signal.SIGKILL)
        self.broker.wait()

    async def stop(self) -> None:
        """SIGTERM every process; nodes stop their replicas on the way out. Replicas a node
        could not stop (a test killed the node: they outlive it, by design) are killed."""
        for process in (*self.nodes.values(), self.broker):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (*self.nodes.values(), self.broker):
            if process is None:
                continue
            try:
                await asyncio.to_thread(process.wait, 30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        _kill_leftover_replicas(self.root)

    def metadata(self, client: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_keys[client]}"),)

    def node_secret(self, node_id: str) -> str:
        """The node secret `node_id` keeps in its state dir (made when it first started)."""
        return (self.root / f"{node_id}-state" / SECRET_FILE).read_text().strip()

    def agent_metadata(self, node_id: str) -> tuple[tuple[str, str], ...]:
        """What the broker shows `node_id`'s NodeAgent: its node secret as the bearer token
        (over TLS the certificate, `operator_tls`, is what counts)."""
        return (("authorization", f"Bearer {self.node_secret(node_id)}"),)

    @contextlib.asynccontextmanager
    async def edge(self, client: str) -> AsyncIterator[EdgeClient]:
        async with open_channel(self.broker_address, self.client_tls) as channel:
            yield EdgeClient(pb_grpc.EdgeBrokerStub(channel), self.metadata(client))


@dataclass
class EdgeClient:
    """EdgeBroker calls with one client's API key."""

    stub: pb_grpc.EdgeBrokerStub
    metadata: tuple[tuple[str, str], ...]

    async def upload(self, path: Path, sha: str | None = None) -> pb.UploadModelResponse:
        data = await asyncio.to_thread(path.read_bytes)
        declared = sha or file_sha256(path)

        def chunks() -> Iterator[npb.ModelChunk]:
            yield npb.ModelChunk(sha256=declared, name=path.stem, data=data[: 1 << 20])
            for offset in range(1 << 20, len(data), 1 << 20):
                yield npb.ModelChunk(data=data[offset : offset + (1 << 20)])

        return await self.stub.UploadModel(chunks(), metadata=self.metadata)

    async def deploy(self, **fields: object) -> pb.Deployment:
        return await self.stub.Deploy(pb.DeployRequest(**fields), metadata=self.metadata)

    async def get(self, deployment_id: str) -> pb.Deployment:
        return await self.stub.GetDeployment(
            pb.GetDeploymentRequest(deployment_id=deployment_id), metadata=self.metadata
        )

    async def list(self) -> list[pb.Deployment]:
        reply = await self.stub.ListDeployments(
            pb.ListDeploymentsRequest(), metadata=self.metadata
        )
        return list(reply.deployments)


async def node_replicas(cluster: Cluster) -> dict[str, list[str]]:
    """node id -> the ids of the replicas it reports (ListReplicas), for every live node."""
    out = {}
    for node_id, process in cluster.nodes.items():
        if process.poll() is not None:
            continue
        # The address of its latest start (a restarted node listens on a new port).
        log = cluster.node_log(node_id).read_text()
        address = re.findall(r"node agent listening on (127\.0\.0\.1:\d+)", log)[-1]
        async with open_channel(address, cluster.operator_tls) as channel:
            listed = await npb_grpc.NodeAgentStub(channel).ListReplicas(
                npb.ListReplicasRequest(), metadata=cluster.agent_metadata(node_id), timeout=10
            )
        out[node_id] = sorted(r.replica_id for r in listed.replicas)
    return out


def _kill_leftover_replicas(root: Path) -> None:
    """SIGKILL every process replica still alive of the nodes under `root` (their state dirs'
    `replica.json`)."""
    for record in root.glob("*-state/replicas/*/replica.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = int(json.loads(record.read_text())["pid"])
            # Only a replica of this cluster's: the pid may have been reused since.
            if str(record.parent.parent.parent) in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)


def replica_processes(cluster: Cluster) -> dict[str, list[str]]:
    """node id -> the replicas (process runtime) whose process is alive, from the
    `replica.json` each leaves in the node's state dir, for every live node."""
    out = {}
    for node_id, process in cluster.nodes.items():
        if process.poll() is not None:
            continue
        alive = []
        for record in (cluster.root / f"{node_id}-state" / "replicas").glob("*/replica.json"):
            with contextlib.suppress(OSError, ValueError):
                pid = json.loads(record.read_text())["pid"]
                stat = Path(f"/proc/{pid}/stat").read_text()
                if stat.rpartition(")")[2].split()[0] != "Z":
                    alive.append(record.parent.name)
        out[node_id] = sorted(alive)
    return out


async def cluster_agrees(cluster: Cluster, timeout_s: float = 60) -> list[pb.Deployment]:
    """Poll until the broker, the nodes and their processes agree: every deployment of
    every client running or pending, each running one's replica on its node and nowhere
    else, no other replica reported or alive anywhere (the orphan grace is 3 s), no GPU
    held by two deployments. The deployments; AssertionError saying what disagrees after
    `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        deployments = []
        async with open_channel(cluster.broker_address, cluster.client_tls) as channel:
            stub = pb_grpc.EdgeBrokerStub(channel)
            for client in cluster.api_keys:
                reply = await stub.ListDeployments(
                    pb.ListDeploymentsRequest(), metadata=cluster.metadata(client), timeout=10
                )
                deployments.extend(reply.deployments)
        running = [d for d in deployments if d.state == "running"]
        expected: dict[str, list[str]] = {node_id: [] for node_id in cluster.nodes}
        for d in running:
            expected.setdefault(d.node_id, []).append(f"{d.deployment_id}-{d.epoch}")
        reported = await node_replicas(cluster)
        processes = replica_processes(cluster)
        gpus = Counter(
            (d.node_id, uuid)
            for d in deployments
            if d.state in ("running", "starting")
            for uuid in d.gpu_uuids
        )
        problems = [
            *(
                f"{d.deployment_id} is {d.state}"
                for d in deployments
                if d.state not in ("running", "pending")
            ),
            *(f"GPU {gpu} held {n} times" for gpu, n in gpus.items() if n > 1),
            *(
                f"{node} runs {reported[node]}, the broker expects {sorted(expected[node])}"
                for node in reported
                if reported[node] != sorted(expected[node])
            ),
            *(
                f"{node} has processes of {processes[node]}, reports {reported[node]}"
                for node in processes
                if processes[node] != reported.get(node)
            ),
        ]
        if not problems:
            return deployments
        if loop.time() > deadline:
            raise AssertionError("; ".join(problems))
        await asyncio.sleep(0.1)


async def infer_once(deployment: pb.Deployment, model: str = "mlp") -> None:
    """One ModelInfer on the deployment's replica; raises AioRpcError on failure."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path(model))
    tls = (
        TlsIdentity(ca=deployment.endpoint_ca_pem.encode()) if deployment.endpoint_ca_pem else None
    )
    async with open_channel(deployment.endpoint, tls) as channel:
        await infer_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            infer_request(model, inputs),
            metadata=(("authorization", f"Bearer {deployment.token}"),),
            timeout=10,
        )


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Poll `condition` every 50 ms; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.05)


class InferenceLoad:
    """A steady stream of inferences, one at a time, recording what each call raised; with
    `expected`, every answer is checked against those outputs (by name)."""

    def __init__(
        self,
        client: OffloadClient,
        inputs: dict[str, np.ndarray],
        expected: dict[str, np.ndarray] | None = None,
    ) -> None:
        self.client = client
        self.inputs = inputs
        self.expected = expected or {}
        self.successes = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="inference-load")

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                outputs = await self.client.infer(self.inputs)
            except OffloadError as err:
                self.failures.append(f"{type(err).__name__}: {err}")
            else:
                for name, array in self.expected.items():
                    np.testing.assert_allclose(outputs[name], array, rtol=1e-5, atol=1e-6)
                self.successes += 1
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._stop.set()
        await self._task


def unloadable_model(path: Path) -> Path:
    """A model the broker accepts (it passes `onnx.checker`) whose replica cannot load it:
    its MatMul's shapes do not match, which ONNX Runtime finds when it loads the model."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])
    weight = numpy_helper.from_array(np.ones((5, 3), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "bad", [x], [y])
    graph.initializer.append(weight)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path
