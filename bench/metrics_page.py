"""What the node daemon's scrape costs a shared replica and the node, by clients (issue
52's priority figure across clients).

At every heartbeat the node asks each replica for the series it reads (``?name[]=...``),
about 1,100 lines with 64 clients, most of them the clients' latency buckets. The replica
writes the page in a thread of its own, holding the GIL while its event loop waits with
the calls in flight; the node parses it on the CPUs it shares with its replicas. This
times, in this process, alternating, `--repeats` times each:

- the replica's page as it serves it (`runtime.metrics.page_app`, the per-client series
  written by `runtime.client_series`), against prometheus_client's `generate_latest` of
  the same series from the same figures (how the replica wrote them before);
- the node's parse of that page (`node_daemon.telemetry.parse_runtime_metrics`), against
  its parse of pages it has not seen before (other clients' ids: no line is known, as at
  a node's first heartbeat with a replica, and as every heartbeat was before the node
  kept the lines it had read).

Each client has calls in every latency bucket, refusals and compute; the medians are
printed.

    python -m bench.metrics_page [--quick] [--clients N] [--repeats R] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from prometheus_client import generate_latest

from node_daemon.telemetry import PARSED, RuntimeCounters, parse_runtime_metrics
from runtime.metrics import DURATION_BUCKETS_S, RuntimeMetrics, page_app


def replica_metrics(clients: int, tag: str = "") -> RuntimeMetrics:
    """A replica's metrics with `clients` clients (their ids after `tag`), each with calls
    in every latency bucket, refusals and compute, and batches of two classes."""
    metrics = RuntimeMetrics()
    model = metrics.for_model("mlp")
    ids = [f"{tag}client-{i:05d}" for i in range(clients)]
    model.use_clients(ids)
    for client in ids:
        for bound in (*DURATION_BUCKETS_S, 7.5):
            model.client_answered(client, "OK", bound)
        model.client_answered(client, "RESOURCE_EXHAUSTED", 0.0001)
        model.client_computed(client, 0.001)
    for cls in ("critical", "best-effort"):
        model.observe_batch(cls, 1, 0.0001, [0.0])
    return metrics


def _ms(work: Callable[[], object], times: int) -> float:
    started = time.perf_counter()
    for _ in range(times):
        work()
    return (time.perf_counter() - started) / times * 1000


def measure(clients: int, repeats: int, times: int) -> dict[str, float]:
    """Milliseconds a page (medians over `repeats` of `times` pages each)."""
    metrics = replica_metrics(clients)
    app = page_app(metrics)
    query = "&".join(f"name[]={name}" for name in sorted(PARSED))
    environ = {"REQUEST_METHOD": "GET", "QUERY_STRING": query, "HTTP_ACCEPT": "*/*"}

    def ours() -> bytes:
        return b"".join(app(environ, lambda status, headers, info=None: lambda data: None))

    def theirs() -> bytes:
        return generate_latest(metrics.registry.restricted_registry(PARSED))

    page = ours().decode()
    if parse_runtime_metrics(page) != parse_runtime_metrics(theirs().decode()):
        raise RuntimeError("the two pages differ in what the node reads of them")
    served: list[float] = []
    before: list[float] = []
    parsed: list[float] = []
    unseen: list[float] = []
    for repeat in range(repeats):
        served.append(_ms(ours, times))
        before.append(_ms(theirs, times))
        parsed.append(_ms(lambda: parse_runtime_metrics(page), times))
        pages = iter([replica_page(clients, f"r{repeat}p{i}-") for i in range(times)])
        unseen.append(_ms(functools.partial(_parse_next, pages), times))
    return {
        "clients": clients,
        "lines": page.count("\n"),
        "served_ms": statistics.median(served),
        "prometheus_client_ms": statistics.median(before),
        "node_parse_ms": statistics.median(parsed),
        "node_parse_unseen_ms": statistics.median(unseen),
    }


def _parse_next(pages: Iterator[str]) -> RuntimeCounters:
    return parse_runtime_metrics(next(pages))


def replica_page(clients: int, tag: str) -> str:
    """The page the node reads of `replica_metrics(clients, tag)`."""
    return generate_latest(
        replica_metrics(clients, tag).registry.restricted_registry(PARSED)
    ).decode()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.metrics_page", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="3 repeats of 5 pages (make bench)")
    parser.add_argument("--clients", type=int, default=64, help="clients of the replica (64)")
    parser.add_argument("--repeats", type=int, help="alternating repeats (7; quick 3)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    repeats = (3 if args.quick else 7) if args.repeats is None else args.repeats
    if not 0 <= args.clients <= 10_000 or not 1 <= repeats <= 1_000:
        parser.error(f"--clients 0..10,000 and --repeats 1..1,000, not {args.clients}, {repeats}")
    figures = measure(args.clients, repeats, 5 if args.quick else 20)
    print(
        f"a shared replica's page for the node, {args.clients} clients "
        f"({figures['lines']:,} lines): served in {figures['served_ms']:.2f} ms, "
        f"prometheus_client's formatting of the same {figures['prometheus_client_ms']:.2f} ms "
        f"({figures['prometheus_client_ms'] / figures['served_ms']:.1f}x); the node's parse "
        f"{figures['node_parse_ms']:.2f} ms, of a page it has not seen "
        f"{figures['node_parse_unseen_ms']:.2f} ms (medians of {repeats}, alternating)"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
