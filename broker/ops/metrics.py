"""The broker's Prometheus metrics, in a registry of their own.

`BrokerMetrics` owns a `CollectorRegistry` rather than using prometheus_client's global one, so
that several brokers (tests) can live in one process. Metric names:

- `offload_nodes{state}`, `offload_gpus{state="free"|"used"}`, `offload_deployments{state}`:
  gauges of the current state. The ops app sets them from the `OpsView` at every scrape.
- `offload_placement_seconds`: histogram of placement decision time (100 us .. 1 s).
- `offload_deploy_decision_seconds`: histogram of the time each placement of a deployment
  holds the placement lock: reading the cluster, placing, and its writes to the state store
  (a first deploy that preempts nothing queues its write and awaits it after the lock; same
  buckets). Decisions are taken one at a time, so 1 / its mean is how many the broker can
  take per second.
- `offload_placement_lock_wait_seconds_total{use}`,
  `offload_placement_lock_held_seconds_total{use}`,
  `offload_placement_lock_acquisitions_total{use}`: counters of the time holders of the
  placement lock (every decision, and the writes that settle one: a replica running, a
  delete, a move's steps) waited for it and held it, by what they used it for (`use`:
  "decide", "running", "start failed", "delete", "deleted", "requeue", "move", "switch",
  "move abandoned", "standby", "standby retired", "node state", "load"). The rate of the
  held seconds, summed over `use`, is the share of time the lock is busy: near 1, it
  bounds the deploys committed per second; each use's share says which holders fill it.
- `offload_state_commits_total`, `offload_state_calls_total`: counters of the state store's
  commits and of the calls they made durable (the calls queued together on the state thread
  commit together); their ratio is the calls per commit.
- `offload_migration_downtime_seconds`: histogram of the gap clients observed across a
  migration's switch (1 ms .. 10 s).
- `offload_migration_span_gap_seconds`: histogram of the longest gap clients observed over a
  whole migration, from the broker's decision to the old replica stopped (the target's start
  included; same buckets). Only from clients that measure it.
- `offload_migrations_total{outcome,trigger}`: counter of finished migrations by outcome and
  what started them ("mobility", "node_lost", "drain", "rebalance", "operator").
- `offload_node_load{node,site}` (0..1, what placement weighs: the larger of the replicas'
  CPU share of the cores the node offers and its GPUs' mean utilization),
  `offload_node_cpu_used_cores{node}`, `offload_node_cpu_cores{node}`,
  `offload_node_memory_used_bytes{node}`: gauges from each node's latest heartbeat, set from
  the `OpsView` at every scrape (a node stays until the broker restarts).
- `offload_deployment_request_rate{deployment}` (requests/s), `..._failure_rate`,
  `..._latency_p50_seconds`, `..._latency_p99_seconds`, `..._latency_slo_seconds` (0: none),
  `..._cpu_used_cores`, `..._cpu_limit_cores` (0: unlimited): gauges of each running
  deployment's serving replica over its node's last sampling interval (its runtime's
  metrics); a figure the node could not read is absent, and a deleted deployment's series
  vanish.
- `offload_resizes_total{policy,direction}`: counter of CPU changes nodes' resource managers
  made (`direction` "up" or "down").
- `offload_client_requests_total{deployment,target,reason}`: requests edge clients ran on
  their replica (`target="remote"`) or their own model (`"local"`), by reason, summed over the
  latest report of each client session the broker keeps. Set from the `OpsView` at every
  scrape. It falls (a counter reset to Prometheus) when the broker forgets an old session of a
  deployment, and vanishes with the deployment.
- `offload_client_remote_reachable{deployment}`: 1 when the deployment's client last reported
  its replica reachable, 0 when it had just failed; absent before a report.
- `offload_service_replicas{service,site}`, `offload_service_clients{service}`: a service's
  replicas at each site (running or not) and the clients on it.
- Per service, over its serving replicas' latest figures (a figure no replica reported is
  absent): `offload_service_request_rate{service}` (requests/s, summed),
  `offload_service_latency_p99_seconds{service}` (the worst replica's p99: not a quantile of
  the union), `offload_service_batch_size_mean{service}` (rows per batch, the replicas'
  means weighted by their request rates), `offload_service_class_compute_share{service,
  class}` (each priority class's share 0..1 of the batches' compute, weighted the same way).
- Per client of a service: `offload_service_client_request_rate{service,client}` and
  `offload_service_client_refused_rate{service,client}` (calls per second, and those refused
  RESOURCE_EXHAUSTED). Cardinality is capped: at most `CLIENT_SERIES_PER_SERVICE` clients per
  service, the busiest (by requests/s, then refused/s); the rest count in the service's
  figures only. A node sends at most 64 clients per replica (the busiest) to begin with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PLACEMENT_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
"""Placement decision time buckets in seconds; 2 ms is the benchmark's p99 target."""

DOWNTIME_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Migration downtime buckets in seconds; 5 s is the bound the design must beat."""


MIGRATION_OUTCOMES = ("succeeded", "rolled_back", "failed")
MIGRATION_TRIGGERS = ("mobility", "node_lost", "drain", "rebalance", "operator")
"""Every series of `offload_migrations_total` exists from the start at 0, so that
`increase()` sees the first migration of a kind."""

CLIENT_SERIES_PER_SERVICE = 20
"""Clients of one service with series of their own (the busiest): two series each, so a
service adds at most 40 per-client series however many clients it has (up to 10,000 per
replica)."""

STANDBY_EVENTS = ("started", "hit", "lapsed", "expired", "preempted", "failed", "lost", "refused")


def _check_seconds(what: str, seconds: float) -> None:
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {seconds!r}")


class _OffloadCollector(Collector):
    """The edge clients' offload reports as last set: counters and gauges built at collect
    time, so a deployment that is gone leaves no series behind."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}
        self.reachable: dict[str, bool] = {}

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "offload_client_requests",
            "Requests edge clients ran on their replica (remote) or their own model (local), "
            "by reason; the latest report of each client session, summed.",
            labels=["deployment", "target", "reason"],
        )
        for labels, count in sorted(self.requests.items()):
            requests.add_metric(list(labels), count)
        yield requests
        reachable = GaugeMetricFamily(
            "offload_client_remote_reachable",
            "1 when the deployment's client last reported its replica reachable, else 0.",
            labels=["deployment"],
        )
        for deployment, up in sorted(self.reachable.items()):
            reachable.add_metric([deployment], 1.0 if up else 0.0)
        yield reachable


@dataclass(frozen=True, slots=True)
class NodeFigures:
    site: str
    load: float
    cpu_used_cores: float
    cpu_cores: float
    memory_used_bytes: float


@dataclass(frozen=True, slots=True)
class DeploymentFigures:
    latency_slo_seconds: float
    cpu_used_cores: float
    cpu_limit_cores: float
    request_rate: float | None = None
    failure_rate: float | None = None
    latency_p50_seconds: float | None = None
    latency_p99_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class ServiceClientFigures:
    """One client's calls on a service, summed over the replicas that reported it."""

    request_rate: float
    refused_rate: float


@dataclass(frozen=True, slots=True)
class ServiceFigures:
    replicas: Mapping[str, int]
    """Site -> the service's replicas there."""
    clients: int
    request_rate: float | None = None
    """Requests/s its serving replicas answered, summed; None when none reported figures."""
    latency_p99_seconds: float | None = None
    """The worst serving replica's p99; None when no request finished at any."""
    batch_size_mean: float | None = None
    """Rows per batch, the replicas' means weighted by their request rates; None when no
    replica batched."""
    class_shares: Mapping[str, float] = field(default_factory=dict)
    """Priority class -> its share 0..1 of the batches' compute, weighted as the batches."""
    client_figures: Mapping[str, ServiceClientFigures] = field(default_factory=dict)
    """Client id -> its calls, for the clients its replicas reported (the busiest of each)."""


@dataclass(frozen=True, slots=True)
class MetricFigures:
    """What the state gauges and the live-load and offload series show at one scrape
    (`OpsView.figures`): counted from the broker's state, not from the dashboard's views."""

    nodes: Mapping[str, int]
    """State -> nodes in it."""
    gpus_free: int
    gpus_used: int
    deployments: Mapping[str, int]
    """State -> deployments (not deleted) in it."""
    standbys: int
    standby_budget: int
    offload_requests: Mapping[tuple[str, str, str], int]
    """(deployment, target, reason) -> requests, summed over its sessions' latest reports."""
    remote_reachable: Mapping[str, bool]
    """Deployment -> whether its most recently reporting session saw its replica reachable."""
    load_nodes: Mapping[str, NodeFigures]
    """Node -> its latest heartbeat's figures."""
    load_deployments: Mapping[str, DeploymentFigures]
    """Deployment (not deleted) -> its serving replica's latest figures."""
    services: Mapping[str, ServiceFigures] = field(default_factory=dict)
    """Service -> its replicas by site and the clients on it."""


class _LoadCollector(Collector):
    """Live load as last set: gauges built at collect time, so that a deployment that is
    gone, or a figure a node could not read, leaves no series behind."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeFigures] = {}
        self.deployments: dict[str, DeploymentFigures] = {}
        self.services: dict[str, ServiceFigures] = {}

    def collect(self) -> Iterator[Metric]:
        def family(name: str, documentation: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, documentation, labels=labels)

        load = family(
            "offload_node_load",
            "The node's load as placement weighs it, 0..1: the larger of its replicas' CPU "
            "share of the cores it offers and its GPUs' mean utilization.",
            ["node", "site"],
        )
        node_gauges = {
            "cpu_used_cores": family(
                "offload_node_cpu_used_cores", "Cores the node's replicas used.", ["node"]
            ),
            "cpu_cores": family(
                "offload_node_cpu_cores", "Cores the node offers to replicas.", ["node"]
            ),
            "memory_used_bytes": family(
                "offload_node_memory_used_bytes", "Memory the node's replicas use.", ["node"]
            ),
        }
        for node, n in sorted(self.nodes.items()):
            load.add_metric([node, n.site], n.load)
            for attribute, gauge in node_gauges.items():
                gauge.add_metric([node], getattr(n, attribute))
        yield load
        yield from node_gauges.values()
        deployment_gauges = {
            "request_rate": "Requests per second its replica answered.",
            "failure_rate": "Requests per second its replica failed.",
            "latency_p50_seconds": "Median request latency at its replica.",
            "latency_p99_seconds": "99th percentile request latency at its replica.",
            "latency_slo_seconds": "Its latency SLO (0: none).",
            "cpu_used_cores": "Cores its replica used.",
            "cpu_limit_cores": "Its replica's CPU quota in cores (0: unlimited).",
        }
        for attribute, documentation in deployment_gauges.items():
            gauge = family(f"offload_deployment_{attribute}", documentation, ["deployment"])
            for deployment, d in sorted(self.deployments.items()):
                value = getattr(d, attribute)
                if value is not None:
                    gauge.add_metric([deployment], value)
            yield gauge
        yield from self._services(family)

    def _services(
        self, family: Callable[[str, str, list[str]], GaugeMetricFamily]
    ) -> Iterator[Metric]:
        replicas = family(
            "offload_service_replicas", "A service's replicas at a site.", ["service", "site"]
        )
        clients = family("offload_service_clients", "Clients on a service.", ["service"])
        gauges = {
            "request_rate": family(
                "offload_service_request_rate",
                "Requests per second a service's replicas answered, summed.",
                ["service"],
            ),
            "latency_p99_seconds": family(
                "offload_service_latency_p99_seconds",
                "The worst 99th percentile request latency among a service's replicas.",
                ["service"],
            ),
            "batch_size_mean": family(
                "offload_service_batch_size_mean",
                "Rows per batch at a service's replicas (weighted by their request rates).",
                ["service"],
            ),
        }
        shares = family(
            "offload_service_class_compute_share",
            "A priority class's share of the batches' compute at a service's replicas.",
            ["service", "class"],
        )
        client_rate = family(
            "offload_service_client_request_rate",
            f"Calls per second of a client of a service (its {CLIENT_SERIES_PER_SERVICE} "
            "busiest clients).",
            ["service", "client"],
        )
        client_refused = family(
            "offload_service_client_refused_rate",
            "Calls per second of a client of a service refused RESOURCE_EXHAUSTED.",
            ["service", "client"],
        )
        for service, figures in sorted(self.services.items()):
            for site, count in sorted(figures.replicas.items()):
                replicas.add_metric([service, site], count)
            clients.add_metric([service], figures.clients)
            for attribute, gauge in gauges.items():
                value = getattr(figures, attribute)
                if value is not None:
                    gauge.add_metric([service], value)
            for name, share in sorted(figures.class_shares.items()):
                shares.add_metric([service, name], share)
            busiest = sorted(
                figures.client_figures.items(),
                key=lambda item: (-item[1].request_rate, -item[1].refused_rate, item[0]),
            )[:CLIENT_SERIES_PER_SERVICE]
            for client, calls in sorted(busiest):
                client_rate.add_metric([service, client], calls.request_rate)
                client_refused.add_metric([service, client], calls.refused_rate)
        yield replicas
        yield clients
        yield from gauges.values()
        yield shares
        yield client_rate
        yield client_refused


class BrokerMetrics:
    """The broker's metrics. Not thread-safe beyond what prometheus_client guarantees; the
    broker calls it from its event loop."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        """Where every metric below is registered; `render` exposes exactly this registry."""
        self._nodes = Gauge(
            "offload_nodes",
            "Nodes the registry knows, by state.",
            ["state"],
            registry=self.registry,
        )
        self._gpus = Gauge(
            "offload_gpus",
            "GPUs of known nodes, free or used by a deployment.",
            ["state"],
            registry=self.registry,
        )
        self._deployments = Gauge(
            "offload_deployments", "Deployments by state.", ["state"], registry=self.registry
        )
        self._placement = Histogram(
            "offload_placement_seconds",
            "Time to take one placement decision (filter, score, choose).",
            buckets=PLACEMENT_BUCKETS_S,
            registry=self.registry,
        )
        self._decision = Histogram(
            "offload_deploy_decision_seconds",
            "Time one deployment's placement held the placement lock: the cluster read, the "
            "placement and its writes to the state store (queued, for a first deploy).",
            buckets=PLACEMENT_BUCKETS_S,
            registry=self.registry,
        )
        self._lock_wait = Counter(
            "offload_placement_lock_wait_seconds",
            "Time holders of the placement lock waited for it, by what they used it for.",
            ["use"],
            registry=self.registry,
        )
        self._lock_held = Counter(
            "offload_placement_lock_held_seconds",
            "Time the placement lock was held, by what for (the rate of the sum over uses: "
            "the share of time it is busy).",
            ["use"],
            registry=self.registry,
        )
        self._lock_acquisitions = Counter(
            "offload_placement_lock_acquisitions",
            "Times the placement lock was taken and released, by what for.",
            ["use"],
            registry=self.registry,
        )
        self._state_commits = Counter(
            "offload_state_commits",
            "Commits of the state store (the calls queued together commit together).",
            registry=self.registry,
        )
        self._state_calls = Counter(
            "offload_state_calls",
            "Calls of the state store made durable by those commits.",
            registry=self.registry,
        )
        self._downtime = Histogram(
            "offload_migration_downtime_seconds",
            "Longest gap a client observed during one migration.",
            buckets=DOWNTIME_BUCKETS_S,
            registry=self.registry,
        )
        self._span_gap = Histogram(
            "offload_migration_span_gap_seconds",
            "Longest gap a client observed over one whole migration (decision to the old "
            "replica stopped).",
            buckets=DOWNTIME_BUCKETS_S,
            registry=self.registry,
        )
        self._migrations = Counter(
            "offload_migrations",
            "Finished migrations, by outcome and trigger.",
            ["outcome", "trigger"],
            registry=self.registry,
        )
        self._beacons = Counter(
            "offload_node_beacons",
            "Liveness beacons (UDP) from nodes: taken, or dropped by why (malformed; unknown: "
            "a key not issued or withdrawn; forged: a MAC that does not match; replayed).",
            ["result"],
            registry=self.registry,
        )
        self._resizes = Counter(
            "offload_resizes",
            "CPU changes nodes' resource managers made to replicas, by policy and direction.",
            ["policy", "direction"],
            registry=self.registry,
        )
        self._standbys = Gauge(
            "offload_standbys",
            "Pre-warmed standby replicas held now (those being stopped included).",
            registry=self.registry,
        )
        self._standby_budget = Gauge(
            "offload_standby_budget",
            "Standby replicas the operator allows at once (--prewarm-budget; 0: pre-warm off).",
            registry=self.registry,
        )
        self._standby_events = Counter(
            "offload_standby_events",
            "Standby replicas by what became of them: started; hit (a move switched to it); "
            "lapsed (the client went elsewhere, or the deployment left); expired (not reached "
            "in time); preempted; failed; lost (its replica or node gone); refused (budget).",
            ["event"],
            registry=self.registry,
        )
        for event in STANDBY_EVENTS:
            self._standby_events.labels(event=event)
        for outcome in MIGRATION_OUTCOMES:
            for trigger in MIGRATION_TRIGGERS:
                self._migrations.labels(outcome=outcome, trigger=trigger)
        self._offload = _OffloadCollector()
        self.registry.register(self._offload)
        self._load = _LoadCollector()
        self.registry.register(self._load)
        # Every state a gauge has shown: a state that empties reads 0 instead of vanishing,
        # so that alerts on e.g. offload_nodes{state="lost"} see the drop.
        self._seen: dict[str, set[str]] = {"nodes": set(), "deployments": set()}
        self._gpus.labels(state="free").set(0)
        self._gpus.labels(state="used").set(0)

    def set_figures(self, figures: MetricFigures) -> None:
        """Set every gauge and series a scrape reads from the broker's state."""
        self.set_nodes(figures.nodes)
        self.set_gpus(free=figures.gpus_free, used=figures.gpus_used)
        self.set_deployments(figures.deployments)
        self.set_standbys(figures.standbys)
        self.set_standby_budget(figures.standby_budget)
        self.set_offload(figures.offload_requests, figures.remote_reachable)
        self.set_load(figures.load_nodes, figures.load_deployments)
        self._load.services = dict(figures.services)

    def set_nodes(self, counts: Mapping[str, int]) -> None:
        """Set `offload_nodes` to `counts` (state -> number of nodes); missing states read 0."""
        self._set_by_state(self._nodes, self._seen["nodes"], counts)

    def set_gpus(self, free: int, used: int) -> None:
        """Set `offload_gpus` for free and used GPUs."""
        self._gpus.labels(state="free").set(free)
        self._gpus.labels(state="used").set(used)

    def set_deployments(self, counts: Mapping[str, int]) -> None:
        """Set `offload_deployments` to `counts` (state -> number); missing states read 0."""
        self._set_by_state(self._deployments, self._seen["deployments"], counts)

    def set_offload(
        self, requests: Mapping[tuple[str, str, str], int], reachable: Mapping[str, bool]
    ) -> None:
        """Set the clients' offload series: requests by (deployment, target, reason), and
        whether each deployment's client last saw its replica reachable. Replaces what was
        set before: a deployment missing now has no series."""
        self._offload.requests = dict(requests)
        self._offload.reachable = dict(reachable)

    def set_load(
        self, nodes: Mapping[str, NodeFigures], deployments: Mapping[str, DeploymentFigures]
    ) -> None:
        """Set the live-load series; replaces what was set before (a node or deployment
        missing now has no series)."""
        self._load.nodes = dict(nodes)
        self._load.deployments = dict(deployments)

    def count_beacons(self, taken: int, refused: Mapping[str, int]) -> None:
        """Count one read of the beacon socket: the beacons taken, the datagrams dropped by
        why."""
        if taken:
            self._beacons.labels(result="taken").inc(taken)
        for why, count in refused.items():
            self._beacons.labels(result=why).inc(count)

    def count_resize(self, policy: str, up: bool) -> None:
        """Count one CPU change a node's resource manager made."""
        self._resizes.labels(policy=policy, direction="up" if up else "down").inc()

    def set_standbys(self, held: int) -> None:
        """Set `offload_standbys`."""
        self._standbys.set(held)

    def set_standby_budget(self, budget: int) -> None:
        """Set `offload_standby_budget`."""
        self._standby_budget.set(budget)

    def count_standby(self, event: str) -> None:
        """Count one standby event (`STANDBY_EVENTS`). ValueError for another."""
        if event not in STANDBY_EVENTS:
            raise ValueError(f"unknown standby event {event!r}")
        self._standby_events.labels(event=event).inc()

    def observe_placement(self, seconds: float) -> None:
        """Record one placement decision that took `seconds`. Raises ValueError below 0."""
        _check_seconds("placement time", seconds)
        self._placement.observe(seconds)

    def observe_placement_lock(self, use: str, waited_s: float, held_s: float) -> None:
        """Record one use of the placement lock: what for, how long its holder waited for
        it and held it. Raises ValueError below 0."""
        _check_seconds("placement lock wait", waited_s)
        _check_seconds("placement lock hold", held_s)
        self._lock_wait.labels(use=use).inc(waited_s)
        self._lock_held.labels(use=use).inc(held_s)
        self._lock_acquisitions.labels(use=use).inc()

    def observe_state_commit(self, calls: int) -> None:
        """Record one commit of the state store that made `calls` calls durable (called on
        the state thread). Raises ValueError below 1."""
        if calls < 1:
            raise ValueError(f"a commit makes at least one call durable, got {calls}")
        self._state_commits.inc()
        self._state_calls.inc(calls)

    def observe_decision(self, seconds: float) -> None:
        """Record one deployment's decision that held the placement lock for `seconds`.
        Raises ValueError below 0."""
        _check_seconds("decision time", seconds)
        self._decision.observe(seconds)

    def record_migration(self, outcome: str, trigger: str, downtime_s: float | None) -> None:
        """Count one finished migration by `outcome` and `trigger` and, when the client
        reported one, the longest gap it observed in seconds. Raises ValueError for a gap
        below 0."""
        if downtime_s is not None:
            _check_seconds("migration downtime", downtime_s)
            self._downtime.observe(downtime_s)
        self._migrations.labels(outcome=outcome, trigger=trigger).inc()

    def observe_downtime(self, seconds: float) -> None:
        """The longest gap a client observed across one migration (it reports it after the
        migration is counted). Raises ValueError below 0."""
        _check_seconds("migration downtime", seconds)
        self._downtime.observe(seconds)

    def observe_span_gap(self, seconds: float) -> None:
        """The longest gap a client observed over one whole migration, decision to the old
        replica stopped. Raises ValueError below 0."""
        _check_seconds("migration span gap", seconds)
        self._span_gap.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text exposition format, and its Content-Type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    @staticmethod
    def _set_by_state(gauge: Gauge, seen: set[str], counts: Mapping[str, int]) -> None:
        seen.update(counts)
        for state in seen:
            gauge.labels(state=state).set(counts.get(state, 0))
