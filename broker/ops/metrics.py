"""The broker's Prometheus metrics, in a registry of their own.

`BrokerMetrics` owns a `CollectorRegistry` rather than using prometheus_client's global one, so
that several brokers (tests) can live in one process. Metric names:

- `offload_nodes{state}`, `offload_gpus{state="free"|"used"}`, `offload_deployments{state}`:
  gauges of the current state. The ops app sets them from the `OpsView` at every scrape.
- `offload_placement_seconds`: histogram of placement decision time (100 us .. 1 s).
- `offload_migration_downtime_seconds`: histogram of the gap clients observed across a
  migration's switch (1 ms .. 10 s).
- `offload_migration_span_gap_seconds`: histogram of the longest gap clients observed over a
  whole migration, from the broker's decision to the old replica stopped (the target's start
  included; same buckets). Only from clients that measure it.
- `offload_migrations_total{outcome}`: counter of finished migrations by outcome.
- `offload_client_requests_total{deployment,target,reason}`: requests edge clients ran on
  their replica (`target="remote"`) or their own model (`"local"`), by reason, summed over the
  latest report of each client session the broker keeps. Set from the `OpsView` at every
  scrape. It falls (a counter reset to Prometheus) when the broker forgets an old session of a
  deployment, and vanishes with the deployment.
- `offload_client_remote_reachable{deployment}`: 1 when the deployment's client last reported
  its replica reachable, 0 when it had just failed; absent before a report.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

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
            "Finished migrations, by outcome.",
            ["outcome"],
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
        self._offload = _OffloadCollector()
        self.registry.register(self._offload)
        # Every state a gauge has shown: a state that empties reads 0 instead of vanishing,
        # so that alerts on e.g. offload_nodes{state="lost"} see the drop.
        self._seen: dict[str, set[str]] = {"nodes": set(), "deployments": set()}
        self._gpus.labels(state="free").set(0)
        self._gpus.labels(state="used").set(0)

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

    def record_migration(self, outcome: str, downtime_s: float | None) -> None:
        """Count one finished migration by `outcome` and, when the client reported one, the
        longest gap it observed in seconds. Raises ValueError for a gap below 0."""
        if downtime_s is not None:
            _check_seconds("migration downtime", downtime_s)
            self._downtime.observe(downtime_s)
        self._migrations.labels(outcome=outcome).inc()

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
