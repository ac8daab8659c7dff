"""How the broker's ops view sums a service's replicas' figures: rates summed, the worst
p99, batch sizes and class shares weighted by the replicas' request rates, and each
client's calls summed over the replicas that reported it."""

from __future__ import annotations

from broker.ops_view import _busiest, _service_load
from broker.telemetry import ClientFigures, RequestFigures


def figures(
    rate: float,
    p99: float | None,
    batch: float | None,
    shares: tuple[tuple[str, float], ...],
    *clients: ClientFigures,
) -> RequestFigures:
    return RequestFigures(
        rate_per_s=rate, failure_rate_per_s=0.0, latency_p50_ms=None, latency_p99_ms=p99,
        in_flight=0, queued=0, batch_size_mean=batch, class_shares=shares, clients=clients,
    )  # fmt: skip


def test_a_services_figures_over_its_replicas() -> None:
    busy = figures(
        30.0, 12.0, 4.0, (("critical", 1.0),),
        ClientFigures("cam-1", 20.0, 0.0, 12.0), ClientFigures("cam-2", 10.0, 2.0, None),
    )  # fmt: skip
    quiet = figures(
        10.0, 40.0, 2.0, (("best-effort", 1.0),),
        ClientFigures("cam-2", 1.0, 0.0, 40.0), ClientFigures("cam-3", 9.0, 0.0, 5.0),
    )  # fmt: skip
    unbatched = figures(0.0, None, None, ())
    load = _service_load([("d-1", busy), ("d-2", quiet), ("d-3", unbatched)])
    assert load.request_rate == 40.0
    assert load.latency_p99_ms == 40.0  # the worst replica's
    assert load.batch_size_mean == 3.5  # (30 x 4 + 10 x 2) / 40
    assert load.class_shares == {"best-effort": 0.25, "critical": 0.75}
    # cam-2 was on both (a switch): its calls summed, its worst p99, the replica it used most.
    assert [
        (c["client_id"], c["deployment_id"], c["request_rate"], c["refused_rate"],
         c["latency_p99_ms"])
        for c in _busiest(load.clients)
    ] == [
        ("cam-1", "d-1", 20.0, 0.0, 12.0),
        ("cam-2", "d-1", 11.0, 2.0, 40.0),
        ("cam-3", "d-2", 9.0, 0.0, 5.0),
    ]  # fmt: skip


def test_a_service_without_figures_has_none() -> None:
    load = _service_load([])
    assert (load.request_rate, load.latency_p99_ms, load.batch_size_mean) == (None, None, None)
    assert (load.class_shares, load.clients) == ({}, {})
    # Idle replicas that batched before: a plain mean, not a division by zero.
    idle = _service_load(
        [("d-1", figures(0.0, None, 2.0, ())), ("d-2", figures(0.0, None, 4.0, ()))]
    )
    assert (idle.request_rate, idle.batch_size_mean) == (0.0, 3.0)
