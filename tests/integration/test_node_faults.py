"""Nothing leaks across a cancelled, failed or crashed start: every replica process or
container a node runs is in its ListReplicas, and a GPU goes to a new replica only once the
replica that held it is gone. Real daemons, real processes and containers, real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

import modelzoo
from images.build import build_image
from node_daemon.agent import NodeAgent, ReplicaState, StartRequest
from node_daemon.errors import StartFailed, StopFailed
from node_daemon.inventory import GpuSpec, TopologyFileInventory
from node_daemon.model_cache import ModelCache
from node_daemon.runtimes import DockerRuntime, ProcessRuntime, ReplicaFailed, Runtime
from node_daemon.runtimes.process_runtime import _Running
from protos.offload.v1 import node_pb2 as pb
from protos.offload.v1 import node_pb2_grpc as pb_grpc
from tests.data import TOPOLOGIES
from tests.docker_support import require_docker
from tests.integration.test_node_agent import Daemon, _cleanup, put_model, start_daemon

DGX1 = TOPOLOGIES / "21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt"
V100 = GpuSpec.parse("Tesla V100-SXM2-16GB:16384")
TOKEN = "replica-token-for-fault-tests"


def running_replicas(runtime: str, node_id: str, state: Path) -> set[str]:
    """The ids of the replicas of this node whose process or container runs now."""
    if runtime == "docker":
        client = require_docker()
        try:
            containers = client.containers.list(filters={"label": f"offload.node={node_id}"})
            return {c.labels["offload.replica"] for c in containers}
        finally:
            client.close()
    found = set()
    marker = str(state / "replicas") + "/"
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
            zombie = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        tokens = [a for a in args if a.startswith(marker) and a.endswith("/token")]
        if tokens and not zombie:
            found.add(Path(tokens[0]).parent.name)
    return found


async def _slow_model(stub: pb_grpc.NodeAgentStub, tmp_path: Path) -> tuple[str, str]:
    """resnet18 and warm-up inputs that take it seconds to get ready: (sha256, sha256)."""
    model = modelzoo.model_path("resnet18")
    inputs = {
        name: np.zeros((64, *array.shape[1:]), array.dtype)
        for name, array in modelzoo.sample_inputs(model).items()
    }
    warmup = tmp_path / "warmup.npz"
    np.savez_compressed(warmup, **inputs)
    return await put_model(stub, model), await put_model(stub, warmup)


async def _stop_all(daemon: Daemon) -> None:
    """Stop every replica the daemon lists, then the daemon: a failed test leaks nothing."""
    ids: list[str] = []
    with contextlib.suppress(grpc.aio.AioRpcError):
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            listed = (await stub.ListReplicas(pb.ListReplicasRequest(), timeout=30)).replicas
            ids = [r.replica_id for r in listed]
    await _cleanup(daemon, ids)


async def listed_then_running(
    stub: pb_grpc.NodeAgentStub, runtime: str, node_id: str, state: Path
) -> tuple[set[str], set[str]]:
    """What the node lists, then what runs: in this order, so that a replica the node stops
    in between is seen gone rather than unlisted."""
    listed = (await stub.ListReplicas(pb.ListReplicasRequest(), timeout=30)).replicas
    running = await asyncio.to_thread(running_replicas, runtime, node_id, state)
    return {r.replica_id for r in listed}, running


async def test_a_start_cancelled_by_the_callers_deadline_leaks_nothing(
    runtime: str, tmp_path: Path
) -> None:
    state, node_id = tmp_path / "state", f"faults-{runtime}-cancel"
    daemon = await start_daemon(runtime, node_id, state, tmp_path / "daemon.log")
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            # Warming resnet18 up on a batch of 64 takes seconds: the deadline cuts the start
            # after the spawn (the files' hashes, checked first, take about 0.1 s).
            sha, warmup = await _slow_model(stub, tmp_path)
            gpu0 = (await stub.Describe(pb.DescribeRequest())).inventory.gpus[0].uuid

            def spec(deployment: str) -> pb.ReplicaSpec:
                return pb.ReplicaSpec(
                    deployment_id=deployment, epoch=1, model_sha256=sha, model_name="resnet18",
                    token=TOKEN, gpu_uuids=[gpu0], warmup_inputs_sha256=warmup,
                )  # fmt: skip

            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.StartReplica(pb.StartReplicaRequest(spec=spec("dep-cut")), timeout=0.4)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if runtime == "process":  # the cut came after the spawn: the replica has a log
                assert (state / "replicas" / "dep-cut-1" / "replica.log").exists()
            # The same GPU for the next replica: refused while the cut one holds it, given
            # only once the cut one is gone; and whatever runs meanwhile is listed.
            for _ in range(600):
                listed, running = await listed_then_running(stub, runtime, node_id, state)
                assert running <= listed, f"{running - listed} run(s) but are not listed"
                try:
                    reply = await stub.StartReplica(
                        pb.StartReplicaRequest(spec=spec("dep-next")), timeout=120
                    )
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
                    await asyncio.sleep(0.1)
                    continue
                assert reply.replica.state == pb.REPLICA_STATE_READY
                break
            else:
                raise AssertionError("GPU0 was never free again")
            running = await asyncio.to_thread(running_replicas, runtime, node_id, state)
            assert running == {"dep-next-1"}
            listed = (await stub.ListReplicas(pb.ListReplicasRequest())).replicas
            assert [(r.replica_id, list(r.spec.gpu_uuids)) for r in listed] == [
                ("dep-next-1", [gpu0])
            ]
    finally:
        await _stop_all(daemon)


async def test_a_daemon_killed_right_after_spawning_a_replica_is_cleaned_up_by_the_next(
    runtime: str, tmp_path: Path
) -> None:
    state, node_id = tmp_path / "state", f"faults-{runtime}-kill"
    log = tmp_path / "daemon.log"
    daemon = await start_daemon(runtime, node_id, state, log)
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            sha, warmup = await _slow_model(stub, tmp_path)
            spec = pb.ReplicaSpec(
                deployment_id="dep-orphan", epoch=1, model_sha256=sha, model_name="resnet18",
                token=TOKEN, gpu_count=1, warmup_inputs_sha256=warmup,
            )  # fmt: skip

            async def start() -> pb.StartReplicaResponse:
                return await stub.StartReplica(pb.StartReplicaRequest(spec=spec), timeout=120)

            starting = asyncio.create_task(start(), name="start")
            for _ in range(1200):
                if await asyncio.to_thread(running_replicas, runtime, node_id, state):
                    break
                await asyncio.sleep(0.01)
            daemon.process.send_signal(signal.SIGKILL)
            await asyncio.to_thread(daemon.process.wait)
            with pytest.raises(grpc.aio.AioRpcError):
                await starting
        daemon = await start_daemon(runtime, node_id, state, log)
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            listed, running = await listed_then_running(stub, runtime, node_id, state)
            assert running <= listed, f"{running - listed} run(s) but are not listed"
            if runtime == "process":  # it was not ready: the next daemon stopped it
                assert listed == running == set()
    finally:
        await _stop_all(daemon)
    assert not await asyncio.to_thread(running_replicas, runtime, node_id, state)


class _Faulty(ProcessRuntime):
    """A process runtime whose start raises right after the spawn, or whose stops fail, on
    demand."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.probe_raises = False
        self.stops_to_fail = 0

    async def _port(self, running: _Running, timeout_s: float) -> int:
        if self.probe_raises:  # the step after the spawn
            raise RuntimeError("injected between two steps of the start")
        return await super()._port(running, timeout_s)

    async def stop(self, replica_id: str, grace_s: float = 10.0) -> int | None:
        if self.stops_to_fail:
            self.stops_to_fail -= 1
            raise ReplicaFailed("injected: the runtime cannot stop it")
        return await super().stop(replica_id, grace_s)


def _agent(runtime: Runtime, tmp_path: Path) -> NodeAgent:
    cache = ModelCache(tmp_path / "models", file_mode=runtime.model_file_mode)
    cache.put_file(modelzoo.model_path("mlp"))
    inventory = TopologyFileInventory(DGX1, V100).read()
    return NodeAgent("faults-node", "site-a", inventory, runtime, cache)


def _request(deployment: str, tmp_path: Path) -> StartRequest:
    sha = next(p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith("."))
    return StartRequest(deployment, 1, sha, "mlp", TOKEN, gpu_count=1)


@pytest.fixture
async def faulty(tmp_path: Path) -> AsyncIterator[tuple[NodeAgent, _Faulty]]:
    runtime = _Faulty(tmp_path / "replicas")
    agent = _agent(runtime, tmp_path)
    try:
        yield agent, runtime
    finally:
        runtime.probe_raises, runtime.stops_to_fail = False, 0
        await agent.close(stop_replicas=True)


async def test_an_error_between_steps_of_a_start_leaves_nothing_running(
    faulty: tuple[NodeAgent, _Faulty], tmp_path: Path
) -> None:
    agent, runtime = faulty
    runtime.probe_raises = True
    with pytest.raises(RuntimeError, match="injected"):
        await agent.start_replica(_request("dep-probe", tmp_path))
    assert await agent.list_replicas() == []
    assert not running_replicas("process", "faults-node", tmp_path)
    assert len(agent.allocator.free()) == 8


async def test_a_replica_that_cannot_be_stopped_stays_listed_holding_its_gpus(
    faulty: tuple[NodeAgent, _Faulty], tmp_path: Path
) -> None:
    agent, runtime = faulty
    # A start that fails and whose clean-up fails too: listed, GPUs held, still running.
    runtime.probe_raises, runtime.stops_to_fail = True, 1
    with pytest.raises(StartFailed, match="cannot stop it"):
        await agent.start_replica(_request("dep-stuck", tmp_path))
    [view] = await agent.list_replicas()
    assert view.state is ReplicaState.STOPPING and "could not be stopped" in view.log_tail
    assert agent.allocator.holder_of(view.gpus[0]) == ["dep-stuck-1"]
    assert running_replicas("process", "faults-node", tmp_path) == {"dep-stuck-1"}
    # A stop that fails keeps it so; the next one frees the GPU, once the process is gone.
    runtime.probe_raises, runtime.stops_to_fail = False, 1
    with pytest.raises(StopFailed, match="stays listed"):
        await agent.stop_replica("dep-stuck-1", grace_s=1)
    assert [v.replica_id for v in await agent.list_replicas()] == ["dep-stuck-1"]
    assert agent.allocator.holder_of(view.gpus[0]) == ["dep-stuck-1"]
    await agent.stop_replica("dep-stuck-1", grace_s=1)
    assert await agent.list_replicas() == []
    assert not running_replicas("process", "faults-node", tmp_path)
    assert agent.allocator.holder_of(view.gpus[0]) == []


async def test_usage_while_replicas_start_and_stop(runtime: str, tmp_path: Path) -> None:
    if runtime == "docker":
        replicas: Runtime = await asyncio.to_thread(
            DockerRuntime.connect, build_image("cpu", progress=lambda _line: None)
        )
    else:
        replicas = ProcessRuntime(tmp_path / "replicas")
    agent = _agent(replicas, tmp_path)
    ids = [f"dep-{i}" for i in range(3)]
    done = asyncio.Event()
    samples: list[set[str]] = []

    async def sample() -> None:
        while not done.is_set():
            sample = await agent.usage()
            samples.append({r.replica_id for r in sample.replicas})
            await asyncio.sleep(0)

    try:
        sampler = asyncio.create_task(sample(), name="usage")
        try:
            await asyncio.gather(*(agent.start_replica(_request(i, tmp_path)) for i in ids))
            await asyncio.gather(*(agent.stop_replica(f"{i}-1", grace_s=1) for i in ids))
        finally:
            done.set()
            await sampler
    finally:
        await agent.close(stop_replicas=True)
    assert samples and all(s <= {f"{i}-1" for i in ids} for s in samples)
    assert any(samples), "usage never saw a replica: the test proved nothing"


async def test_a_stop_during_the_start_cancels_it_and_frees_the_gpu_once_gone(
    tmp_path: Path,
) -> None:
    agent = _agent(ProcessRuntime(tmp_path / "replicas"), tmp_path)
    model = modelzoo.model_path("resnet18")
    inputs = {
        name: np.zeros((64, *array.shape[1:]), array.dtype)
        for name, array in modelzoo.sample_inputs(model).items()
    }
    np.savez_compressed(tmp_path / "warmup.npz", **inputs)
    request = StartRequest(
        "dep-stopped", 1, agent.cache.put_file(model).sha256, "resnet18", TOKEN,
        gpu_count=1, warmup_inputs_sha256=agent.cache.put_file(tmp_path / "warmup.npz").sha256,
    )  # fmt: skip
    try:
        starting = asyncio.create_task(agent.start_replica(request), name="start")
        for _ in range(600):
            if running_replicas("process", "faults-node", tmp_path):
                break
            await asyncio.sleep(0.02)
        [view] = await agent.list_replicas()
        assert view.state is ReplicaState.STARTING
        await agent.stop_replica("dep-stopped-1", grace_s=1)
        with pytest.raises(StartFailed, match="stopped while it started"):
            await starting
        assert await agent.list_replicas() == []
        assert not running_replicas("process", "faults-node", tmp_path)
        assert agent.allocator.holder_of(view.gpus[0]) == []
    finally:
        await agent.close(stop_replicas=True)
