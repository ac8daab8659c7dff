"""What the node measures about itself and its replicas, every sampling interval.

`Telemetry.sample` turns cumulative counters into figures over the interval since the last
sample: per replica the CPU it used (cores), its CPU quota and how often the quota throttled
it, its memory, and its runtime's request figures (scraped from the replica's Prometheus
metrics endpoint: rate, failures, p50/p99 latency from the histogram's bucket deltas,
in-flight and queued calls, and when the model batches the mean batch size, the queue
delay's p99 and each priority class's share of the compute; for a replica for many, a
service's, each client's calls, refusals and p99, the busiest `MAX_CLIENT_FIGURES` of them);
for the node, the cores it offers and what its replicas used.
A figure that cannot be read is left out, never guessed: a replica whose metrics endpoint
does not answer has no request figures; the first sample of a replica has no CPU figure yet
(nothing to take a difference from) and reads 0.

The heartbeat carries the latest sample (`node_daemon.broker_link`); the node's resource
manager (`node_daemon.resources`) re-divides CPU from it.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from common.inventory import Gpu
from node_daemon.runtimes.base import ReplicaStats
from runtime.metrics import CLIENTS_GENERATION

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 0.5
"""A replica's metrics endpoint that does not answer within this is skipped for the sample."""

MAX_CLIENT_FIGURES = 64
"""Clients of one replica a sample carries, the busiest (by requests per second, then by
refusals): a replica may have 10,000 (`runtime.clients.MAX_CLIENTS`), and the heartbeat
stays small. `RequestFigures.clients_total` says how many there were."""

REFUSED_CODE = "RESOURCE_EXHAUSTED"
"""The gRPC status name the runtime counts a client's refused calls under (over its rate
limit, or its share of the queue)."""


@dataclass(frozen=True, slots=True)
class ClientFigures:
    """One client's calls at a replica for many over the interval."""

    client_id: str
    rate_per_s: float
    """Calls answered per second, refusals included."""
    refused_per_s: float
    """Calls answered RESOURCE_EXHAUSTED per second."""
    latency_p99_ms: float
    """Upper bucket bound; 0 when none finished in the interval."""
    requests_total: int
    refused_total: int


@dataclass(frozen=True, slots=True)
class ClassFigures:
    """One priority class's part of a replica's batch compute over the interval."""

    name: str
    """The runtime's name of the class ("critical", "standard", "best-effort")."""
    compute_share: float
    """Its share of the compute time of the interval's batches, 0..1."""
    requests_per_s: float


@dataclass(frozen=True, slots=True)
class RequestFigures:
    """A replica's requests over the interval, from its runtime's metrics."""

    rate_per_s: float
    failure_rate_per_s: float
    latency_p50_ms: float
    """0 when no request finished in the interval (upper bucket bounds otherwise)."""
    latency_p99_ms: float
    compute_p50_ms: float
    in_flight: int
    queued: int
    requests_total: int
    failures_total: int
    batch_size_mean: float = 0.0
    """Rows per batch run in the interval; 0 when no batch ran (the model does not batch)."""
    queue_delay_p99_ms: float = 0.0
    """The requests' wait for their batch, p99 (upper bucket bound); 0 when none ran."""
    classes: tuple[ClassFigures, ...] = ()
    """The classes whose batches computed in the interval, by name."""
    clients: tuple[ClientFigures, ...] = ()
    """The busiest `MAX_CLIENT_FIGURES` clients of its clients file, the busiest first; none
    for a replica without one."""
    clients_total: int = 0
    """The clients its metrics page had series for."""


@dataclass(frozen=True, slots=True)
class ReplicaSample:
    replica_id: str
    deployment_id: str
    priority: int
    """The deployment's priority class (0 standby .. 3 critical; `ReplicaSpec.priority`)."""
    cpus: float
    """The CPU the replica was started with (cores; 0: unlimited, not managed)."""
    cpus_min: float
    """The floor the resource manager keeps (cores; `ReplicaSpec.cpus_min`, defaulted)."""
    cpus_max: float
    """The ceiling (cores; `ReplicaSpec.cpus_max`, defaulted to the node's cores)."""
    cpu_limit: float
    """Its CPU quota now (cores); 0 when unlimited."""
    cpu_used_cores: float
    """CPU it used over the interval (cores)."""
    throttled_ratio: float
    """Share of the interval's CPU periods in which the quota throttled it, 0..1."""
    memory_used_mib: int
    requests: RequestFigures | None
    """None when its metrics could not be read."""


@dataclass(frozen=True, slots=True)
class NodeSample:
    at: float
    """Unix seconds, when it was taken."""
    interval_s: float
    """Seconds since the previous sample (0 for the first)."""
    cpu_cores: float
    """Cores the node offers to its replicas."""
    gpus: tuple[Gpu, ...]
    replicas: tuple[ReplicaSample, ...]
    memory_total_mib: int = 0
    """The node's physical memory (MiB); 0 when unknown."""

    @property
    def cpu_used_cores(self) -> float:
        return sum(r.cpu_used_cores for r in self.replicas)

    @property
    def memory_used_mib(self) -> int:
        return sum(r.memory_used_mib for r in self.replicas)


def offered_cores() -> float:
    """The cores this process may run on (its affinity: `--cpuset`, a container's cpuset)."""
    return float(len(os.sched_getaffinity(0)))


def physical_memory_mib() -> int:
    """The machine's memory (MiB); 0 where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    except (ValueError, OSError):
        return 0


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The upper bound of the bucket holding quantile `q` of a histogram's observations;
    `buckets` are (upper bound, cumulative count) ascending, +Inf last. 0 when empty; the
    highest finite bound when the quantile is in the +Inf bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return 0.0
    rank = q * buckets[-1][1]
    finite = [b for b, _ in buckets if math.isfinite(b)]
    for bound, count in buckets:
        if count >= rank:
            return bound if math.isfinite(bound) else (finite[-1] if finite else 0.0)
    return finite[-1] if finite else 0.0


@dataclass(frozen=True, slots=True)
class ClientCounters:
    """One client's cumulative figures on a replica's metrics page, summed over its models."""

    requests: float = 0.0
    """Calls answered, every code."""
    refused: float = 0.0
    """Those answered `REFUSED_CODE`."""
    latency_buckets: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RuntimeCounters:
    """One scrape of a replica's runtime metrics, summed over its models."""

    requests: float
    failures: float
    latency_buckets: tuple[tuple[float, float], ...]
    compute_buckets: tuple[tuple[float, float], ...]
    in_flight: float
    queued: float
    batches: float = 0.0
    """Batches run (the batch-size histogram's count); 0 from a runtime that does not batch."""
    batch_rows: float = 0.0
    """Their rows (its sum)."""
    queue_delay_buckets: tuple[tuple[float, float], ...] = ()
    class_compute_s: tuple[tuple[str, float], ...] = ()
    """(class, seconds its batches computed), by class name."""
    class_requests: tuple[tuple[str, float], ...] = ()
    """(class, requests computed)."""
    clients: Mapping[str, ClientCounters] = field(default_factory=dict)
    """Client id -> its figures, for each client of the replica's clients file."""


_RUNTIME = "offload_runtime_"
_SUMMED = tuple(
    _RUNTIME + n
    for n in (
        "requests_total", "request_failures_total", "in_flight", "queued", "batch_size_count",
        "batch_size_sum",
    )
)  # fmt: skip
"""Series summed over the page's models."""
_BUCKETED = tuple(
    _RUNTIME + n
    for n in (
        "request_duration_seconds_bucket", "compute_duration_seconds_bucket",
        "queue_delay_seconds_bucket",
    )
)  # fmt: skip
"""Histograms summed bucket by bucket over the page's models."""
_BY_CLASS = (f"{_RUNTIME}class_compute_seconds_total", f"{_RUNTIME}class_requests_total")
"""Series summed per priority class."""
PARSED = frozenset(
    (
        *_SUMMED, *_BUCKETED, *_BY_CLASS, f"{_RUNTIME}client_requests_total",
        f"{_RUNTIME}client_request_duration_seconds_bucket",
    )
)  # fmt: skip
"""The series `parse_runtime_metrics` reads: the only ones the node asks a replica for
(`Telemetry.read_page`), and of a page with more, the only lines parsed."""
_SAMPLE_LINE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+(-?\d+))?")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_ESCAPES = re.compile(r"\\(.)")
KNOWN_LINES = 16_384
"""The most lines `_samples` keeps the name and labels of (`_known`)."""
_known: dict[str, tuple[str, dict[str, str]]] = {}
"""A sample line up to its value's space -> its name and labels, for lines parsed before:
a replica's page is the same from one heartbeat to the next but for the values, so most
lines are a dictionary lookup and a float (for 64 clients' 1,100 lines, a fraction of
their parse: `python -m bench.metrics_page`). Emptied when full; read-only labels."""


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample line of a Prometheus text page whose name is
    one of `PARSED`; ValueError for such a line that does not parse.

    By hand, for its speed: prometheus_client's parser took tens of milliseconds for a
    shared replica's page with 64 clients (about 1,600 lines, most of them the clients'
    latency buckets), at every sample (each heartbeat), on the CPU the node shares with its
    replicas, and the calls in flight at the replica waited for it (`bench.services`'
    priority arm, docs/BENCHMARKS.md). A line read before costs a lookup (`_known`)."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        seen = _known.get(head)
        if seen is not None:
            try:
                number = float(value)
            except ValueError:
                pass  # read below as a new line, which says what is wrong with it
            else:
                yield seen[0], seen[1], number
                continue
        end = len(line)
        for stop in ("{", " ", "\t"):
            at = line.find(stop)
            if 0 <= at < end:
                end = at
        if line[:end] not in PARSED:
            continue
        match = _SAMPLE_LINE.fullmatch(line.rstrip())
        if match is None:
            raise ValueError(f"a metrics line that does not parse: {line[:80]!r}")
        name, label_text, value_text, timestamp = match.groups()
        labels: dict[str, str] = {}
        if label_text:
            at = 0
            while at < len(label_text):
                label = _LABEL.match(label_text, at)
                if label is None or label.end() == at:
                    raise ValueError(f"metrics labels that do not parse: {line[:80]!r}")
                unescaped = label[2]
                if "\\" in unescaped:
                    unescaped = _ESCAPES.sub(lambda m: "\n" if m[1] == "n" else m[1], unescaped)
                labels[label[1]] = unescaped
                at = label.end()
        number = float(value_text)
        if timestamp is None and value_text == value:
            if len(_known) >= KNOWN_LINES:
                _known.clear()
            _known[head] = (name, labels)
        yield name, labels, number


def parse_runtime_metrics(text: str) -> RuntimeCounters:
    """The runtime's metrics page (Prometheus text format) summed over its models; ValueError
    for a page whose series of these figures do not parse (`_samples`)."""
    sums = dict.fromkeys(_SUMMED, 0.0)
    buckets: dict[str, dict[float, float]] = {name: {} for name in _BUCKETED}
    by_class: dict[str, dict[str, float]] = {name: {} for name in _BY_CLASS}
    client_calls: dict[str, list[float]] = {}
    """Client -> [calls answered, refused]."""
    client_latency: dict[str, dict[float, float]] = {}
    try:
        for name, labels, value in _samples(text):
            if name in sums:
                sums[name] += value
            elif name in buckets:
                summed = buckets[name]
                bound = float(labels["le"])
                summed[bound] = summed.get(bound, 0.0) + value
            elif name in by_class:
                per_class = by_class[name]
                per_class[labels["class"]] = per_class.get(labels["class"], 0.0) + value
            elif name == f"{_RUNTIME}client_requests_total":
                calls = client_calls.setdefault(labels["client"], [0.0, 0.0])
                calls[0] += value
                if labels["code"] == REFUSED_CODE:
                    calls[1] += value
            else:  # offload_runtime_client_request_duration_seconds_bucket
                summed = client_latency.setdefault(labels["client"], {})
                bound = float(labels["le"])
                summed[bound] = summed.get(bound, 0.0) + value
    except KeyError as err:
        raise ValueError(f"a metrics series without its label {err}") from None
    clients = {}
    for client in client_calls.keys() | client_latency.keys():
        answered, refused = client_calls.get(client, (0.0, 0.0))
        latency_buckets = tuple(sorted(client_latency.get(client, {}).items()))
        clients[client] = ClientCounters(answered, refused, latency_buckets)
    return RuntimeCounters(
        sums[f"{_RUNTIME}requests_total"],
        sums[f"{_RUNTIME}request_failures_total"],
        tuple(sorted(buckets[f"{_RUNTIME}request_duration_seconds_bucket"].items())),
        tuple(sorted(buckets[f"{_RUNTIME}compute_duration_seconds_bucket"].items())),
        sums[f"{_RUNTIME}in_flight"],
        sums[f"{_RUNTIME}queued"],
        sums[f"{_RUNTIME}batch_size_count"],
        sums[f"{_RUNTIME}batch_size_sum"],
        tuple(sorted(buckets[f"{_RUNTIME}queue_delay_seconds_bucket"].items())),
        tuple(sorted(by_class[f"{_RUNTIME}class_compute_seconds_total"].items())),
        tuple(sorted(by_class[f"{_RUNTIME}class_requests_total"].items())),
        clients,
    )


def request_figures(
    before: RuntimeCounters, now: RuntimeCounters, interval_s: float
) -> RequestFigures:
    """Figures over the interval between two scrapes. A counter that went down (the runtime
    restarted) counts from 0."""

    def delta(a: float, b: float) -> float:
        return b - a if b >= a else b

    def bucket_delta(
        a: tuple[tuple[float, float], ...], b: tuple[tuple[float, float], ...]
    ) -> list[tuple[float, float]]:
        old = dict(a)
        return [(bound, delta(old.get(bound, 0.0), count)) for bound, count in b]

    span = max(interval_s, 1e-3)
    latency = bucket_delta(before.latency_buckets, now.latency_buckets)
    compute = bucket_delta(before.compute_buckets, now.compute_buckets)
    batches = delta(before.batches, now.batches)
    rows = delta(before.batch_rows, now.batch_rows)
    delay = bucket_delta(before.queue_delay_buckets, now.queue_delay_buckets)
    old_compute, old_requests = dict(before.class_compute_s), dict(before.class_requests)
    computed = {
        name: delta(old_compute.get(name, 0.0), seconds) for name, seconds in now.class_compute_s
    }
    computed_s = sum(computed.values())
    served = {
        name: delta(old_requests.get(name, 0.0), count) for name, count in now.class_requests
    }
    classes = tuple(
        ClassFigures(name, seconds / computed_s, served.get(name, 0.0) / span)
        for name, seconds in computed.items()
        if seconds > 0
    )
    clients = []
    for client, counters in now.clients.items():
        old = before.clients.get(client, ClientCounters())  # a new client counts from 0
        clients.append(
            ClientFigures(
                client_id=client,
                rate_per_s=delta(old.requests, counters.requests) / span,
                refused_per_s=delta(old.refused, counters.refused) / span,
                latency_p99_ms=1000
                * histogram_quantile(
                    0.99, bucket_delta(old.latency_buckets, counters.latency_buckets)
                ),
                requests_total=round(counters.requests),
                refused_total=round(counters.refused),
            )
        )
    busiest = heapq.nsmallest(
        MAX_CLIENT_FIGURES, clients, key=lambda c: (-c.rate_per_s, -c.refused_per_s, c.client_id)
    )
    return RequestFigures(
        rate_per_s=delta(before.requests, now.requests) / span,
        failure_rate_per_s=delta(before.failures, now.failures) / span,
        latency_p50_ms=1000 * histogram_quantile(0.5, latency),
        latency_p99_ms=1000 * histogram_quantile(0.99, latency),
        compute_p50_ms=1000 * histogram_quantile(0.5, compute),
        in_flight=round(now.in_flight),
        queued=round(now.queued),
        requests_total=round(now.requests),
        failures_total=round(now.failures),
        batch_size_mean=rows / batches if batches > 0 else 0.0,
        queue_delay_p99_ms=1000 * histogram_quantile(0.99, delay),
        classes=classes,
        clients=tuple(busiest),
        clients_total=len(clients),
    )


@dataclass(frozen=True, slots=True)
class CpuCounters:
    """A replica's cumulative CPU figures, as its runtime reads them (`ReplicaStats`)."""

    cpu_seconds: float
    throttled_periods: int
    periods: int


def cpu_figures(
    before: CpuCounters | None, now: CpuCounters, interval_s: float
) -> tuple[float, float]:
    """(cores used, throttled ratio) over the interval; (0, 0) without a previous reading."""
    if before is None or interval_s <= 0:
        return 0.0, 0.0
    used = max(0.0, now.cpu_seconds - before.cpu_seconds) / interval_s
    periods = now.periods - before.periods
    throttled = now.throttled_periods - before.throttled_periods
    ratio = min(1.0, max(0.0, throttled / periods)) if periods > 0 else 0.0
    return used, ratio


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the node knows of a running replica besides its counters."""

    replica_id: str
    deployment_id: str
    priority: int
    cpus: float
    cpus_min: float
    cpus_max: float
    metrics_endpoint: str


class Telemetry:
    """Keeps each replica's previous counters, to turn the next reading into figures over
    the interval. One per node; `sample` is not re-entrant (the node calls it from one
    loop)."""

    def __init__(self, cpu_cores: float | None = None) -> None:
        self.cpu_cores = offered_cores() if cpu_cores is None else cpu_cores
        self.memory_total_mib = physical_memory_mib()
        self._at: float | None = None
        self._cpu: dict[str, CpuCounters] = {}
        self._requests: dict[str, RuntimeCounters] = {}
        self._http: aiohttp.ClientSession | None = None
        self.latest: NodeSample | None = None
        """The last sample taken."""

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def sample(
        self,
        replicas: Sequence[tuple[ReplicaInfo, ReplicaStats | None]],
        gpus: tuple[Gpu, ...],
    ) -> NodeSample:
        """One sample: `replicas` with their runtime's counters now (None: not readable);
        their metrics endpoints are scraped here, all at once."""
        now = time.monotonic()
        interval = 0.0 if self._at is None else now - self._at
        self._at = now
        scraped = await asyncio.gather(*(self._scrape(info) for info, _ in replicas))
        samples = []
        for (info, stats), counters in zip(replicas, scraped, strict=True):
            used, throttled = 0.0, 0.0
            if stats is not None:
                reading = CpuCounters(stats.cpu_seconds, stats.throttled_periods, stats.periods)
                used, throttled = cpu_figures(self._cpu.get(info.replica_id), reading, interval)
                self._cpu[info.replica_id] = reading
            requests = None
            if counters is not None:
                before = self._requests.get(info.replica_id)
                if before is not None:  # a first scrape has nothing to take a difference from
                    requests = request_figures(before, counters, interval)
                self._requests[info.replica_id] = counters
            samples.append(
                ReplicaSample(
                    replica_id=info.replica_id,
                    deployment_id=info.deployment_id,
                    priority=info.priority,
                    cpus=info.cpus,
                    cpus_min=info.cpus_min,
                    cpus_max=info.cpus_max,
                    cpu_limit=stats.cpu_limit if stats else 0.0,
                    cpu_used_cores=used,
                    throttled_ratio=throttled,
                    memory_used_mib=stats.memory_used_mib if stats else 0,
                    requests=requests,
                )
            )
        present = {info.replica_id for info, _ in replicas}
        for kept in (self._cpu, self._requests):
            for gone in set(kept) - present:
                del kept[gone]
        self.latest = NodeSample(
            at=time.time(),
            interval_s=interval,
            cpu_cores=self.cpu_cores,
            gpus=gpus,
            replicas=tuple(samples),
            memory_total_mib=self.memory_total_mib,
        )
        return self.latest

    async def _scrape(self, info: ReplicaInfo) -> RuntimeCounters | None:
        text = await self.read_page(info.replica_id, info.metrics_endpoint, sorted(PARSED))
        if text is None:
            return None
        try:
            return parse_runtime_metrics(text)
        except ValueError as err:
            logger.debug("replica=%s: metrics not parsed: %r", info.replica_id, err)
            return None

    async def read_page(
        self, replica_id: str, metrics_endpoint: str, names: Sequence[str] = ()
    ) -> str | None:
        """The replica's metrics page (Prometheus text), only the metrics `names` when given
        (the runtime's endpoint serves just those); None when it has no endpoint or does
        not answer 200 within `SCRAPE_TIMEOUT_S`."""
        if not metrics_endpoint:
            return None
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
            )
        url = f"http://{metrics_endpoint}/metrics"
        try:
            async with self._http.get(url, params=[("name[]", n) for n in names]) as response:
                if response.status != 200:
                    return None
                return await response.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as err:
            logger.debug("replica=%s: metrics not read: %r", replica_id, err)
            return None


def clients_generation_of(text: str) -> int | None:
    """The value of the `CLIENTS_GENERATION` gauge on a metrics page; None when the page
    has none, or one that is not a whole number within 0..2^53."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name != CLIENTS_GENERATION:
            continue
        try:
            number = float(value)
        except ValueError:
            return None
        if not (math.isfinite(number) and 0 <= number <= 2**53 and number.is_integer()):
            return None
        return int(number)
    return None


def usage_digest(sample: NodeSample) -> tuple[object, ...]:
    """A coarse fingerprint of `sample`: two samples with the same digest tell the broker the
    same thing, so the node sends a sample when the digest changes and otherwise only every
    `--sample-interval` (`node_daemon.broker_link`). Coarse on purpose, or every sample
    would differ: per replica its CPU to a tenth of a core, its quota, its memory to 64 MiB,
    its request rate to a factor of two and whether it fails requests or queues them; per
    GPU its utilization to 5 points and its memory to 256 MiB; the node's cores."""
    replicas = tuple(
        (
            r.replica_id,
            round(r.cpu_used_cores, 1),
            r.cpu_limit,
            r.memory_used_mib // 64,
            None
            if r.requests is None
            else (
                round(math.log2(1 + r.requests.rate_per_s)),
                r.requests.failure_rate_per_s > 0,
                r.requests.queued > 0,
            ),
        )
        for r in sample.replicas
    )
    gpus = tuple((g.utilization_pct // 5, g.memory_used_mib // 256) for g in sample.gpus)
    return (sample.cpu_cores, replicas, gpus)
