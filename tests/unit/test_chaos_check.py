"""The chaos suite's checker (`bench.chaos_check.problems`) on made-up views of a cluster: it
finds each broken invariant, and nothing in a cluster that agrees."""

from __future__ import annotations

from bench.chaos_check import ClusterState, ReplicaProcess, Stored, problems
from protos.offload.v1 import node_pb2 as npb

GPU0, GPU1 = "GPU-0000", "GPU-0001"


def stored(deployment_id: str, state: str = "running", node_id: str = "node-a") -> Stored:
    return Stored(deployment_id, "alice", state, node_id, epoch=1, reason="")


def reported(deployment_id: str, *gpus: str, shared: bool = False) -> npb.Replica:
    spec = npb.ReplicaSpec(
        deployment_id=deployment_id,
        epoch=1,
        gpu_uuids=gpus,
        gpu_memory_mib=1024 if shared else 0,
    )
    return npb.Replica(replica_id=f"{deployment_id}-1", spec=spec, state=npb.REPLICA_STATE_READY)


def process(
    deployment_id: str, *gpus: str, pid: int = 100, shared: bool = False
) -> ReplicaProcess:
    return ReplicaProcess(pid, "node-a", f"{deployment_id}-1", gpus, shares_gpu=shared)


def state(
    deployments: list[Stored], replicas: list[npb.Replica], processes: list[ReplicaProcess]
) -> ClusterState:
    return ClusterState(tuple(deployments), {"node-a": tuple(replicas)}, tuple(processes))


def test_a_cluster_that_agrees_has_no_problem() -> None:
    agreeing = state(
        [stored("d-1"), stored("d-2", state="pending", node_id="")],
        [reported("d-1", GPU0)],
        [process("d-1", GPU0)],
    )
    assert problems(agreeing, acknowledged=["d-1", "d-2"]).empty()


def test_a_process_its_node_does_not_report_is_leaked() -> None:
    found = problems(state([], [], [process("d-9", GPU0)]))
    assert len(found.leaked) == 1 and "does not report" in found.leaked[0]


def test_a_replica_no_deployment_claims_is_leaked() -> None:
    found = problems(
        state([stored("d-1", state="pending", node_id="")], [reported("d-1")], [process("d-1")])
    )
    assert len(found.leaked) == 1 and "no deployment claims" in found.leaked[0]


def test_a_gpu_in_two_replicas_is_double_booked_unless_both_share_it() -> None:
    whole = state(
        [stored("d-1"), stored("d-2")],
        [reported("d-1", GPU0), reported("d-2", GPU0, GPU1)],
        [process("d-1", GPU0, pid=1), process("d-2", GPU0, GPU1, pid=2)],
    )
    found = problems(whole)
    # Seen twice: in CUDA_VISIBLE_DEVICES and in the node's report.
    assert len(found.double_booked) == 2 and all(GPU0 in line for line in found.double_booked)
    shared = state(
        [stored("d-1"), stored("d-2")],
        [reported("d-1", GPU0, shared=True), reported("d-2", GPU0, shared=True)],
        [process("d-1", GPU0, pid=1, shared=True), process("d-2", GPU0, pid=2, shared=True)],
    )
    assert problems(shared).double_booked == []


def test_lost_and_duplicated_deployments_are_found() -> None:
    lost = problems(state([stored("d-1")], [], []), acknowledged=["d-1", "d-2"])
    assert any("d-2: acknowledged, not in the store" in line for line in lost.lost_or_duplicated)
    assert any("d-1 running on node-a" in line for line in lost.lost_or_duplicated)
    twice = ClusterState(
        (stored("d-1"),),
        {"node-a": (reported("d-1"),), "node-b": (reported("d-1"),)},
        (process("d-1"), ReplicaProcess(2, "node-b", "d-1-1", (), shares_gpu=False)),
    )
    assert any("d-1 has 2 replicas" in line for line in problems(twice).lost_or_duplicated)


def test_a_deployment_neither_running_nor_pending_is_unsettled() -> None:
    found = problems(state([stored("d-1", state="starting")], [], []))
    assert found.unsettled == ["d-1 is starting: "]
