"""`NullRuntime`, the hollow nodes' runtime: replicas ready at once that run nothing, on its
own and under the real `NodeAgent` (the same start, GPU bookkeeping, listing and stop as a
node with a real runtime)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.agent import NodeAgent, ReplicaState, StartRequest
from node_daemon.errors import AlreadyExists, GpusExhausted
from node_daemon.inventory import GpuSpec, inventory_from_capture
from node_daemon.model_cache import ModelCache
from node_daemon.runtimes import ReplicaSpec, ReplicaStats, ReplicaStatus
from node_daemon.runtimes.null_runtime import NULL_PORT, NullRuntime
from tests.data import TOPOLOGIES

TOKEN = "a-replica-token-0123456789"


def spec(replica_id: str, **labels: str) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=replica_id,
        model_path=Path("/nonexistent/model.onnx"),
        model_name="mlp",
        token=TOKEN,
        labels=labels,
        host="10.0.0.7",
    )


async def test_a_started_replica_is_ready_at_once_and_uses_nothing() -> None:
    runtime = NullRuntime()
    replica = await runtime.start(spec("d-1-1", node="n1", deployment="d-1"))
    assert replica.endpoint == f"10.0.0.7:{NULL_PORT}"
    assert (replica.runtime, replica.ref, replica.metrics_endpoint) == ("null", "null-d-1-1", "")
    assert replica.labels == {"node": "n1", "deployment": "d-1"}
    assert await runtime.status("d-1-1") == ReplicaStatus(running=True)
    assert await runtime.stats("d-1-1") == ReplicaStats(cpu_seconds=0.0, memory_used_mib=0)
    await runtime.update("d-1-1", cpus=2.0, memory_mib=512)
    assert runtime.replica_ids == {"d-1-1"}
    with pytest.raises(ValueError, match="already running"):
        await runtime.start(spec("d-1-1"))


async def test_stop_forgets_a_replica_and_an_unknown_one_is_not_an_error() -> None:
    runtime = NullRuntime()
    await runtime.start(spec("d-1-1"))
    assert await runtime.stop("d-1-1", grace_s=5) == 0
    assert await runtime.status("d-1-1") is None
    assert await runtime.stats("d-1-1") is None
    assert await runtime.stop("d-1-1") is None
    with pytest.raises(ValueError, match="no replica d-1-1"):
        await runtime.update("d-1-1", cpus=1.0, memory_mib=0)


async def test_adopt_matches_labels_and_detach_and_close_forget_everything() -> None:
    runtime = NullRuntime()
    await runtime.start(spec("d-1-1", node="n1"))
    await runtime.start(spec("d-2-1", node="n2"))
    assert [r.replica_id for r in await runtime.adopt({"node": "n1"})] == ["d-1-1"]
    assert len(await runtime.adopt({})) == 2
    await runtime.detach()
    assert await runtime.adopt({}) == []
    await runtime.start(spec("d-3-1"))
    await runtime.close()
    assert runtime.replica_ids == frozenset()


async def test_a_node_agent_over_it_starts_lists_samples_and_stops_replicas(
    tmp_path: Path, probe_model: Path
) -> None:
    """The hollow node's path: the agent checks the model in its cache, takes GPUs by
    topology, records the replica and reports it, exactly as over a real runtime."""
    inventory = inventory_from_capture(
        next(TOPOLOGIES.glob("12_*.txt")), GpuSpec("A100-SXM4-40GB", 40960)
    )
    cache = ModelCache(tmp_path / "models")
    sha = cache.put_file(probe_model).sha256
    runtime = NullRuntime()
    agent = NodeAgent("hollow-1", "site-a", inventory, runtime, cache, host="127.0.0.1")
    try:
        request = StartRequest(
            deployment_id="d-1", epoch=1, model_sha256=sha, model_name="probe", token=TOKEN,
            gpu_count=2, p2p_required=True,
        )  # fmt: skip
        view = await agent.start_replica(request)
        assert view.state is ReplicaState.READY
        assert view.endpoint == f"127.0.0.1:{NULL_PORT}"
        assert len(view.gpus) == 2
        with pytest.raises(AlreadyExists):
            await agent.start_replica(request)
        whole = StartRequest(
            deployment_id="d-2", epoch=1, model_sha256=sha, model_name="probe", token=TOKEN,
            gpu_count=len(inventory.gpus),
        )  # fmt: skip
        with pytest.raises(GpusExhausted):  # two of them are the first replica's
            await agent.start_replica(whole)
        assert runtime.replica_ids == {"d-1-1"}
        listed = await agent.list_replicas()
        assert [(v.replica_id, v.state) for v in listed] == [("d-1-1", ReplicaState.READY)]
        sample = await agent.usage()
        assert [(r.replica_id, r.cpu_used_cores) for r in sample.replicas] == [("d-1-1", 0.0)]
        await agent.stop_replica("d-1-1", grace_s=1)
        assert await agent.list_replicas() == []
        assert runtime.replica_ids == frozenset()
        # Its GPUs are free again: the whole node fits now.
        assert len((await agent.start_replica(whole)).gpus) == len(inventory.gpus)
    finally:
        await agent.close(stop_replicas=True)
    assert runtime.replica_ids == frozenset()
