"""One replica under many clients: batching off against on, beside ONNX Runtime's ceiling.

    python -m bench.serving [--quick] [--device cpu|cuda] [--models mlp resnet18]
                            [--clients 1,4,16,64] [--kinds ours,triton] [--rounds 3]
                            [--workers 1,4]
                            [--instances K] [--json FILE]

For each model: ONNX Runtime in this process (the replica's session options: one intra-op
thread per CPU of this process, no spinning; the CUDA provider with `--device cuda`) at batch
1 and at its best batch, the ceiling; then `python -m runtime.server` replicas on loopback,
each configuration in turn:

- ``off``: `--max-batch-size 1`, each inference alone, as before batching;
- ``on``: batching on (`--max-batch-size` auto, `--max-queue-delay-us` as given);
- ``on xW`` for each W > 1 of `--workers`: W runtime processes on one port (gRPC's
  SO_REUSEPORT: the kernel spreads the clients' connections), each batching its share onto
  the same device: where one interpreter's parsing caps the throughput, this moves it.

Each configuration meets N closed-loop clients for each N of `--clients` and each client
kind of `--kinds` ("ours": the SDK's request building on grpc.aio; "triton":
tritonclient.grpc.aio), run from `bench.serving_client` processes, a connection per client.
``off`` and ``on`` run side by side in `--rounds` rounds, each with fresh replicas (a
process's own speed is drawn again each round). In a round, at each load, the clients call
off and on in turn, all on one for a phase of `--phase-seconds` and then all on the other
(off first in odd rounds, on first in even ones), until each has had its `--seconds`: the two
share every stretch of this machine's noise, which came in bursts of seconds and moved a
4-second block's ratio by up to a third. A load whose calls would take more than a tenth of
a phase (the model's compute time, from the replica's log, times the clients, times 10) gets
longer phases, and one whole block each where that is over `--seconds` (ResNet-18 on a CPU
at 16 and 64 clients). Each round's on/off ratio shows how far the figure moves by itself.
Reported per configuration, pooled over its rounds: requests/s, p50/p99/p99.9, the mean batch
(from the replica's `/metrics`), the replicas' CPU (cores), the machine's, and with NVML the
GPU's utilisation and memory. Then the priority arm, on a replica of its own ("on"'s flags): 4
critical clients alone, then among best-effort clients that saturate the replica (60, 12 with
--quick), each block `--priority-seconds` long, the critical clients in a load process of their
own, the best-effort ones running `OUTLAST_S` past them; with `--pin-priority` (the default,
with 2 CPUs or more) the replica on half of this machine's CPUs and the clients on the other
half. Reported: the critical p99 beside its p99 alone (p50s and rates too), every best-effort
client's answers (none starved), and, from the replica's /metrics over the critical clients'
block, each class's share of compute and the best-effort calls a second.

The verdict lines compare what issue 48 asks: 1-client p50 on/off, throughput at 16 and 64
clients on/off (with two rounds or more, each round's ratio and the pooled ratio's 95 %
interval over the rounds: where it holds 1, the run cannot tell on from off), the p99
batching adds (on minus off at the same load: a saturated replica queues either way)
against `--max-queue-delay-us` plus one batch's compute, the priority ratio. `--device cuda`
runs the same on a machine with an NVIDIA GPU and onnxruntime-gpu, unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnxruntime as ort

import modelzoo
from bench.timing import paired_bootstrap, tail_percentiles
from node_daemon.server import split_cpus
from node_daemon.telemetry import histogram_quantile

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-serving-token"
CRITICAL_TOKEN = "bench-serving-critical"
BEST_EFFORT_TOKEN = "bench-serving-best-effort"
CRITICAL_CLIENTS = 4
PRIORITY_RATIO_TARGET = 1.5
OUTLAST_S = 1.0
"""Seconds the priority arm's best-effort clients run past the critical ones."""
PHASE_CALLS = 10
"""A phase of off/on in turn lasts at least this many of one client's calls at the load,
estimated as the clients times the model's compute time: a call in flight at a switch is
answered where it was sent, so a phase much longer than a call keeps the two apart."""
START_MARGIN_S = 2.0
"""Seconds between writing a block's specs and its start: every client process connected
and warm by then."""
READY_TIMEOUT_S = 300.0


@dataclass
class Servers:
    """The runtime processes of one configuration, on one port."""

    name: str
    model: str
    endpoint: str
    processes: list[asyncio.subprocess.Process]
    metrics: list[str]
    logs: list[Path]
    batching: bool
    client_cpus: frozenset[int] | None = None
    """The CPUs its clients run on, apart from the replica's (`--pin-priority`); None: any."""


@dataclass
class Block:
    config: str
    kind: str
    clients: int
    rate: float
    latency: dict[str, float]
    failures: dict[str, int]
    mean_batch: float
    server_cores: float
    machine_cores: float
    gpu_util: float | None = None
    gpu_mem_mib: float | None = None
    per_client: list[list[float]] = field(default_factory=list, repr=False)
    scrape: dict[str, float] = field(default_factory=dict, repr=False)
    seconds: float = 0.0
    """How long the clients ran."""
    rounds: list[tuple[float, float]] = field(default_factory=list)
    """(requests/s, p50 ms) of each round pooled here (`merge_rounds`)."""
    parts: list[Block] = field(default_factory=list, repr=False)
    """The rounds' blocks pooled here (`merge_rounds`), for the verdicts' intervals."""


def merge_rounds(rounds: Sequence[Block]) -> Block:
    """One configuration's blocks at one load, one per round, as one: latencies pooled,
    requests/s and cores over the rounds' whole time, the replica's counters summed."""
    first = rounds[0]
    seconds = sum(b.seconds for b in rounds)
    scraped: dict[str, float] = {}
    for block in rounds:
        for key, value in block.scrape.items():
            scraped[key] = scraped.get(key, 0.0) + value
    per_client = [samples for b in rounds for samples in b.per_client]
    pooled = [v for samples in per_client for v in samples]
    failures: dict[str, int] = {}
    for block in rounds:
        for name, count in block.failures.items():
            failures[name] = failures.get(name, 0) + count
    utils = [b.gpu_util for b in rounds if b.gpu_util is not None]
    mems = [b.gpu_mem_mib for b in rounds if b.gpu_mem_mib is not None]

    def over_time(value: Callable[[Block], float]) -> float:
        return sum(value(b) * b.seconds for b in rounds) / seconds if seconds else 0.0

    return Block(
        config=first.config,
        kind=first.kind,
        clients=first.clients,
        rate=len(pooled) / seconds if seconds else 0.0,
        latency=tail_percentiles(pooled) if pooled else {},
        failures=failures,
        mean_batch=_mean_batch(scraped),
        server_cores=over_time(lambda b: b.server_cores),
        machine_cores=over_time(lambda b: b.machine_cores),
        gpu_util=statistics.mean(utils) if utils else None,
        gpu_mem_mib=max(mems) if mems else None,
        per_client=per_client,
        scrape=scraped,
        seconds=seconds,
        rounds=[(b.rate, b.latency.get("p50", 0.0)) for b in rounds],
        parts=list(rounds),
    )


# ---- the ceiling -----------------------------------------------------------------------


def providers(device: str) -> list[str]:
    if device == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise SystemExit("--device cuda: this onnxruntime has no CUDA execution provider")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def ort_ceiling(
    model: Path, feeds: dict[str, np.ndarray], device: str, batches: Sequence[int], seconds: float
) -> dict[int, float]:
    """Inferences per second of ONNX Runtime in this process at each batch size."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = len(os.sched_getaffinity(0))
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(model), options, providers=providers(device))
    rates = {}
    for batch in batches:
        batched = {k: np.concatenate([v] * batch) for k, v in feeds.items()}
        session.run(None, batched)
        runs = 0
        started = time.perf_counter()
        while runs < 2 or time.perf_counter() - started < seconds:
            session.run(None, batched)
            runs += 1
        rates[batch] = runs * batch / (time.perf_counter() - started)
    return rates


# ---- the replicas ----------------------------------------------------------------------


def _pinned(cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """A child's `preexec_fn` keeping it (and the threads it starts) on `cpus`."""
    if cpus is None:
        return None
    return functools.partial(os.sched_setaffinity, 0, cpus)


def replica_and_client_cpus() -> tuple[frozenset[int], frozenset[int]] | None:
    """This process's CPUs in two halves, the replica's and its clients', as a server and
    its devices are apart; None with fewer than 2."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        return None
    replica, clients = split_cpus(cpus, 2)
    return replica, clients


def _write_tokens(workdir: Path) -> Path:
    """The deployment's token file and the class tokens' (returned) in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "token").write_text(TOKEN)
    classes = workdir / "class-tokens"
    classes.write_text(f"critical {CRITICAL_TOKEN}\nbest-effort {BEST_EFFORT_TOKEN}\n")
    classes.chmod(0o600)
    return classes


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


async def _wait_for(log: Path, process: asyncio.subprocess.Process, pattern: str) -> str:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        text = _read(log)
        if re.search(pattern, text):
            return text
        if process.returncode is not None:
            break
        await asyncio.sleep(0.1)
    tail = "\n".join(_read(log).splitlines()[-20:])
    raise SystemExit(f"a runtime did not get to {pattern!r}:\n{tail}")


async def stop_servers(servers: Servers) -> None:
    for process in servers.processes:
        if process.returncode is None:
            process.terminate()
    for process in servers.processes:
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()


@contextlib.asynccontextmanager
async def serving(
    name: str,
    model: Path,
    workdir: Path,
    workers: int,
    flags: Sequence[str],
    cpus: tuple[frozenset[int], frozenset[int]] | None = None,
) -> AsyncIterator[Servers]:
    """`workers` runtime processes on one port, each ready (SystemExit with its log's tail
    when one does not become ready), stopped on exit, those started before a failure too.
    `cpus`: the replicas' CPUs and their clients' (`--pin-priority`); None: any."""
    classes = _write_tokens(workdir)
    port = 0
    servers = Servers(
        name, model.stem, "", [], [], [], batching=False, client_cpus=cpus and cpus[1]
    )
    try:
        for index in range(workers):
            log = workdir / f"runtime-{index}.log"
            with log.open("wb") as out:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "runtime.server", "--model", str(model),
                    "--name", model.stem, "--host", "127.0.0.1", "--port", str(port),
                    "--metrics-port", "0", "--token-file", str(workdir / "token"),
                    "--class-tokens", str(classes), *flags,
                    stdout=out, stderr=out, cwd=REPO_ROOT,
                    preexec_fn=_pinned(cpus and cpus[0]),
                )  # fmt: skip
            servers.processes.append(process)
            servers.logs.append(log)
            text = await _wait_for(log, process, r"listening on \S+:(\d+)")
            port = int(re.search(r"listening on \S+:(\d+)", text).group(1))  # type: ignore[union-attr]
            servers.metrics.append(re.search(r"metrics served at (\S+)", text).group(1))  # type: ignore[union-attr]
        servers.endpoint = f"127.0.0.1:{port}"
        for log, process in zip(servers.logs, servers.processes, strict=True):
            text = await _wait_for(log, process, r" ready provider=")
            servers.batching = "batches: up to" in text
        yield servers
    finally:
        await stop_servers(servers)


_SAMPLE = re.compile(r"^(offload_runtime_\w+)\{([^}]*)\} (\S+)$", re.M)


def scrape(urls: Sequence[str]) -> dict[str, float]:
    """Every `offload_runtime_*` series of these pages, summed across them, by
    `name{labels}`."""
    totals: dict[str, float] = {}
    for url in urls:
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        for name, labels, value in _SAMPLE.findall(page):
            key = f"{name}{{{labels}}}"
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def _mean_batch(scraped: dict[str, float]) -> float:
    """Rows per batch from the change of a replica's batch-size histogram (1.0: none)."""
    batches = _delta({}, scraped, "offload_runtime_batch_size_count")
    return _delta({}, scraped, "offload_runtime_batch_size_sum") / batches if batches else 1.0


def _delta(before: dict[str, float], after: dict[str, float], prefix: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix))


def _cpu_seconds(pids: Sequence[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _machine_busy_seconds() -> float:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


class GpuSampler:
    """NVML's GPU utilisation and memory in use, sampled every 100 ms in a thread; nothing
    without NVML."""

    def __init__(self) -> None:
        self._handle: Any = None
        self._util: list[float] = []
        self._mem: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml: Any = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML here: the CPU columns only
            self._handle = None

    def __enter__(self) -> GpuSampler:
        if self._handle is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self._util.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            self._mem.append(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20)

    def figures(self) -> tuple[float | None, float | None]:
        if not self._util:
            return None, None
        return statistics.mean(self._util), max(self._mem)


# ---- the load --------------------------------------------------------------------------


async def run_block(
    servers: Servers,
    kind: str,
    shares: Sequence[Sequence[str]],
    seconds: float,
    inputs: Path,
    workdir: Path,
    outlast_s: float = 0.0,
) -> Block:
    """`run_blocks` on one configuration."""
    (block,) = await run_blocks([servers], kind, shares, seconds, 0.0, inputs, workdir, outlast_s)
    return block


async def run_blocks(
    running: Sequence[Servers],
    kind: str,
    shares: Sequence[Sequence[str]],
    seconds: float,
    phase_s: float,
    inputs: Path,
    workdir: Path,
    outlast_s: float = 0.0,
) -> list[Block]:
    """Closed-loop clients, one per token, from one client process per share at once, on
    each of `running` for `seconds` in all: in turn, in phases of about `phase_s`
    (`bench.serving_client`), so that each configuration's block has its share of every
    stretch of the machine's noise. A block's replica figures (requests, batches, its CPU)
    are its own; the machine's cores are the pair's. With `outlast_s` (one configuration),
    the processes after the first run that much longer, and the replica's figures
    (`Block.scrape`) are of the first's `seconds` alone: the load around the first share's
    clients holds until they stop, and its queue's drain after is not counted."""
    tokens = [t for share in shares for t in share]
    start_at = time.time() + START_MARGIN_S + 0.02 * len(tokens)
    children = []
    outs = []
    for index, share in enumerate(shares):
        spec = {
            "endpoints": [s.endpoint for s in running], "model": running[0].model,
            "inputs": str(inputs), "kind": kind, "tokens": share, "seconds": seconds,
            "phase_s": phase_s, "outlast_s": outlast_s if index else 0.0,
            "start_at": start_at, "timeout_s": 60,
        }  # fmt: skip
        spec_file = workdir / f"client-{index}.json"
        spec_file.write_text(json.dumps(spec))
        out = workdir / f"client-{index}.out.json"
        outs.append(out)
        children.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.serving_client",
                str(spec_file),
                str(out),
                cwd=REPO_ROOT,
                preexec_fn=_pinned(running[0].client_cpus),
            )
        )
    await asyncio.sleep(max(0.0, start_at - time.time()))
    pids = [[p.pid for p in servers.processes] for servers in running]
    scrape_before = await asyncio.to_thread(_scrape_each, running)
    cpu_before = [_cpu_seconds(each) for each in pids]
    machine_before, wall_before = _machine_busy_seconds(), time.perf_counter()
    with GpuSampler() as gpu:
        if outlast_s:
            await asyncio.sleep(seconds)
            scrape_after = await asyncio.to_thread(_scrape_each, running)
        codes = [await child.wait() for child in children]
    wall = time.perf_counter() - wall_before
    cpu_after = [_cpu_seconds(each) for each in pids]
    machine_cores = (_machine_busy_seconds() - machine_before) / wall
    if not outlast_s:
        scrape_after = await asyncio.to_thread(_scrape_each, running)
    if any(codes):
        names = "/".join(s.name for s in running)
        raise SystemExit(f"a client process of {names}/{kind} exited with {codes}")
    results = [json.loads(out.read_text()) for out in outs]
    util, mem = gpu.figures()
    blocks = []
    for at, servers in enumerate(running):
        per_client: list[list[float]] = []
        failures: dict[str, int] = {}
        took = 0.0
        for result in results:
            per_client += result["latencies_ms"][at]
            took = max(took, result["seconds"][at])
            for kinds in result["failures"][at]:
                for name, count in kinds.items():
                    failures[name] = failures.get(name, 0) + count
        pooled = [v for client in per_client for v in client]
        own = _kept(scrape_before[at], scrape_after[at])
        blocks.append(
            Block(
                config=servers.name,
                kind=kind,
                clients=len(tokens),
                rate=len(pooled) / took if took else 0.0,
                latency=tail_percentiles(pooled) if pooled else {},
                failures=failures,
                mean_batch=_mean_batch(own),
                server_cores=(cpu_after[at] - cpu_before[at]) / took if took else 0.0,
                machine_cores=machine_cores,
                gpu_util=util,
                gpu_mem_mib=mem,
                per_client=per_client,
                scrape=own,
                seconds=took,
            )
        )
    return blocks


_KEPT = ("class_compute", "class_requests", "queue_delay", "compute_duration", "batch_size")
"""The replica series a block keeps (their change over the block)."""


def _scrape_each(running: Sequence[Servers]) -> list[dict[str, float]]:
    return [scrape(servers.metrics) for servers in running]


def _kept(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        key: value - before.get(key, 0.0)
        for key, value in after.items()
        if any(name in key for name in _KEPT)
    }


def client_shares(tokens: Sequence[str], asked: int | None) -> list[list[str]]:
    """`tokens` split over the load processes: as many as asked, else one per four CPUs of
    this machine (at least one, at most one per client)."""
    clients = len(tokens)
    if asked:
        processes = max(1, min(asked, clients))
    else:
        processes = max(1, min(clients, (os.cpu_count() or 2) // 4))
    return [list(tokens[i::processes]) for i in range(processes)]


# ---- what the figures say --------------------------------------------------------------


def queue_delay_p99_s(scraped: dict[str, float]) -> float | None:
    """The p99 of the requests' queue delay, as the upper bound of the histogram bucket it
    falls in (the replicas' `offload_runtime_queue_delay_seconds`)."""
    buckets: dict[float, float] = {}
    for key, value in scraped.items():
        match = re.match(r'offload_runtime_queue_delay_seconds_bucket\{.*le="([^"]+)"', key)
        if match:
            bound = math.inf if match.group(1) == "+Inf" else float(match.group(1))
            buckets[bound] = buckets.get(bound, 0.0) + value
    if not buckets.get(math.inf):
        return None
    return histogram_quantile(0.99, sorted(buckets.items()))


def batch_compute_s(scraped: dict[str, float]) -> float | None:
    count = sum(
        v
        for k, v in scraped.items()
        if k.startswith("offload_runtime_compute_duration_seconds_count")
    )
    total = sum(
        v
        for k, v in scraped.items()
        if k.startswith("offload_runtime_compute_duration_seconds_sum")
    )
    return total / count if count else None


def class_shares(scraped: dict[str, float]) -> dict[str, float]:
    used: dict[str, float] = {}
    for key, value in scraped.items():
        match = re.match(r'offload_runtime_class_compute_seconds_total\{.*class="([^"]+)"', key)
        if match:
            used[match.group(1)] = used.get(match.group(1), 0.0) + value
    total = sum(used.values())
    return {c: v / total for c, v in used.items()} if total else {}


def verdicts(blocks: list[Block], priority: dict[str, Any] | None, delay_us: float) -> list[str]:
    lines = []
    by = {(b.config, b.kind, b.clients): b for b in blocks}
    for (config, kind, clients), block in sorted(by.items()):
        if config != "on":
            continue
        off = by.get(("off", kind, clients))
        if off is None or not off.latency or not block.latency:
            continue
        if clients == 1:
            ratio = block.latency["p50"] / off.latency["p50"]
            lines.append(
                f"{kind}, 1 client: p50 on/off {ratio:.2f}{_by_round(block, off, 1)} "
                f"({'no worse' if ratio <= 1.0 else 'WORSE'} than batching off)"
            )
        if clients >= 16:
            ratio = block.rate / off.rate if off.rate else math.inf
            lines.append(
                f"{kind}, {clients} clients: throughput on/off {ratio:.2f}"
                f"{_by_round(block, off, 0)} "
                f"({'at least' if ratio >= 1.0 else 'BELOW'} batching off's)"
            )
        compute = batch_compute_s(block.scrape)
        if compute is not None and clients > 1:
            # What batching adds to the tail: p99 on minus p99 off at the same load (the
            # queueing a saturated replica has either way is not batching's).
            added = block.latency["p99"] - off.latency["p99"]
            bound = delay_us / 1000 + compute * 1000
            p99 = queue_delay_p99_s(block.scrape)
            lines.append(
                f"{kind}, {clients} clients: p99 on - off {added:+.2f} ms, bound {bound:.2f} ms "
                f"(delay {delay_us:g} us + a batch's {compute * 1000:.2f} ms): "
                f"{'within' if added <= bound else 'OVER'}; queue delay p99 <= "
                f"{(p99 or 0) * 1000:.2f} ms (bucket)"
            )
    if priority:
        lines.append(
            f"priority: critical p99 {priority['critical_p99']:.2f} ms among "
            f"{priority['best_effort_clients']} best-effort, {priority['alone_p99']:.2f} ms "
            f"alone: {priority['ratio']:.2f}x ("
            f"{'within' if priority['ratio'] <= PRIORITY_RATIO_TARGET else 'OVER'} "
            f"{PRIORITY_RATIO_TARGET}x); best-effort clients answered: "
            f"{priority['best_effort_min_answers']} at least each "
            f"({'none starved' if priority['best_effort_min_answers'] > 0 else 'STARVED'}); "
            f"compute shares {priority['shares']}; {priority['critical_answers']} critical "
            f"answers; replica and clients "
            f"{'on separate CPUs' if priority['pinned'] else 'sharing the CPUs'}"
        )
    return lines


def _by_round(on: Block, off: Block, figure: int) -> str:
    """Each round's on/off ratio of `figure` (0: requests/s, 1: p50), when there are two
    rounds or more, and the pooled ratio's 95 % interval over the rounds (`on_off_interval`)."""
    pairs = list(zip(on.rounds, off.rounds, strict=True))
    if len(pairs) < 2:
        return ""
    ratios = ", ".join(f"{a[figure] / b[figure]:.2f}" if b[figure] else "-" for a, b in pairs)
    low, high = on_off_interval(on, off, figure)
    return f" (pooled; by round {ratios}; 95 % interval {low:.2f}-{high:.2f})"


_Figures = tuple[int, float, np.ndarray]
"""A round's block as the verdicts' intervals pool it: answers, seconds, latencies (ms)."""


def on_off_interval(on: Block, off: Block, figure: int) -> tuple[float, float]:
    """The 95 % interval of the pooled on/off ratio of `figure` (0: requests/s, 1: p50) with
    the rounds resampled, each round's on and off blocks together
    (`bench.timing.paired_bootstrap`). Each round has fresh replicas, so the interval
    holds how far one pair of processes differs from another beside the machine's drift;
    where it holds 1, the run cannot tell on from off."""

    def figures(block: Block) -> _Figures:
        latencies = np.concatenate([np.asarray(c, dtype=float) for c in block.per_client])
        return len(latencies), block.seconds, latencies

    def pooled(drawn: Sequence[tuple[_Figures, _Figures]]) -> float:
        if figure == 0:
            on_rate, off_rate = (
                sum(pair[side][0] for pair in drawn) / sum(pair[side][1] for pair in drawn)
                for side in (0, 1)
            )
            return on_rate / off_rate if off_rate else math.inf
        on_p50, off_p50 = (
            float(np.median(np.concatenate([pair[side][2] for pair in drawn]))) for side in (0, 1)
        )
        return on_p50 / off_p50

    pairs = [(figures(a), figures(b)) for a, b in zip(on.parts, off.parts, strict=True)]
    return paired_bootstrap(pairs, pooled)


def print_table(model: str, ceiling: dict[int, float], blocks: list[Block]) -> None:
    best = max(ceiling, key=lambda b: ceiling[b])
    print(
        f"\n{model}: in-process ONNX Runtime {ceiling[1]:,.0f} inf/s at batch 1, "
        f"{ceiling[best]:,.0f} at batch {best} (the ceiling)"
    )
    print(
        f"{'config':<8} {'client':<7} {'N':>3} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'p99.9 ms':>9} {'batch':>6} {'srv cores':>9} {'all cores':>9} {'gpu %':>6} "
        f"{'gpu MiB':>8} failed"
    )
    for b in blocks:
        gpu = (
            f"{b.gpu_util:6.0f} {b.gpu_mem_mib:8.0f}"
            if b.gpu_util is not None
            else f"{'-':>6} {'-':>8}"
        )
        lat = b.latency
        print(
            f"{b.config:<8} {b.kind:<7} {b.clients:>3} {b.rate:>9,.0f} {lat.get('p50', 0):>8.2f} "
            f"{lat.get('p99', 0):>8.2f} {lat.get('p99.9', 0):>9.2f} {b.mean_batch:>6.1f} "
            f"{b.server_cores:>9.2f} {b.machine_cores:>9.2f} {gpu} {sum(b.failures.values())}"
        )


# ---- the run ---------------------------------------------------------------------------


def _save_inputs(workdir: Path, feeds: dict[str, np.ndarray]) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    inputs = workdir / "inputs.npz"
    np.savez(inputs, **cast(dict[str, Any], feeds))
    return inputs


async def bench_model(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = modelzoo.model_path(name)
    feeds = modelzoo.sample_inputs(model, seed=1)
    inputs = _save_inputs(workdir, feeds)
    ceiling = ort_ceiling(model, feeds, args.device, args.ceiling_batches, args.ceiling_seconds)
    common = ["--device", args.device, "--instances", str(args.instances), *args.runtime_flags]
    delay = ["--max-queue-delay-us", f"{args.max_queue_delay_us:g}"]
    configs: list[tuple[str, int, list[str]]] = [
        ("off", 1, [*common, "--max-batch-size", "1"]),
        ("on", 1, [*common, *delay, "--max-batch-size", args.max_batch_size]),
    ]
    configs += [
        (f"on x{w}", w, [*common, *delay, "--max-batch-size", args.max_batch_size])
        for w in args.workers
        if w > 1
    ]
    blocks: list[Block] = []
    priority = None
    loads = [(clients, kind) for clients in args.clients for kind in args.kinds]
    # off and on side by side, their blocks interleaved; each more configuration alone.
    for group in (configs[:2], *([c] for c in configs[2:])):
        rounds: dict[tuple[str, int, str], list[Block]] = {
            (config, clients, kind): [] for config, _, _ in group for clients, kind in loads
        }
        for index in range(args.rounds):
            # Fresh processes each round: a replica's own speed (where the kernel put its
            # threads, its memory) stays with it for its life, and two identical ones
            # differed by up to a fifth in every round they shared (docs/BENCHMARKS.md).
            async with contextlib.AsyncExitStack() as stack:
                running = [
                    await stack.enter_async_context(
                        serving(
                            config,
                            model,
                            workdir / f"{config.replace(' ', '')}-{index}",
                            workers,
                            flags,
                        )
                    )
                    for config, workers, flags in group
                ]
                _pin_loops_together(running)
                for servers in running if index == 0 else ():
                    _say_how_it_batches(name, servers)
                pids = ", ".join(f"{s.name} pid {s.processes[0].pid}" for s in running)
                print(f"  {name} round {index + 1} of {args.rounds}: {pids}", flush=True)
                compute_s = max(_compute_ms(servers) for servers in running) / 1000
                for clients, kind in loads:
                    shares = client_shares([TOKEN] * clients, args.client_processes)
                    phase_s = max(args.phase_seconds, PHASE_CALLS * clients * compute_s)
                    order = running if index % 2 == 0 else running[::-1]
                    parts = await run_blocks(
                        order, kind, shares, args.seconds, phase_s, inputs, workdir
                    )
                    for block in parts:
                        rounds[(block.config, clients, kind)].append(block)
        for (config, clients, kind), parts in rounds.items():
            block = merge_rounds(parts)
            blocks.append(block)
            print(
                f"  {name} {config} {kind} x{clients}: {block.rate:,.0f} req/s, p99 "
                f"{block.latency.get('p99', 0):.2f} ms, batch {block.mean_batch:.1f}",
                flush=True,
            )
    if args.priority_clients:
        on_flags = configs[1][2]
        cpus = replica_and_client_cpus() if args.pin_priority else None
        async with serving("priority", model, workdir / "priority", 1, on_flags, cpus) as servers:
            priority = await priority_arm(servers, args, inputs, workdir)
    print_table(name, ceiling, blocks)
    lines = verdicts(blocks, priority, args.max_queue_delay_us)
    for line in lines:
        print(f"  {line}")
    return {
        "model": name,
        "ceiling": {str(k): v for k, v in ceiling.items()},
        "blocks": [
            {k: v for k, v in b.__dict__.items() if k not in ("per_client", "parts")}
            for b in blocks
        ],
        "priority": priority,
        "verdicts": lines,
    }


def _pin_loops_together(running: Sequence[Servers]) -> None:
    """Pin the event loop of each of `running` (off and on, loaded one at a time) to the
    CPU the first one's runtime pinned its loop to, where each runtime pinned its own
    (`--pin-event-loop small`, the default, for an inline model): a runtime picks the CPU
    by its pid (`runtime.server.pin_this_thread`), and two identical unbatched replicas on
    the two CPUs of this VM differed by up to a fifth, the same way in every round
    (docs/BENCHMARKS.md). The loop is the process's main thread: its thread id is the pid."""
    pinned = [re.search(r"event loop pinned to CPU (\d+)", _read(s.logs[0])) for s in running]
    if len(running) < 2 or not all(pinned):
        return
    cpu = int(pinned[0].group(1))  # type: ignore[union-attr]
    for servers in running[1:]:
        os.sched_setaffinity(servers.processes[0].pid, {cpu})


def _compute_ms(servers: Servers) -> float:
    """The model's compute time its first replica measured at load (its ready line)."""
    found = re.search(r"; compute ([\d.]+) ms:", _read(servers.logs[0]))
    return float(found.group(1)) if found else 0.0


def _say_how_it_batches(model: str, servers: Servers) -> None:
    """Print what `--max-batch-size auto` chose for `servers`, or why it does not batch,
    and the CPUs its first process's event loop may run on."""
    cpus = sorted(os.sched_getaffinity(servers.processes[0].pid))
    print(f"  {model} {servers.name}: event loop on CPU {','.join(map(str, cpus))}")
    if servers.name == "off":
        return
    log = _read(servers.logs[0])
    if not servers.batching:
        why = re.search(r"batching off: (.*)", log)
        print(f"{model}: the replica does not batch ({why and why.group(1)}): 'on' = 'off'")
    elif chosen := re.search(r"--max-batch-size auto: (.*)", log):
        print(f"  {model} {servers.name}: --max-batch-size auto chose {chosen.group(1)}")


async def priority_arm(
    servers: Servers, args: argparse.Namespace, inputs: Path, workdir: Path
) -> dict[str, Any]:
    """4 critical clients alone, then among `args.priority_clients` best-effort ones."""
    critical_tokens = [CRITICAL_TOKEN] * CRITICAL_CLIENTS
    seconds = args.priority_seconds
    alone = await run_block(servers, "ours", [critical_tokens], seconds, inputs, workdir)
    # The critical clients keep their own process, as alone: devices are apart, and a
    # critical call must not wait in a load process's loop behind best-effort ones.
    best_effort = client_shares([BEST_EFFORT_TOKEN] * args.priority_clients, args.client_processes)
    # The best-effort clients outlast the critical ones: the replica's figures are of the
    # time both ran, not of the best-effort queue draining after.
    mixed = await run_block(
        servers, "ours", [critical_tokens, *best_effort], seconds, inputs, workdir, OUTLAST_S
    )
    critical = [v for samples in mixed.per_client[:CRITICAL_CLIENTS] for v in samples]
    best_effort_answers = [len(samples) for samples in mixed.per_client[CRITICAL_CLIENTS:]]
    alone_tail = tail_percentiles([v for c in alone.per_client for v in c])
    among_tail = tail_percentiles(critical)
    return {
        "best_effort_clients": args.priority_clients,
        "alone_p50": alone_tail["p50"],
        "alone_p99": alone_tail["p99"],
        "alone_rate": alone.rate,
        "critical_p50": among_tail["p50"],
        "critical_p99": among_tail["p99"],
        "critical_rate": len(critical) / seconds,
        "ratio": among_tail["p99"] / alone_tail["p99"],
        "best_effort_min_answers": min(best_effort_answers),
        "best_effort_rate": sum(
            value
            for key, value in mixed.scrape.items()
            if key.startswith("offload_runtime_class_requests_total{")
            and 'class="best-effort"' in key
        )
        / seconds,
        "critical_answers": len(critical),
        "pinned": servers.client_cpus is not None,
        "shares": {k: round(v, 3) for k, v in class_shares(mixed.scrape).items()},
        "failures": mixed.failures,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serving", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="short mode (make bench)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", nargs="+", default=None, help="default: mlp resnet18")
    parser.add_argument(
        "--clients", type=_ints, default=None, help="client counts (default 1,4,16,64; quick 1,16)"
    )
    parser.add_argument(
        "--kinds", type=lambda t: t.split(","), default=None,
        help="client kinds: ours,triton (default both; quick: ours)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=None, help="per block (4; quick 1.5)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved blocks of off and on at each "
        "load, pooled (3; quick 1): the rounds' ratios show the machine's own drift",
    )  # fmt: skip
    parser.add_argument(
        "--phase-seconds", type=float, default=1.0, help="off and on in turn within a block, "
        "this long each (default 1; longer for slow loads, see above; over --seconds: one "
        "whole block each)",
    )  # fmt: skip
    parser.add_argument(
        "--workers", type=_ints, default=[1], help="runtime processes on one port, each a "
        "configuration after 'on' (e.g. 1,4)",
    )  # fmt: skip
    parser.add_argument("--instances", type=int, default=1, help="sessions per replica")
    parser.add_argument("--max-batch-size", default="auto", help="for 'on' (default auto)")
    parser.add_argument("--max-queue-delay-us", type=float, default=0.0, help="for 'on'")
    parser.add_argument(
        "--priority-clients", type=int, default=None,
        help="best-effort clients of the priority arm (default 60; quick 12; 0: no arm)",
    )  # fmt: skip
    parser.add_argument(
        "--priority-seconds", type=float, default=None,
        help="per block of the priority arm (10; quick 1.5): ResNet-18 on a CPU answers a few "
        "dozen calls a second, and a p99 wants hundreds",
    )  # fmt: skip
    parser.add_argument(
        "--pin-priority", action=argparse.BooleanOptionalAction, default=True,
        help="run the priority arm's replica on half of this machine's CPUs and its clients "
        "on the other half, as devices are other machines (default on, with 2 CPUs or more)",
    )  # fmt: skip
    parser.add_argument("--client-processes", type=int, default=None)
    parser.add_argument(
        "--runtime-flags", type=str.split, default=[],
        help="more flags for every replica, as one string (e.g. '--io-binding')",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    return parser


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: give counts like 1,4,16") from None
    if any(v < 1 or v > 4096 for v in values):
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: each count from 1 to 4096")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quick = args.quick
    args.models = args.models or ["mlp", "resnet18"]
    args.clients = args.clients or ([1, 16] if quick else [1, 4, 16, 64])
    args.kinds = args.kinds or (["ours"] if quick else ["ours", "triton"])
    args.seconds = args.seconds or (1.5 if quick else 4.0)
    args.rounds = args.rounds or (1 if quick else 3)
    if not 1 <= args.rounds <= 100:
        raise SystemExit(f"--rounds must be from 1 to 100, not {args.rounds}")
    args.priority_seconds = args.priority_seconds or (1.5 if quick else 10.0)
    for flag, value in (
        ("--phase-seconds", args.phase_seconds),
        ("--seconds", args.seconds),
        ("--priority-seconds", args.priority_seconds),
    ):
        if not 0.05 <= value <= 3600:  # NaN fails too
            raise SystemExit(f"{flag} must be from 0.05 to 3600, not {value}")
    if args.priority_clients is None:
        args.priority_clients = 12 if quick else 60
    args.ceiling_batches = [1, 8] if quick else [1, 8, 32]
    args.ceiling_seconds = 0.5 if quick else 2.0
    print(
        f"bench.serving on {os.cpu_count()} CPUs, device {args.device}, onnxruntime "
        f"{ort.__version__}; blocks of {args.seconds:g} s",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        for name in args.models:
            results.append(asyncio.run(bench_model(name, args, Path(tmp) / name)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    failed = sum(sum(b["failures"].values()) for r in results for b in r["blocks"])
    if failed:
        print(f"{failed} requests failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
