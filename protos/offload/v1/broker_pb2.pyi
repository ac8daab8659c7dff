from protos.offload.v1 import node_pb2 as _node_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PriorityClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_CLASS_UNSPECIFIED: _ClassVar[PriorityClass]
    PRIORITY_CLASS_BEST_EFFORT: _ClassVar[PriorityClass]
    PRIORITY_CLASS_STANDARD: _ClassVar[PriorityClass]
    PRIORITY_CLASS_CRITICAL: _ClassVar[PriorityClass]
PRIORITY_CLASS_UNSPECIFIED: PriorityClass
PRIORITY_CLASS_BEST_EFFORT: PriorityClass
PRIORITY_CLASS_STANDARD: PriorityClass
PRIORITY_CLASS_CRITICAL: PriorityClass

class RegisterRequest(_message.Message):
    __slots__ = ("node_id", "address", "site", "inventory", "runtimes", "replicas", "beacons")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    RUNTIMES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    BEACONS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    site: str
    inventory: _node_pb2.Inventory
    runtimes: _containers.RepeatedScalarFieldContainer[str]
    replicas: _containers.RepeatedCompositeFieldContainer[_node_pb2.Replica]
    beacons: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., site: _Optional[str] = ..., inventory: _Optional[_Union[_node_pb2.Inventory, _Mapping]] = ..., runtimes: _Optional[_Iterable[str]] = ..., replicas: _Optional[_Iterable[_Union[_node_pb2.Replica, _Mapping]]] = ..., beacons: bool = ...) -> None: ...

class Beacon(_message.Message):
    __slots__ = ("port", "id", "key", "interval_ms")
    PORT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    port: int
    id: bytes
    key: bytes
    interval_ms: int
    def __init__(self, port: _Optional[int] = ..., id: _Optional[bytes] = ..., key: _Optional[bytes] = ..., interval_ms: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "lost_after_ms", "lease_renew_ms")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LOST_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_RENEW_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    lost_after_ms: int
    lease_renew_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., lost_after_ms: _Optional[int] = ..., lease_renew_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "usage", "replicas", "lease_only", "beacons")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ONLY_FIELD_NUMBER: _ClassVar[int]
    BEACONS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    usage: _node_pb2.UsageResponse
    replicas: _containers.RepeatedCompositeFieldContainer[_node_pb2.Replica]
    lease_only: bool
    beacons: bool
    def __init__(self, node_id: _Optional[str] = ..., usage: _Optional[_Union[_node_pb2.UsageResponse, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[_node_pb2.Replica, _Mapping]]] = ..., lease_only: bool = ..., beacons: bool = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("beacon",)
    BEACON_FIELD_NUMBER: _ClassVar[int]
    beacon: Beacon
    def __init__(self, beacon: _Optional[_Union[Beacon, _Mapping]] = ...) -> None: ...

class FetchModelRequest(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class UploadModelResponse(_message.Message):
    __slots__ = ("sha256", "size_bytes", "deduplicated")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size_bytes: int
    deduplicated: bool
    def __init__(self, sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., deduplicated: bool = ...) -> None: ...

class DeployRequest(_message.Message):
    __slots__ = ("model_sha256", "model_name", "gpus", "gpu_memory_mib", "p2p_required", "cpus", "memory_mib", "priority", "latency_slo_ms", "client_id", "site", "cpus_min", "cpus_max")
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    P2P_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    CPUS_MIN_FIELD_NUMBER: _ClassVar[int]
    CPUS_MAX_FIELD_NUMBER: _ClassVar[int]
    model_sha256: str
    model_name: str
    gpus: int
    gpu_memory_mib: int
    p2p_required: bool
    cpus: float
    memory_mib: int
    priority: PriorityClass
    latency_slo_ms: float
    client_id: str
    site: str
    cpus_min: float
    cpus_max: float
    def __init__(self, model_sha256: _Optional[str] = ..., model_name: _Optional[str] = ..., gpus: _Optional[int] = ..., gpu_memory_mib: _Optional[int] = ..., p2p_required: bool = ..., cpus: _Optional[float] = ..., memory_mib: _Optional[int] = ..., priority: _Optional[_Union[PriorityClass, str]] = ..., latency_slo_ms: _Optional[float] = ..., client_id: _Optional[str] = ..., site: _Optional[str] = ..., cpus_min: _Optional[float] = ..., cpus_max: _Optional[float] = ...) -> None: ...

class Deployment(_message.Message):
    __slots__ = ("deployment_id", "endpoint", "token", "epoch", "node_id", "gpu_uuids", "model_name", "state", "reason", "explanation_json", "client_id", "site", "priority", "model_sha256", "resizes", "endpoint_ca_pem")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_JSON_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    RESIZES_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_CA_PEM_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    endpoint: str
    token: str
    epoch: int
    node_id: str
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    model_name: str
    state: str
    reason: str
    explanation_json: str
    client_id: str
    site: str
    priority: PriorityClass
    model_sha256: str
    resizes: _containers.RepeatedCompositeFieldContainer[_node_pb2.ResizeEvent]
    endpoint_ca_pem: str
    def __init__(self, deployment_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., token: _Optional[str] = ..., epoch: _Optional[int] = ..., node_id: _Optional[str] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., model_name: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., explanation_json: _Optional[str] = ..., client_id: _Optional[str] = ..., site: _Optional[str] = ..., priority: _Optional[_Union[PriorityClass, str]] = ..., model_sha256: _Optional[str] = ..., resizes: _Optional[_Iterable[_Union[_node_pb2.ResizeEvent, _Mapping]]] = ..., endpoint_ca_pem: _Optional[str] = ...) -> None: ...

class GetDeploymentRequest(_message.Message):
    __slots__ = ("deployment_id",)
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    def __init__(self, deployment_id: _Optional[str] = ...) -> None: ...

class ListDeploymentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDeploymentsResponse(_message.Message):
    __slots__ = ("deployments",)
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    deployments: _containers.RepeatedCompositeFieldContainer[Deployment]
    def __init__(self, deployments: _Optional[_Iterable[_Union[Deployment, _Mapping]]] = ...) -> None: ...

class DeleteDeploymentRequest(_message.Message):
    __slots__ = ("deployment_id",)
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    def __init__(self, deployment_id: _Optional[str] = ...) -> None: ...

class DeleteDeploymentResponse(_message.Message):
    __slots__ = ("already_deleted",)
    ALREADY_DELETED_FIELD_NUMBER: _ClassVar[int]
    already_deleted: bool
    def __init__(self, already_deleted: bool = ...) -> None: ...

class WatchDeploymentRequest(_message.Message):
    __slots__ = ("deployment_id",)
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    def __init__(self, deployment_id: _Optional[str] = ...) -> None: ...

class PlacementUpdate(_message.Message):
    __slots__ = ("deployment_id", "endpoint", "token", "epoch", "reason", "migration_id", "state", "prepared_ms", "endpoint_ca_pem", "node_id")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREPARED_MS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_CA_PEM_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    endpoint: str
    token: str
    epoch: int
    reason: str
    migration_id: str
    state: str
    prepared_ms: float
    endpoint_ca_pem: str
    node_id: str
    def __init__(self, deployment_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., token: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ..., migration_id: _Optional[str] = ..., state: _Optional[str] = ..., prepared_ms: _Optional[float] = ..., endpoint_ca_pem: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class ReportLocationRequest(_message.Message):
    __slots__ = ("client_id", "site")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    site: str
    def __init__(self, client_id: _Optional[str] = ..., site: _Optional[str] = ...) -> None: ...

class ReportLocationResponse(_message.Message):
    __slots__ = ("migration_id",)
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    def __init__(self, migration_id: _Optional[str] = ...) -> None: ...

class AckSwitchRequest(_message.Message):
    __slots__ = ("deployment_id", "epoch")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    epoch: int
    def __init__(self, deployment_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class AckSwitchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ObservationReport(_message.Message):
    __slots__ = ("deployment_id", "migration_id", "longest_gap_ms", "failed_requests", "requests", "span_gap_ms", "offload")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    LONGEST_GAP_MS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SPAN_GAP_MS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    migration_id: str
    longest_gap_ms: float
    failed_requests: int
    requests: int
    span_gap_ms: float
    offload: OffloadSummary
    def __init__(self, deployment_id: _Optional[str] = ..., migration_id: _Optional[str] = ..., longest_gap_ms: _Optional[float] = ..., failed_requests: _Optional[int] = ..., requests: _Optional[int] = ..., span_gap_ms: _Optional[float] = ..., offload: _Optional[_Union[OffloadSummary, _Mapping]] = ...) -> None: ...

class ObservationAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("deployment_id", "to_node", "strategy")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    to_node: str
    strategy: str
    def __init__(self, deployment_id: _Optional[str] = ..., to_node: _Optional[str] = ..., strategy: _Optional[str] = ...) -> None: ...

class MigrationEvent(_message.Message):
    __slots__ = ("event", "at")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    event: str
    at: float
    def __init__(self, event: _Optional[str] = ..., at: _Optional[float] = ...) -> None: ...

class Migration(_message.Message):
    __slots__ = ("migration_id", "deployment_id", "trigger", "source_node", "target_node", "strategy", "state", "timeline", "outcome", "reason", "downtime_ms", "failed_requests", "span_gap_ms", "prewarmed")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_NODE_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DOWNTIME_MS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SPAN_GAP_MS_FIELD_NUMBER: _ClassVar[int]
    PREWARMED_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    deployment_id: str
    trigger: str
    source_node: str
    target_node: str
    strategy: str
    state: str
    timeline: _containers.RepeatedCompositeFieldContainer[MigrationEvent]
    outcome: str
    reason: str
    downtime_ms: float
    failed_requests: int
    span_gap_ms: float
    prewarmed: bool
    def __init__(self, migration_id: _Optional[str] = ..., deployment_id: _Optional[str] = ..., trigger: _Optional[str] = ..., source_node: _Optional[str] = ..., target_node: _Optional[str] = ..., strategy: _Optional[str] = ..., state: _Optional[str] = ..., timeline: _Optional[_Iterable[_Union[MigrationEvent, _Mapping]]] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ..., downtime_ms: _Optional[float] = ..., failed_requests: _Optional[int] = ..., span_gap_ms: _Optional[float] = ..., prewarmed: bool = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DrainNodeResponse(_message.Message):
    __slots__ = ("migration_ids",)
    MIGRATION_IDS_FIELD_NUMBER: _ClassVar[int]
    migration_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, migration_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RetireNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class RetireNodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMigrationsRequest(_message.Message):
    __slots__ = ("deployment_id",)
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    def __init__(self, deployment_id: _Optional[str] = ...) -> None: ...

class ListMigrationsResponse(_message.Message):
    __slots__ = ("migrations",)
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    migrations: _containers.RepeatedCompositeFieldContainer[Migration]
    def __init__(self, migrations: _Optional[_Iterable[_Union[Migration, _Mapping]]] = ...) -> None: ...

class WatchServiceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ServiceSpec(_message.Message):
    __slots__ = ("model_sha256", "model_name", "gpus", "gpu_memory_mib", "cpus", "memory_mib", "clients", "any_client", "min_replicas_per_site", "max_replicas", "latency_slo_ms", "max_rps_per_client")
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    ANY_CLIENT_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_PER_SITE_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_RPS_PER_CLIENT_FIELD_NUMBER: _ClassVar[int]
    model_sha256: str
    model_name: str
    gpus: int
    gpu_memory_mib: int
    cpus: float
    memory_mib: int
    clients: _containers.RepeatedScalarFieldContainer[str]
    any_client: bool
    min_replicas_per_site: int
    max_replicas: int
    latency_slo_ms: float
    max_rps_per_client: float
    def __init__(self, model_sha256: _Optional[str] = ..., model_name: _Optional[str] = ..., gpus: _Optional[int] = ..., gpu_memory_mib: _Optional[int] = ..., cpus: _Optional[float] = ..., memory_mib: _Optional[int] = ..., clients: _Optional[_Iterable[str]] = ..., any_client: bool = ..., min_replicas_per_site: _Optional[int] = ..., max_replicas: _Optional[int] = ..., latency_slo_ms: _Optional[float] = ..., max_rps_per_client: _Optional[float] = ...) -> None: ...

class CreateServiceRequest(_message.Message):
    __slots__ = ("name", "spec")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: ServiceSpec
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[ServiceSpec, _Mapping]] = ...) -> None: ...

class ServiceReplica(_message.Message):
    __slots__ = ("deployment_id", "site", "node_id", "state", "endpoint", "clients")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    site: str
    node_id: str
    state: str
    endpoint: str
    clients: int
    def __init__(self, deployment_id: _Optional[str] = ..., site: _Optional[str] = ..., node_id: _Optional[str] = ..., state: _Optional[str] = ..., endpoint: _Optional[str] = ..., clients: _Optional[int] = ...) -> None: ...

class ServiceEvent(_message.Message):
    __slots__ = ("at", "action", "deployment_id", "site", "reason")
    AT_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    at: float
    action: str
    deployment_id: str
    site: str
    reason: str
    def __init__(self, at: _Optional[float] = ..., action: _Optional[str] = ..., deployment_id: _Optional[str] = ..., site: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Service(_message.Message):
    __slots__ = ("name", "owner", "spec", "replicas", "clients", "created_at", "events")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    owner: str
    spec: ServiceSpec
    replicas: _containers.RepeatedCompositeFieldContainer[ServiceReplica]
    clients: int
    created_at: float
    events: _containers.RepeatedCompositeFieldContainer[ServiceEvent]
    def __init__(self, name: _Optional[str] = ..., owner: _Optional[str] = ..., spec: _Optional[_Union[ServiceSpec, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[ServiceReplica, _Mapping]]] = ..., clients: _Optional[int] = ..., created_at: _Optional[float] = ..., events: _Optional[_Iterable[_Union[ServiceEvent, _Mapping]]] = ...) -> None: ...

class GetServiceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListServicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListServicesResponse(_message.Message):
    __slots__ = ("services",)
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    services: _containers.RepeatedCompositeFieldContainer[Service]
    def __init__(self, services: _Optional[_Iterable[_Union[Service, _Mapping]]] = ...) -> None: ...

class DeleteServiceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteServiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UseServiceRequest(_message.Message):
    __slots__ = ("name", "site", "priority")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    site: str
    priority: PriorityClass
    def __init__(self, name: _Optional[str] = ..., site: _Optional[str] = ..., priority: _Optional[_Union[PriorityClass, str]] = ...) -> None: ...

class ServiceAssignment(_message.Message):
    __slots__ = ("service", "client_id", "deployment_id", "node_id", "site", "endpoint", "token", "epoch", "model_name", "priority", "endpoint_ca_pem", "reason")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_CA_PEM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    service: str
    client_id: str
    deployment_id: str
    node_id: str
    site: str
    endpoint: str
    token: str
    epoch: int
    model_name: str
    priority: PriorityClass
    endpoint_ca_pem: str
    reason: str
    def __init__(self, service: _Optional[str] = ..., client_id: _Optional[str] = ..., deployment_id: _Optional[str] = ..., node_id: _Optional[str] = ..., site: _Optional[str] = ..., endpoint: _Optional[str] = ..., token: _Optional[str] = ..., epoch: _Optional[int] = ..., model_name: _Optional[str] = ..., priority: _Optional[_Union[PriorityClass, str]] = ..., endpoint_ca_pem: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class OffloadSummary(_message.Message):
    __slots__ = ("session", "policy", "local_model", "decisions", "remote_requests", "local_requests", "fallbacks", "remote_estimate_ms", "local_estimate_ms", "remote_reachable")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_MODEL_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ESTIMATE_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ESTIMATE_MS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REACHABLE_FIELD_NUMBER: _ClassVar[int]
    session: str
    policy: str
    local_model: str
    decisions: _containers.RepeatedCompositeFieldContainer[OffloadDecisionCount]
    remote_requests: int
    local_requests: int
    fallbacks: int
    remote_estimate_ms: float
    local_estimate_ms: float
    remote_reachable: bool
    def __init__(self, session: _Optional[str] = ..., policy: _Optional[str] = ..., local_model: _Optional[str] = ..., decisions: _Optional[_Iterable[_Union[OffloadDecisionCount, _Mapping]]] = ..., remote_requests: _Optional[int] = ..., local_requests: _Optional[int] = ..., fallbacks: _Optional[int] = ..., remote_estimate_ms: _Optional[float] = ..., local_estimate_ms: _Optional[float] = ..., remote_reachable: bool = ...) -> None: ...

class OffloadDecisionCount(_message.Message):
    __slots__ = ("target", "reason", "requests")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    target: str
    reason: str
    requests: int
    def __init__(self, target: _Optional[str] = ..., reason: _Optional[str] = ..., requests: _Optional[int] = ...) -> None: ...
