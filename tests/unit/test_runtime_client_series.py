"""A shared replica's per-client series (`runtime.client_series`): the node's narrow page
written by hand is what prometheus_client writes from the same figures, byte for byte; the
observations fall in prometheus_client's buckets; a client dropped from the file loses its
series; and the metrics endpoint serves the narrow page to a plain-text request that
names its series, prometheus_client's own page to any other."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from runtime import client_series
from runtime.client_series import _count
from runtime.metrics import DURATION_BUCKETS_S, MetricsEndpoint, RuntimeMetrics

NODE_NAMES = frozenset(
    {
        "offload_runtime_client_requests_total",
        "offload_runtime_client_request_duration_seconds_bucket",
        "offload_runtime_requests_total",
    }
)
"""Some of the series the node asks for, the others' included."""


def busy_metrics() -> RuntimeMetrics:
    """Two models' clients with calls in every bucket, refusals, compute, and ids that the
    text format must escape."""
    metrics = RuntimeMetrics()
    for name in ("mlp", 'odd "model"'):
        model = metrics.for_model(name)
        clients = [f"client-{i:02d}" for i in range(20)] + ['we"ird\\id\nx']
        model.use_clients(clients)
        for i, client in enumerate(clients):
            for bound in (*DURATION_BUCKETS_S, 7.5):
                model.client_answered(client, "OK", bound * (1 + i % 2 * 0.5))
            if i % 3 == 0:
                model.client_answered(client, "RESOURCE_EXHAUSTED", 0.0001)
            model.client_computed(client, 0.000123 * (i + 1))
    return metrics


@pytest.mark.parametrize(
    "names",
    [
        client_series.NAMES,
        NODE_NAMES & client_series.NAMES,
        frozenset({"offload_runtime_client_request_duration_seconds_sum"}),
        frozenset({"offload_runtime_client_request_duration_seconds_count", "nothing_else"}),
        frozenset({"offload_runtime_client_compute_seconds_total"}),
    ],
)
def test_the_narrow_text_is_what_prometheus_client_writes_from_the_same_figures(
    names: frozenset[str],
) -> None:
    metrics = busy_metrics()
    theirs = generate_latest(metrics.registry.restricted_registry(names)).decode()
    ours = metrics.clients.text(names)
    # The restricted registry's family order is a set's; each family's lines are in order.
    assert sorted(blocks(ours)) == sorted(blocks(theirs))
    assert ours.count("\n") > 20


def blocks(page: str) -> Iterator[str]:
    """Each family's lines of `page`, from its HELP line on."""
    yield from ("# HELP " + block for block in page.split("# HELP ") if block)


def test_a_replica_without_clients_has_no_per_client_lines() -> None:
    metrics = RuntimeMetrics()
    metrics.for_model("mlp").use_clients([])
    assert metrics.clients.text(client_series.NAMES) == ""
    assert generate_latest(metrics.registry.restricted_registry(client_series.NAMES)) == b""


@pytest.mark.parametrize("count", [0, 7, 999_999, 1_000_000, 12_345_678, 2**53])
def test_a_count_is_written_as_prometheus_client_writes_it(count: int) -> None:
    assert _count(count) == floatToGoString(float(count))


def test_latencies_fall_in_the_buckets_prometheus_clients_histogram_puts_them_in() -> None:
    values = [0.0, *DURATION_BUCKETS_S, *(b * 1.0001 for b in DURATION_BUCKETS_S), 60.0]
    reference = Histogram("h", "h", buckets=DURATION_BUCKETS_S, registry=CollectorRegistry())
    metrics = RuntimeMetrics()
    model = metrics.for_model("mlp")
    model.use_clients(["c"])
    for value in values:
        reference.observe(value)
        model.client_answered("c", "OK", value)
    [(_, buckets, _, total, _)] = model._clients.snapshot()
    [family] = reference.collect()
    expected = [s.value for s in family.samples if s.name == "h_bucket"]
    assert buckets == expected and buckets[-1] == len(values)
    assert total == pytest.approx(sum(values))


def test_a_client_dropped_from_the_file_loses_its_series_and_a_new_one_starts_at_zero() -> None:
    metrics = RuntimeMetrics()
    model = metrics.for_model("mlp")
    model.use_clients(["a", "b"])
    model.client_answered("a", "OK", 0.001)
    model.client_answered("b", "OK", 0.001)
    model.use_clients(["b", "c"])
    model.client_answered("a", "OK", 0.001)  # its call ended after the file dropped it
    page = generate_latest(metrics.registry).decode()
    requests = {
        sample.labels["client"]: sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "offload_runtime_client_requests_total"
    }
    assert requests == {"b": 1.0}
    assert 'client="c"' in page and 'client="a"' not in page


def test_the_endpoint_serves_the_narrow_page_to_a_named_plain_request_and_the_full_to_others() -> (
    None
):
    metrics = busy_metrics()
    endpoint = MetricsEndpoint.start(metrics, "127.0.0.1", 0)
    try:
        query = "&".join(f"name[]={name}" for name in sorted(NODE_NAMES))
        narrow = fetch(f"{endpoint.url}?{query}", {"Accept-Encoding": "gzip"})
        expected = generate_latest(metrics.registry.restricted_registry(NODE_NAMES)).decode()
        assert sorted(blocks(narrow)) == sorted(blocks(expected))  # and not compressed
        assert "offload_runtime_requests_total{" in narrow
        full = fetch(endpoint.url, {})
        assert "offload_runtime_client_compute_seconds_total{" in full
        assert "offload_runtime_in_flight{" in full
        open_metrics = fetch(
            f"{endpoint.url}?{query}", {"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        assert open_metrics.endswith("# EOF\n")
    finally:
        endpoint.close()


def fetch(url: str, headers: dict[str, str]) -> str:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return str(r.read().decode())
