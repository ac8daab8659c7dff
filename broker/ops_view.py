"""`BrokerOpsView`: the `OpsView` the ops HTTP server reads, over the broker's state."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

from broker.deployment_table import ACTIVE
from broker.nodes import NodeEntry
from broker.ops import (
    BatchingInfo,
    DeploymentFigures,
    DeploymentInfo,
    DeploymentLoadInfo,
    LoadInfo,
    MetricFigures,
    MigrationInfo,
    NodeFigures,
    NodeInfo,
    NodeLoadInfo,
    OffloadInfo,
    PrewarmInfo,
    ServiceClientFigures,
    ServiceClientInfo,
    ServiceFigures,
    ServiceInfo,
    ServiceReplicaInfo,
    StandbyInfo,
)
from broker.ops.view import SCALE_DECISIONS_SHOWN, SERVICE_CLIENTS_SHOWN
from broker.placement import PriorityClass
from broker.service import Broker
from broker.state import (
    DeploymentRecord,
    OffloadReportRecord,
    ServiceClientRecord,
    ServiceRecord,
    ServiceReplicaRecord,
)
from broker.telemetry import DeploymentPoint, RequestFigures
from broker.values import ServiceSpec, spec_of


def topology_matrix(entry: NodeEntry) -> str:
    """The node's GPU links as `nvidia-smi topo -m` prints them."""
    inventory = entry.inventory
    names = [f"GPU{g.index}" for g in inventory.gpus]
    rows = ["\t" + "\t".join(names)]
    for a in inventory.gpus:
        cells = [
            " X " if a.index == b.index else str(inventory.link(a.index, b.index))
            for b in inventory.gpus
        ]
        rows.append(f"GPU{a.index}\t" + "\t".join(cells))
    return "\n".join(rows) if inventory.gpus else "(no GPUs)"


def _summary(record: DeploymentRecord) -> str:
    try:
        explanation = json.loads(record.explanation_json or "{}")
    except json.JSONDecodeError:
        return ""
    chosen = explanation.get("chosen")
    if not chosen:
        return explanation.get("note", "")
    deciding = ", ".join(explanation.get("deciding", [])) or "only candidate"
    return f"latency {chosen['latency_ms']:.1f} ms; deciding: {deciding}"


def offload_info(report: OffloadReportRecord, now: float) -> OffloadInfo:
    """One session's latest offload report as the ops API shows it; `now` in Unix seconds."""
    s = report.summary
    total = s.remote_requests + s.local_requests
    return {
        "session": s.session,
        "policy": s.policy,
        "local_model": s.local_model,
        "remote_requests": s.remote_requests,
        "local_requests": s.local_requests,
        "remote_share": round(s.remote_requests / total, 4) if total else None,
        "fallbacks": s.fallbacks,
        "decisions": [
            {"target": c.target, "reason": c.reason, "requests": c.requests} for c in s.decisions
        ],
        "remote_estimate_ms": s.remote_estimate_ms,
        "local_estimate_ms": s.local_estimate_ms,
        "remote_reachable": s.remote_reachable,
        "reported_at": report.reported_at,
        "reported_age_s": round(max(now - report.reported_at, 0.0), 3),
    }


def _holders(active: list[DeploymentRecord]) -> dict[tuple[str, int], list[str]]:
    """(node, GPU index) -> the deployments of `active` that hold that GPU."""
    holders: dict[tuple[str, int], list[str]] = {}
    for record in active:
        if record.node_id and record.state in ACTIVE:
            for index in record.gpus:
                holders.setdefault((record.node_id, index), []).append(record.deployment_id)
    return holders


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _point(p: DeploymentPoint) -> list[float | None]:
    replica = p.replica
    requests = replica.requests
    return [
        round(p.at, 3),
        round(requests.rate_per_s, 3) if requests else None,
        requests.latency_p50_ms if requests else None,
        requests.latency_p99_ms if requests else None,
        round(replica.cpu_used_cores, 3),
        replica.cpu_limit_cores,
        round(requests.failure_rate_per_s, 3) if requests else None,
    ]


def _batching(p: DeploymentPoint) -> BatchingInfo | None:
    requests = p.replica.requests
    if requests is None or requests.batch_size_mean is None:
        return None
    return {
        "batch_size_mean": round(requests.batch_size_mean, 2),
        "queue_delay_p99_ms": requests.queue_delay_p99_ms,
        "class_shares": {name: round(share, 3) for name, share in requests.class_shares},
    }


def _weighted_mean(pairs: list[tuple[float, float]]) -> float | None:
    """The mean of (value, weight) pairs; a plain mean when every weight is 0; None when
    there are none."""
    if not pairs:
        return None
    total = sum(weight for _, weight in pairs)
    if total <= 0:
        return sum(value for value, _ in pairs) / len(pairs)
    return sum(value * weight for value, weight in pairs) / total


@dataclass(slots=True)
class _ClientCalls:
    request_rate: float = 0.0
    refused_rate: float = 0.0
    latency_p99_ms: float | None = None
    deployment_id: str = ""
    busiest_rate: float = -1.0
    """The request rate at `deployment_id`, the replica it called most."""


@dataclass(slots=True)
class _ServiceLoad:
    """A service's figures over its serving replicas' latest ones."""

    request_rate: float | None = None
    latency_p99_ms: float | None = None
    batch_size_mean: float | None = None
    class_shares: dict[str, float] = field(default_factory=dict)
    clients: dict[str, _ClientCalls] = field(default_factory=dict)


def _service_load(replicas: list[tuple[str, RequestFigures]]) -> _ServiceLoad:
    """Sum the rates, take the worst p99, weigh batch sizes and class shares by the
    replicas' request rates; each client's calls summed over the replicas that reported
    it (a client switched between two is on both for a few seconds)."""
    load = _ServiceLoad()
    if not replicas:
        return load
    load.request_rate = sum(r.rate_per_s for _, r in replicas)
    p99s = [r.latency_p99_ms for _, r in replicas if r.latency_p99_ms is not None]
    load.latency_p99_ms = max(p99s) if p99s else None
    batching = [r for _, r in replicas if r.batch_size_mean is not None]
    load.batch_size_mean = _weighted_mean(
        [(r.batch_size_mean or 0.0, r.rate_per_s) for r in batching]
    )
    names = {name for r in batching for name, _ in r.class_shares}
    for name in sorted(names):
        share = _weighted_mean(
            [(dict(r.class_shares).get(name, 0.0), r.rate_per_s) for r in batching]
        )
        if share:
            load.class_shares[name] = share
    for deployment_id, r in replicas:
        for c in r.clients:
            calls = load.clients.setdefault(c.client_id, _ClientCalls())
            calls.request_rate += c.rate_per_s
            calls.refused_rate += c.refused_per_s
            if c.latency_p99_ms is not None:
                calls.latency_p99_ms = max(calls.latency_p99_ms or 0.0, c.latency_p99_ms)
            if c.rate_per_s > calls.busiest_rate:
                calls.deployment_id, calls.busiest_rate = deployment_id, c.rate_per_s
    return load


def _busiest(clients: dict[str, _ClientCalls]) -> list[ServiceClientInfo]:
    ranked = sorted(
        clients.items(), key=lambda item: (-item[1].request_rate, -item[1].refused_rate, item[0])
    )
    return [
        {
            "client_id": client_id,
            "deployment_id": calls.deployment_id,
            "request_rate": round(calls.request_rate, 3),
            "refused_rate": round(calls.refused_rate, 3),
            "latency_p99_ms": calls.latency_p99_ms,
        }
        for client_id, calls in ranked[:SERVICE_CLIENTS_SHOWN]
    ]


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True, slots=True)
class _ServiceRows:
    """The services' rows, grouped, with what the broker knows of their replicas now."""

    services: list[ServiceRecord]
    replicas: dict[str, list[ServiceReplicaRecord]]
    """Service -> its replicas, oldest first."""
    clients: list[ServiceClientRecord]
    deployments: dict[str, DeploymentRecord]
    """Deployment id -> its record, for those not deleted."""


class BrokerOpsView:
    def __init__(self, broker: Broker, prewarm_budget: int = 0) -> None:
        self._broker = broker
        self._prewarm_budget = prewarm_budget

    async def _active(self) -> list[DeploymentRecord]:
        return await self._broker.deployments.visible()

    async def _service_rows(self, active: list[DeploymentRecord]) -> _ServiceRows:
        services, replicas, clients = await self._broker.service_rows()
        grouped: dict[str, list[ServiceReplicaRecord]] = {}
        for row in replicas:
            grouped.setdefault(row.service, []).append(row)
        return _ServiceRows(
            services, grouped, clients, {record.deployment_id: record for record in active}
        )

    def _serving(self, deployment_id: str, rows: _ServiceRows) -> RequestFigures | None:
        """The latest request figures of a replica still deployed."""
        if deployment_id not in rows.deployments:
            return None
        latest = self._broker.load_history.latest_replica(deployment_id)
        return latest.replica.requests if latest is not None else None

    def _service_loads(self, rows: _ServiceRows) -> dict[str, _ServiceLoad]:
        loads = {}
        for service in rows.services:
            serving = [
                (row.deployment_id, requests)
                for row in rows.replicas.get(service.name, [])
                if (requests := self._serving(row.deployment_id, rows)) is not None
            ]
            loads[service.name] = _service_load(serving)
        return loads

    async def services(self) -> list[ServiceInfo]:
        rows = await self._service_rows(await self._active())
        loads = self._service_loads(rows)
        on_replica = Counter(c.deployment_id for c in rows.clients)
        on_service = Counter(c.service for c in rows.clients)
        out: list[ServiceInfo] = []
        for service in rows.services:
            replicas: list[ServiceReplicaInfo] = []
            for row in rows.replicas.get(service.name, []):
                record = rows.deployments.get(row.deployment_id)
                requests = self._serving(row.deployment_id, rows)
                replicas.append(
                    {
                        "deployment_id": row.deployment_id,
                        "site": row.site,
                        "node_id": record.node_id if record is not None else None,
                        "state": str(record.state) if record is not None else "deleted",
                        "clients": on_replica[row.deployment_id],
                        "request_rate": _round(requests.rate_per_s, 3) if requests else None,
                        "latency_p99_ms": requests.latency_p99_ms if requests else None,
                        "queued": requests.queued if requests else None,
                        "batch_size_mean": _round(requests.batch_size_mean, 2)
                        if requests
                        else None,
                        "class_shares": {n: round(v, 3) for n, v in requests.class_shares}
                        if requests
                        else {},
                    }
                )
            load = loads[service.name]
            out.append(
                {
                    "name": service.name,
                    "owner": service.owner,
                    "model_name": ServiceSpec.from_json(service.spec_json).model_name,
                    "clients": on_service[service.name],
                    "replicas": replicas,
                    "request_rate": _round(load.request_rate, 3),
                    "latency_p99_ms": load.latency_p99_ms,
                    "batch_size_mean": _round(load.batch_size_mean, 2),
                    "class_shares": {n: round(v, 3) for n, v in load.class_shares.items()},
                    "busiest_clients": _busiest(load.clients),
                    "scale_decisions": [
                        {
                            "at": e.at,
                            "action": str(e.action),
                            "deployment_id": e.deployment_id,
                            "site": e.site,
                            "reason": e.reason,
                        }
                        for e in await self._broker.services.events(
                            service.name, SCALE_DECISIONS_SHOWN
                        )
                    ],
                }
            )
        return out

    async def nodes(self) -> list[NodeInfo]:
        holders = _holders(await self._active())
        now = time.monotonic()
        nodes: list[NodeInfo] = []
        for node_id in sorted(self._broker.nodes):
            entry = self._broker.nodes[node_id]
            nodes.append(
                {
                    "node_id": node_id,
                    "site": entry.record.site,
                    "state": str(entry.record.state),
                    "address": entry.record.address,
                    "last_heartbeat_age_s": round(now - entry.last_heartbeat, 3),
                    "runtime": ",".join(entry.record.runtimes),
                    "gpus": [
                        {
                            "index": g.index,
                            "uuid": g.uuid,
                            "name": g.name,
                            "memory_total_mib": g.memory_total_mib,
                            "free": (node_id, g.index) not in holders,
                            "holders": holders.get((node_id, g.index), []),
                        }
                        for g in entry.inventory.gpus
                    ],
                    "links": [
                        {"a": a, "b": b, "kind": str(link)}
                        for (a, b), link in sorted(entry.inventory.links.items())
                    ],
                    "topology_text": topology_matrix(entry),
                }
            )
        return nodes

    async def deployments(self) -> list[DeploymentInfo]:
        now = time.time()
        offload: dict[str, list[OffloadInfo]] = {}
        for report in await self._broker.reports.offload_reports():
            offload.setdefault(report.deployment_id, []).append(offload_info(report, now))
        return [
            {
                "deployment_id": r.deployment_id,
                "client_id": r.client_id,
                "model_name": r.model_name,
                "state": str(r.state),
                "node_id": r.node_id,
                "gpus": list(r.gpus),
                "endpoint": r.endpoint or None,
                "epoch": r.epoch,
                "priority": PriorityClass(r.priority).name.lower(),
                "site": r.site,
                "reason": r.reason or None,
                "explanation": _summary(r),
                "offload": offload.get(r.deployment_id, []),
            }
            for r in sorted(await self._active(), key=lambda r: r.created_at)
        ]

    async def migrations(self) -> list[MigrationInfo]:
        records = await self._broker.moves.list_migrations()
        out: list[MigrationInfo] = []
        for m in sorted(records, key=lambda m: m.created_at, reverse=True)[:50]:
            out.append(
                {
                    "migration_id": m.migration_id,
                    "deployment_id": m.deployment_id,
                    "trigger": str(m.trigger),
                    "source": m.source_node,
                    "target": m.target_node,
                    "strategy": str(m.strategy).replace("_", "-"),
                    "outcome": m.outcome or None,
                    "reason": m.reason,
                    "downtime_ms": m.downtime_ms,
                    "span_gap_ms": m.span_gap_ms,
                    "failed_requests": m.failed_requests,
                    "timeline": json.loads(m.timeline_json or "[]"),
                    "prewarmed": m.prewarmed,
                }
            )
        return out

    async def prewarm(self) -> PrewarmInfo:
        now = time.monotonic()
        held_now = self._broker.standbys.held()
        active = {
            id(s) for s in held_now if self._broker.standbys.standby_of(s.deployment_id) is s
        }
        standbys: list[StandbyInfo] = []
        for standby in sorted(held_now, key=lambda s: s.created):
            held = id(standby) in active
            standbys.append(
                {
                    "deployment_id": standby.deployment_id,
                    "replica_id": standby.replica,
                    "node_id": standby.node_id,
                    "site": standby.site,
                    "gpus": list(standby.record.gpus),
                    "probability": round(standby.probability, 3) if standby.probability else None,
                    "state": ("ready" if standby.ready else "starting") if held else "retiring",
                    "age_s": round(now - standby.created, 3),
                }
            )
        return {"budget": self._prewarm_budget, "standbys": standbys}

    async def figures(self) -> MetricFigures:
        broker = self._broker
        active = await self._active()
        held = _holders(active)
        gpus = [(node, g.index) for node, e in broker.nodes.items() for g in e.inventory.gpus]
        used = sum(1 for gpu in gpus if gpu in held)
        visible = {record.deployment_id for record in active}
        requests: Counter[tuple[str, str, str]] = Counter()
        reachable: dict[str, bool] = {}
        for report in await broker.reports.offload_reports():  # the most recent first
            deployment = report.deployment_id
            if deployment not in visible:
                continue
            for c in report.summary.decisions:
                requests[deployment, c.target, c.reason] += c.requests
            reachable.setdefault(deployment, report.summary.remote_reachable)
        history = broker.load_history
        load_nodes = {}
        for node_id in history.node_ids():
            point = history.latest_point(node_id)
            if point is None:
                continue
            entry = broker.nodes.get(node_id)
            load_nodes[node_id] = NodeFigures(
                site=entry.record.site if entry else "",
                load=point.load,
                cpu_used_cores=point.cpu_used_cores,
                cpu_cores=point.cpu_cores,
                memory_used_bytes=point.memory_used_mib * 1024 * 1024,
            )
        load_deployments = {}
        for record in active:
            latest = history.latest_replica(record.deployment_id)
            if latest is None:
                continue
            replica = latest.replica
            served = replica.requests
            load_deployments[record.deployment_id] = DeploymentFigures(
                latency_slo_seconds=spec_of(record).latency_slo_ms / 1000,
                cpu_used_cores=replica.cpu_used_cores,
                cpu_limit_cores=replica.cpu_limit_cores or 0.0,
                request_rate=served.rate_per_s if served else None,
                failure_rate=served.failure_rate_per_s if served else None,
                latency_p50_seconds=_seconds(served.latency_p50_ms) if served else None,
                latency_p99_seconds=_seconds(served.latency_p99_ms) if served else None,
            )
        return MetricFigures(
            nodes=Counter(str(e.record.state) for e in broker.nodes.values()),
            gpus_free=len(gpus) - used,
            gpus_used=used,
            deployments=Counter(str(record.state) for record in active),
            standbys=len(broker.standbys.held()),
            standby_budget=self._prewarm_budget,
            offload_requests=requests,
            remote_reachable=reachable,
            load_nodes=load_nodes,
            load_deployments=load_deployments,
            services=self._service_figures(await self._service_rows(active)),
        )

    def _service_figures(self, rows: _ServiceRows) -> dict[str, ServiceFigures]:
        on_service = Counter(c.service for c in rows.clients)
        figures = {}
        for name, load in self._service_loads(rows).items():
            figures[name] = ServiceFigures(
                replicas=Counter(row.site for row in rows.replicas.get(name, [])),
                clients=on_service[name],
                request_rate=load.request_rate,
                latency_p99_seconds=_seconds(load.latency_p99_ms),
                batch_size_mean=load.batch_size_mean,
                class_shares=load.class_shares,
                client_figures={
                    client: ServiceClientFigures(calls.request_rate, calls.refused_rate)
                    for client, calls in load.clients.items()
                },
            )
        return figures

    async def load(self) -> LoadInfo:
        history = self._broker.load_history
        nodes: list[NodeLoadInfo] = []
        for node_id in history.node_ids():
            entry = self._broker.nodes.get(node_id)
            latest = history.latest(node_id)
            nodes.append(
                {
                    "node_id": node_id,
                    "site": entry.record.site if entry else "",
                    "resize_policy": latest.resize_policy if latest else "",
                    "points": [
                        [
                            round(p.at, 3),
                            round(p.load, 4),
                            round(p.cpu_used_cores, 3),
                            p.cpu_cores,
                            p.memory_used_mib,
                        ]
                        for p in history.node_points(node_id)
                    ],
                }
            )
        deployments: list[DeploymentLoadInfo] = []
        for record in sorted(await self._active(), key=lambda r: r.created_at):
            points = history.deployment_points(record.deployment_id)
            if not points:
                continue
            spec = spec_of(record)
            deployments.append(
                {
                    "deployment_id": record.deployment_id,
                    "node_id": points[-1].node_id,
                    "priority": PriorityClass(record.priority).name.lower().replace("_", "-"),
                    "latency_slo_ms": spec.latency_slo_ms,
                    "points": [_point(p) for p in points],
                    "batching": _batching(points[-1]),
                }
            )
        return {
            "window_s": history.window_s,
            "nodes": nodes,
            "deployments": deployments,
            "resizes": [
                {
                    "event_id": r.event_id,
                    "at": r.at,
                    "node_id": r.node_id,
                    "deployment_id": r.deployment_id,
                    "replica_id": r.replica_id,
                    "cpus_before": r.cpus_before,
                    "cpus_after": r.cpus_after,
                    "policy": r.policy,
                    "reason": r.reason,
                }
                for r in await self._broker.registry.resizes()
            ],
        }
