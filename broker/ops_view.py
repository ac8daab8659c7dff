"""`BrokerOpsView`: the `OpsView` the ops HTTP server reads, over the broker's state."""

from __future__ import annotations

import json
import time
from collections import Counter

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
    ServiceFigures,
    StandbyInfo,
)
from broker.placement import PriorityClass
from broker.service import Broker
from broker.state import DeploymentRecord, OffloadReportRecord
from broker.telemetry import DeploymentPoint
from broker.values import spec_of


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


class BrokerOpsView:
    def __init__(self, broker: Broker, prewarm_budget: int = 0) -> None:
        self._broker = broker
        self._prewarm_budget = prewarm_budget

    async def _active(self) -> list[DeploymentRecord]:
        return await self._broker.deployments.visible()

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
            services={
                name: ServiceFigures(replicas=dict(sites), clients=clients)
                for name, (sites, clients) in (await broker.services.counts()).items()
            },
        )

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
