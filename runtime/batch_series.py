"""The batching series of a replica's metrics page (`runtime.batching`'s batch sizes, queue
delays and each class's compute and requests), kept in plain numbers: `BatchSeries`.

Why not prometheus_client's children: a model that runs inline on a CPU (the MLP) runs
each of its calls as a batch of one, and recording that batch through prometheus_client
took 8 locked value updates a call (three histogram observations, two counters): the
largest part of what batching on added to such a call (`python -m bench.batcher_cost`),
where batching off records one observation. Here it is a few list and dictionary
updates, with no lock: the batcher records on the event loop only.

The series are those `runtime.metrics`' docstring lists, under the same names, but for
the ``_created`` samples, which nothing reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from runtime.client_series import PlainHistogram

BATCH_SIZE = ("offload_runtime_batch_size", "Rows of each batch run (batching).")
QUEUE_DELAY = (
    "offload_runtime_queue_delay_seconds",
    "Each request's wait from its queueing to its batch's start (batching).",
)
CLASS_COMPUTE = (
    "offload_runtime_class_compute_seconds",
    "Compute time of the batches of each priority class (batching).",
)
CLASS_REQUESTS = (
    "offload_runtime_class_requests",
    "Requests computed per priority class (batching).",
)


class ModelBatches:
    """One model's batching figures (`BatchSeries.for_model`). Event loop only."""

    __slots__ = ("batch_size", "class_compute", "class_requests", "model", "queue_delay")

    def __init__(
        self, model: str, size_bounds: Sequence[float], delay_bounds: Sequence[float]
    ) -> None:
        self.model = model
        self.batch_size = PlainHistogram(size_bounds)
        self.queue_delay = PlainHistogram(delay_bounds)
        self.class_compute: dict[str, float] = {}
        """Each class's series from its first batch on."""
        self.class_requests: dict[str, int] = {}

    def observe(self, cls: str, rows: int, compute_s: float, waits_s: Sequence[float]) -> None:
        """One batch of class `cls` ran: its rows, its compute time, each request's wait."""
        self.batch_size.observe(rows)
        for wait in waits_s:
            self.queue_delay.observe(wait)
        self.class_compute[cls] = self.class_compute.get(cls, 0.0) + compute_s
        self.class_requests[cls] = self.class_requests.get(cls, 0) + len(waits_s)

    def observe_alone(self, cls: str, rows: int, times_s: Sequence[float]) -> None:
        """Requests of class `cls` of `rows` each ran alone, without waiting, one taking each
        of `times_s`: as many batches of `rows`, each request's wait 0."""
        count = len(times_s)
        self.batch_size.observe_many(rows, count)
        self.queue_delay.observe_many(0.0, count)
        self.class_compute[cls] = self.class_compute.get(cls, 0.0) + math.fsum(times_s)
        self.class_requests[cls] = self.class_requests.get(cls, 0) + count


class BatchSeries(Collector):
    """The batching series of every model of one registry (a collector registered in it);
    each model's histograms on the page from `for_model` on, at zero."""

    def __init__(self, size_bounds: Sequence[float], delay_bounds: Sequence[float]) -> None:
        self._size_bounds = tuple(size_bounds)
        self._delay_bounds = tuple(delay_bounds)
        self._models: list[ModelBatches] = []

    def for_model(self, model: str) -> ModelBatches:
        """`model`'s figures, its histograms on the page from now on."""
        batches = ModelBatches(model, self._size_bounds, self._delay_bounds)
        self._models.append(batches)
        return batches

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        size, delay, compute, requests = families
        for model in self._models:
            for family, histogram in ((size, model.batch_size), (delay, model.queue_delay)):
                edges = [*map(floatToGoString, histogram.bounds), "+Inf"]
                buckets = list(zip(edges, histogram.cumulative(), strict=True))
                family.add_metric((model.model,), buckets, histogram.total)
            for cls, seconds in list(model.class_compute.items()):
                compute.add_metric((model.model, cls), seconds)
            for cls, count in list(model.class_requests.items()):
                requests.add_metric((model.model, cls), count)
        return families

    @staticmethod
    def _families() -> tuple[
        HistogramMetricFamily, HistogramMetricFamily, CounterMetricFamily, CounterMetricFamily
    ]:
        return (
            HistogramMetricFamily(*BATCH_SIZE, labels=("model",)),
            HistogramMetricFamily(*QUEUE_DELAY, labels=("model",)),
            CounterMetricFamily(*CLASS_COMPUTE, labels=("model", "class")),
            CounterMetricFamily(*CLASS_REQUESTS, labels=("model", "class")),
        )
