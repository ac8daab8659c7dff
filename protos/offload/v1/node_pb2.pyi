from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_STARTING: _ClassVar[ReplicaState]
    REPLICA_STATE_READY: _ClassVar[ReplicaState]
    REPLICA_STATE_STOPPING: _ClassVar[ReplicaState]
    REPLICA_STATE_EXITED: _ClassVar[ReplicaState]
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_STARTING: ReplicaState
REPLICA_STATE_READY: ReplicaState
REPLICA_STATE_STOPPING: ReplicaState
REPLICA_STATE_EXITED: ReplicaState

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_mib", "memory_used_mib", "utilization_pct", "pci_bus_id", "numa_node", "compute_capability")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PCT_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int
    utilization_pct: int
    pci_bus_id: str
    numa_node: int
    compute_capability: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_mib: _Optional[int] = ..., memory_used_mib: _Optional[int] = ..., utilization_pct: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., numa_node: _Optional[int] = ..., compute_capability: _Optional[str] = ...) -> None: ...

class GpuLink(_message.Message):
    __slots__ = ("gpu_a", "gpu_b", "kind", "nvlinks")
    GPU_A_FIELD_NUMBER: _ClassVar[int]
    GPU_B_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NVLINKS_FIELD_NUMBER: _ClassVar[int]
    gpu_a: str
    gpu_b: str
    kind: str
    nvlinks: int
    def __init__(self, gpu_a: _Optional[str] = ..., gpu_b: _Optional[str] = ..., kind: _Optional[str] = ..., nvlinks: _Optional[int] = ...) -> None: ...

class Inventory(_message.Message):
    __slots__ = ("gpus", "links", "driver_version", "cuda_version", "nics")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    NICS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    links: _containers.RepeatedCompositeFieldContainer[GpuLink]
    driver_version: str
    cuda_version: str
    nics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[GpuLink, _Mapping]]] = ..., driver_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., nics: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaSpec(_message.Message):
    __slots__ = ("deployment_id", "epoch", "model_sha256", "model_name", "gpu_uuids", "gpu_memory_mib", "cpus", "memory_mib", "token", "gpu_count", "p2p_required", "warmup_inputs_sha256", "background_start", "priority", "cpus_min", "cpus_max")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    P2P_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    WARMUP_INPUTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_START_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CPUS_MIN_FIELD_NUMBER: _ClassVar[int]
    CPUS_MAX_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    epoch: int
    model_sha256: str
    model_name: str
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    gpu_memory_mib: int
    cpus: float
    memory_mib: int
    token: str
    gpu_count: int
    p2p_required: bool
    warmup_inputs_sha256: str
    background_start: bool
    priority: int
    cpus_min: float
    cpus_max: float
    def __init__(self, deployment_id: _Optional[str] = ..., epoch: _Optional[int] = ..., model_sha256: _Optional[str] = ..., model_name: _Optional[str] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., gpu_memory_mib: _Optional[int] = ..., cpus: _Optional[float] = ..., memory_mib: _Optional[int] = ..., token: _Optional[str] = ..., gpu_count: _Optional[int] = ..., p2p_required: bool = ..., warmup_inputs_sha256: _Optional[str] = ..., background_start: bool = ..., priority: _Optional[int] = ..., cpus_min: _Optional[float] = ..., cpus_max: _Optional[float] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("replica_id", "spec", "endpoint", "state", "exit_code", "log_tail", "runtime", "ref")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    LOG_TAIL_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    spec: ReplicaSpec
    endpoint: str
    state: ReplicaState
    exit_code: int
    log_tail: str
    runtime: str
    ref: str
    def __init__(self, replica_id: _Optional[str] = ..., spec: _Optional[_Union[ReplicaSpec, _Mapping]] = ..., endpoint: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., exit_code: _Optional[int] = ..., log_tail: _Optional[str] = ..., runtime: _Optional[str] = ..., ref: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("node_id", "site", "inventory", "runtimes", "topology")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    RUNTIMES_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    site: str
    inventory: Inventory
    runtimes: _containers.RepeatedScalarFieldContainer[str]
    topology: str
    def __init__(self, node_id: _Optional[str] = ..., site: _Optional[str] = ..., inventory: _Optional[_Union[Inventory, _Mapping]] = ..., runtimes: _Optional[_Iterable[str]] = ..., topology: _Optional[str] = ...) -> None: ...

class StartReplicaRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: ReplicaSpec
    def __init__(self, spec: _Optional[_Union[ReplicaSpec, _Mapping]] = ...) -> None: ...

class StartReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: Replica
    def __init__(self, replica: _Optional[_Union[Replica, _Mapping]] = ...) -> None: ...

class StopReplicaRequest(_message.Message):
    __slots__ = ("replica_id", "grace_ms")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    grace_ms: int
    def __init__(self, replica_id: _Optional[str] = ..., grace_ms: _Optional[int] = ...) -> None: ...

class StopReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class UpdateResourcesRequest(_message.Message):
    __slots__ = ("replica_id", "cpus", "memory_mib")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    cpus: float
    memory_mib: int
    def __init__(self, replica_id: _Optional[str] = ..., cpus: _Optional[float] = ..., memory_mib: _Optional[int] = ...) -> None: ...

class UpdateResourcesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaRequests(_message.Message):
    __slots__ = ("rate_per_s", "failure_rate_per_s", "latency_p50_ms", "latency_p99_ms", "compute_p50_ms", "in_flight", "queued", "requests_total", "failures_total", "batch_size_mean", "queue_delay_p99_ms", "classes", "clients", "clients_total")
    RATE_PER_S_FIELD_NUMBER: _ClassVar[int]
    FAILURE_RATE_PER_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P50_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P99_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_P50_MS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_MEAN_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DELAY_P99_MS_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    rate_per_s: float
    failure_rate_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    compute_p50_ms: float
    in_flight: int
    queued: int
    requests_total: int
    failures_total: int
    batch_size_mean: float
    queue_delay_p99_ms: float
    classes: _containers.RepeatedCompositeFieldContainer[ClassCompute]
    clients: _containers.RepeatedCompositeFieldContainer[ClientRequests]
    clients_total: int
    def __init__(self, rate_per_s: _Optional[float] = ..., failure_rate_per_s: _Optional[float] = ..., latency_p50_ms: _Optional[float] = ..., latency_p99_ms: _Optional[float] = ..., compute_p50_ms: _Optional[float] = ..., in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., requests_total: _Optional[int] = ..., failures_total: _Optional[int] = ..., batch_size_mean: _Optional[float] = ..., queue_delay_p99_ms: _Optional[float] = ..., classes: _Optional[_Iterable[_Union[ClassCompute, _Mapping]]] = ..., clients: _Optional[_Iterable[_Union[ClientRequests, _Mapping]]] = ..., clients_total: _Optional[int] = ...) -> None: ...

class ClientRequests(_message.Message):
    __slots__ = ("client_id", "rate_per_s", "refused_per_s", "latency_p99_ms", "requests_total", "refused_total")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    RATE_PER_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_PER_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P99_MS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    rate_per_s: float
    refused_per_s: float
    latency_p99_ms: float
    requests_total: int
    refused_total: int
    def __init__(self, client_id: _Optional[str] = ..., rate_per_s: _Optional[float] = ..., refused_per_s: _Optional[float] = ..., latency_p99_ms: _Optional[float] = ..., requests_total: _Optional[int] = ..., refused_total: _Optional[int] = ...) -> None: ...

class ClassCompute(_message.Message):
    __slots__ = ("priority_class", "compute_share", "requests_per_s")
    PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SHARE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    priority_class: str
    compute_share: float
    requests_per_s: float
    def __init__(self, priority_class: _Optional[str] = ..., compute_share: _Optional[float] = ..., requests_per_s: _Optional[float] = ...) -> None: ...

class ReplicaUsage(_message.Message):
    __slots__ = ("replica_id", "cpu_pct", "memory_used_mib", "cpu_limit", "throttled_pct", "requests")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    CPU_PCT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    CPU_LIMIT_FIELD_NUMBER: _ClassVar[int]
    THROTTLED_PCT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    cpu_pct: float
    memory_used_mib: int
    cpu_limit: float
    throttled_pct: float
    requests: ReplicaRequests
    def __init__(self, replica_id: _Optional[str] = ..., cpu_pct: _Optional[float] = ..., memory_used_mib: _Optional[int] = ..., cpu_limit: _Optional[float] = ..., throttled_pct: _Optional[float] = ..., requests: _Optional[_Union[ReplicaRequests, _Mapping]] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("cpu_cores", "cpu_used_cores", "memory_total_mib", "memory_used_mib")
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    CPU_USED_CORES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    cpu_cores: float
    cpu_used_cores: float
    memory_total_mib: int
    memory_used_mib: int
    def __init__(self, cpu_cores: _Optional[float] = ..., cpu_used_cores: _Optional[float] = ..., memory_total_mib: _Optional[int] = ..., memory_used_mib: _Optional[int] = ...) -> None: ...

class ResizeEvent(_message.Message):
    __slots__ = ("event_id", "replica_id", "deployment_id", "cpus_before", "cpus_after", "policy", "reason", "at")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    CPUS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    CPUS_AFTER_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    replica_id: str
    deployment_id: str
    cpus_before: float
    cpus_after: float
    policy: str
    reason: str
    at: float
    def __init__(self, event_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., deployment_id: _Optional[str] = ..., cpus_before: _Optional[float] = ..., cpus_after: _Optional[float] = ..., policy: _Optional[str] = ..., reason: _Optional[str] = ..., at: _Optional[float] = ...) -> None: ...

class UsageResponse(_message.Message):
    __slots__ = ("gpus", "replicas", "node", "resizes", "resize_policy")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RESIZES_FIELD_NUMBER: _ClassVar[int]
    RESIZE_POLICY_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaUsage]
    node: NodeLoad
    resizes: _containers.RepeatedCompositeFieldContainer[ResizeEvent]
    resize_policy: str
    def __init__(self, gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaUsage, _Mapping]]] = ..., node: _Optional[_Union[NodeLoad, _Mapping]] = ..., resizes: _Optional[_Iterable[_Union[ResizeEvent, _Mapping]]] = ..., resize_policy: _Optional[str] = ...) -> None: ...

class ModelChunk(_message.Message):
    __slots__ = ("sha256", "name", "data")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    name: str
    data: bytes
    def __init__(self, sha256: _Optional[str] = ..., name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutModelResponse(_message.Message):
    __slots__ = ("sha256", "size_bytes", "deduplicated")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size_bytes: int
    deduplicated: bool
    def __init__(self, sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., deduplicated: bool = ...) -> None: ...

class ReplicaClient(_message.Message):
    __slots__ = ("client_id", "priority_class", "token_sha256", "max_rps")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SHA256_FIELD_NUMBER: _ClassVar[int]
    MAX_RPS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    priority_class: str
    token_sha256: str
    max_rps: float
    def __init__(self, client_id: _Optional[str] = ..., priority_class: _Optional[str] = ..., token_sha256: _Optional[str] = ..., max_rps: _Optional[float] = ...) -> None: ...

class SetReplicaClientsRequest(_message.Message):
    __slots__ = ("replica_id", "clients")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    clients: _containers.RepeatedCompositeFieldContainer[ReplicaClient]
    def __init__(self, replica_id: _Optional[str] = ..., clients: _Optional[_Iterable[_Union[ReplicaClient, _Mapping]]] = ...) -> None: ...

class SetReplicaClientsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
