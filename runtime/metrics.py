"""The runtime's own Prometheus metrics, and the HTTP endpoint that serves them.

The node daemon scrapes `GET /metrics` (Prometheus text format) on each replica to see its
live load. These names are a contract with that scraper; change both together:

- ``offload_runtime_requests_total{model}`` (counter): inference calls answered, successfully
  or not;
- ``offload_runtime_request_failures_total{model, code}`` (counter): those answered with an
  error, `code` the gRPC status name (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, INTERNAL, or
  CANCELLED for a call its client cancelled or let expire);
- ``offload_runtime_request_duration_seconds{model}`` (histogram): from a call's arrival in
  the handler to its answer;
- ``offload_runtime_compute_duration_seconds{model}`` (histogram): ONNX Runtime's `run` alone;
- ``offload_runtime_in_flight{model}`` (gauge): calls being handled now;
- ``offload_runtime_queued{model}`` (gauge): calls waiting for a worker thread, or for a
  batch when the model batches (always 0 when it runs inline on the event loop unbatched);
- with batching (`runtime.batching`): ``offload_runtime_batch_size{model}`` (histogram): the
  rows of each batch run; ``offload_runtime_queue_delay_seconds{model}`` (histogram): each
  request's wait from its queueing to its batch's start;
  ``offload_runtime_class_compute_seconds_total{model, class}`` (counter): compute time of
  the batches of each priority class (critical, standard, best-effort), whose rates give
  the classes' shares; ``offload_runtime_class_requests_total{model, class}`` (counter):
  requests computed per class; ``offload_runtime_class_queued{model, class}`` (gauge):
  requests waiting per class;
- ``offload_runtime_class_refused_total{model, class}`` (counter): requests refused
  RESOURCE_EXHAUSTED because their class already had --max-queued-per-class waiting, for a
  batch or for a worker thread (each class's series appears at its first refusal).

Per client of a shared replica (`--clients-file`, `runtime.clients`; the deployment's own
calls are not among them), with a series for each client of the file's last reading and
none for a client no longer in it (so at most the file's `MAX_CLIENTS` per name):

- ``offload_runtime_client_requests_total{model, client, code}`` (counter): its inference
  calls answered, `code` the gRPC status name (OK for a success; RESOURCE_EXHAUSTED for
  one over its rate limit or its share of the queue), each code's series from its first;
- ``offload_runtime_client_request_duration_seconds{model, client}`` (histogram): from a
  call's arrival in the handler to its answer;
- ``offload_runtime_client_compute_seconds_total{model, client}`` (counter): the compute
  time of its requests (a batch's time split by rows among its requests).

These, and the batching series above, are kept in plain numbers (`runtime.client_series`,
`runtime.batch_series`, which say why), without the ``_created`` samples of
prometheus_client's own counters and histograms.

And for the replica as a whole:

- ``offload_runtime_clients_generation`` (gauge, no label): the generation of the clients
  file whose table is in effect (`runtime.clients`; 0 before any file with one): the node
  reads it to confirm that a file it wrote is in effect (it asks for this name alone, with
  ``?name[]=offload_runtime_clients_generation``). It is set after the table is swapped, so
  a reader that sees it sees the table in use.

Calls refused before the handler are not counted: those without the right token (so that a
caller without it cannot move a replica's load figures) and those gRPC itself refuses (a
message over --max-message-bytes).

Each server has its own registry (not prometheus_client's global one): the page holds these
metrics and nothing else, and several servers can run in one process (tests, benchmarks).

The endpoint takes no token, unlike every inference call: the page carries counts and
durations per model name, never tensor data, the deployment token or the model's path.

The hot path pays a few prometheus_client operations per call (about 2.5 µs on a 2-core
development machine, within the noise of the MLP's 0.5 ms ModelInfer: one counter increment,
two histogram observations, a gauge up and down, and a gauge up and down more when the model
runs in worker threads): each model's labelled children are resolved once, in
`ModelMetrics`, never per call.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import (
    CONTENT_TYPE_PLAIN_0_0_4,
    ThreadingWSGIServer,
    choose_encoder,
    generate_latest,
    make_wsgi_app,
)

from runtime import client_series
from runtime.batch_series import BatchSeries
from runtime.client_series import ClientSeries

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication

DURATION_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0,
)  # fmt: skip
"""Histogram buckets (seconds) for 0.1 ms (a tiny model inline) to 5 s (a large one on a
busy CPU); slower calls fall in +Inf."""

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Histogram buckets (rows) of the batch sizes."""

CLIENTS_GENERATION = "offload_runtime_clients_generation"
"""The gauge of the clients table's generation (the node daemon reads it by this name)."""

SHUTDOWN_POLL_S = 0.1
"""How often the endpoint's thread checks for `MetricsEndpoint.close`: what a close waits
at most, and the thread's idle wake-up rate."""


class ModelMetrics:
    """One model's metrics, each labelled child resolved once: the only object the
    per-call paths touch. Thread-safe (prometheus_client's values take a lock), so worker
    threads may observe `compute` and lower `queued`."""

    __slots__ = (
        "_batches",
        "_class_queued",
        "_class_refused",
        "_clients",
        "_failures",
        "_failures_by_code",
        "_model",
        "_refused_by_class",
        "compute",
        "duration",
        "in_flight",
        "queued",
        "requests",
    )

    def __init__(self, family: RuntimeMetrics, model: str) -> None:
        self._model = model
        self.requests = family.requests.labels(model)
        self.duration = family.duration.labels(model)
        self.compute = family.compute.labels(model)
        self.in_flight = family.in_flight.labels(model)
        self.queued = family.queued.labels(model)
        self._failures = family.failures
        self._failures_by_code: dict[str, Counter] = {}
        self._batches = family.batches.for_model(model)
        self._class_queued = family.class_queued
        self._class_refused = family.class_refused
        self._refused_by_class: dict[str, Counter] = {}
        self._clients = family.clients.for_model(model)
        """The clients of the clients file's last reading (`runtime.client_series`)."""

    def use_clients(self, ids: Iterable[str]) -> None:
        """Keep series for exactly the clients `ids`: a new one's appear at zero, those of
        a client no longer listed are removed. Event loop only."""
        self._clients.use(ids)

    def client_answered(self, client: str, code: str, seconds: float) -> None:
        """A call of `client` answered with the gRPC status `code` (its name) after
        `seconds`; nothing for a client not listed (removed while its call ran). Event loop
        only."""
        self._clients.answered(client, code, seconds)

    def client_computed(self, client: str, seconds: float) -> None:
        """`client`'s requests computed for `seconds` (`runtime.batching.
        ClientComputeObserver`); nothing for a client not listed. Any thread."""
        self._clients.computed(client, seconds)

    def count_queued(
        self, total: Callable[[], float], per_class: Sequence[tuple[str, Callable[[], float]]]
    ) -> None:
        """Read the queue lengths from these functions at each scrape (batching)."""
        self.queued.set_function(total)
        for name, length in per_class:
            self._class_queued.labels(self._model, name).set_function(length)

    def observe_batch(
        self, cls: str, rows: int, compute_s: float, waits_s: Sequence[float]
    ) -> None:
        """One batch of priority class `cls` ran (`runtime.batching.BatchObserver`). Event
        loop only."""
        self._batches.observe(cls, rows, compute_s, waits_s)
        self.compute.observe(compute_s)

    def observe_alone(self, cls: str, rows: int, times_s: Sequence[float]) -> None:
        """Requests of priority class `cls` of `rows` each ran alone, without waiting, each
        taking one of `times_s` (`runtime.batching.AloneObserver`). Event loop only."""
        self._batches.observe_alone(cls, rows, times_s)
        observe = self.compute.observe
        for seconds in times_s:
            observe(seconds)

    def refused_full(self, cls: str) -> None:
        """One request of priority class `cls` refused: its class's queue (for a batch or a
        worker thread) was full (`runtime.batching.RefusalObserver`). Event loop only."""
        counter = self._refused_by_class.get(cls)
        if counter is None:
            counter = self._refused_by_class[cls] = self._class_refused.labels(self._model, cls)
        counter.inc()

    def failed(self, code: str) -> None:
        """Count one call answered with the gRPC status `code` (its name). Event loop only.

        Each code's series appears at its first failure: the runtime answers a handful of
        codes, and a page of zeros for the rest would only add lines to every scrape."""
        counter = self._failures_by_code.get(code)
        if counter is None:
            counter = self._failures_by_code[code] = self._failures.labels(self._model, code)
        counter.inc()


class RuntimeMetrics:
    """A server's registry and its metric families (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "offload_runtime_requests",
            "Inference calls answered, successfully or not.",
            ["model"],
            registry=r,
        )
        self.failures = Counter(
            "offload_runtime_request_failures",
            "Inference calls answered with an error, by gRPC status code name.",
            ["model", "code"],
            registry=r,
        )
        self.duration = Histogram(
            "offload_runtime_request_duration_seconds",
            "From an inference call's arrival in the handler to its answer.",
            ["model"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.compute = Histogram(
            "offload_runtime_compute_duration_seconds",
            "ONNX Runtime's run alone, per inference.",
            ["model"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "offload_runtime_in_flight",
            "Inference calls being handled now.",
            ["model"],
            registry=r,
        )
        self.queued = Gauge(
            "offload_runtime_queued",
            "Inference calls waiting for a worker thread or a batch (0 when the model runs "
            "inline unbatched).",
            ["model"],
            registry=r,
        )
        self.batches = BatchSeries(BATCH_SIZE_BUCKETS, DURATION_BUCKETS_S)
        r.register(self.batches)
        self.class_queued = Gauge(
            "offload_runtime_class_queued",
            "Requests waiting for a batch per priority class (batching).",
            ["model", "class"],
            registry=r,
        )

        self.class_refused = Counter(
            "offload_runtime_class_refused",
            "Requests refused RESOURCE_EXHAUSTED per priority class: their class already had "
            "--max-queued-per-class waiting for a batch or a worker thread.",
            ["model", "class"],
            registry=r,
        )

        self.clients = ClientSeries(DURATION_BUCKETS_S)
        r.register(self.clients)
        self.clients_generation = Gauge(
            CLIENTS_GENERATION,
            "The generation of the clients file whose table is in effect (0: none read).",
            registry=r,
        )

    def for_model(self, model: str) -> ModelMetrics:
        """The children of `model`; its series appear on the page from now on, at zero."""
        return ModelMetrics(self, model)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # a line per scrape would drown the replica's log


class _Server(ThreadingWSGIServer):
    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family  # read by TCPServer.__init__, which makes the socket
        super().__init__(address, _QuietHandler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would also look the address up (socket.getfqdn), which can
        # wait seconds on DNS on a node without it; the name it finds is never used here.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])
        self.setup_environ()


@dataclass(slots=True)
class MetricsEndpoint:
    """prometheus_client's WSGI server for one registry, in a daemon thread (a thread per
    scrape): a scrape never waits for the event loop, which an inline inference may hold,
    and never runs on it. Formatting the page holds the GIL line by line: a shared
    replica's 64 clients make it about 1,600 lines, milliseconds that the loop's calls
    wait for. So the node asks only for the series it reads (`node_daemon.telemetry`), and
    the clients' among them are written by hand (`page_app`, `runtime.client_series`)."""

    host: str
    port: int
    """The port bound (the one asked for, or the free one picked for 0)."""
    _httpd: _Server
    _thread: threading.Thread

    @classmethod
    def start(cls, metrics: RuntimeMetrics, host: str, port: int) -> MetricsEndpoint:
        """Bind `host:port` (0: a free port) and serve `metrics` on every path (Prometheus
        asks for /metrics). OSError when the address cannot be bound."""
        family, *_, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        httpd = _Server((str(address[0]), port), family)
        httpd.set_app(page_app(metrics))
        thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": SHUTDOWN_POLL_S},
            name="metrics-http",
            daemon=True,
        )
        thread.start()
        return cls(host, httpd.server_address[1], httpd, thread)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port. Blocking (up to `SHUTDOWN_POLL_S`); a
        scrape being answered finishes in its own daemon thread."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def page_app(metrics: RuntimeMetrics) -> WSGIApplication:
    """prometheus_client's WSGI app for `metrics.registry`, but for a GET in the plain text
    format that names its series (``?name[]=...``, as the node daemon's): the per-client
    series among them written by `ClientSeries.text` (milliseconds faster with many
    clients), the others by `generate_latest`, and nothing compressed (the node is near)."""
    full = make_wsgi_app(metrics.registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        encoder, _ = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        if not names or environ["REQUEST_METHOD"] != "GET" or encoder is not generate_latest:
            return full(environ, start_response)
        wanted = frozenset(names)
        others = metrics.registry.restricted_registry(wanted - client_series.NAMES)
        body = generate_latest(others) + metrics.clients.text(wanted).encode()
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)])
        return [body]

    return app
