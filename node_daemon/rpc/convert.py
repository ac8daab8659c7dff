"""offload.v1 node messages <-> the node daemon's domain values."""

from __future__ import annotations

from node_daemon.agent import ReplicaState, ReplicaUsage, ReplicaView, StartRequest
from node_daemon.inventory import Gpu, Inventory
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
    )


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
    )


def replica(view: ReplicaView) -> pb.Replica:
    return pb.Replica(
        replica_id=view.replica_id,
        spec=replica_spec(view.request),
        endpoint=view.endpoint,
        state=_STATES[view.state],
        exit_code=view.exit_code or 0,
        log_tail=client_text(view.log_tail),
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


def replica_usage(usage: ReplicaUsage) -> pb.ReplicaUsage:
    return pb.ReplicaUsage(
        replica_id=usage.replica_id, cpu_pct=usage.cpu_pct, memory_used_mib=usage.memory_used_mib
    )
