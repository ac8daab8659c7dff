"""A replica's batching series (`runtime.batch_series`): the buckets prometheus_client's
histograms would hold for the same batches, each model's histograms on the page at zero
from its start, and a class's counters from its first batch."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runtime.metrics import BATCH_SIZE_BUCKETS, DURATION_BUCKETS_S, RuntimeMetrics


def samples(metrics: RuntimeMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    page = generate_latest(metrics.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def test_batches_fall_in_the_buckets_prometheus_clients_histograms_put_them_in() -> None:
    sizes = [1, 2, 3, 32, 33, 512, 513, 4096]
    waits = [0.0, *DURATION_BUCKETS_S, *(b * 1.001 for b in DURATION_BUCKETS_S), 9.0]
    registry = CollectorRegistry()
    size_reference = Histogram("s", "s", buckets=BATCH_SIZE_BUCKETS, registry=registry)
    wait_reference = Histogram("w", "w", buckets=DURATION_BUCKETS_S, registry=registry)
    metrics = RuntimeMetrics()
    model = metrics.for_model("mlp")
    for size in sizes:
        size_reference.observe(size)
        model.observe_batch("critical", size, 0.001, [])
    for wait in waits:
        wait_reference.observe(wait)
    size_reference.observe(1)
    model.observe_batch("best-effort", 1, 0.002, waits)
    ours = samples(metrics)
    theirs = {
        (s.name, s.labels.get("le")): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }
    for mine, reference in (
        ("offload_runtime_batch_size", "s"),
        ("offload_runtime_queue_delay_seconds", "w"),
    ):
        for (name, le), value in theirs.items():
            if not name.startswith(f"{reference}_"):
                continue
            labels = {("model", "mlp")} | ({("le", le)} if le is not None else set())
            key = (mine + name[len(reference) :], frozenset(labels))
            assert ours[key] == pytest.approx(value), key
    calls = {
        cls: ours[
            ("offload_runtime_class_requests_total", frozenset({("model", "mlp"), ("class", cls)}))
        ]
        for cls in ("critical", "best-effort")
    }
    assert calls == {"critical": 0.0, "best-effort": float(len(waits))}


def test_a_models_histograms_start_at_zero_and_a_class_appears_at_its_first_batch() -> None:
    metrics = RuntimeMetrics()
    model = metrics.for_model("mlp")
    before = samples(metrics)
    assert before[("offload_runtime_batch_size_count", frozenset({("model", "mlp")}))] == 0
    assert not [key for key in before if key[0].startswith("offload_runtime_class_compute")]
    model.observe_batch("critical", 4, 0.25, [0.001] * 4)
    model.observe_batch("critical", 2, 0.5, [0.002] * 2)
    after = samples(metrics)
    critical = frozenset({("model", "mlp"), ("class", "critical")})
    assert after[("offload_runtime_class_compute_seconds_total", critical)] == 0.75
    assert after[("offload_runtime_class_requests_total", critical)] == 6
    assert after[("offload_runtime_batch_size_sum", frozenset({("model", "mlp")}))] == 6
    assert (
        after[("offload_runtime_compute_duration_seconds_count", frozenset({("model", "mlp")}))]
        == 2
    )


def test_requests_that_ran_alone_read_as_the_same_batches_told_one_by_one() -> None:
    """`observe_alone` (the batcher's folded lone path) puts on the page what telling each
    request as a batch of its rows that waited 0 s puts there."""
    times = [0.00003, 0.00004, 0.5]
    folded, one_by_one = RuntimeMetrics(), RuntimeMetrics()
    folded.for_model("mlp").observe_alone("standard", 2, times)
    model = one_by_one.for_model("mlp")
    for seconds in times:
        model.observe_batch("standard", 2, seconds, [0.0])
    ours, reference = samples(folded), samples(one_by_one)
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        assert ours[key] == pytest.approx(value), key
    assert reference[("offload_runtime_batch_size_count", frozenset({("model", "mlp")}))] == 3
