"""The node daemon through its NodeAgent API, as the broker will drive it, on both runtimes.

The daemon runs as a real process (`offload node`); replicas are real containers or
processes; inference goes through tritonclient.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

import modelzoo
from common.content import file_sha256
from common.replica_memory import MEMORY_LIMIT_UNAVAILABLE
from node_daemon.runtimes import cgroup_limits
from protos.offload.v1 import node_pb2 as pb
from protos.offload.v1 import node_pb2_grpc as pb_grpc
from tests.data import TOPOLOGIES
from tests.docker_support import require_docker

DGX1 = TOPOLOGIES / "21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt"
PROBE = Path(__file__).resolve().parents[1] / "triton_probe.py"
TOKEN = "replica-token-for-node-tests"
LISTENING = re.compile(r"node agent listening on [^ ]+:(\d+)")


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def start_daemon(runtime: str, node_id: str, state: Path, log: Path) -> Daemon:
    command = [
        sys.executable, "-m", "edge_client.cli", "node", "--listen", "127.0.0.1:0",
        "--site", "site-a", "--node-id", node_id, "--runtime", runtime,
        "--topology-file", str(DGX1), "--gpu-spec", "Tesla V100-SXM2-16GB:16384",
        "--state-dir", str(state),
    ]  # fmt: skip
    process, offset = await asyncio.to_thread(_spawn, command, log)
    for _ in range(1200):
        text = (await asyncio.to_thread(log.read_text, errors="replace"))[offset:]
        if match := LISTENING.findall(text):
            return Daemon(process, int(match[-1]), log)
        if process.poll() is not None:
            break
        await asyncio.sleep(0.05)
    process.kill()
    process.wait()
    text = await asyncio.to_thread(log.read_text, errors="replace")
    raise AssertionError("node daemon did not start:\n" + text)


def _spawn(command: list[str], log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """The daemon, and where its lines start in the log (an earlier daemon's come first)."""
    offset = log.stat().st_size if log.exists() else 0
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    return process, offset


def triton_infer(endpoint: str, model: str, inputs_file: Path, out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, str(PROBE), "--url", endpoint, "--model", model,
         "--inputs", str(inputs_file), "--outputs", str(out)],
        env={**os.environ, "TRITON_PROBE_TOKEN": TOKEN},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def put_model(stub: pb_grpc.NodeAgentStub, path: Path) -> str:
    sha = file_sha256(path)
    data = await asyncio.to_thread(path.read_bytes)

    def chunks() -> Iterator[pb.ModelChunk]:
        yield pb.ModelChunk(sha256=sha, name=path.name, data=data[: 1 << 20])
        for offset in range(1 << 20, len(data), 1 << 20):
            yield pb.ModelChunk(data=data[offset : offset + (1 << 20)])

    response = await stub.PutModel(chunks())
    assert response.sha256 == sha
    return sha


@pytest.fixture
def daemon_paths(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    yield tmp_path / "state", tmp_path / "daemon.log"


async def test_replicas_survive_a_daemon_kill(
    runtime: str, daemon_paths: tuple[Path, Path], tmp_path: Path
) -> None:
    state, log = daemon_paths
    node_id = f"test-node-{runtime}"
    mlp, cnn = modelzoo.model_path("mlp"), modelzoo.model_path("mobilenetv2")
    inputs = {name: tmp_path / f"{name}.npz" for name in ("mlp", "mobilenetv2")}
    for name, path in (("mlp", mlp), ("mobilenetv2", cnn)):
        np.savez(inputs[name], **modelzoo.sample_inputs(path))
    daemon = await start_daemon(runtime, node_id, state, log)
    started: list[str] = []
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            shas = {"mlp": await put_model(stub, mlp), "mobilenetv2": await put_model(stub, cnn)}
            described = await stub.Describe(pb.DescribeRequest())
            assert described.node_id == node_id and len(described.inventory.gpus) == 8
            replicas = {}
            for name, gpus in (("mlp", 1), ("mobilenetv2", 4)):
                spec = pb.ReplicaSpec(
                    deployment_id=f"dep-{name}", epoch=1, model_sha256=shas[name],
                    model_name=name, token=TOKEN, gpu_count=gpus, p2p_required=gpus > 1,
                )  # fmt: skip
                response = await stub.StartReplica(pb.StartReplicaRequest(spec=spec))
                replicas[name] = response.replica
                started.append(response.replica.replica_id)
                assert response.replica.state == pb.REPLICA_STATE_READY
            # The 4-GPU P2P request got an NVLink quad of the hybrid cube-mesh.
            quad = replicas["mobilenetv2"].spec.gpu_uuids
            assert len(quad) == 4 and len(set(quad) & set(replicas["mlp"].spec.gpu_uuids)) == 0
            for name, replica in replicas.items():
                report = await asyncio.to_thread(
                    triton_infer, replica.endpoint, name, inputs[name], tmp_path / "o.npz"
                )
                assert report["model_ready"]

        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait()
        daemon = await start_daemon(runtime, node_id, state, log)

        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            listed = (await stub.ListReplicas(pb.ListReplicasRequest())).replicas
            assert {r.replica_id: r.endpoint for r in listed} == {
                r.replica_id: r.endpoint for r in replicas.values()
            }
            assert all(r.state == pb.REPLICA_STATE_READY for r in listed)
            for name, replica in replicas.items():
                report = await asyncio.to_thread(
                    triton_infer, replica.endpoint, name, inputs[name], tmp_path / "o.npz"
                )
                assert report["model_ready"]
            # The adopted replicas still hold their GPUs: 3 are free, 4 do not fit.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.StartReplica(
                    pb.StartReplicaRequest(
                        spec=pb.ReplicaSpec(
                            deployment_id="dep-big",
                            epoch=1,
                            model_sha256=shas["mlp"],
                            model_name="mlp",
                            token=TOKEN,
                            gpu_count=4,
                        )
                    )
                )
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "asked for 4 GPU(s); GPUs free:" in caught.value.details()
            assert "(3 of 8)" in caught.value.details()

            replica_id = replicas["mlp"].replica_id
            await stub.StopReplica(pb.StopReplicaRequest(replica_id=replica_id, grace_ms=2000))
            started.remove(replica_id)
            listed = (await stub.ListReplicas(pb.ListReplicasRequest())).replicas
            assert [r.replica_id for r in listed] == [replicas["mobilenetv2"].replica_id]
            assert not _replica_exists(runtime, replicas["mlp"])
    finally:
        await _cleanup(daemon, started)


async def test_unknown_model_and_bad_requests(
    runtime: str, daemon_paths: tuple[Path, Path]
) -> None:
    state, log = daemon_paths
    daemon = await start_daemon(runtime, f"test-node-{runtime}-errors", state, log)
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            spec = pb.ReplicaSpec(
                deployment_id="dep-x", epoch=1, model_sha256="ab" * 32, model_name="m",
                token=TOKEN,
            )  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.StartReplica(pb.StartReplicaRequest(spec=spec))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert "not in this node's cache" in caught.value.details()
            spec.deployment_id = "Bad Name!"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.StartReplica(pb.StartReplicaRequest(spec=spec))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.StopReplica(pb.StopReplicaRequest(replica_id="nope-1"))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            # Numbers must be finite and bounded: the error names the field and its range.
            spec.deployment_id = "dep-x"
            for field, value, allowed in (
                ("cpus", float("nan"), "0..1024.0"),
                ("cpus", 1e308, "0..1024.0"),
                ("memory_mib", 2**63 - 1, "0..16777216"),
                ("epoch", -1, "0..9007199254740992"),
                ("gpu_memory_mib", 2**40, "0..1048576"),
            ):
                bad = pb.ReplicaSpec()
                bad.CopyFrom(spec)
                setattr(bad, field, value)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.StartReplica(pb.StartReplicaRequest(spec=bad))
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert caught.value.details() == (
                    f"{field} must be a finite number within {allowed}"
                )
            # A 7 MB id comes back as a short prefix, not whole.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.StopReplica(pb.StopReplicaRequest(replica_id="r" * 7_000_000))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert caught.value.details().startswith(f"no replica {'r' * 40!r}… (7000000 ")
            # Corrupt protobuf: INVALID_ARGUMENT, not UNKNOWN.
            raw = channel.unary_unary("/offload.v1.NodeAgent/StartReplica")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await raw(b"\x0a\x05\x0a\x03\xff\xfe\xfd")  # deployment_id: invalid UTF-8
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid message" in caught.value.details()
    finally:
        await _cleanup(daemon, [])


async def test_a_failed_start_tells_the_caller_why_without_node_details(
    tmp_path: Path, daemon_paths: tuple[Path, Path]
) -> None:
    state, log = daemon_paths
    daemon = await start_daemon("process", "test-node-broken-model", state, log)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"this is not an ONNX model")
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            spec = pb.ReplicaSpec(
                deployment_id="dep-broken", epoch=1, model_sha256=await put_model(stub, broken),
                model_name="broken", token=TOKEN,
            )  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.StartReplica(pb.StartReplicaRequest(spec=spec))
            details = caught.value.details()
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "cannot load <path> as an ONNX model" in details
            assert str(tmp_path) not in details and "\x1b" not in details
            assert "Error:" not in details and "Exception" not in details
            # Nor where the replica listened: its log tail's addresses and ports are gone.
            assert "runtime listening on <address>" in details, details
            assert not re.search(r"127\.0\.0\.1|:\d{3,5}\b|port \d", details), details
            assert not (await stub.ListReplicas(pb.ListReplicasRequest())).replicas
        # The node's own log has the whole story, paths and ports included.
        text = log.read_text()
        assert str(state / "models") in text
        assert re.search(r"runtime listening on 127\.0\.0\.1:\d+", text)
    finally:
        await _cleanup(daemon, [])


async def test_the_nodes_state_is_the_owners_only_under_umask_022(tmp_path: Path) -> None:
    previous = os.umask(0o022)  # the daemon inherits it, as from a login shell
    try:
        state, log = tmp_path / "state", tmp_path / "daemon.log"
        daemon = await start_daemon("process", "test-node-private-state", state, log)
    finally:
        os.umask(previous)
    started: list[str] = []
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            sha = await put_model(stub, modelzoo.model_path("mlp"))
            spec = pb.ReplicaSpec(
                deployment_id="dep-private", epoch=1, model_sha256=sha, model_name="mlp",
                token=TOKEN,
            )  # fmt: skip
            replica = (await stub.StartReplica(pb.StartReplicaRequest(spec=spec))).replica
            started.append(replica.replica_id)
        workdir = state / "replicas" / replica.replica_id
        folders = [state, state / "models", state / "replicas", workdir]
        files = [state / "models" / sha, *(p for p in workdir.iterdir() if p.is_file())]
        assert {p.name for p in files} >= {sha, "token", "replica.log", "replica.json"}
        assert {str(p): p.stat().st_mode & 0o777 for p in folders + files} == {
            **{str(p): 0o700 for p in folders},
            **{str(p): 0o600 for p in files},
        }
    finally:
        await _cleanup(daemon, started)


async def test_a_dead_replica_is_reported_with_exit_code_and_log(
    runtime: str, daemon_paths: tuple[Path, Path]
) -> None:
    state, log = daemon_paths
    daemon = await start_daemon(runtime, f"test-node-{runtime}-dies", state, log)
    started: list[str] = []
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            sha = await put_model(stub, modelzoo.model_path("mlp"))
            spec = pb.ReplicaSpec(
                deployment_id="dep-dies", epoch=3, model_sha256=sha, model_name="mlp",
                token=TOKEN, gpu_count=1,
            )  # fmt: skip
            replica = (await stub.StartReplica(pb.StartReplicaRequest(spec=spec))).replica
            started.append(replica.replica_id)
            _kill_replica(runtime, replica)
            for _ in range(100):
                listed = (await stub.ListReplicas(pb.ListReplicasRequest())).replicas
                if listed[0].state == pb.REPLICA_STATE_EXITED:
                    break
                await asyncio.sleep(0.1)
            dead = listed[0]
            assert dead.state == pb.REPLICA_STATE_EXITED
            assert "runtime listening on" in dead.log_tail
            if runtime == "docker":
                assert dead.exit_code == 137
            # Its GPU is free again.
            usage = await stub.Usage(pb.UsageRequest())
            assert len(usage.gpus) == 8
    finally:
        await _cleanup(daemon, started)


def _kill_replica(runtime: str, replica: pb.Replica) -> None:
    if runtime == "docker":
        client = require_docker()
        client.containers.get(replica.ref).kill()
        client.close()
    else:
        os.kill(int(replica.ref), signal.SIGKILL)


def memory_limit(group: Path) -> int:
    """A memory cgroup's limit in bytes, v1 or v2."""
    v1 = group / "memory.limit_in_bytes"
    return int((v1 if v1.exists() else group / "memory.max").read_text())


def _replica_exists(runtime: str, replica: pb.Replica) -> bool:
    if runtime == "docker":
        import docker.errors

        client = require_docker()
        try:
            client.containers.get(replica.ref)
        except docker.errors.NotFound:
            return False
        finally:
            client.close()
        return True
    try:  # an orphan that exited may stay a zombie when PID 1 does not reap
        return Path(f"/proc/{replica.ref}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _cleanup(daemon: Daemon, replica_ids: list[str]) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError):
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            for replica_id in replica_ids:
                await stub.StopReplica(pb.StopReplicaRequest(replica_id=replica_id, grace_ms=1000))
    daemon.process.send_signal(signal.SIGTERM)
    try:
        await asyncio.to_thread(daemon.process.wait, 30)
    except subprocess.TimeoutExpired:
        daemon.process.kill()
        daemon.process.wait()


async def test_resources_usage_and_topology(runtime: str, daemon_paths: tuple[Path, Path]) -> None:
    state, log = daemon_paths
    daemon = await start_daemon(runtime, f"test-node-{runtime}-res", state, log)
    started: list[str] = []
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            described = await stub.Describe(pb.DescribeRequest())
            assert "NUMA node (CPUs 0-11,24-35): GPU0 GPU1 GPU2 GPU3" in described.topology
            assert described.runtimes == [runtime]
            sha = await put_model(stub, modelzoo.model_path("mlp"))
            spec = pb.ReplicaSpec(
                deployment_id="dep-res", epoch=1, model_sha256=sha, model_name="mlp",
                token=TOKEN, gpu_count=2, cpus=1.5, memory_mib=1024,
            )  # fmt: skip
            if runtime == "process" and not cgroup_limits.can_limit_memory():
                # Refused, not run unlimited: nothing here could hold it to 1024 MiB.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.StartReplica(pb.StartReplicaRequest(spec=spec))
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert refused.value.details().startswith(MEMORY_LIMIT_UNAVAILABLE)
                assert not (await stub.ListReplicas(pb.ListReplicasRequest())).replicas
                spec.memory_mib = 0
            replica = (await stub.StartReplica(pb.StartReplicaRequest(spec=spec))).replica
            started.append(replica.replica_id)
            usage = await stub.Usage(pb.UsageRequest())
            assert [u.replica_id for u in usage.replicas] == [replica.replica_id]
            assert usage.replicas[0].memory_used_mib > 0
            update = pb.UpdateResourcesRequest(
                replica_id=replica.replica_id, cpus=0.5, memory_mib=768
            )
            if runtime == "process":
                if not (cgroup_limits.can_limit_cpu() and cgroup_limits.can_limit_memory()):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.UpdateResources(update)
                    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "use the Docker runtime" in caught.value.details()
                    return
                pid = int(replica.ref)
                (memory,) = (
                    g
                    for g in cgroup_limits.own_groups(pid, replica.replica_id)
                    if (g / "memory.limit_in_bytes").exists() or (g / "memory.max").exists()
                )
                assert memory_limit(memory) == 1024 * 1024 * 1024
                await stub.UpdateResources(update)
                assert memory_limit(memory) == 768 * 1024 * 1024
                return
            client = require_docker()
            try:
                container = client.containers.get(replica.ref)
                assert container.attrs["HostConfig"]["CpuQuota"] == 150_000
                # GPUs without an NVIDIA runtime: started on the CPU, the intent recorded.
                assert container.labels["offload.gpu-mode"] == "cpu-fallback"
                assert container.labels["offload.gpu-uuids"] == ",".join(replica.spec.gpu_uuids)
                await stub.UpdateResources(update)
                container.reload()
                assert container.attrs["HostConfig"]["CpuQuota"] == 50_000
                assert container.attrs["HostConfig"]["Memory"] == 768 * 1024 * 1024
            finally:
                client.close()
    finally:
        await _cleanup(daemon, started)


async def test_a_critical_deployments_replica_serves_its_calls_as_critical(
    daemon_paths: tuple[Path, Path],
) -> None:
    state, log = daemon_paths
    daemon = await start_daemon("process", "test-node-critical", state, log)
    started: list[str] = []
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            sha = await put_model(stub, modelzoo.model_path("mlp"))
            spec = pb.ReplicaSpec(
                deployment_id="dep-critical", epoch=1, model_sha256=sha, model_name="mlp",
                token=TOKEN, priority=3,
            )  # fmt: skip
            replica = (await stub.StartReplica(pb.StartReplicaRequest(spec=spec))).replica
            started.append(replica.replica_id)
        # The MLP batches; the runtime names the class of the deployment's calls at load,
        # before it reports ready.
        replica_log = state / "replicas" / replica.replica_id / "replica.log"
        text = await asyncio.to_thread(replica_log.read_text, errors="replace")
        assert "model=mlp batches: up to" in text, text
        assert "the deployment's calls are critical" in text, text
    finally:
        await _cleanup(daemon, started)


async def test_agent_token_guards_every_call(tmp_path: Path) -> None:
    token_file = tmp_path / "agent-token"
    token_file.write_text("agent-secret-0123456789")
    log = tmp_path / "daemon.log"
    command = [
        sys.executable, "-m", "edge_client.cli", "node", "--listen", "127.0.0.1:0",
        "--site", "site-a", "--node-id", "test-node-auth", "--runtime", "process",
        "--state-dir", str(tmp_path / "state"), "--agent-token-file", str(token_file),
    ]  # fmt: skip
    process, _ = await asyncio.to_thread(_spawn, command, log)
    for _ in range(600):
        if match := LISTENING.search(await asyncio.to_thread(log.read_text)):
            break
        await asyncio.sleep(0.05)
    daemon = Daemon(process, int(match.group(1)), log)
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Describe(pb.DescribeRequest())
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "agent token" in (caught.value.details() or "")
            # A wrong token, on a unary call and on PutModel's stream: the node's own words,
            # which name no deployment (the agent token is the node's).
            wrong = (("authorization", "Bearer not-the-agent-token-0123"),)
            sha = file_sha256(modelzoo.model_path("mlp"))
            for call in (
                stub.Describe(pb.DescribeRequest(), metadata=wrong),
                stub.PutModel(iter([pb.ModelChunk(sha256=sha, data=b"x")]), metadata=wrong),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                details = caught.value.details() or ""
                assert details == "invalid agent token for this node"
                assert "deployment" not in details
            described = await stub.Describe(
                pb.DescribeRequest(),
                metadata=(("authorization", "Bearer agent-secret-0123456789"),),
            )
            assert described.node_id == "test-node-auth" and not described.inventory.gpus
    finally:
        await _cleanup(daemon, [])
