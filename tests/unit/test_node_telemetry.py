"""The node's telemetry: counters into figures over an interval, histogram quantiles, the
runtime's metrics page read and scraped (a dead endpoint leaves the figures out), its
batching figures read from the runtime's own page and carried to the broker, a
process's cgroup found and read, the usage message, and an NVML node's live GPU figures."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from broker.rpc.convert import node_sample_from_proto
from node_daemon import telemetry
from node_daemon.agent import NodeAgent
from node_daemon.inventory import (
    Gpu,
    Inventory,
    InventoryUnavailable,
    Link,
    LinkKind,
    NvmlLiveGpus,
    RawGpuUsage,
)
from node_daemon.model_cache import ModelCache
from node_daemon.resources import ResizeEvent, ResourceManager
from node_daemon.rpc import convert
from node_daemon.runtimes import ProcessRuntime, ReplicaStats, cgroups
from node_daemon.telemetry import (
    MAX_CLIENT_FIGURES,
    ClassFigures,
    ClientCounters,
    CpuCounters,
    NodeSample,
    ReplicaInfo,
    ReplicaSample,
    RequestFigures,
    RuntimeCounters,
    Telemetry,
    cpu_figures,
    histogram_quantile,
    parse_runtime_metrics,
    request_figures,
)
from protos.offload.v1 import node_pb2 as npb
from runtime.metrics import RuntimeMetrics

PAGE = """\
# TYPE offload_runtime_requests_total counter
offload_runtime_requests_total{model="a"} 90.0
offload_runtime_requests_total{model="b"} 10.0
# TYPE offload_runtime_request_failures_total counter
offload_runtime_request_failures_total{code="INVALID_ARGUMENT",model="a"} 4.0
# TYPE offload_runtime_request_duration_seconds histogram
offload_runtime_request_duration_seconds_bucket{le="0.001",model="a"} 50.0
offload_runtime_request_duration_seconds_bucket{le="0.01",model="a"} 89.0
offload_runtime_request_duration_seconds_bucket{le="+Inf",model="a"} 90.0
offload_runtime_request_duration_seconds_bucket{le="0.001",model="b"} 0.0
offload_runtime_request_duration_seconds_bucket{le="0.01",model="b"} 10.0
offload_runtime_request_duration_seconds_bucket{le="+Inf",model="b"} 10.0
# TYPE offload_runtime_in_flight gauge
offload_runtime_in_flight{model="a"} 2.0
# TYPE offload_runtime_queued gauge
offload_runtime_queued{model="a"} 1.0
"""


def test_the_metrics_page_sums_over_models() -> None:
    counters = parse_runtime_metrics(PAGE)
    assert (counters.requests, counters.failures) == (100.0, 4.0)
    assert counters.latency_buckets == ((0.001, 50.0), (0.01, 99.0), (float("inf"), 100.0))
    assert (counters.in_flight, counters.queued) == (2.0, 1.0)
    with pytest.raises(ValueError):
        parse_runtime_metrics("offload_runtime_requests_total{model=oops 1\n")


def test_the_parser_reads_what_prometheus_clients_reads_of_a_shared_replicas_page() -> None:
    # The runtime's own page, 64 clients with calls and refusals: the figures equal those
    # summed from prometheus_client's parser, which the hand-written one replaced for speed.
    metrics = RuntimeMetrics()
    model = metrics.for_model("mlp")
    clients = [f"client-{i:02d}" for i in range(64)]
    model.use_clients(clients)
    for i, client in enumerate(clients):
        model.client_answered(client, "OK", 0.0002 * (i + 1))
        if i % 3 == 0:
            model.client_answered(client, "RESOURCE_EXHAUSTED", 0.0001)
    model.observe_batch("critical", 2, 0.003, [0.0001, 0.002])
    model.observe_batch("best-effort", 1, 0.001, [0.05])
    page = runtime_page(metrics)
    ours = parse_runtime_metrics(page)
    theirs: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "offload_runtime_client_request_duration_seconds_bucket":
                buckets = theirs.setdefault(sample.labels["client"], {})
                buckets[float(sample.labels["le"])] = sample.value
    assert set(ours.clients) == set(clients) == set(theirs)
    for client in clients:
        assert ours.clients[client].latency_buckets == tuple(sorted(theirs[client].items()))
    assert ours.clients["client-03"].requests == 2 and ours.clients["client-03"].refused == 1
    assert ours.clients["client-04"].refused == 0
    assert dict(ours.class_compute_s) == {"critical": 0.003, "best-effort": 0.001}
    assert (ours.batches, ours.batch_rows) == (2.0, 3.0)


def test_the_parser_takes_escapes_and_timestamps_and_skips_series_it_does_not_read() -> None:
    page = (
        "# HELP offload_runtime_requests_total a \\ help\n line\n"
        'offload_runtime_requests_total{model="a \\"quoted\\", b"} 3 1700000000000\n'
        'offload_runtime_class_requests_total{class="critical",model="m",} 2.5\n'
        "offload_runtime_in_flight 4\n"
        "some_other_series{this is not parsed at all\n"
        "offload_runtime_client_compute_seconds_total{broken\n"
    )
    counters = parse_runtime_metrics(page)
    assert counters.requests == 3.0 and counters.in_flight == 4.0
    assert counters.class_requests == (("critical", 2.5),)


@pytest.mark.parametrize(
    "line",
    [
        'offload_runtime_requests_total{model="a"} many',
        'offload_runtime_requests_total{model="a} 1',
        "offload_runtime_requests_total{model=a} 1",
        'offload_runtime_requests_total{model="a"}',
        'offload_runtime_class_compute_seconds_total{model="m"} 1',
        'offload_runtime_request_duration_seconds_bucket{le="soon",model="m"} 1',
    ],
)
def test_a_series_the_node_reads_that_does_not_parse_is_a_value_error(line: str) -> None:
    with pytest.raises(ValueError):
        parse_runtime_metrics(line + "\n")


def test_a_line_read_before_is_read_again_with_its_new_value_and_a_bad_one_still_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(telemetry, "_known", {})
    head = 'offload_runtime_class_requests_total{class="critical",model="m"}'
    assert parse_runtime_metrics(f"{head} 2\n").class_requests == (("critical", 2.0),)
    assert head in telemetry._known
    assert parse_runtime_metrics(f"{head} 7.5\n").class_requests == (("critical", 7.5),)
    # With a timestamp after it, the value is still the one before the timestamp.
    assert parse_runtime_metrics(f"{head} 3 1700000000000\n").class_requests == (
        ("critical", 3.0),
    )
    with pytest.raises(ValueError, match="many"):
        parse_runtime_metrics(f"{head} many\n")


def test_the_lines_kept_are_bounded_and_the_figures_the_same_past_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metrics = RuntimeMetrics()
    model = metrics.for_model("mlp")
    model.use_clients([f"client-{i:02d}" for i in range(8)])
    for i in range(8):
        model.client_answered(f"client-{i:02d}", "OK", 0.001 * i)
    page = runtime_page(metrics)
    monkeypatch.setattr(telemetry, "_known", {})
    unbounded = parse_runtime_metrics(page)
    monkeypatch.setattr(telemetry, "KNOWN_LINES", 10)
    monkeypatch.setattr(telemetry, "_known", {})
    for _ in range(3):
        assert parse_runtime_metrics(page) == unbounded
        assert 0 < len(telemetry._known) <= 10


def test_quantiles_are_bucket_upper_bounds() -> None:
    buckets = ((0.001, 50.0), (0.01, 99.0), (float("inf"), 100.0))
    assert histogram_quantile(0.5, buckets) == 0.001
    assert histogram_quantile(0.99, buckets) == 0.01
    # In the +Inf bucket: the highest finite bound, not infinity.
    assert histogram_quantile(1.0, buckets) == 0.01
    assert histogram_quantile(0.5, ((0.001, 0.0), (float("inf"), 0.0))) == 0.0


def test_request_figures_are_over_the_interval_and_survive_a_runtime_restart() -> None:
    before = RuntimeCounters(100, 4, ((0.001, 50), (0.01, 99), (float("inf"), 100)), (), 0, 0)
    now = RuntimeCounters(300, 4, ((0.001, 50), (0.01, 298), (float("inf"), 300)), (), 3, 1)
    figures = request_figures(before, now, 2.0)
    assert (figures.rate_per_s, figures.failure_rate_per_s) == (100.0, 0.0)
    # The interval's 200 requests all took 1..10 ms: the earlier fast ones do not count.
    assert (figures.latency_p50_ms, figures.latency_p99_ms) == (10.0, 10.0)
    assert (figures.in_flight, figures.queued, figures.requests_total) == (3, 1, 300)
    restarted = RuntimeCounters(20, 0, ((0.001, 20), (float("inf"), 20)), (), 0, 0)
    assert request_figures(now, restarted, 1.0).rate_per_s == 20.0


def runtime_page(metrics: RuntimeMetrics) -> str:
    """The runtime's /metrics page as its endpoint serves it."""
    return generate_latest(metrics.registry).decode()


def test_batching_figures_are_read_from_the_runtimes_own_page_over_the_interval() -> None:
    metrics = RuntimeMetrics()
    model = metrics.for_model("mlp")
    metrics.for_model("idle")  # a model that never batched: its zeros change nothing
    model.observe_batch("critical", 1, 0.002, [0.0001])
    before = parse_runtime_metrics(runtime_page(metrics))
    assert (before.batches, before.batch_rows) == (1.0, 1.0)
    # The interval: three critical batches of 4 rows (6 ms of compute) and one best-effort
    # batch of 8 (2 ms); the 20 requests waited 0.2 ms, but one of them 3 ms.
    for _ in range(3):
        model.observe_batch("critical", 4, 0.002, [0.0002] * 4)
    model.observe_batch("best-effort", 8, 0.002, [0.0002] * 7 + [0.003])
    now = parse_runtime_metrics(runtime_page(metrics))
    assert now.class_compute_s == (("best-effort", 0.002), ("critical", 0.008))
    figures = request_figures(before, now, 2.0)
    assert figures.batch_size_mean == 5.0  # 20 rows in 4 batches; the earlier 1 not counted
    assert figures.queue_delay_p99_ms == 5.0  # the 3 ms wait, in the 2.5..5 ms bucket
    assert [(c.name, round(c.compute_share, 6), c.requests_per_s) for c in figures.classes] == [
        ("best-effort", 0.25, 4.0),
        ("critical", 0.75, 6.0),
    ]
    # An interval without batches (an idle replica, or a model that does not batch).
    quiet = request_figures(now, now, 2.0)
    assert (quiet.batch_size_mean, quiet.queue_delay_p99_ms, quiet.classes) == (0.0, 0.0, ())
    # A runtime older than batching: no such series at all.
    assert request_figures(parse_runtime_metrics(PAGE), parse_runtime_metrics(PAGE), 1.0) == (
        replace(quiet, in_flight=2, queued=1, requests_total=100, failures_total=4)
    )


def test_batching_figures_reach_the_broker_through_the_usage_message() -> None:
    figures = RequestFigures(
        40.0, 0.0, 2.5, 5.0, 1.0, 3, 2, 400, 0, batch_size_mean=5.0, queue_delay_p99_ms=5.0,
        classes=(ClassFigures("best-effort", 0.25, 4.0), ClassFigures("critical", 0.75, 6.0)),
    )  # fmt: skip
    sample = NodeSample(
        at=1.0, interval_s=1.0, cpu_cores=2.0, gpus=(),
        replicas=(ReplicaSample("r-1", "dep-1", 3, 0.5, 0.25, 2.0, 0.5, 0.4, 0.0, 300, figures),),
    )  # fmt: skip
    wire = npb.UsageResponse.FromString(convert.usage(sample).SerializeToString())
    (replica,) = node_sample_from_proto(wire).replicas
    assert replica.requests is not None
    assert (replica.requests.batch_size_mean, replica.requests.queue_delay_p99_ms) == (5.0, 5.0)
    assert replica.requests.class_shares == (("best-effort", 0.25), ("critical", 0.75))
    # Without batches in the interval: none shown, not a batch size of 0.
    quiet = replace(sample, replicas=(replace(sample.replicas[0], requests=replace(
        figures, batch_size_mean=0.0, queue_delay_p99_ms=0.0, classes=()
    )),))  # fmt: skip
    (replica,) = node_sample_from_proto(convert.usage(quiet)).replicas
    assert replica.requests is not None
    assert (replica.requests.batch_size_mean, replica.requests.class_shares) == (None, ())


def test_cpu_figures_need_two_readings() -> None:
    first = CpuCounters(cpu_seconds=10.0, throttled_periods=5, periods=100)
    assert cpu_figures(None, first, 1.0) == (0.0, 0.0)
    later = CpuCounters(cpu_seconds=11.5, throttled_periods=15, periods=120)
    assert cpu_figures(first, later, 2.0) == (0.75, 0.5)
    assert cpu_figures(first, first, 1.0) == (0.0, 0.0)


def test_a_process_cgroup_is_found_from_proc(tmp_path: Path) -> None:
    dirs = cgroups.cgroup_dirs(os.getpid())
    assert dirs, "every process is in some cgroup"
    assert cgroups.cgroup_dirs(2**22 + 12345) == {}  # no such process
    # A fake hierarchy at this process's cgroup path, read through `root`: v1 where the
    # machine has a v1 cpu controller, else v2.
    pid = os.getpid()
    if "cpu" in dirs:
        relative = dirs["cpu"].relative_to(cgroups.ROOT / "cpu")
        cpu, acct = tmp_path / "cpu" / relative, tmp_path / "cpuacct" / relative
        for d in (cpu, acct):
            d.mkdir(parents=True)
        (cpu / "cpu.stat").write_text("nr_periods 40\nnr_throttled 10\nthrottled_time 5\n")
        (cpu / "cpu.cfs_quota_us").write_text("50000\n")
        (cpu / "cpu.cfs_period_us").write_text("100000\n")
        (acct / "cpuacct.usage").write_text("2500000000\n")
        unlimited = (cpu / "cpu.cfs_quota_us", "-1\n")
    else:
        (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
        v2 = tmp_path / dirs[""].relative_to(cgroups.ROOT)
        v2.mkdir(parents=True, exist_ok=True)
        (v2 / "cpu.stat").write_text("usage_usec 2500000\nnr_periods 40\nnr_throttled 10\n")
        (v2 / "cpu.max").write_text("50000 100000\n")
        unlimited = (v2 / "cpu.max", "max 100000\n")
    assert cgroups.cpu_accounting(pid, tmp_path) == cgroups.CpuAccounting(2.5, 40, 10, 0.5)
    unlimited[0].write_text(unlimited[1])
    read = cgroups.cpu_accounting(pid, tmp_path)
    assert read is not None and read.limit_cores == 0.0


PAGE_LATER = (
    PAGE.replace(
        'offload_runtime_requests_total{model="a"} 90.0',
        'offload_runtime_requests_total{model="a"} 110.0',
    )
    .replace(
        'offload_runtime_request_duration_seconds_bucket{le="0.01",model="a"} 89.0',
        'offload_runtime_request_duration_seconds_bucket{le="0.01",model="a"} 109.0',
    )
    .replace(
        'offload_runtime_request_duration_seconds_bucket{le="+Inf",model="a"} 90.0',
        'offload_runtime_request_duration_seconds_bucket{le="+Inf",model="a"} 110.0',
    )
)


@contextlib.asynccontextmanager
async def metrics_server(pages: list[str]) -> AsyncIterator[str]:
    """A runtime's metrics endpoint answering `pages` in turn (the last one from then on);
    yields its host:port."""

    async def metrics(request: web.Request) -> web.Response:
        page = pages.pop(0) if len(pages) > 1 else pages[0]
        return web.Response(text=page, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def info(replica_id: str, endpoint: str = "") -> ReplicaInfo:
    return ReplicaInfo(replica_id, f"dep-{replica_id}", 3, 0.5, 0.25, 2.0, endpoint)


async def test_a_sample_turns_two_readings_into_figures_and_a_dead_endpoint_into_none() -> None:
    telemetry = Telemetry(cpu_cores=2.0)
    try:
        async with metrics_server([PAGE, PAGE_LATER]) as endpoint:
            # A port nothing listens on: that replica has no request figures, and the
            # sample goes on.
            with socket.socket() as free:
                free.bind(("127.0.0.1", 0))
                dead = f"127.0.0.1:{free.getsockname()[1]}"
            replicas = [info("a", endpoint), info("b", dead), info("c")]
            first = await telemetry.sample(
                [(r, ReplicaStats(10.0, 100, 10, 1, 0.5)) for r in replicas], ()
            )
            assert first.interval_s == 0
            assert [r.requests for r in first.replicas] == [None, None, None]
            assert first.cpu_used_cores == 0  # nothing to take a difference from
            await asyncio.sleep(0.2)
            second = await telemetry.sample(
                [
                    (replicas[0], ReplicaStats(10.2, 120, 30, 6, 0.5)),
                    (replicas[1], None),  # not readable now
                    (replicas[2], ReplicaStats(10.0, 100, 10, 1, 0.5)),
                ],
                (),
            )
    finally:
        await telemetry.close()
    a, b, c = second.replicas
    assert second.interval_s > 0.15
    assert a.cpu_used_cores == pytest.approx(0.2 / second.interval_s)
    assert a.throttled_ratio == pytest.approx(0.25)  # 5 of the interval's 20 periods
    assert (a.cpu_limit, a.memory_used_mib, a.priority, a.cpus_min) == (0.5, 120, 3, 0.25)
    assert a.requests is not None
    assert a.requests.rate_per_s == pytest.approx(20 / second.interval_s)
    assert (a.requests.latency_p50_ms, a.requests.latency_p99_ms) == (10.0, 10.0)
    assert (a.requests.in_flight, a.requests.queued) == (2, 1)
    assert b.requests is None and (b.cpu_used_cores, b.cpu_limit, b.memory_used_mib) == (0, 0, 0)
    assert c.requests is None and c.cpu_used_cores == 0
    assert second.cpu_used_cores == pytest.approx(a.cpu_used_cores)
    assert second.memory_used_mib == 220
    assert second.cpu_cores == 2.0 and second.memory_total_mib > 0
    assert telemetry.latest is second


def test_the_usage_message_carries_the_sample_and_the_resizes() -> None:
    telemetry_sample = NodeSample(
        at=1.0, interval_s=1.0, cpu_cores=2.0, gpus=(), memory_total_mib=4096,
        replicas=(
            ReplicaSample("r-1", "dep-1", 3, 0.5, 0.25, 2.0, 0.75, 0.6, 0.4, 300, None),
        ),
    )  # fmt: skip
    message = convert.usage(telemetry_sample)
    assert (message.node.cpu_cores, message.node.cpu_used_cores) == (2.0, 0.6)
    assert (message.node.memory_total_mib, message.node.memory_used_mib) == (4096, 300)
    (replica,) = message.replicas
    assert (replica.cpu_pct, replica.cpu_limit, replica.throttled_pct) == (60.0, 0.75, 40.0)
    assert not replica.HasField("requests")
    assert (list(message.resizes), message.resize_policy) == ([], "")

    async def apply(replica_id: str, cores: float) -> None: ...

    manager = ResourceManager("usage", apply)
    manager._events.append(ResizeEvent("run-1", "r-1", "dep-1", 0.5, 0.75, "usage", "why", 2.0))
    message = convert.usage(telemetry_sample, manager)
    assert message.resize_policy == "usage"
    assert [(e.event_id, e.cpus_before, e.cpus_after, e.reason) for e in message.resizes] == [
        ("run-1", 0.5, 0.75, "why")
    ]


GPUS = (
    Gpu(index=0, uuid="GPU-a", name="H100", memory_total_mib=81559, utilization_pct=3),
    Gpu(index=1, uuid="GPU-b", name="H100", memory_total_mib=81559, memory_used_mib=7),
)


class FakeUsage:
    """Stands in for `NvmlUsageReader`: what NVML would report now, or its failure."""

    def __init__(self) -> None:
        self.now: tuple[RawGpuUsage, ...] = ()
        self.broken = False

    def read_usage(self) -> tuple[RawGpuUsage, ...]:
        if self.broken:
            raise InventoryUnavailable("NVML failed reading the GPUs' usage (GPU is lost)")
        return self.now


def test_an_nvml_node_reads_its_gpus_figures_live() -> None:
    reader = FakeUsage()
    live = NvmlLiveGpus(GPUS, reader)
    reader.now = (RawGpuUsage("GPU-a", 2048 << 20, 87), RawGpuUsage("GPU-b", 512 << 20, None))
    a, b = live.read()
    assert (a.utilization_pct, a.memory_used_mib, a.name) == (87, 2048, "H100")
    # A figure NVML does not give stays as read at startup; so does a GPU it did not list.
    assert (b.utilization_pct, b.memory_used_mib) == (0, 512)
    reader.now = (RawGpuUsage("GPU-b", 0, 40),)
    assert live.read() == (GPUS[0], replace(GPUS[1], memory_used_mib=0, utilization_pct=40))


async def test_a_gpu_read_that_fails_leaves_the_startup_figures_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="node_daemon.agent")
    reader = FakeUsage()
    reader.now = (RawGpuUsage("GPU-a", 1 << 30, 50),)
    inventory = Inventory(gpus=GPUS, links={(0, 1): Link(LinkKind.SYS)})
    agent = NodeAgent(
        "n1", "site-a", inventory, ProcessRuntime(tmp_path), ModelCache(tmp_path / "m", 1 << 20),
        read_gpus=NvmlLiveGpus(GPUS, reader).read,
    )  # fmt: skip
    try:
        assert (await agent.usage()).gpus[0].utilization_pct == 50
        reader.broken = True
        for _ in range(3):
            assert (await agent.usage()).gpus == GPUS
        assert sum("cannot be read" in r.message for r in caplog.records) == 1
        reader.broken = False
        assert (await agent.usage()).gpus[0].utilization_pct == 50
        assert sum("read again" in r.message for r in caplog.records) == 1
    finally:
        await agent.close(stop_replicas=True)


def test_client_figures_are_read_from_the_runtimes_own_page_over_the_interval() -> None:
    metrics = RuntimeMetrics()
    model = metrics.for_model("mlp")
    model.use_clients(["cam-1", "cam-2", "cam-3"])
    model.client_answered("cam-1", "OK", 0.002)
    before = parse_runtime_metrics(runtime_page(metrics))
    # The interval (2 s): cam-1 6 answered (one slow), cam-2 2 answered and 4 refused over
    # its rate, cam-3 nothing; cam-4 joins the clients file and is answered once.
    for _ in range(5):
        model.client_answered("cam-1", "OK", 0.002)
    model.client_answered("cam-1", "OK", 0.3)
    for code in ("OK", "OK", *["RESOURCE_EXHAUSTED"] * 4):
        model.client_answered("cam-2", code, 0.0004)
    model.use_clients(["cam-1", "cam-2", "cam-3", "cam-4"])
    model.client_answered("cam-4", "OK", 0.001)
    figures = request_figures(before, parse_runtime_metrics(runtime_page(metrics)), 2.0)
    assert figures.clients_total == 4
    assert [
        (c.client_id, c.rate_per_s, c.refused_per_s, c.latency_p99_ms, c.requests_total)
        for c in figures.clients
    ] == [
        ("cam-2", 3.0, 2.0, 0.5, 6),  # as busy as cam-1, more refused: first
        ("cam-1", 3.0, 0.0, 500.0, 7),  # the 0.3 s answer is its p99 (the 0.25..0.5 bucket)
        ("cam-4", 0.5, 0.0, 1.0, 1),  # new: counted from 0
        ("cam-3", 0.0, 0.0, 0.0, 0),  # idle: no latency
    ]
    assert figures.clients[0].refused_total == 4


def test_a_sample_carries_only_the_busiest_clients() -> None:
    many = {f"c-{i:05d}": ClientCounters(requests=float(i), refused=0.0) for i in range(1, 10_001)}
    before = RuntimeCounters(0, 0, (), (), 0, 0)
    now = RuntimeCounters(0, 0, (), (), 0, 0, clients=many)
    figures = request_figures(before, now, 1.0)
    assert figures.clients_total == 10_000
    assert len(figures.clients) == MAX_CLIENT_FIGURES
    assert [c.client_id for c in figures.clients[:2]] == ["c-10000", "c-09999"]
    assert figures.clients[-1].rate_per_s == 10_001 - MAX_CLIENT_FIGURES
    # They fit one heartbeat the broker takes: the cap is the broker's too.
    sample = NodeSample(
        at=1.0, interval_s=1.0, cpu_cores=2.0, gpus=(),
        replicas=(ReplicaSample("r-1", "dep-1", 2, 0, 0, 2.0, 0, 0, 0, 300, figures),),
    )  # fmt: skip
    wire = npb.UsageResponse.FromString(convert.usage(sample).SerializeToString())
    (replica,) = node_sample_from_proto(wire).replicas
    assert replica.requests is not None
    assert replica.requests.clients_total == 10_000
    assert [(c.client_id, c.rate_per_s) for c in replica.requests.clients[:1]] == [
        ("c-10000", 10_000.0)
    ]
    assert len(replica.requests.clients) == MAX_CLIENT_FIGURES
