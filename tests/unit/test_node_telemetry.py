"""The node's telemetry arithmetic: counters into figures over an interval, histogram
quantiles, the runtime's metrics page read, and a process's cgroup found and read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node_daemon.runtimes import cgroups
from node_daemon.telemetry import (
    CpuCounters,
    RuntimeCounters,
    cpu_figures,
    histogram_quantile,
    parse_runtime_metrics,
    request_figures,
)

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
