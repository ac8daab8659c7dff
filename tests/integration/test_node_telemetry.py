"""The node's own view of live load and its resource manager, with real replicas (containers,
or processes) under real ResNet-18 load: a busy replica's CPU and the node's rise while it is
loaded and fall once the load stops (in that order; how many samples each takes is not
asserted: on a loaded machine the replicas get the CPU late); with the `usage` policy a
throttled critical replica gets more CPU and gives it back once its burst ends; Docker's
stats call, the fallback where a container's cgroup is not visible, reads what its cgroup
files do.

The node agent is driven in this process, sample by sample, as the daemon's sampling loop
drives it (`BrokerLink._sample_usage`: `NodeAgent.usage`, then the resource manager's
`step`), so that the test sees every sample; the daemon's wiring of the same loop to the
heartbeat and `--resize-policy` is what `bench.resize` runs (tests/integration/
test_bench_resize.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

import modelzoo
from edge_client.rpc.tensors import infer_request
from images.build import build_image
from node_daemon.agent import NodeAgent, ReplicaView, StartRequest
from node_daemon.inventory import cpu_only_inventory
from node_daemon.model_cache import ModelCache
from node_daemon.resources import ResizeEvent, ResizeSettings, ResourceManager
from node_daemon.runtimes import DockerRuntime, ProcessRuntime, Runtime, docker_runtime
from node_daemon.runtimes.cgroup_limits import can_limit_cpu
from node_daemon.telemetry import NodeSample, Telemetry
from protos.inference import grpc_service_pb2_grpc as infer_grpc
from tests.docker_support import require_docker

MODEL = "resnet18"
TOKEN = "telemetry-test-token-0123"
CORES = 2.0
"""What the node offers here, whatever the machine: the policy's arithmetic is against it."""
SAMPLE_S = 0.5
BUSY = 0.3
"""Cores: a replica under three closed loops of ResNet-18 uses more (about one core of this
machine's two); an idle one uses well under `IDLE`."""
IDLE = 0.1


@pytest.fixture(params=[pytest.param("docker", marks=pytest.mark.docker), "process"])
async def agent(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[NodeAgent]:
    runtime: Runtime
    if request.param == "docker":
        require_docker().close()
        image = await asyncio.to_thread(build_image, "cpu", progress=lambda _line: None)
        runtime = await asyncio.to_thread(DockerRuntime.connect, image)
    else:
        runtime = ProcessRuntime(workdir=tmp_path / "replicas")
    agent = NodeAgent(
        "telemetry-node", "site-a", cpu_only_inventory(), runtime,
        ModelCache(tmp_path / "models", file_mode=runtime.model_file_mode),
        telemetry=Telemetry(cpu_cores=CORES),
    )  # fmt: skip
    try:
        yield agent
    finally:
        await agent.close(stop_replicas=True)


async def start(
    agent: NodeAgent,
    name: str,
    cpus: float,
    priority: int,
    cpus_min: float = 0.0,
    cpus_max: float = 0.0,
) -> ReplicaView:
    sha = (await asyncio.to_thread(agent.cache.put_file, modelzoo.model_path(MODEL))).sha256
    return await agent.start_replica(
        StartRequest(
            deployment_id=name, epoch=1, model_sha256=sha, model_name=MODEL, token=TOKEN,
            cpus=cpus, priority=priority, cpus_min=cpus_min, cpus_max=cpus_max,
        )
    )  # fmt: skip


@asynccontextmanager
async def loaded(endpoint: str, loops: int = 3) -> AsyncIterator[list[int]]:
    """`loops` closed loops of inferences on the replica while inside; the list holds how many
    each got answered (filled in on the way out; a failed request fails the test)."""
    request = infer_request(MODEL, modelzoo.sample_inputs(modelzoo.model_path(MODEL)))
    stop = asyncio.Event()

    async def loop() -> int:
        answered = 0
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = infer_grpc.GRPCInferenceServiceStub(channel)
            while not stop.is_set():
                await stub.ModelInfer(
                    request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30
                )
                answered += 1
        return answered

    tasks = [asyncio.create_task(loop(), name=f"load-{i}") for i in range(loops)]
    answered: list[int] = []
    try:
        yield answered
    finally:
        stop.set()
        answered.extend(await asyncio.gather(*tasks))


async def eventually(
    agent: NodeAgent, holds: Callable[[NodeSample], bool], what: str, timeout_s: float = 60.0
) -> NodeSample:
    """Take samples, `SAMPLE_S` apart, as the daemon does; the first one `holds` is true of.
    AssertionError with the last ones seen if none is within `timeout_s`."""
    seen = []
    for _ in range(int(timeout_s / SAMPLE_S)):
        await asyncio.sleep(SAMPLE_S)
        sample = await agent.usage()
        if holds(sample):
            return sample
        seen.append([(r.replica_id, round(r.cpu_used_cores, 2)) for r in sample.replicas])
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}; last samples {seen[-4:]}")


async def test_a_busy_replicas_cpu_and_the_nodes_rise_under_load_and_fall_after(
    agent: NodeAgent,
) -> None:
    busy = await start(agent, "busy", cpus=1.5, priority=2)
    await start(agent, "idle", cpus=0.5, priority=1)

    def used(sample: NodeSample, replica_id: str) -> float:
        return next(r.cpu_used_cores for r in sample.replicas if r.replica_id == replica_id)

    # Loaded or not, the first sample of a replica has nothing to take a difference from.
    await agent.usage()
    await eventually(agent, lambda s: s.cpu_used_cores < IDLE, "an idle node")
    async with loaded(busy.endpoint) as answered:
        hot = await eventually(
            agent, lambda s: used(s, busy.replica_id) > BUSY, "the busy replica's CPU rose"
        )
        assert hot.cpu_used_cores >= used(hot, busy.replica_id) > BUSY
        assert used(hot, "idle-1") < IDLE
        replica = next(r for r in hot.replicas if r.replica_id == busy.replica_id)
        assert replica.requests is not None and replica.requests.rate_per_s > 0
        assert replica.requests.latency_p50_ms > 0 and replica.requests.compute_p50_ms > 0
        assert replica.memory_used_mib > 0
        if agent.runtime.name == "docker":  # a process replica has no quota until resized
            assert replica.cpu_limit == pytest.approx(1.5)
        assert hot.cpu_cores == CORES and hot.memory_total_mib > 0
    assert all(n > 0 for n in answered)
    cold = await eventually(agent, lambda s: s.cpu_used_cores < IDLE, "the node cooled")
    assert used(cold, busy.replica_id) < IDLE

    def rate(sample: NodeSample) -> float | None:
        figures = next(r.requests for r in sample.replicas if r.replica_id == busy.replica_id)
        return None if figures is None else figures.rate_per_s

    # The sample that saw it cool may still count the last requests' answers.
    await eventually(agent, lambda s: rate(s) == 0, "no more requests")


async def test_with_the_usage_policy_a_throttled_critical_replica_gets_more_cpu_and_gives_it_back(
    agent: NodeAgent,
) -> None:
    if agent.runtime.name == "process" and not can_limit_cpu():
        pytest.skip("the process runtime limits CPU only where a cgroup is writable")
    critical = await start(agent, "crit", cpus=0.5, cpus_min=0.25, cpus_max=1.5, priority=3)
    await start(agent, "be", cpus=1.0, priority=1)
    manager = ResourceManager("usage", agent.resize, ResizeSettings(shrink_after_s=2.0))
    agent.resizer = manager

    async def step_until(holds: Callable[[list[ResizeEvent]], bool], what: str) -> None:
        """The daemon's sampling loop, until `holds` is true of the critical one's resizes."""
        for _ in range(int(60 / SAMPLE_S)):
            await asyncio.sleep(SAMPLE_S)
            await manager.step(await agent.usage())
            if holds([e for e in manager.events() if e.replica_id == critical.replica_id]):
                return
        raise AssertionError(f"never: {what}; resizes: {manager.events()}")

    async with loaded(critical.endpoint) as answered:
        await step_until(lambda mine: any(e.cpus_after > 0.5 for e in mine), "it grew")
        grown = [e for e in manager.events() if e.replica_id == critical.replica_id][-1]
        assert grown.policy == "usage" and grown.deployment_id == "crit"
        assert "throttled" in grown.reason and "critical" in grown.reason
        assert grown.cpus_after <= 1.5
        sample = await agent.usage()
        limit = next(r.cpu_limit for r in sample.replicas if r.replica_id == critical.replica_id)
        assert limit > 0.5  # the runtime's quota now, read back from the replica's cgroup
        assert sum(r.cpu_limit for r in sample.replicas) <= CORES + 1e-6
    assert all(n > 0 for n in answered)
    peak = max(e.cpus_after for e in manager.events() if e.replica_id == critical.replica_id)
    await step_until(
        lambda mine: mine[-1].cpus_after < peak and mine[-1].cpus_after >= 0.25, "it gave back"
    )
    back = [e for e in manager.events() if e.replica_id == critical.replica_id][-1]
    assert "used" in back.reason
    sample = await agent.usage()
    limit = next(r.cpu_limit for r in sample.replicas if r.replica_id == critical.replica_id)
    assert limit == pytest.approx(back.cpus_after, abs=0.01)
    ids = [e.event_id for e in manager.events()]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("agent", ["docker"], indirect=True)
async def test_dockers_stats_call_reads_what_the_cgroup_files_do(agent: NodeAgent) -> None:
    """The fallback where the daemon cannot see a container's cgroup (another pid or cgroup
    namespace): the same counters from the engine's stats call."""
    view = await start(agent, "stats", cpus=0.5, priority=2)
    client = require_docker()
    try:
        container = await asyncio.to_thread(client.containers.get, view.ref)
        pid = container.attrs["State"]["Pid"]
        async with loaded(view.endpoint, loops=2):
            await asyncio.sleep(1.0)  # the quota throttles it
            files = docker_runtime._cgroup_stats(pid, container.id)
            sample = await asyncio.to_thread(container.stats, stream=False, one_shot=True)
        called = docker_runtime._stats_from(sample, container.attrs["HostConfig"])
    finally:
        client.close()
    assert files is not None
    assert called.cpu_limit == files.cpu_limit == pytest.approx(0.5)
    # Read a moment apart: the later reading counts at least as much, not much more.
    assert files.cpu_seconds <= called.cpu_seconds <= files.cpu_seconds + 5
    assert files.periods <= called.periods and files.throttled_periods <= called.throttled_periods
    assert called.throttled_periods > 0
    assert abs(called.memory_used_mib - files.memory_used_mib) < 64
    # A pid whose cgroup does not name the container is not trusted.
    assert docker_runtime._cgroup_stats(pid, "0" * 64) is None
    assert docker_runtime._cgroup_stats(os.getpid(), container.id) is None
