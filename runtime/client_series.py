"""The per-client series of a shared replica's metrics page, kept in plain numbers and
formatted by hand for the node daemon's scrape: `ClientSeries`.

Why not prometheus_client's own children, as the replica's other series: a shared replica
with 64 clients has about 1,100 lines of them (each client's latency buckets, mostly), the
node daemon reads them at every heartbeat (`node_daemon.telemetry`), and
prometheus_client's `generate_latest` took 17-19 ms for them on this project's 2-core
development VM (`python -m bench.metrics_page`), holding the GIL while the replica's event
loop waited with its calls. Here a line is one string made of pieces escaped when the
client arrived, and a call's observation is a list index and two additions, with no lock
(event loop only).

The series are the same, under the same names (`runtime.metrics`' docstring lists them),
but for the `_created` samples, which nothing reads. The full page gets them through
prometheus_client (`collect`); a request that names its series (``?name[]=...``, as the
node's does) gets them from `text`, which writes exactly what `generate_latest` writes for
them (tested).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

REQUESTS = "offload_runtime_client_requests"
REQUESTS_DOC = (
    "Inference calls answered per client of the clients file, by gRPC status code name "
    "(OK for a success)."
)
DURATION = "offload_runtime_client_request_duration_seconds"
DURATION_DOC = "From a client's inference call's arrival in the handler to its answer."
COMPUTE = "offload_runtime_client_compute_seconds"
COMPUTE_DOC = "Compute time of each client's requests (a batch's split by rows)."
NAMES = frozenset(
    (
        f"{REQUESTS}_total", f"{DURATION}_bucket", f"{DURATION}_count", f"{DURATION}_sum",
        f"{COMPUTE}_total",
    )
)  # fmt: skip
"""The sample names of these series (what a ``name[]`` may ask for)."""


def _label(value: str) -> str:
    """A label value as the text format quotes it (prometheus_client's escaping)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _count(value: int) -> str:
    """A count as `generate_latest` writes it: as a float, without calling its formatter
    for the usual case (its exponent starts at a million)."""
    return f"{value}.0" if 0 <= value < 1_000_000 else floatToGoString(value)


class PlainHistogram:
    """Observations counted per bucket of `bounds` (not cumulative; the last past the
    largest bound, +Inf), and their sum: prometheus_client's histogram without its locks,
    for one thread's updates (`runtime.batch_series` keeps its histograms in these too)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def observe_many(self, value: float, count: int) -> None:
        """`count` observations of `value`."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count

    def cumulative(self) -> list[int]:
        """The buckets' counts, cumulative, copied in one step first (under the GIL): they
        never decrease, and the last (+Inf) is the count."""
        return list(itertools.accumulate(list(self.counts)))


@dataclass(slots=True)
class _Client:
    """One client's figures at one model, and the label text of its lines."""

    id: str
    client: str
    """Its id's label text (`_label`), as `model` is its model's."""
    model: str
    latency: PlainHistogram
    compute_s: float = 0.0
    by_code: dict[str, int] = field(default_factory=dict)


class ModelClients:
    """One model's clients (`ClientSeries.for_model`): what the per-call paths touch."""

    __slots__ = ("_bounds", "_clients", "_label", "_lock", "model")

    def __init__(self, model: str, bounds: Sequence[float]) -> None:
        self.model = model
        self._label = _label(model)
        self._bounds = tuple(bounds)
        self._clients: dict[str, _Client] = {}
        self._lock = threading.Lock()
        """Held to add compute time, which worker threads do too."""

    def use(self, ids: Iterable[str]) -> None:
        """Keep series for exactly the clients `ids`: a new one's appear at zero, those of a
        client no longer listed are gone. Event loop only."""
        kept = {}
        for client in ids:
            kept[client] = self._clients.get(client) or _Client(
                client, _label(client), self._label, PlainHistogram(self._bounds)
            )
        self._clients = kept  # one assignment: a reader takes one table or the other

    def answered(self, client: str, code: str, seconds: float) -> None:
        """A call of `client` answered with gRPC status `code` after `seconds`; nothing for
        a client not listed. Event loop only."""
        figures = self._clients.get(client)
        if figures is None:
            return
        figures.by_code[code] = figures.by_code.get(code, 0) + 1
        figures.latency.observe(seconds)

    def computed(self, client: str, seconds: float) -> None:
        """`client`'s requests computed for `seconds`; nothing for a client not listed. Any
        thread."""
        figures = self._clients.get(client)
        if figures is not None:
            with self._lock:
                figures.compute_s += seconds

    def snapshot(self) -> list[tuple[_Client, list[int], dict[str, int], float, float]]:
        """Each client's figures now: (client, cumulative latency buckets, calls by code,
        latency sum, compute seconds)."""
        return [
            (c, c.latency.cumulative(), dict(c.by_code), c.latency.total, c.compute_s)
            for c in list(self._clients.values())
        ]


class ClientSeries(Collector):
    """The per-client series of every model of one registry (a collector registered in it)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = tuple(bounds)
        self._le = [*map(floatToGoString, self._bounds), "+Inf"]
        self._models: list[ModelClients] = []

    def for_model(self, model: str) -> ModelClients:
        """`model`'s clients, on the page from now on (none until `ModelClients.use`)."""
        clients = ModelClients(model, self._bounds)
        self._models.append(clients)
        return clients

    def describe(self) -> Iterable[Metric]:
        return [
            CounterMetricFamily(REQUESTS, REQUESTS_DOC, labels=("model", "client", "code")),
            HistogramMetricFamily(DURATION, DURATION_DOC, labels=("model", "client")),
            CounterMetricFamily(COMPUTE, COMPUTE_DOC, labels=("model", "client")),
        ]

    def collect(self) -> Iterable[Metric]:
        requests = CounterMetricFamily(REQUESTS, REQUESTS_DOC, labels=("model", "client", "code"))
        duration = HistogramMetricFamily(DURATION, DURATION_DOC, labels=("model", "client"))
        compute = CounterMetricFamily(COMPUTE, COMPUTE_DOC, labels=("model", "client"))
        for model in self._models:
            for client, buckets, by_code, duration_s, compute_s in model.snapshot():
                labels = (model.model, client.id)
                for code, count in by_code.items():
                    requests.add_metric((*labels, code), count)
                duration.add_metric(labels, list(zip(self._le, buckets, strict=True)), duration_s)
                compute.add_metric(labels, compute_s)
        return [requests, duration, compute]

    def text(self, names: frozenset[str]) -> str:
        """The samples named in `names`, as `generate_latest` writes them from a registry
        restricted to `names` (a family without such a sample has no lines at all)."""
        snapshots = [s for model in self._models for s in model.snapshot()]
        requests: list[str] = []
        if f"{REQUESTS}_total" in names:
            requests = [
                f'{REQUESTS}_total{{client="{c.client}",code="{_label(code)}",'
                f'model="{c.model}"}} {_count(count)}\n'
                for c, _, by_code, _, _ in snapshots
                for code, count in by_code.items()
            ]
        duration: list[str] = []
        for c, buckets, _, duration_s, _ in snapshots:
            if f"{DURATION}_bucket" in names:
                duration += [
                    f'{DURATION}_bucket{{client="{c.client}",le="{le}",model="{c.model}"}} '
                    f"{_count(count)}\n"
                    for le, count in zip(self._le, buckets, strict=True)
                ]
            labels = f'client="{c.client}",model="{c.model}"'
            if f"{DURATION}_count" in names:
                duration.append(f"{DURATION}_count{{{labels}}} {_count(buckets[-1])}\n")
            if f"{DURATION}_sum" in names:
                duration.append(f"{DURATION}_sum{{{labels}}} {floatToGoString(duration_s)}\n")
        compute: list[str] = []
        if f"{COMPUTE}_total" in names:
            compute = [
                f'{COMPUTE}_total{{client="{c.client}",model="{c.model}"}} '
                f"{floatToGoString(seconds)}\n"
                for c, _, _, _, seconds in snapshots
            ]
        return "".join(
            _header(name, doc, kind) + "".join(lines)
            for name, doc, kind, lines in (
                (f"{REQUESTS}_total", REQUESTS_DOC, "counter", requests),
                (DURATION, DURATION_DOC, "histogram", duration),
                (f"{COMPUTE}_total", COMPUTE_DOC, "counter", compute),
            )
            if lines
        )


def _header(name: str, doc: str, kind: str) -> str:
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"
