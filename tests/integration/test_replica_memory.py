"""A replica's memory asks, held or refused (issue 49, item 6), on the process runtime with
GPUs from a topology capture:

- a GPU memory share below the model's need is refused FAILED_PRECONDITION naming the share
  and the need, before anything is placed or started (the broker at deploy, from the model
  file; the node at StartReplica, for any caller);
- a replica whose ONNX Runtime arena runs out of its share while it loads is refused the
  same way, with the need measured, never the arena's trace (the arena is a GPU's: the
  replica process here is one that logs what such a replica logs, through the real process
  runtime);
- `memory_mib` is enforced with a memory cgroup of the replica's own, removed when it
  stops, or refused before anything starts where no cgroup can be written;
- the broker tells the node's refusal from a replica that failed by itself, and answers it
  FAILED_PRECONDITION end to end.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

import modelzoo
from broker.errors import ReplicaFailed, Unfit
from broker.node_client import NodeClient
from broker.rpc.status import status_of
from common.replica_memory import MEMORY_LIMIT_UNAVAILABLE, SHARE_TOO_SMALL, estimate
from edge_client.client import OffloadClient
from edge_client.errors import FailedPrecondition
from node_daemon.agent import NodeAgent, StartRequest
from node_daemon.errors import GpuShareTooSmall, Unsupported
from node_daemon.inventory import GpuSpec, TopologyFileInventory
from node_daemon.model_cache import ModelCache
from node_daemon.runtimes import ProcessRuntime, cgroup_limits
from tests.cluster_support import THREE_NODES, Cluster, infer_once, replica_processes
from tests.data import TOPOLOGIES
from tests.unit.test_replica_memory import ARENA_TAIL

DGX1 = TOPOLOGIES / "21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt"
V100 = GpuSpec.parse("Tesla V100-SXM2-16GB:16384")
TOKEN = "replica-token-for-memory-tests"
NODE_A = THREE_NODES[0]
MIB = 1024 * 1024

needs_memory_cgroup = pytest.mark.skipif(
    not cgroup_limits.can_limit_memory(),
    reason="needs a writable memory cgroup (v1 `memory` or v2 with `memory`; root)",
)


class _ArenaRunsOut(ProcessRuntime):
    """The process runtime, whose replica process is one that logs what a replica on a GPU
    logs when its ONNX Runtime arena reaches its `gpu_mem_limit` while it loads, and exits
    1: everything else (spawn, log, exit, log tail, clean-up) is the runtime's own."""

    def _launcher(self, background: bool) -> list[str]:
        print_and_exit = f"import sys; print({ARENA_TAIL!r}, file=sys.stderr); sys.exit(1)"
        return [sys.executable, "-c", print_and_exit]  # the rest of the command is its argv


def _agent(runtime: ProcessRuntime, tmp_path: Path) -> NodeAgent:
    cache = ModelCache(tmp_path / "models", file_mode=runtime.model_file_mode)
    inventory = TopologyFileInventory(DGX1, V100).read()
    return NodeAgent("memory-node", "site-a", inventory, runtime, cache)


def _nothing_started(agent: NodeAgent, tmp_path: Path) -> bool:
    gpus_free = all(agent.allocator.holder_of(g.index) == [] for g in agent.inventory.gpus)
    folders = list((tmp_path / "replicas").glob("*/replica.json"))
    return gpus_free and not agent._replicas and not folders


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[NodeAgent]:
    agent = _agent(ProcessRuntime(tmp_path / "replicas"), tmp_path)
    try:
        yield agent
    finally:
        await agent.close(stop_replicas=True)


async def test_the_node_refuses_a_share_below_the_models_need_before_it_starts(
    agent: NodeAgent, tmp_path: Path
) -> None:
    model = modelzoo.model_path("resnet18")
    sha = agent.cache.put_file(model).sha256
    need = estimate(model).need_mib
    request = StartRequest("dep-small", 1, sha, "resnet18", TOKEN, gpu_count=1, gpu_memory_mib=32)
    with pytest.raises(GpuShareTooSmall) as refused:
        await agent.start_replica(request)
    message = str(refused.value)
    assert message.startswith(SHARE_TOO_SMALL)
    assert "gpu_memory_mib 32 asked" in message and f"at least {need} MiB" in message
    assert _nothing_started(agent, tmp_path)
    # The same model with a share that covers the need starts (on the CPU here).
    enough = StartRequest(
        "dep-enough", 1, sha, "resnet18", TOKEN, gpu_count=1, gpu_memory_mib=need
    )
    view = await agent.start_replica(enough)
    assert view.endpoint and view.request.gpu_memory_mib == need


async def test_an_arena_that_runs_out_at_load_is_the_same_refusal_with_the_need_measured(
    tmp_path: Path,
) -> None:
    agent = _agent(_ArenaRunsOut(tmp_path / "replicas"), tmp_path)
    sha = agent.cache.put_file(modelzoo.model_path("mlp")).sha256
    request = StartRequest("dep-arena", 1, sha, "mlp", TOKEN, gpu_count=1, gpu_memory_mib=128)
    try:
        with pytest.raises(GpuShareTooSmall) as refused:
            await agent.start_replica(request)
    finally:
        await agent.close(stop_replicas=True)
    message = str(refused.value)
    assert message.startswith(SHARE_TOO_SMALL)
    assert "gpu_memory_mib 128 asked" in message and "at least 134 MiB measured" in message
    assert "Available memory" not in message and "BFCArena" not in message
    assert _nothing_started(agent, tmp_path)


async def test_memory_mib_where_no_cgroup_can_be_written_is_refused_before_it_starts(
    tmp_path: Path,
) -> None:
    runtime = ProcessRuntime(tmp_path / "replicas", cgroup_root=tmp_path / "no-cgroupfs")
    agent = _agent(runtime, tmp_path)
    sha = agent.cache.put_file(modelzoo.model_path("mlp")).sha256
    request = StartRequest("dep-mem", 1, sha, "mlp", TOKEN, gpu_count=1, memory_mib=512)
    try:
        with pytest.raises(Unsupported) as refused:
            await agent.start_replica(request)
    finally:
        await agent.close(stop_replicas=True)
    message = str(refused.value)
    assert message.startswith(MEMORY_LIMIT_UNAVAILABLE)
    assert "memory_mib 512 asked" in message and "no cgroup memory controller" in message
    assert _nothing_started(agent, tmp_path)


def test_the_broker_answers_a_nodes_refusal_failed_precondition_and_a_failure_unavailable() -> (
    None
):
    client = NodeClient("node-a", "127.0.0.1:1", "t" * 32)

    def node_said(code: grpc.StatusCode, details: str) -> Exception:
        empty = grpc.aio.Metadata()
        return client._error("start a replica", grpc.aio.AioRpcError(code, empty, empty, details))

    refused = node_said(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"{SHARE_TOO_SMALL}: gpu_memory_mib 32 asked, but model 'resnet18' needs at least 67 MiB",
    )
    assert isinstance(refused, Unfit)
    assert status_of(refused) == grpc.StatusCode.FAILED_PRECONDITION
    assert str(refused).startswith(SHARE_TOO_SMALL) and "(node node-a)" in str(refused)
    failed = node_said(grpc.StatusCode.FAILED_PRECONDITION, "replica d-1: exited with code 1")
    assert isinstance(failed, ReplicaFailed) and not isinstance(failed, Unfit)
    assert status_of(failed) == grpc.StatusCode.UNAVAILABLE


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        await cluster.start_node(NODE_A)
        yield cluster
    finally:
        await cluster.stop()


async def test_a_deploy_with_a_share_below_the_need_is_refused_and_nothing_is_recorded(
    cluster: Cluster,
) -> None:
    model = modelzoo.model_path("resnet18")
    need = estimate(model).need_mib
    async with OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice:
        sha = await alice.upload_model(model)
        with pytest.raises(FailedPrecondition) as refused:
            await alice.deploy(sha, "resnet18", gpus=1, gpu_memory_mib=32, site="site-a")
        message = str(refused.value)
        assert "gpu_memory_mib 32 asked" in message and f"at least {need} MiB" in message
        async with cluster.edge("alice") as edge:
            assert await edge.list() == []  # no deployment, failed or otherwise
        assert replica_processes(cluster)[NODE_A.node_id] == []
        # A share that covers the need is placed and serves.
        deployment = await alice.deploy(
            sha, "resnet18", gpus=1, gpu_memory_mib=need + 64, site="site-a"
        )
        assert deployment.state == "running"
        async with cluster.edge("alice") as edge:
            (listed,) = await edge.list()
        await infer_once(listed, "resnet18")


@needs_memory_cgroup
async def test_a_deploys_memory_mib_is_its_replicas_cgroup_limit_until_it_is_deleted(
    cluster: Cluster,
) -> None:
    async with OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice:
        sha = await alice.upload_model(modelzoo.model_path("mlp"))
        deployment = await alice.deploy(sha, "mlp", gpus=1, memory_mib=384, site="site-a")
        assert deployment.state == "running"
        replica = f"{deployment.deployment_id}-{deployment.epoch}"
        pid = cluster.replica_pid(deployment)
        (group,) = cgroup_limits.own_groups(pid, replica)
        v1 = group / "memory.limit_in_bytes"
        assert int((v1 if v1.exists() else group / "memory.max").read_text()) == 384 * MIB
        assert str(pid) in (group / "cgroup.procs").read_text().split()
        async with cluster.edge("alice") as edge:
            (listed,) = await edge.list()
        await infer_once(listed)
        assert await alice.delete(deployment.deployment_id) is True
    for _ in range(600):
        if not group.exists():
            break
        await asyncio.sleep(0.1)
    assert not group.exists(), f"{group} left behind"
