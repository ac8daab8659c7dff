"""A replica started at background priority (a migration's target) runs there until it is
ready and at normal priority from then on, whatever the runtime; a daemon that adopts one
its predecessor left low raises it; and a replica being stopped (a migration's source, once
the client has moved) is lowered before its drain (issue 12)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import modelzoo
import node_daemon.runtimes.process_runtime
from images.build import build_image
from node_daemon.runtimes import DockerRuntime, ProcessRuntime, ReplicaSpec, cgroups
from node_daemon.runtimes.cgroup_limits import REPLICAS_PARENT, shares_to_weight
from node_daemon.runtimes.docker_runtime import (
    BACKGROUND_CPU_SHARES,
    LINEAR_SHARES_FOR_DEFAULT,
    NORMAL_CPU_SHARES,
)
from node_daemon.runtimes.process_runtime import can_leave_background
from tests.docker_support import require_docker

TOKEN = "priority-test-token"

needs_cap = pytest.mark.skipif(
    not can_leave_background(), reason="needs CAP_SYS_NICE or RLIMIT_NICE 20"
)


def policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of `pid` (empty once it is gone)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out.add(os.sched_getscheduler(int(task.name)))
        except (ProcessLookupError, ValueError):
            continue
    return out


def spec(replica_id: str, background: bool) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id, modelzoo.model_path("mlp"), "mlp", TOKEN, labels={"node": "prio"},
        background=background,
    )  # fmt: skip


@needs_cap
async def test_a_process_replica_starts_idle_and_serves_at_normal_priority(
    tmp_path: Path,
) -> None:
    runtime = ProcessRuntime(workdir=tmp_path)
    seen: set[int] = set()
    try:
        start = asyncio.create_task(runtime.start(spec("bg-1", True)), name="start")
        # Sample every thread's policy while it starts (imports, model load, warm-up).
        while not start.done():
            running = runtime._running.get("bg-1")
            if running is not None:
                seen |= policies(running.pid)
            await asyncio.sleep(0.01)
        replica = await start
        assert os.SCHED_IDLE in seen and os.SCHED_OTHER not in seen
        # Ready: every thread, ONNX Runtime's included, is back at normal priority.
        after = policies(int(replica.ref))
        assert after == {os.SCHED_OTHER}
        normal = await runtime.start(spec("fg-1", False))
        assert policies(int(normal.ref)) == {os.SCHED_OTHER}
    finally:
        await runtime.close()


FIRST_LOOK = """
import json, os
with open(os.environ["FIRST_LOOK_FILE"], "a") as out:
    out.write(json.dumps([sorted(os.sched_getaffinity(0)), os.sched_getscheduler(0)]) + "\\n")
"""


@needs_cap
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin to 1")
async def test_a_process_replica_runs_pinned_and_idle_from_its_first_instruction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A `sitecustomize` on the replica's PYTHONPATH runs as its interpreter starts, before
    # anything of ours: it sees the CPUs and the policy the spawn gave it. The daemon is
    # held up right after each spawn (a busy loop, a loaded host), so whatever it sets
    # once the spawn has returned comes too late for that first look.
    spawn = asyncio.create_subprocess_exec

    async def held_up(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        process = await spawn(*args, **kwargs)
        await asyncio.sleep(1.0)
        return process

    monkeypatch.setattr(
        node_daemon.runtimes.process_runtime.asyncio, "create_subprocess_exec", held_up
    )
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FIRST_LOOK)
    looks = tmp_path / "first-look.jsonl"
    monkeypatch.setenv("FIRST_LOOK_FILE", str(looks))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    )
    cpu = max(os.sched_getaffinity(0))
    runtime = ProcessRuntime(workdir=tmp_path / "replicas", cpuset=frozenset({cpu}))
    try:
        await runtime.start(spec("pin-bg", True))
        await runtime.start(spec("pin-fg", False))
    finally:
        await runtime.close()
    first = [json.loads(line) for line in looks.read_text().splitlines()]
    assert first == [[[cpu], os.SCHED_IDLE], [[cpu], os.SCHED_OTHER]]


@needs_cap
@pytest.mark.parametrize("launcher", ["prompt", "slow"])
async def test_a_process_replica_not_ready_in_time_is_raised_anyway(
    launcher: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(node_daemon.runtimes.process_runtime, "BACKGROUND_LIMIT_S", 0.0)
    if launcher == "slow":
        # As on a loaded machine: the overdue raise comes before chrt has set SCHED_IDLE.
        chrt = shutil.which("chrt")
        if chrt is None:
            pytest.skip("no chrt (util-linux) here: replicas start with no launcher")
        slow = tmp_path / "bin" / "chrt"
        slow.parent.mkdir()
        slow.write_text(f'#!/bin/sh\nsleep 0.5\nexec {chrt} "$@"\n')
        slow.chmod(0o755)
        monkeypatch.setenv("PATH", f"{slow.parent}{os.pathsep}{os.environ['PATH']}")
    runtime = ProcessRuntime(workdir=tmp_path / "replicas")
    try:
        replica = await runtime.start(spec("bg-2", True))
        assert policies(int(replica.ref)) == {os.SCHED_OTHER}
        assert "not ready after 0s at background priority: raising it" in caplog.text
    finally:
        await runtime.close()


async def test_a_process_replica_being_stopped_yields_the_cpu_before_its_drain(
    tmp_path: Path,
) -> None:
    runtime = ProcessRuntime(workdir=tmp_path)
    try:
        replica = await runtime.start(spec("old-1", False))
        pid = int(replica.ref)
        assert policies(pid) == {os.SCHED_OTHER}
        # Held, so that its SIGTERM handler (the drain) waits until the policies are read.
        os.kill(pid, signal.SIGSTOP)
        try:
            stopping = asyncio.create_task(runtime.stop("old-1", grace_s=10.0))
            await asyncio.sleep(0)  # stop's first step: lowered, then signalled
            assert not stopping.done()
            assert policies(pid) == {os.SCHED_IDLE}
        finally:
            os.kill(pid, signal.SIGCONT)
        assert await stopping == 0  # drained and exited of itself, not killed
    finally:
        await runtime.close()


@pytest.fixture
async def docker_runtime() -> AsyncIterator[DockerRuntime]:
    require_docker().close()
    image = build_image("cpu", progress=lambda _line: None)
    runtime = DockerRuntime.connect(image)
    try:
        yield runtime
    finally:
        await runtime.close()


def cpu_shares(runtime: DockerRuntime, replica_id: str) -> int:
    container = runtime._started[replica_id].container
    container.reload()
    return int(container.attrs["HostConfig"]["CpuShares"])


@pytest.mark.docker
async def test_a_container_starts_light_and_an_adopting_daemon_raises_one_left_light(
    docker_runtime: DockerRuntime,
) -> None:
    await docker_runtime.start(spec("bg-3", True))
    assert cpu_shares(docker_runtime, "bg-3") == NORMAL_CPU_SHARES
    # As a daemon killed between the start and the raise would leave it.
    container = docker_runtime._started["bg-3"].container
    await asyncio.to_thread(container.update, cpu_shares=BACKGROUND_CPU_SHARES)
    assert cpu_shares(docker_runtime, "bg-3") == BACKGROUND_CPU_SHARES
    image = docker_runtime.image
    await docker_runtime.detach()
    successor = DockerRuntime.connect(image)
    try:
        (adopted,) = await successor.adopt({"node": "prio"})
        assert adopted.replica_id == "bg-3" and adopted.endpoint
        assert cpu_shares(successor, "bg-3") == NORMAL_CPU_SHARES
    finally:
        await successor.close()


def fake_cgroup_v2(root: Path) -> Path:
    """An empty cgroup file system as a v2 host mounts it. This machine is cgroup v1: the
    engine and the container are real, the weight file `show_weight` writes is not."""
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    return root


async def show_weight(runtime: DockerRuntime, replica_id: str, weight: int) -> None:
    """Once the replica's container runs, give its v2 cgroup (named in its process's
    `/proc/<pid>/cgroup`, under the runtime's cgroup root) a `cpu.weight` of `weight`."""
    while True:
        started = runtime._started.get(replica_id)
        if started is not None:
            await asyncio.to_thread(started.container.reload)
            pid = int(started.container.attrs["State"]["Pid"])
            if pid:
                break
        await asyncio.sleep(0.005)
    await asyncio.to_thread(_write_weight, runtime.cgroup_root, pid, weight)


def _write_weight(root: Path, pid: int, weight: int) -> None:
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    (v2,) = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
    own = root / v2.lstrip("/")
    own.mkdir(parents=True)
    (own / "cpu.weight").write_text(f"{weight}\n")


@pytest.mark.docker
@pytest.mark.parametrize(
    ("weight", "shares", "warned"),
    [
        # runc before 1.3.2: 1024 shares -> cpu.weight 39; 2,598 maps to the default 100 (the
        # file here does not change, so the warning follows).
        (39, LINEAR_SHARES_FOR_DEFAULT, True),
        # runc from 1.3.2 (or crun from 1.23): 1024 -> 100 already.
        (100, NORMAL_CPU_SHARES, False),
        # A conversion this daemon does not know: left as it is, and said.
        (70, NORMAL_CPU_SHARES, True),
    ],
)
async def test_a_container_raised_on_cgroup_v2_gets_the_default_cpu_weight(
    docker_runtime: DockerRuntime,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    weight: int,
    shares: int,
    warned: bool,
) -> None:
    docker_runtime.cgroup_root = fake_cgroup_v2(tmp_path / "cgroup")
    # The replica takes a second to be ready: its weight file is there long before.
    await asyncio.gather(
        docker_runtime.start(spec("bg-4", True)), show_weight(docker_runtime, "bg-4", weight)
    )
    assert cpu_shares(docker_runtime, "bg-4") == shares
    warnings = [r for r in caplog.records if "cpu.weight" in r.getMessage()]
    assert bool(warnings) == warned, warnings
    assert all(f"cpu.weight {weight}," in r.getMessage() for r in warnings)


@pytest.mark.docker
@pytest.mark.skipif(os.geteuid() != 0, reason="weighing a top-level cgroup needs root")
async def test_weighed_replicas_run_in_a_cgroup_of_their_own_at_that_weight() -> None:
    require_docker().close()
    image = build_image("cpu", progress=lambda _line: None)
    v1 = (cgroups.ROOT / "cpu" / "cpu.shares").exists()
    weight_file = (
        cgroups.ROOT / "cpu" / REPLICAS_PARENT / "cpu.shares"
        if v1
        else cgroups.ROOT / REPLICAS_PARENT / "cpu.weight"
    )
    before = weight_file.read_text() if weight_file.exists() else None
    runtime = DockerRuntime.connect(image, replica_shares=3000)
    try:
        assert weight_file.read_text().strip() == str(3000 if v1 else shares_to_weight(3000))
        await runtime.start(spec("w-1", True))
        # The background start's low weight is among the replicas, and raised at ready.
        assert cpu_shares(runtime, "w-1") == NORMAL_CPU_SHARES  # (reloads the attributes)
        container = runtime._started["w-1"].container
        assert container.attrs["HostConfig"]["CgroupParent"] == f"/{REPLICAS_PARENT}"
        pid = int(container.attrs["State"]["Pid"])
        own = cgroups.cgroup_dirs(pid).get("cpu" if v1 else "")
        assert own is not None and own.parent == weight_file.parent, own
    finally:
        await runtime.close()
        if before is not None:  # the weight the demo or an earlier run gave it
            weight_file.write_text(before)


@pytest.mark.docker
async def test_a_container_being_stopped_is_lowered_before_its_drain(
    docker_runtime: DockerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    await docker_runtime.start(spec("old-2", False))
    assert cpu_shares(docker_runtime, "old-2") == 0  # the engine's default weight
    container = docker_runtime._started["old-2"].container
    real_stop = container.stop
    at_stop: list[int] = []

    def stop(**kwargs: object) -> None:
        """The engine's own record of the container's weight when its stop (SIGTERM,
        the drain) begins."""
        container.reload()
        at_stop.append(int(container.attrs["HostConfig"]["CpuShares"]))
        real_stop(**kwargs)

    monkeypatch.setattr(container, "stop", stop)
    assert await docker_runtime.stop("old-2") == 0
    assert at_stop == [BACKGROUND_CPU_SHARES]
