"""offload.v1 node messages <-> the node daemon's domain values."""

from __future__ import annotations

from collections.abc import Iterable

from node_daemon.agent import ClientFields, ReplicaState, ReplicaView, StartRequest
from node_daemon.inventory import Gpu, Inventory
from node_daemon.resources import ResourceManager
from node_daemon.telemetry import NodeSample, ReplicaSample
from protos.offload.v1 import node_pb2 as pb
from runtime.errors import client_text

_STATES = {
    ReplicaState.STARTING: pb.REPLICA_STATE_STARTING,
    ReplicaState.READY: pb.REPLICA_STATE_READY,
    ReplicaState.STOPPING: pb.REPLICA_STATE_STOPPING,
    ReplicaState.EXITED: pb.REPLICA_STATE_EXITED,
}


def start_request(spec: pb.ReplicaSpec) -> StartRequest:
    return StartRequest(
        deployment_id=spec.deployment_id,
        epoch=spec.epoch,
        model_sha256=spec.model_sha256,
        model_name=spec.model_name,
        token=spec.token,
        gpu_uuids=tuple(spec.gpu_uuids),
        gpu_count=spec.gpu_count,
        gpu_memory_mib=spec.gpu_memory_mib,
        p2p_required=spec.p2p_required,
        cpus=spec.cpus,
        memory_mib=spec.memory_mib,
        warmup_inputs_sha256=spec.warmup_inputs_sha256,
        background_start=spec.background_start,
        priority=spec.priority,
        cpus_min=spec.cpus_min,
        cpus_max=spec.cpus_max,
    )


def replica_clients(clients: Iterable[pb.ReplicaClient]) -> list[ClientFields]:
    """A SetReplicaClients request's clients, unchecked (the agent checks them)."""
    return [(c.client_id, c.priority_class, c.token_sha256, c.max_rps) for c in clients]


def replica_spec(request: StartRequest) -> pb.ReplicaSpec:
    return pb.ReplicaSpec(
        deployment_id=request.deployment_id,
        epoch=request.epoch,
        model_sha256=request.model_sha256,
        model_name=request.model_name,
        gpu_uuids=request.gpu_uuids,
        gpu_memory_mib=request.gpu_memory_mib,
        cpus=request.cpus,
        memory_mib=request.memory_mib,
        token=request.token,
        gpu_count=request.gpu_count,
        p2p_required=request.p2p_required,
        warmup_inputs_sha256=request.warmup_inputs_sha256,
        background_start=request.background_start,
        priority=request.priority,
        cpus_min=request.cpus_min,
        cpus_max=request.cpus_max,
    )


def replica(view: ReplicaView) -> pb.Replica:
    return pb.Replica(
        replica_id=view.replica_id,
        spec=replica_spec(view.request),
        endpoint=view.endpoint,
        state=_STATES[view.state],
        exit_code=view.exit_code or 0,
        log_tail=client_text(view.log_tail, hide_addresses=True),
        runtime=view.runtime,
        ref=view.ref,
    )


def gpu(g: Gpu) -> pb.Gpu:
    return pb.Gpu(
        index=g.index,
        uuid=g.uuid,
        name=g.name,
        memory_total_mib=g.memory_total_mib,
        memory_used_mib=g.memory_used_mib,
        utilization_pct=g.utilization_pct,
        pci_bus_id=g.pci_bus_id,
        numa_node=-1 if g.numa_node is None else g.numa_node,
        compute_capability=g.compute_capability,
    )


def inventory(inv: Inventory) -> pb.Inventory:
    uuid = {g.index: g.uuid for g in inv.gpus}
    return pb.Inventory(
        gpus=[gpu(g) for g in inv.gpus],
        links=[
            pb.GpuLink(gpu_a=uuid[a], gpu_b=uuid[b], kind=str(link), nvlinks=link.nvlinks)
            for (a, b), link in sorted(inv.links.items())
        ],
        driver_version=inv.driver_version,
        cuda_version=inv.cuda_version,
        nics=[n.name for n in inv.nics],
    )


def usage(sample: NodeSample, resizer: ResourceManager | None = None) -> pb.UsageResponse:
    """A sample, with the resource manager's recent resizes and its policy (none and ""
    without one), as the heartbeat and `Usage` carry it."""
    resizes = resizer.events() if resizer is not None else ()
    return pb.UsageResponse(
        gpus=[gpu(g) for g in sample.gpus],
        replicas=[_replica_usage(r) for r in sample.replicas],
        node=pb.NodeLoad(
            cpu_cores=sample.cpu_cores,
            cpu_used_cores=sample.cpu_used_cores,
            memory_total_mib=sample.memory_total_mib,
            memory_used_mib=sample.memory_used_mib,
        ),
        resizes=[
            pb.ResizeEvent(
                event_id=r.event_id,
                replica_id=r.replica_id,
                deployment_id=r.deployment_id,
                cpus_before=r.cpus_before,
                cpus_after=r.cpus_after,
                policy=r.policy,
                reason=r.reason,
                at=r.at,
            )
            for r in resizes
        ],
        resize_policy=resizer.policy if resizer is not None else "",
    )


def _replica_usage(r: ReplicaSample) -> pb.ReplicaUsage:
    message = pb.ReplicaUsage(
        replica_id=r.replica_id,
        cpu_pct=100 * r.cpu_used_cores,
        memory_used_mib=r.memory_used_mib,
        cpu_limit=r.cpu_limit,
        throttled_pct=100 * r.throttled_ratio,
    )
    if (q := r.requests) is not None:
        message.requests.CopyFrom(
            pb.ReplicaRequests(
                rate_per_s=q.rate_per_s,
                failure_rate_per_s=q.failure_rate_per_s,
                latency_p50_ms=q.latency_p50_ms,
                latency_p99_ms=q.latency_p99_ms,
                compute_p50_ms=q.compute_p50_ms,
                in_flight=q.in_flight,
                queued=q.queued,
                requests_total=q.requests_total,
                failures_total=q.failures_total,
                batch_size_mean=q.batch_size_mean,
                queue_delay_p99_ms=q.queue_delay_p99_ms,
                classes=[
                    pb.ClassCompute(
                        priority_class=c.name,
                        compute_share=c.compute_share,
                        requests_per_s=c.requests_per_s,
                    )
                    for c in q.classes
                ],
                clients=[
                    pb.ClientRequests(
                        client_id=c.client_id,
                        rate_per_s=c.rate_per_s,
                        refused_per_s=c.refused_per_s,
                        latency_p99_ms=c.latency_p99_ms,
                        requests_total=c.requests_total,
                        refused_total=c.refused_total,
                    )
                    for c in q.clients
                ],
                clients_total=q.clients_total,
            )
        )
    return message
