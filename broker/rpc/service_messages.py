"""Services (issue 52) between broker.proto and the domain (`broker.services`): every field
of a request within its bounds (`broker.rpc.validate`; the domain checks the rest), and the
client's view of a service and of its assignment."""

from __future__ import annotations

from typing import cast

from broker.placement import PriorityClass
from broker.rpc import validate
from broker.services import Assignment, ServiceView
from broker.values import DEFAULT_MAX_REPLICAS, MAX_REPLICAS, MAX_SERVICE_CLIENTS, ServiceSpec
from protos.offload.v1 import broker_pb2 as pb
from runtime.batching import PriorityClass as ClientClass

CLIENT_CLASSES = {
    PriorityClass.BEST_EFFORT: ClientClass.BEST_EFFORT,
    PriorityClass.STANDARD: ClientClass.STANDARD,
    PriorityClass.CRITICAL: ClientClass.CRITICAL,
}
"""A deployment's priority as the class of a client's calls at a shared replica."""
_PRIORITIES = {client_class: priority for priority, client_class in CLIENT_CLASSES.items()}


def service_spec(message: pb.ServiceSpec) -> ServiceSpec:
    validate.integer("the number of spec.clients", len(message.clients), 0, MAX_SERVICE_CLIENTS)
    return ServiceSpec(
        model_sha256=validate.sha256("spec.model_sha256", message.model_sha256),
        model_name=message.model_name,
        gpus=message.gpus,
        gpu_memory_mib=validate.integer(
            "spec.gpu_memory_mib", message.gpu_memory_mib, 0, validate.MAX_GPU_MEMORY_MIB
        ),
        cpus=validate.number("spec.cpus", message.cpus, 0, validate.MAX_CPUS),
        memory_mib=validate.integer(
            "spec.memory_mib", message.memory_mib, 0, validate.MAX_MEMORY_MIB
        ),
        clients=tuple(dict.fromkeys(message.clients)),
        any_client=message.any_client,
        min_replicas_per_site=validate.integer(
            "spec.min_replicas_per_site", message.min_replicas_per_site, 0, MAX_REPLICAS
        ),
        max_replicas=validate.integer("spec.max_replicas", message.max_replicas, 0, MAX_REPLICAS)
        or DEFAULT_MAX_REPLICAS,
        latency_slo_ms=validate.number(
            "spec.latency_slo_ms", message.latency_slo_ms, 0, validate.MAX_LATENCY_SLO_MS
        ),
        max_rps_per_client=validate.number(
            "spec.max_rps_per_client", message.max_rps_per_client, 0, 1e6
        ),
    )


def client_class(value: int) -> ClientClass:
    """The class a client asks for at a shared replica (unspecified: standard)."""
    return CLIENT_CLASSES[validate.priority(value)]


def service_message(view: ServiceView) -> pb.Service:
    spec = view.spec
    return pb.Service(
        name=view.record.name,
        owner=view.record.owner,
        spec=pb.ServiceSpec(
            model_sha256=spec.model_sha256,
            model_name=spec.model_name,
            gpus=spec.gpus,
            gpu_memory_mib=spec.gpu_memory_mib,
            cpus=spec.cpus,
            memory_mib=spec.memory_mib,
            clients=spec.clients,
            any_client=spec.any_client,
            min_replicas_per_site=spec.min_replicas_per_site,
            max_replicas=spec.max_replicas,
            latency_slo_ms=spec.latency_slo_ms,
            max_rps_per_client=spec.max_rps_per_client,
        ),
        replicas=[
            pb.ServiceReplica(
                deployment_id=r.deployment_id,
                site=r.site,
                node_id=(r.deployment.node_id or "") if r.deployment else "",
                state=str(r.deployment.state) if r.deployment else "deleted",
                endpoint=r.deployment.endpoint if r.deployment else "",
                clients=r.clients,
            )
            for r in view.replicas
        ],
        clients=view.clients,
        created_at=view.record.created_at,
        events=[
            pb.ServiceEvent(
                at=e.at,
                action=str(e.action),
                deployment_id=e.deployment_id,
                site=e.site,
                reason=e.reason,
            )
            for e in view.events
        ],
    )


def assignment_message(assignment: Assignment, endpoint_ca: str = "") -> pb.ServiceAssignment:
    replica = assignment.replica
    return pb.ServiceAssignment(
        service=assignment.service,
        client_id=assignment.client_id,
        deployment_id=replica.deployment_id,
        node_id=replica.node_id or "",
        site=replica.site,
        endpoint=replica.endpoint,
        token=assignment.token,
        epoch=assignment.epoch,
        model_name=replica.model_name,
        priority=cast(pb.PriorityClass, _PRIORITIES[assignment.priority]),
        endpoint_ca_pem=endpoint_ca if replica.endpoint else "",
        reason=assignment.reason,
    )
