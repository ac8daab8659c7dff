"""The process runtime limits a replica's CPU and memory with cgroups of its own (from its
start, and at `update`), every thread of it, and removes them at `stop`; where no cgroup is
writable it says so, and a replica that asks for memory_mib there is refused before anything
starts. A node's cpuset pins every thread of its replicas."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest

import modelzoo
from edge_client.rpc.tensors import infer_request
from node_daemon.runtimes import (
    LimitUnavailable,
    ProcessRuntime,
    ReplicaFailed,
    ReplicaSpec,
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
needs_memory_cgroup = pytest.mark.skipif(
    not cgroup_limits.can_limit_memory(),
    reason="needs a writable memory cgroup (v1 `memory` or v2 with `memory`; root)",
)
MIB = 1024 * 1024


def memory_limit(group: Path) -> int:
    """A memory cgroup's limit in bytes, v1 or v2."""
    for name in ("memory.limit_in_bytes", "memory.max"):
        if (group / name).exists():
            return int((group / name).read_text())
    raise AssertionError(f"{group} has no memory limit file")


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
        if cgroup_limits.can_limit_memory():
            await runtime.update("cg-1", 0, 512)
            (memory,) = (g for g in runtime._cgroups["cg-1"] if g != group)
            assert memory_limit(memory) == 512 * MIB
            assert str(pid) in (memory / "cgroup.procs").read_text().split()
    finally:
        stop.set()
        answered = await asyncio.gather(*loads, return_exceptions=True)
        await runtime.stop("cg-1")
    assert all(isinstance(n, int) and n > 0 for n in answered), answered
    assert not group.exists()
    assert not any(g.exists() for g in cgroup_limits.leftover_groups("cg-1"))
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


@needs_memory_cgroup
async def test_a_replica_runs_within_its_memory_limit_from_its_start(tmp_path: Path) -> None:
    runtime = ProcessRuntime(workdir=tmp_path)
    spec = ReplicaSpec("mem-1", modelzoo.model_path("mlp"), "mlp", TOKEN, memory_mib=300)
    replica = await runtime.start(spec)
    pid = int(replica.ref)
    (group,) = runtime._cgroups["mem-1"]
    try:
        assert group.parent.name == cgroup_limits.PARENT and group.name == "mem-1"
        assert memory_limit(group) == 300 * MIB
        # In it from before its interpreter started: the launcher kept the spawn's pid.
        assert str(pid) in (group / "cgroup.procs").read_text().split()
        assert group in cgroup_limits.own_groups(pid, "mem-1")
        await infer_mlp(replica.endpoint, 20)  # it serves within it
    finally:
        await runtime.stop("mem-1")
    assert not group.exists()
    assert runtime._cgroups == {}


async def infer_mlp(endpoint: str, calls: int) -> None:
    request = infer_request("mlp", modelzoo.sample_inputs(modelzoo.model_path("mlp")))
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = infer_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(calls):
            await stub.ModelInfer(request, metadata=(("authorization", f"Bearer {TOKEN}"),))


@needs_memory_cgroup
async def test_a_replica_over_its_memory_limit_fails_its_start_saying_so(
    tmp_path: Path,
) -> None:
    # ResNet-18 on the CPU peaks near 190 MiB while it loads: 100 MiB cannot hold it.
    runtime = ProcessRuntime(workdir=tmp_path)
    spec = ReplicaSpec("mem-2", modelzoo.model_path(MODEL), MODEL, TOKEN, memory_mib=100)
    with pytest.raises(ReplicaFailed, match="passing its memory limit, memory_mib 100"):
        await runtime.start(spec)
    assert runtime._cgroups == {} and runtime._running == {}
    assert cgroup_limits.leftover_groups("mem-2") == []


async def test_where_no_memory_cgroup_is_writable_memory_mib_is_refused_before_a_start(
    tmp_path: Path,
) -> None:
    # A cgroupfs root with no hierarchy at all: nothing can be limited there.
    runtime = ProcessRuntime(workdir=tmp_path / "replicas", cgroup_root=tmp_path / "cgroupfs")
    spec = ReplicaSpec("mem-3", modelzoo.model_path("mlp"), "mlp", TOKEN, memory_mib=512)
    with pytest.raises(LimitUnavailable, match="no cgroup memory controller"):
        await runtime.start(spec)
    assert runtime._running == {} and runtime._cgroups == {}
    assert not (tmp_path / "replicas" / "mem-3").exists()
    assert not cgroup_limits.can_limit_memory(root=tmp_path / "cgroupfs")


def test_a_v2_memory_cgroup_gets_its_limit_and_no_swap(tmp_path: Path) -> None:
    # A unified (v2) hierarchy that offers `memory`, as a file tree: this process's v2
    # cgroup is where /proc/self/cgroup says, below the fake root.
    own = cgroup_limits.cgroup_dirs(os.getpid(), tmp_path).get("")
    if own is None:
        pytest.skip("this process has no v2 cgroup line")
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    own = cgroup_limits.cgroup_dirs(os.getpid(), tmp_path)[""]
    own.mkdir(parents=True, exist_ok=True)
    (own / "cgroup.controllers").write_text("cpu memory\n")
    (own / "cgroup.subtree_control").write_text("")
    (own / cgroup_limits.PARENT).mkdir()
    (own / cgroup_limits.PARENT / "cgroup.subtree_control").write_text("")
    group = own / cgroup_limits.PARENT / "r-1"
    group.mkdir()
    (group / "memory.swap.max").write_text("max")
    made = cgroup_limits.memory_group("r-1", 256, root=tmp_path)
    assert made == group
    assert (group / "memory.max").read_text() == str(256 * MIB)
    assert (group / "memory.swap.max").read_text() == "0"
    assert "+memory" in (own / "cgroup.subtree_control").read_text()
    assert "+memory" in (own / cgroup_limits.PARENT / "cgroup.subtree_control").read_text()
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cgroup_limits.oom_kills(group) == 1


@needs_memory_cgroup
async def test_a_restarted_daemon_removes_the_memory_cgroups_of_what_it_adopts_and_drops(
    tmp_path: Path,
) -> None:
    first = ProcessRuntime(workdir=tmp_path)
    spec = ReplicaSpec(
        "mem-4", modelzoo.model_path("mlp"), "mlp", TOKEN, labels={"node": "n"}, memory_mib=300
    )
    await first.start(spec)
    (group,) = first._cgroups["mem-4"]
    await first.detach()  # the daemon goes, its replica serves on
    # A daemon killed after it made a replica's cgroup, before it spawned the replica: a
    # folder whose record has no pid, a cgroup with nothing in it.
    cgroup_limits.memory_group("mem-5", 300)
    (tmp_path / "mem-5").mkdir(mode=0o700)
    (tmp_path / "mem-5" / "replica.json").write_text(
        '{"pid": null, "endpoint": "", "labels": {"node": "n"}}'
    )
    second = ProcessRuntime(workdir=tmp_path)
    adopted = await second.adopt({"node": "n"})
    assert [r.replica_id for r in adopted] == ["mem-4"]
    assert cgroup_limits.leftover_groups("mem-5") == []  # dropped with its folder
    assert group.exists()
    await second.stop("mem-4")
    assert not group.exists()
