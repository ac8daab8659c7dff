"""The process runtime limits a replica's CPU with a cgroup of its own (from its start, and at
`update`), every thread of it, and removes that cgroup at `stop`; where no cgroup is writable
it says so. A node's cpuset pins every thread of its replicas."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest

import modelzoo
from edge_client.rpc.tensors import infer_request
from node_daemon.runtimes import (
    ProcessRuntime,
    ReplicaFailed,
    ReplicaSpec,
    ResourceUpdateUnsupported,
    cgroup_limits,
)
from node_daemon.runtimes.cgroup_limits import CgroupUnavailable
from protos.inference import grpc_service_pb2_grpc as infer_grpc

TOKEN = "cgroup-test-token"
MODEL = "resnet18"
V1_CPU = Path("/sys/fs/cgroup/cpu")

needs_v1 = pytest.mark.skipif(
    not (V1_CPU / "cpu.cfs_quota_us").exists() or not os.access(V1_CPU, os.W_OK),
    reason="needs a writable cgroup v1 cpu hierarchy (root)",
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads_of(pid: int) -> set[int]:
    return {int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()}


async def cores_used(pid: int, seconds: float) -> float:
    loop = asyncio.get_running_loop()
    cpu0, t0 = cpu_seconds(pid), loop.time()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - cpu0) / (loop.time() - t0)


async def keep_busy(endpoint: str, stop: asyncio.Event) -> int:
    """Requests back to back until `stop`; how many were answered."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path(MODEL))
    request = infer_request(MODEL, inputs)
    answered = 0
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = infer_grpc.GRPCInferenceServiceStub(channel)
        while not stop.is_set():
            await stub.ModelInfer(request, metadata=(("authorization", f"Bearer {TOKEN}"),))
            answered += 1
    return answered


@needs_v1
async def test_a_busy_replica_limited_to_a_third_of_a_core_uses_about_that(
    tmp_path: Path,
) -> None:
    runtime = ProcessRuntime(workdir=tmp_path)
    spec = ReplicaSpec("cg-1", modelzoo.model_path(MODEL), MODEL, TOKEN, concurrency=2)
    replica = await runtime.start(spec)
    pid = int(replica.ref)
    stop = asyncio.Event()
    loads = [
        asyncio.create_task(keep_busy(replica.endpoint, stop), name=f"load-{i}") for i in range(3)
    ]
    try:
        await runtime.update("cg-1", 0.3, 0)
        group = V1_CPU / cgroup_limits.PARENT / "cg-1"
        assert (group / "cpu.cfs_quota_us").read_text().strip() == "30000"
        assert (group / "cpu.cfs_period_us").read_text().strip() == "100000"
        # The process and every thread of it (ONNX Runtime's pools included) are in it.
        threads = threads_of(pid)
        assert len(threads) > 1
        assert threads <= {int(t) for t in (group / "tasks").read_text().split()}
        assert str(pid) in (group / "cgroup.procs").read_text().split()
        # The runtime's stats read the quota back.
        stats = await runtime.stats("cg-1")
        assert stats is not None and stats.cpu_limit == pytest.approx(0.3)
        await asyncio.sleep(0.5)  # the quota has bitten
        used = await cores_used(pid, 2.0)
        assert used < 0.5, f"limited to 0.3 core, it used {used:.2f}"
        after = await runtime.stats("cg-1")
        assert after is not None and after.throttled_periods > 0
        # A second update changes the quota of the same cgroup.
        await runtime.update("cg-1", 1.5, 0)
        assert (group / "cpu.cfs_quota_us").read_text().strip() == "150000"
        with pytest.raises(ResourceUpdateUnsupported, match="CPU only"):
            await runtime.update("cg-1", 0.5, 512)
    finally:
        stop.set()
        answered = await asyncio.gather(*loads, return_exceptions=True)
        await runtime.stop("cg-1")
    assert all(isinstance(n, int) and n > 0 for n in answered), answered
    assert not group.exists()
    assert runtime._cgroups == {}


def test_without_a_writable_cgroup_the_limit_is_refused_with_a_reason(tmp_path: Path) -> None:
    # A cgroupfs root with no cpu hierarchy: neither v1 nor v2 can limit.
    with pytest.raises(CgroupUnavailable, match="no cgroup CPU controller"):
        cgroup_limits.limit_cpu(os.getpid(), "nowhere", 0.3, root=tmp_path)
    assert not cgroup_limits.can_limit_cpu(root=tmp_path)
    # A v1 hierarchy that cannot be written (a file where the cgroup would go).
    own = cgroup_limits.cgroup_dirs(os.getpid(), tmp_path).get("cpu")
    if own is None:
        pytest.skip("this process has no v1 cpu cgroup")
    own.mkdir(parents=True, exist_ok=True)
    (own / "cpu.cfs_quota_us").write_text("-1")
    assert cgroup_limits.can_limit_cpu(root=tmp_path) == os.access(own, os.W_OK)
    (own / cgroup_limits.PARENT).write_text("not a directory")
    with pytest.raises(CgroupUnavailable, match="cannot limit CPU with a cgroup here"):
        cgroup_limits.limit_cpu(os.getpid(), "blocked", 0.3, root=tmp_path)


async def test_an_update_of_a_replica_not_running_fails(tmp_path: Path) -> None:
    runtime = ProcessRuntime(workdir=tmp_path)
    with pytest.raises(ReplicaFailed, match="not running"):
        await runtime.update("absent", 0.5, 0)


@needs_v1
async def test_a_replica_runs_on_its_cpuset_within_its_quota_from_its_start(
    tmp_path: Path,
) -> None:
    cpu = max(os.sched_getaffinity(0))
    runtime = ProcessRuntime(workdir=tmp_path, cpuset=frozenset({cpu}))
    spec = ReplicaSpec("cg-2", modelzoo.model_path(MODEL), MODEL, TOKEN, cpus=0.4)
    replica = await runtime.start(spec)
    pid = int(replica.ref)
    group = V1_CPU / cgroup_limits.PARENT / "cg-2"
    try:
        # Ready, with ONNX Runtime's threads started: every one on the node's CPU, in the
        # replica's cgroup, whose quota was there before the model loaded.
        threads = threads_of(pid)
        assert len(threads) > 1
        assert {frozenset(os.sched_getaffinity(tid)) for tid in threads} == {frozenset({cpu})}
        assert threads <= {int(t) for t in (group / "tasks").read_text().split()}
        assert (group / "cpu.cfs_quota_us").read_text().strip() == "40000"
        stats = await runtime.stats("cg-2")
        assert stats is not None and stats.cpu_limit == pytest.approx(0.4)
    finally:
        await runtime.stop("cg-2")
    assert not group.exists()
