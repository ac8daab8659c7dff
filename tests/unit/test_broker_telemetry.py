"""The broker's view of live load: a heartbeat's telemetry read and checked, the node's load
figure, and the history per node and per deployment."""

from __future__ import annotations

import pytest

from broker.errors import InvalidRequest
from broker.rpc.convert import MAX_CLIENT_FIGURES, MAX_RESIZES, node_sample_from_proto
from broker.telemetry import LoadHistory, NodeSample, ReplicaLoad
from protos.offload.v1 import node_pb2 as npb


def usage(**node: float) -> npb.UsageResponse:
    figures: dict[str, float] = {"cpu_cores": 2.0, "cpu_used_cores": 1.5} | node
    return npb.UsageResponse(
        node=npb.NodeLoad(**figures),  # type: ignore[arg-type]
        replicas=[
            npb.ReplicaUsage(
                replica_id="d-1-1",
                cpu_pct=150.0,
                memory_used_mib=300,
                cpu_limit=1.5,
                throttled_pct=40.0,
                requests=npb.ReplicaRequests(
                    rate_per_s=20.0, latency_p50_ms=4.0, latency_p99_ms=0.0, in_flight=2
                ),
            ),
            npb.ReplicaUsage(replica_id="d-2-1", cpu_pct=0.0),
        ],
        resizes=[
            npb.ResizeEvent(
                event_id="run1-1",
                replica_id="d-1-1",
                deployment_id="d-1",
                cpus_before=0.5,
                cpus_after=1.5,
                policy="usage",
                reason="throttled 40% at 0.50 cores",
                at=1.7e9,
            )
        ],
        resize_policy="usage",
    )


def test_a_heartbeat_reads_into_a_sample_with_cores_and_ratios() -> None:
    sample = node_sample_from_proto(usage())
    assert sample.load == 0.75
    busy, idle = sample.replicas
    assert (busy.cpu_used_cores, busy.cpu_limit_cores, busy.throttled_ratio) == (1.5, 1.5, 0.4)
    assert busy.requests is not None
    assert (busy.requests.rate_per_s, busy.requests.latency_p50_ms) == (20.0, 4.0)
    assert busy.requests.latency_p99_ms is None  # 0 on the wire: no request finished
    assert idle.requests is None  # the node could not read its runtime's metrics
    assert [r.reason for r in sample.resizes] == ["throttled 40% at 0.50 cores"]
    assert sample.resize_policy == "usage"


def test_load_is_the_larger_of_cpu_share_and_gpu_utilization_within_0_and_1() -> None:
    assert NodeSample(cpu_cores=4, cpu_used_cores=1, gpu_utilization_pct=(90, 70)).load == 0.8
    assert NodeSample(cpu_cores=4, cpu_used_cores=3, gpu_utilization_pct=(10,)).load == 0.75
    # A node older than the telemetry fields: GPU utilization only.
    assert NodeSample(gpu_utilization_pct=(50,)).load == 0.5
    # Replicas may burst past what the node offers: load stays at most 1.
    assert NodeSample(cpu_cores=2, cpu_used_cores=3).load == 1.0
    assert NodeSample().load == 0.0


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (usage(cpu_used_cores=float("nan")), "usage.node.cpu_used_cores must be a finite"),
        (usage(cpu_cores=-1.0), "usage.node.cpu_cores must be a finite number within 0"),
        (usage(memory_used_mib=-5), "usage.node.memory_used_mib must be within"),
    ],
)
def test_a_bad_node_figure_is_refused_naming_it(message: npb.UsageResponse, error: str) -> None:
    with pytest.raises(InvalidRequest, match=error):
        node_sample_from_proto(message)


def test_bad_replica_and_resize_figures_are_refused_naming_them() -> None:
    message = usage()
    message.replicas[0].throttled_pct = 250.0
    with pytest.raises(InvalidRequest, match=r"usage.replicas\[0\].throttled_pct"):
        node_sample_from_proto(message)
    message = usage()
    message.replicas[0].requests.rate_per_s = float("inf")
    with pytest.raises(InvalidRequest, match=r"usage.replicas\[0\].requests.rate_per_s"):
        node_sample_from_proto(message)
    message = usage()
    message.resizes[0].policy = "greedy"
    with pytest.raises(InvalidRequest, match=r"usage.resizes\[0\].policy 'greedy' is not one"):
        node_sample_from_proto(message)
    message = usage()
    message.resizes[0].reason = "line\nbreak"
    with pytest.raises(InvalidRequest, match=r"usage.resizes\[0\].reason"):
        node_sample_from_proto(message)
    message = usage()
    message.resizes.extend([message.resizes[0]] * MAX_RESIZES)
    with pytest.raises(InvalidRequest, match=r"usage\.resizes"):
        node_sample_from_proto(message)
    message = usage()
    message.replicas[0].requests.batch_size_mean = float("nan")
    with pytest.raises(InvalidRequest, match=r"usage.replicas\[0\].requests.batch_size_mean"):
        node_sample_from_proto(message)
    for classes, error in (
        ([("urgent", 1.0)], r"classes\[0\].priority_class 'urgent' is not one of"),
        ([("critical", 1.5)], r"classes\[0\].compute_share must be a finite number within"),
        ([("critical", 0.5), ("critical", 0.5)], r"classes\[1\].priority_class critical is rep"),
        ([("critical", 0.25)] * 4, r"requests.classes has 4 entries; at most 3"),
    ):
        message = usage()
        message.replicas[0].requests.classes.extend(
            npb.ClassCompute(priority_class=name, compute_share=share) for name, share in classes
        )
        with pytest.raises(InvalidRequest, match=error):
            node_sample_from_proto(message)
    message = usage()
    message.resize_policy = "chaos"
    with pytest.raises(InvalidRequest, match=r"usage\.resize_policy 'chaos'"):
        node_sample_from_proto(message)


def replica(replica_id: str, cores: float) -> ReplicaLoad:
    return ReplicaLoad(replica_id, cores, 0.0, 0.0, 100, None)


def test_history_keeps_the_window_and_attributes_each_sample_once() -> None:
    history = LoadHistory(window_s=10.0)
    for t in range(15):
        sample = NodeSample(cpu_cores=2, cpu_used_cores=t / 10, replicas=(replica("d-1-1", 0.5),))
        history.record("n1", sample, float(t))
        history.attribute("n1", {"d-1-1": "d-1"})
        history.attribute("n1", {"d-1-1": "d-1"})  # a second reconciliation of one heartbeat
    assert [p.at for p in history.node_points("n1")] == [float(t) for t in range(4, 15)]
    assert history.node_points("n1")[-1].load == 0.7
    assert [p.at for p in history.deployment_points("d-1")] == [float(t) for t in range(4, 15)]
    assert history.latest("n1") == sample


def test_only_serving_replicas_join_a_deployments_history_which_follows_its_moves() -> None:
    history = LoadHistory()
    standby = replica("d-1-2", 0.1)
    history.record("n1", NodeSample(replicas=(replica("d-1-1", 0.5),)), 1.0)
    history.attribute("n1", {"d-1-1": "d-1"})
    history.record("n2", NodeSample(replicas=(standby,)), 1.5)
    history.attribute("n2", {})  # a standby serves nothing yet
    history.record("n2", NodeSample(replicas=(replica("d-1-2", 0.3),)), 2.0)
    history.attribute("n2", {"d-1-2": "d-1"})  # after the switch
    points = history.deployment_points("d-1")
    assert [(p.node_id, p.replica.cpu_used_cores) for p in points] == [("n1", 0.5), ("n2", 0.3)]
    assert history.latest_replica("d-1") == points[-1]
    history.forget_deployment("d-1")
    assert history.deployment_points("d-1") == []
    assert list(history.deployment_ids()) == []


def test_client_figures_are_read_and_bad_ones_refused_naming_them() -> None:
    message = usage()
    requests = message.replicas[0].requests
    requests.clients_total = 3
    requests.clients.extend(
        [
            npb.ClientRequests(client_id="cam-2", rate_per_s=8.0, refused_per_s=2.0),
            npb.ClientRequests(client_id="cam-1", rate_per_s=4.0, latency_p99_ms=5.0),
        ]
    )
    (busy, _) = node_sample_from_proto(message).replicas
    assert busy.requests is not None
    assert busy.requests.clients_total == 3
    assert [
        (c.client_id, c.rate_per_s, c.refused_per_s, c.latency_p99_ms)
        for c in busy.requests.clients
    ] == [("cam-2", 8.0, 2.0, None), ("cam-1", 4.0, 0.0, 5.0)]
    field = r"usage.replicas\[0\].requests.clients"
    for change, error in (
        ({"client_id": "cam 1"}, rf"{field}\[1\].client_id: client id 'cam 1' must be 1 to 64"),
        ({"client_id": "cam-2"}, rf"{field}\[1\].client_id cam-2 is repeated"),
        ({"rate_per_s": float("nan")}, rf"{field}\[1\].rate_per_s must be a finite number"),
        ({"refused_per_s": -1.0}, rf"{field}\[1\].refused_per_s must be a finite number"),
        ({"latency_p99_ms": 1e12}, rf"{field}\[1\].latency_p99_ms must be a finite number"),
    ):
        bad = npb.UsageResponse()
        bad.CopyFrom(message)
        for name, value in change.items():
            setattr(bad.replicas[0].requests.clients[1], name, value)
        with pytest.raises(InvalidRequest, match=error):
            node_sample_from_proto(bad)
    bad = npb.UsageResponse()
    bad.CopyFrom(message)
    bad.replicas[0].requests.clients_total = 1  # fewer than it sent
    with pytest.raises(InvalidRequest, match=r"requests.clients_total must be within 2..10000"):
        node_sample_from_proto(bad)
    bad.replicas[0].requests.clients_total = 65
    bad.replicas[0].requests.clients.extend(
        npb.ClientRequests(client_id=f"c-{i}") for i in range(MAX_CLIENT_FIGURES - 1)
    )
    with pytest.raises(InvalidRequest, match=rf"{field} has 65 entries; at most 64"):
        node_sample_from_proto(bad)
