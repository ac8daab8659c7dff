"""offload.v1 messages <-> the broker's domain values."""

from __future__ import annotations

import re
from collections.abc import Sequence

from broker.errors import InvalidRequest, quote
from broker.rpc import validate
from broker.state import OffloadCount, OffloadSummary
from broker.telemetry import ClientFigures, NodeSample, ReplicaLoad, RequestFigures, Resize
from broker.values import MAX_GPUS
from common import offload
from common.inventory import Gpu, Inventory, Link, LinkKind, Nic
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import node_pb2 as npb
from runtime.clients import MAX_CLIENTS, check_client_id

_NV = re.compile(r"NV(\d{1,2})")
_VERSION = re.compile(r"[^\x00-\x1f\x7f]{0,64}")
_NIC = re.compile(r"[^\x00-\x20\x7f]{1,64}")


def link_from_text(kind: str) -> Link:
    if match := _NV.fullmatch(kind):
        return Link(LinkKind.NV, int(match.group(1)))
    try:
        return Link(LinkKind(kind))
    except ValueError:
        raise InvalidRequest(f"unknown GPU link kind {quote(kind)}") from None


def gpu_from_proto(g: npb.Gpu, field: str) -> Gpu:
    """One GPU of an inventory; InvalidRequest for a value out of its bounds."""
    memory_total_mib = validate.integer(
        f"{field}.memory_total_mib", g.memory_total_mib, 1, validate.MAX_GPU_MEMORY_MIB
    )
    return Gpu(
        index=validate.integer(f"{field}.index", g.index, 0, MAX_GPUS - 1),
        uuid=validate.name(f"{field}.uuid", g.uuid),
        name=validate.name(f"{field}.name", g.name) if g.name else "",
        memory_total_mib=memory_total_mib,
        memory_used_mib=validate.integer(
            f"{field}.memory_used_mib", g.memory_used_mib, 0, memory_total_mib
        ),
        utilization_pct=validate.integer(f"{field}.utilization_pct", g.utilization_pct, 0, 100),
        pci_bus_id=validate.name(f"{field}.pci_bus_id", g.pci_bus_id) if g.pci_bus_id else "",
        numa_node=None
        if g.numa_node < 0
        else validate.integer(f"{field}.numa_node", g.numa_node, 0, validate.MAX_NUMA_NODE),
        compute_capability=validate.matching(
            f"{field}.compute_capability", g.compute_capability, _VERSION, "a short version"
        ),
    )


def inventory_from_proto(message: npb.Inventory) -> Inventory:
    """The node's inventory as the broker's domain sees it; InvalidRequest when the node sent
    a value out of bounds or something inconsistent (duplicate GPUs, links to unknown GPUs,
    missing pairs)."""
    validate.count("inventory.gpus", message.gpus, MAX_GPUS)
    validate.count("inventory.links", message.links, MAX_GPUS * (MAX_GPUS - 1) // 2)
    validate.count("inventory.nics", message.nics, validate.MAX_LIST)
    gpus = tuple(gpu_from_proto(g, f"inventory.gpus[{i}]") for i, g in enumerate(message.gpus))
    if len({g.index for g in gpus}) != len(gpus) or len({g.uuid for g in gpus}) != len(gpus):
        raise InvalidRequest("the inventory lists a GPU index or UUID twice")
    if sorted(g.index for g in gpus) != list(range(len(gpus))):
        raise InvalidRequest("GPU indices must be 0..N-1")
    index = {g.uuid: g.index for g in gpus}
    links = {}
    for link in message.links:
        if link.gpu_a not in index or link.gpu_b not in index or link.gpu_a == link.gpu_b:
            raise InvalidRequest(
                f"link {quote(link.gpu_a)} - {quote(link.gpu_b)} names an unknown GPU"
            )
        a, b = sorted((index[link.gpu_a], index[link.gpu_b]))
        links[(a, b)] = link_from_text(link.kind)
    expected = len(gpus) * (len(gpus) - 1) // 2
    if len(links) != expected:
        raise InvalidRequest(f"the inventory has {len(links)} GPU links; {expected} expected")
    return Inventory(
        gpus=gpus,
        links=links,
        nics=tuple(
            Nic(validate.matching("inventory.nics", nic, _NIC, "a network interface name"))
            for nic in message.nics
        ),
        driver_version=validate.matching(
            "inventory.driver_version", message.driver_version, _VERSION, "a short version"
        ),
        cuda_version=validate.matching(
            "inventory.cuda_version", message.cuda_version, _VERSION, "a short version"
        ),
    )


def offload_from_proto(message: pb.OffloadSummary) -> OffloadSummary:
    """A client's offload summary, every field within its bounds and the totals consistent
    with the decisions (as `edge_client.adaptive` counts them: a side's requests are the sum
    of its decisions, the fallbacks are the local requests of reason "fallback"), so what the
    dashboard shows adds up; InvalidRequest naming the first field that does not."""
    field = "offload"
    session = validate.identifier(f"{field}.session", message.session)
    policy = validate.word(f"{field}.policy", message.policy, offload.POLICIES)
    local_model = message.local_model
    if local_model:
        validate.file_name(f"{field}.local_model", local_model)
    most = len(offload.TARGETS) * len(offload.REASONS)
    validate.count(f"{field}.decisions", message.decisions, most)
    decisions: dict[tuple[str, str], int] = {}
    for i, d in enumerate(message.decisions):
        at = f"{field}.decisions[{i}]"
        key = (
            validate.word(f"{at}.target", d.target, offload.TARGETS),
            validate.word(f"{at}.reason", d.reason, offload.REASONS),
        )
        if key in decisions:
            raise InvalidRequest(f"{at} repeats target {key[0]} with reason {key[1]}")
        decisions[key] = validate.integer(f"{at}.requests", d.requests, 0, validate.MAX_REQUESTS)
    totals = {}
    for target, name in (("remote", "remote_requests"), ("local", "local_requests")):
        total = validate.integer(
            f"{field}.{name}", getattr(message, name), 0, validate.MAX_REQUESTS
        )
        counted = sum(n for (t, _), n in decisions.items() if t == target)
        if total != counted:
            raise InvalidRequest(
                f"{field}.{name} {total} is not the sum of its decisions' requests ({counted})"
            )
        totals[target] = total
    fallbacks = validate.integer(f"{field}.fallbacks", message.fallbacks, 0, validate.MAX_REQUESTS)
    if fallbacks != (counted := decisions.get(("local", "fallback"), 0)):
        raise InvalidRequest(
            f"{field}.fallbacks {fallbacks} is not the local requests of reason fallback "
            f"({counted})"
        )
    return OffloadSummary(
        session=session,
        policy=policy,
        local_model=local_model,
        decisions=tuple(
            OffloadCount(target, reason, n) for (target, reason), n in sorted(decisions.items())
        ),
        remote_requests=totals["remote"],
        local_requests=totals["local"],
        fallbacks=fallbacks,
        remote_estimate_ms=validate.estimate(
            f"{field}.remote_estimate_ms", message.remote_estimate_ms
        ),
        local_estimate_ms=validate.estimate(
            f"{field}.local_estimate_ms", message.local_estimate_ms
        ),
        remote_reachable=message.remote_reachable,
    )


MAX_RESIZES = 64
"""Resize events one heartbeat may carry (a node repeats a bounded window of recent ones)."""
_REASON = re.compile(r"[^\x00-\x1f\x7f]{0,512}")
_RESIZE_POLICIES = ("usage", "gain")
MAX_CLIENT_FIGURES = 64
"""Clients of one replica a heartbeat may carry (a node sends the busiest of them)."""
_BATCH_CLASSES = ("critical", "standard", "best-effort")
"""The runtime's priority classes (`runtime.batching.PriorityClass`), as replicas report
their batches' compute by class."""


def node_sample_from_proto(usage: npb.UsageResponse) -> NodeSample:
    """A heartbeat's telemetry; InvalidRequest for a value out of its bounds. A node older
    than the telemetry fields sends GPU utilization only (the rest reads as zeros)."""
    validate.count("usage.gpus", usage.gpus, MAX_GPUS)
    validate.count("usage.replicas", usage.replicas, validate.MAX_REPLICAS)
    validate.count("usage.resizes", usage.resizes, MAX_RESIZES)
    node = usage.node
    return NodeSample(
        cpu_cores=validate.number("usage.node.cpu_cores", node.cpu_cores, 0, validate.MAX_CPUS),
        cpu_used_cores=validate.number(
            "usage.node.cpu_used_cores", node.cpu_used_cores, 0, validate.MAX_CPUS
        ),
        memory_total_mib=validate.integer(
            "usage.node.memory_total_mib", node.memory_total_mib, 0, validate.MAX_MEMORY_MIB
        ),
        memory_used_mib=validate.integer(
            "usage.node.memory_used_mib", node.memory_used_mib, 0, validate.MAX_MEMORY_MIB
        ),
        gpu_utilization_pct=tuple(
            validate.integer(f"usage.gpus[{i}].utilization_pct", g.utilization_pct, 0, 100)
            for i, g in enumerate(usage.gpus)
        ),
        replicas=tuple(
            _replica_load(r, f"usage.replicas[{i}]") for i, r in enumerate(usage.replicas)
        ),
        resizes=tuple(_resize(r, f"usage.resizes[{i}]") for i, r in enumerate(usage.resizes)),
        resize_policy=(
            validate.word(
                "usage.resize_policy", usage.resize_policy, ("static", *_RESIZE_POLICIES)
            )
            if usage.resize_policy
            else ""
        ),
    )


def _replica_load(r: npb.ReplicaUsage, field: str) -> ReplicaLoad:
    requests = None
    if r.HasField("requests"):
        q = r.requests
        rates = validate.MAX_REQUESTS
        latency = validate.MAX_ESTIMATE_MS
        requests = RequestFigures(
            rate_per_s=validate.number(f"{field}.requests.rate_per_s", q.rate_per_s, 0, rates),
            failure_rate_per_s=validate.number(
                f"{field}.requests.failure_rate_per_s", q.failure_rate_per_s, 0, rates
            ),
            latency_p50_ms=validate.number(
                f"{field}.requests.latency_p50_ms", q.latency_p50_ms, 0, latency
            )
            or None,
            latency_p99_ms=validate.number(
                f"{field}.requests.latency_p99_ms", q.latency_p99_ms, 0, latency
            )
            or None,
            in_flight=validate.integer(f"{field}.requests.in_flight", q.in_flight, 0, rates),
            queued=validate.integer(f"{field}.requests.queued", q.queued, 0, rates),
            batch_size_mean=validate.number(
                f"{field}.requests.batch_size_mean", q.batch_size_mean, 0, rates
            )
            or None,
            queue_delay_p99_ms=validate.number(
                f"{field}.requests.queue_delay_p99_ms", q.queue_delay_p99_ms, 0, latency
            )
            or None,
            class_shares=_class_shares(q.classes, f"{field}.requests.classes"),
            clients=_clients(q.clients, f"{field}.requests.clients"),
            clients_total=validate.integer(
                f"{field}.requests.clients_total", q.clients_total, len(q.clients), MAX_CLIENTS
            ),
        )
    return ReplicaLoad(
        replica_id=validate.replica_id(f"{field}.replica_id", r.replica_id),
        cpu_used_cores=validate.number(f"{field}.cpu_pct", r.cpu_pct, 0, 100 * validate.MAX_CPUS)
        / 100,
        cpu_limit_cores=validate.number(f"{field}.cpu_limit", r.cpu_limit, 0, validate.MAX_CPUS),
        throttled_ratio=validate.number(f"{field}.throttled_pct", r.throttled_pct, 0, 100) / 100,
        memory_used_mib=validate.integer(
            f"{field}.memory_used_mib", r.memory_used_mib, 0, validate.MAX_MEMORY_MIB
        ),
        requests=requests,
    )


def _class_shares(
    classes: Sequence[npb.ClassCompute], field: str
) -> tuple[tuple[str, float], ...]:
    """Each class once, by the runtime's names, with its compute share 0..1."""
    validate.count(field, classes, len(_BATCH_CLASSES))
    shares: dict[str, float] = {}
    for i, c in enumerate(classes):
        name = validate.word(f"{field}[{i}].priority_class", c.priority_class, _BATCH_CLASSES)
        if name in shares:
            raise InvalidRequest(f"{field}[{i}].priority_class {name} is repeated")
        shares[name] = validate.number(f"{field}[{i}].compute_share", c.compute_share, 0, 1)
    return tuple(shares.items())


def _clients(clients: Sequence[npb.ClientRequests], field: str) -> tuple[ClientFigures, ...]:
    """Each client once, by a valid client id, with figures within bounds."""
    validate.count(field, clients, MAX_CLIENT_FIGURES)
    rates, latency = validate.MAX_REQUESTS, validate.MAX_ESTIMATE_MS
    figures: dict[str, ClientFigures] = {}
    for i, c in enumerate(clients):
        at = f"{field}[{i}]"
        try:
            client_id = check_client_id(c.client_id)
        except ValueError as err:
            raise InvalidRequest(f"{at}.client_id: {err}") from err
        if client_id in figures:
            raise InvalidRequest(f"{at}.client_id {client_id} is repeated")
        figures[client_id] = ClientFigures(
            client_id=client_id,
            rate_per_s=validate.number(f"{at}.rate_per_s", c.rate_per_s, 0, rates),
            refused_per_s=validate.number(f"{at}.refused_per_s", c.refused_per_s, 0, rates),
            latency_p99_ms=validate.number(f"{at}.latency_p99_ms", c.latency_p99_ms, 0, latency)
            or None,
        )
    return tuple(figures.values())


def _resize(r: npb.ResizeEvent, field: str) -> Resize:
    return Resize(
        event_id=validate.replica_id(f"{field}.event_id", r.event_id),
        replica_id=validate.replica_id(f"{field}.replica_id", r.replica_id),
        deployment_id=validate.identifier(f"{field}.deployment_id", r.deployment_id),
        cpus_before=validate.number(f"{field}.cpus_before", r.cpus_before, 0, validate.MAX_CPUS),
        cpus_after=validate.number(f"{field}.cpus_after", r.cpus_after, 0, validate.MAX_CPUS),
        policy=validate.word(f"{field}.policy", r.policy, _RESIZE_POLICIES),
        reason=validate.matching(
            f"{field}.reason", r.reason, _REASON, "at most 512 characters, no control characters"
        ),
        at=validate.number(f"{field}.at", r.at, 0, 2**40),
    )
