"""The inference server inside a replica: `python -m runtime.server --model PATH ...`.

Serves one ONNX model over the Open Inference Protocol (grpc.aio). Start-up order: listen
(ServerLive answers at once), load the model, run one warm-up inference, then turn
ServerReady/ModelReady true. SIGTERM or SIGINT drains: ServerReady turns false, new
inferences get UNAVAILABLE, the ones already accepted finish within the grace period, and the
process exits 0.

Beside the gRPC port, the server's Prometheus metrics (`runtime.metrics`) are served over
plain HTTP on --metrics-port, without a token: the page holds counts and durations, never a
tensor, the token or the model's path. It is up from the start (the node daemon reads its
port from the log line before `runtime listening on`) until gRPC has stopped.

With `--clients-file PATH` the replica also takes the calls of the clients listed there, each
with its own class and rate limit, and follows the file as it changes (`runtime.clients`):
SIGHUP has it read the file again at once (the node sends it after each write; without a
clients file SIGHUP is logged and ignored, never the default's exit).

With `--tls-cert` and `--tls-key` (the node's certificate, which the node hands its replicas)
gRPC serves TLS; without them, a --host other hosts can reach needs `--insecure` (the node
passes it when it serves plaintext itself).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc
import numpy as np
import uvloop

from protos.inference import grpc_service_pb2_grpc as pb_grpc
from runtime.batching import (
    CLASSES,
    MAX_BATCH_SIZE_LIMIT,
    MAX_CLASS_WAIT_LIMIT_S,
    MAX_INSTANCES_LIMIT,
    MAX_QUEUE_DELAY_LIMIT_S,
    MAX_QUEUED_LIMIT,
    MIN_GAIN,
    SWEEP_BUDGET_S,
    SWEEP_SIZES,
    Batcher,
    BatchPolicy,
    PriorityClass,
    choose_batch_size,
)
from runtime.clients import (
    MAX_CLIENTS,
    POLL_INTERVAL_S,
    RELOAD_SIGNAL,
    ClientEntry,
    ClientTable,
    read_clients,
    watch_clients_file,
)
from runtime.errors import ModelLoadError
from runtime.metrics import MetricsEndpoint, ModelMetrics, RuntimeMetrics
from runtime.model import CPU, DEVICES, OnnxModel, time_in_turn
from runtime.pem import TlsIdentity, read_pem
from runtime.precision import FP16_MAX_DEVIATION, Precision, check_fp16
from runtime.rpc.auth import CallerTokens, require_token
from runtime.rpc.measurement import measure_calls
from runtime.rpc.registration import add_servicer, raw_messages
from runtime.rpc.servicer import RAW_METHODS, InferenceServicer, ServingState
from runtime.rpc.status import parse_in_handler
from runtime.tls import check_listener, listen, server_credentials

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_INLINE_BELOW_MS = 20.0
EVENT_LOOPS = ("uvloop", "asyncio")
PIN_CHOICES = ("small", "never")
DEFAULT_METRICS_PORT = 8002
"""Triton's metrics port, beside its (and our) gRPC port 8001."""
METRICS_OFF = -1
SINGLE_THREAD_BELOW_MS = 1.0
POOL_MIN_GAIN = 0.1
"""A model under `SINGLE_THREAD_BELOW_MS` keeps its pool of intra-op threads only when it
computes at least this much quicker with it than with one thread, the two timed in turn:
a tie goes to one thread. Five runs of each, one session after the other, gave the MLP's
replicas two threads in 2 of 12 starts on a 2-CPU VM, each start its own draw (timed in
turn with this margin: one thread in 12 of 12)."""
DEFAULT_MAX_QUEUED_PER_CLASS = 256
"""At most this many requests wait per priority class: 151 MB of ResNet-18 inputs."""
DEFAULT_MAX_CLASS_WAIT_MS = 100.0
PIN_LOOP_BELOW_MS = 1.0
"""An inline model that computes in less than this gets its loop's thread pinned (with
`pin_event_loop`): its call is short enough for the cache misses of a core change to be a
large part of it; a longer one's is not, and a pinned thread cannot leave a busy core."""


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    model: Path
    name: str
    token: str
    host: str = "0.0.0.0"
    port: int = 8001
    """0 picks a free port (logged)."""
    device: str = "auto"
    gpu_mem_limit_mib: int = 0
    """The replica's share of GPU memory, 0 for no limit (ONNX Runtime's gpu_mem_limit)."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Larger requests get RESOURCE_EXHAUSTED; also the limit on responses."""
    grace_s: float = 10.0
    """How long accepted inferences get to finish after SIGTERM."""
    concurrency: int = 2
    """Inferences run at once (worker threads sharing the session) when not inline."""
    inline_below_ms: float = DEFAULT_INLINE_BELOW_MS
    """A model whose measured compute time (median, at warm-up) is at most this runs its
    inferences on the event loop, one at a time, instead of in worker threads."""
    intra_op_threads: int = 0
    """ONNX Runtime threads per inference; 0 lets ONNX Runtime choose."""
    warmup_inputs: Path | None = None
    """An .npz of every input for the warm-up inference; None warms up with zeros."""
    metrics_port: int | None = None
    """Port of the Prometheus endpoint on `host` (0 picks a free port, logged); None serves
    none. The command line's default is `DEFAULT_METRICS_PORT`; this one is None so that
    servers made in one process (tests, benchmarks) do not contend for a port."""
    tls: TlsIdentity | None = None
    """The certificate and key gRPC serves TLS with; None: plaintext."""
    event_loop: str = "uvloop"
    """`main`'s event loop: one of `EVENT_LOOPS`."""
    pin_event_loop: bool = False
    """Pin the event loop's thread to one CPU when the model runs inline and computes in
    under `PIN_LOOP_BELOW_MS` (`pin_this_thread`). The command line's default is True; this
    one is False so that a server made in another program's loop (tests, benchmarks) leaves
    that program's thread where it was."""
    max_batch_size: int | None = None
    """Rows per batch; None: measured at load when the model has a batch axis (`runtime.
    batching.choose_batch_size`); 1: batching off (each inference alone, as before)."""
    batching: BatchPolicy = field(default_factory=BatchPolicy)
    """The batcher's other settings (its max_batch_size is replaced by the one chosen)."""
    io_binding: bool = False
    """Batches on CUDA run through IO binding with device input buffers kept per shape."""
    priority_class: PriorityClass = PriorityClass.STANDARD
    """The class of calls made with `token` (the deployment's)."""
    class_tokens: Mapping[str, PriorityClass] = field(default_factory=dict)
    """More tokens the replica takes, each with its caller's class (clients sharing it)."""
    clients_file: Path | None = None
    """The clients file the replica follows (`runtime.clients`); None: no clients."""
    clients: tuple[ClientEntry, ...] = ()
    """Its clients as read at start."""
    clients_generation: int = 0
    """The generation of that reading (`runtime.clients`; 0: none)."""
    precision: Precision = Precision.FP32
    """FP16: serve `fp16_model`, once checked against `model` at load (`runtime.precision`)."""
    fp16_model: Path | None = None
    """`model`'s FP16 copy (`python -m modelzoo.fp16`), served with `precision` FP16."""

    def served_file(self) -> Path:
        """The .onnx file the sessions load: `model`, or its FP16 copy."""
        if self.precision is Precision.FP32:
            return self.model
        if self.fp16_model is None:
            raise ModelLoadError("--precision fp16 needs --fp16-model, the model's FP16 copy")
        return self.fp16_model

    def caller_tokens(self) -> CallerTokens:
        return CallerTokens({**self.class_tokens, self.token: self.priority_class})


@dataclass(slots=True)
class RunningServer:
    server: grpc.aio.Server
    port: int
    state: ServingState
    executor: ThreadPoolExecutor
    metrics: RuntimeMetrics
    model_metrics: ModelMetrics
    """The served model's children of `metrics`: the only ones the per-call paths touch."""
    tokens: CallerTokens
    clients: ClientTable
    """The clients the replica takes now (`use_clients`)."""
    metrics_endpoint: MetricsEndpoint | None = None
    """None when the settings ask for no metrics port."""

    async def drain(self, grace_s: float) -> None:
        """Refuse new inferences, let accepted ones finish within `grace_s`, then stop."""
        self.state.draining = True
        started = time.monotonic()
        in_flight = self.state.in_flight
        try:
            await asyncio.wait_for(self.state.wait_idle(), grace_s)
        except TimeoutError:
            logger.warning(
                "drain: %d inference(s) still running after %.1fs grace",
                self.state.in_flight,
                grace_s,
            )
        # Calls gRPC received before the signal but has not handed to the servicer yet (an
        # inline inference holds the loop) get their answer, UNAVAILABLE, before the stop
        # would cut them: give the loop two inferences' time to dispatch them.
        settle_s = 0.01 + (2 * self.state.compute_s if self.state.inline else 0.0)
        await asyncio.sleep(min(settle_s, max(0.0, grace_s - (time.monotonic() - started))))
        remaining = max(0.0, grace_s - (time.monotonic() - started))
        await self.server.stop(remaining)
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.state.batcher is not None:
            self.state.batcher.close()
        await self.close_metrics()
        logger.info(
            "drained: %d in flight at the signal, stopped after %.3fs",
            in_flight,
            time.monotonic() - started,
        )

    def use_clients(self, table: ClientTable) -> None:
        """Take `table`'s clients from the next call on, and keep metrics for them; its
        generation is reported last, once the table is the one in use."""
        self.clients = table
        self.tokens.use_clients(table)
        self.model_metrics.use_clients(table.ids)
        self.metrics.clients_generation.set(table.generation)

    async def close_metrics(self) -> None:
        """Stop serving the metrics page (idempotent); last, so scrapes see a drain end."""
        endpoint, self.metrics_endpoint = self.metrics_endpoint, None
        if endpoint is not None:
            await asyncio.to_thread(endpoint.close)


async def start_server(settings: RuntimeSettings) -> RunningServer:
    """Listen and answer ServerLive, and serve the metrics when `settings` ask for it; the
    model is not loaded yet (see `load_model`). OSError when a port cannot be bound."""
    state = ServingState()
    metrics = RuntimeMetrics()
    model_metrics = metrics.for_model(settings.name)
    tokens = settings.caller_tokens()
    executor = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="infer")
    limit = settings.max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ],
    )
    add_servicer(
        server,
        pb_grpc.add_GRPCInferenceServiceServicer_to_server,
        InferenceServicer(
            state,
            settings.name,
            executor,
            model_metrics,
            settings.batching.max_queued_per_class,
        ),
        # The token is checked first: a refused call's request is never parsed (nor
        # counted); the measurement then includes the parsing.
        [
            raw_messages(RAW_METHODS),
            parse_in_handler,
            measure_calls(model_metrics),
            require_token(tokens),
        ],
    )
    tls = settings.tls
    try:
        port = listen(
            server, f"{settings.host}:{settings.port}", server_credentials(tls) if tls else None
        )
    except OSError:
        executor.shutdown()
        raise
    endpoint = None
    if settings.metrics_port is not None:
        try:
            endpoint = MetricsEndpoint.start(metrics, settings.host, settings.metrics_port)
        except OSError as err:
            await server.stop(None)
            executor.shutdown()
            raise OSError(
                f"cannot serve metrics on {settings.host}:{settings.metrics_port}: {err}"
            ) from err
        # Before the line below: whoever waits for that one finds this one too.
        logger.info("metrics served at %s (no token needed)", endpoint.url)
    await server.start()
    logger.info("runtime listening on %s:%d%s", settings.host, port, " (TLS)" if tls else "")
    running = RunningServer(
        server, port, state, executor, metrics, model_metrics, tokens, ClientTable(), endpoint
    )
    running.use_clients(ClientTable(settings.clients, generation=settings.clients_generation))
    if settings.clients_file is not None:
        logger.info(
            "clients file %s: %d clients, generation %d",
            settings.clients_file,
            len(settings.clients),
            settings.clients_generation,
        )
    return running


async def load_model(running: RunningServer, settings: RuntimeSettings) -> None:
    """Load and warm up the model, choose how to run it from its measured compute time, then
    turn ready. ModelLoadError when loading or the warm-up fails.

    The choices, each logged: without --intra-op-threads a model gets one intra-op thread
    per CPU this process may run on (`OnnxModel.load`); if that is more than one and it
    computes in under `SINGLE_THREAD_BELOW_MS`, it is loaded again with one thread, the two
    sessions are timed in turn (`time_in_turn`), and the pool stays only if it is
    `POOL_MIN_GAIN` quicker (a tiny model gains nothing from a thread pool and pays for
    waking it); a model within --inline-below-ms runs inline, and with `pin_event_loop` one under
    `PIN_LOOP_BELOW_MS` has the loop's thread, which then runs its inferences, pinned to one
    CPU.
    """
    started = time.monotonic()
    warmup_inputs = _read_warmup_inputs(settings.warmup_inputs)
    model, compute_ms = await asyncio.to_thread(
        _load_warm, settings, settings.intra_op_threads, warmup_inputs
    )
    if settings.precision is Precision.FP16:
        await asyncio.to_thread(check_fp16, model, settings.model, warmup_inputs)
    threads = model.intra_op_threads
    if settings.intra_op_threads == 0 and threads > 1 and compute_ms < SINGLE_THREAD_BELOW_MS:
        single, _ = await asyncio.to_thread(_load_warm, settings, 1, warmup_inputs)
        pool_ms, single_ms = await asyncio.to_thread(time_in_turn, (model, single), warmup_inputs)
        logger.info(
            "model=%s compute %.3f ms with %d threads (one per CPU), %.3f ms with one, "
            "timed in turn",
            settings.name,
            pool_ms,
            threads,
            single_ms,
        )
        compute_ms = pool_ms
        if not keeps_pool(pool_ms, single_ms):
            model, compute_ms, threads = single, single_ms, 1
    running.state.inline = compute_ms <= settings.inline_below_ms
    running.state.compute_s = compute_ms / 1000
    running.state.batcher = await _batcher(
        running, settings, model, threads, compute_ms, warmup_inputs
    )
    if settings.pin_event_loop and running.state.inline:
        _pin_inline_loop(settings.name, compute_ms)
    # What is alive now (modules, the session) lives as long as the process: keep it out of
    # the collector's full passes, which otherwise take milliseconds in the middle of a call.
    gc.collect()
    gc.freeze()
    running.state.model = model
    if running.state.batcher is not None:
        how = "batches (above)"
    elif running.state.inline:
        how = (
            "runs inline on the event loop "
            f"(at most --inline-below-ms {settings.inline_below_ms:g})"
        )
    else:
        how = (
            f"runs in {settings.concurrency} worker thread(s) "
            f"(over --inline-below-ms {settings.inline_below_ms:g})"
        )
    logger.info(
        "model=%s ready provider=%s precision %s intra-op threads %d (load and warm-up "
        "%.2fs); compute %.2f ms: %s",
        settings.name,
        model.provider,
        settings.precision,
        threads,
        time.monotonic() - started,
        compute_ms,
        how,
    )


async def _batcher(
    running: RunningServer,
    settings: RuntimeSettings,
    model: OnnxModel,
    threads: int,
    compute_ms: float,
    warmup_inputs: dict[str, np.ndarray] | None,
) -> Batcher | None:
    """The batcher for `model`, with `--instances` sessions (`model` and more of the same
    file and threads), or None when batching is off or the model cannot batch (logged)."""
    size = settings.max_batch_size
    if size == 1:
        logger.info("model=%s batching off (--max-batch-size 1)", settings.name)
        return None
    feeds = model.warmup_feeds(warmup_inputs)
    why_not = await asyncio.to_thread(model.why_not_batched, feeds)
    if why_not is not None:
        log = logger.info if size is None else logger.warning
        log("model=%s batching off: %s", settings.name, why_not)
        return None
    policy = settings.batching
    if size is None:
        times = await asyncio.to_thread(model.time_batches, feeds, SWEEP_SIZES, SWEEP_BUDGET_S)
        size = choose_batch_size(times)
        logger.info(
            "model=%s --max-batch-size auto: %d (ms per run by batch size: %s)",
            settings.name,
            size,
            ", ".join(f"{n}: {t * 1000:.2f}" for n, t in times.items()),
        )
    policy = BatchPolicy(
        max_batch_size=size,
        max_queue_delay_s=policy.max_queue_delay_s,
        max_queued_per_class=policy.max_queued_per_class,
        max_class_wait_s=policy.max_class_wait_s,
        instances=policy.instances,
    )
    instances = [model]
    for _ in range(policy.instances - 1):
        more, _ms = await asyncio.to_thread(_load_warm, settings, threads, warmup_inputs)
        instances.append(more)
    on_cpu = model.provider == CPU
    pad_to: tuple[int, ...] = ()
    if not on_cpu:
        # Shapes tuned at load: no batch meets a new one (`Batcher`'s pad_to).
        pad_to = tuple(n for n in SWEEP_SIZES if n < policy.max_batch_size)
        pad_to += (policy.max_batch_size,)
    if settings.io_binding:
        bound = all([instance.bind_io() for instance in instances])
        logger.info(
            "model=%s IO binding %s",
            settings.name,
            "on (device input buffers kept per shape)" if bound else "off: not on the GPU",
        )
    metrics = running.model_metrics
    batcher = Batcher(
        instances,
        policy,
        compute_ms / 1000,
        # A CUDA session runs in its own thread only (`Batcher`), never inline on the loop.
        settings.inline_below_ms / 1000 if on_cpu else -1.0,
        metrics.observe_batch,
        pad_to,
        on_refused=metrics.refused_full,
        on_client_compute=metrics.client_computed,
        observe_alone=metrics.observe_alone,
    )
    if not on_cpu:
        sizes = pad_to
        await batcher.on_each_instance(
            lambda instance: cast(OnnxModel, instance).time_batches(feeds, sizes, math.inf)
        )
        logger.info(
            "model=%s batches padded to %s rows, each session warmed at these in its own "
            "thread (%s tunes its kernels per shape and keeps state per thread)",
            settings.name,
            ", ".join(map(str, pad_to)),
            model.provider,
        )
    metrics.count_queued(
        lambda: batcher.queued,
        [(c.value, functools.partial(batcher.queued_in, c)) for c in CLASSES],
    )
    logger.info(
        "model=%s batches: up to %d rows, queue delay %.0f us, %d instance(s), %d queued per "
        "class at most; the deployment's calls are %s",
        settings.name,
        policy.max_batch_size,
        policy.max_queue_delay_s * 1e6,
        policy.instances,
        policy.max_queued_per_class,
        settings.priority_class,
    )
    return batcher


def pin_this_thread() -> int | None:
    """Pin the calling thread to one of the CPUs the process may run on, chosen by its pid
    so that replicas started together spread over them; that CPU, or None when the process
    has only one. Threads started before keep their CPUs (ONNX Runtime's pool, gRPC's); ones
    the calling thread starts later inherit the pin.

    Why: the MLP of `bench.peers` computes in tens of microseconds back to back, and several
    times that inside a server whose loop's thread sleeps between calls and wakes on either
    core; with that thread pinned, our overhead over the echo fell in five of six alternating
    `bench.peers` pairs, its median ratio to KServe's from 0.51 to 0.32 (docs/BENCHMARKS.md,
    "Our runtime beside KServe's ModelServer"), likely because that core's cache still
    holds what the last call touched.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    cpu = cpus[os.getpid() % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def _pin_inline_loop(name: str, compute_ms: float) -> None:
    """Pin the calling thread, the loop's, which runs model `name`'s inferences inline, if
    the model computes in under `PIN_LOOP_BELOW_MS`; log what was done and why."""
    small = compute_ms < PIN_LOOP_BELOW_MS
    pinned = pin_this_thread() if small else None
    if pinned is not None:
        why = (
            f"pinned to CPU {pinned} (it runs the inferences: one core's cache keeps what "
            "the last call touched)"
        )
    elif small:
        why = "not pinned: this process may run on one CPU only"
    else:
        why = f"not pinned: the model computes in {PIN_LOOP_BELOW_MS:g} ms or more"
    logger.info("model=%s event loop %s", name, why)


def keeps_pool(pool_ms: float, single_ms: float) -> bool:
    """Whether a tiny model keeps its pool of intra-op threads: only when it computes
    `POOL_MIN_GAIN` quicker with it than with one thread."""
    return pool_ms <= (1 - POOL_MIN_GAIN) * single_ms


def _load_warm(
    settings: RuntimeSettings, intra_op_threads: int, inputs: dict[str, np.ndarray] | None
) -> tuple[OnnxModel, float]:
    """A loaded, warmed-up session and its compute time in ms. Blocking."""
    model = OnnxModel.load(
        settings.served_file(),
        settings.name,
        settings.device,
        settings.gpu_mem_limit_mib,
        intra_op_threads,
    )
    return model, model.warm_up(inputs)


def _read_warmup_inputs(path: Path | None) -> dict[str, np.ndarray] | None:
    if path is None:
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"--warmup-inputs {path}: not a readable .npz file ({err})") from err


async def serve(settings: RuntimeSettings) -> int:
    """Run until SIGTERM/SIGINT, then drain. Returns the process exit code. With a clients
    file, its watch runs beside (`runtime.clients.watch_clients_file`) until the drain, and
    SIGHUP has it read the file at once. The handlers are installed before anything is
    served: a node that sees the metrics page may signal the process."""
    stop = asyncio.Event()
    reload = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if settings.clients_file is not None:
        loop.add_signal_handler(RELOAD_SIGNAL, reload.set)
    else:
        loop.add_signal_handler(
            RELOAD_SIGNAL,
            lambda: logger.info("%s: no --clients-file; nothing to read", RELOAD_SIGNAL.name),
        )
    running = await start_server(settings)
    async with asyncio.TaskGroup() as background:
        watching = None
        if settings.clients_file is not None:
            watching = background.create_task(
                watch_clients_file(
                    settings.clients_file,
                    running.clients,
                    running.use_clients,
                    reload=reload,
                ),
                name="watch-clients-file",
            )
        code = await _until_stopped(running, settings, stop)
        if watching is not None:
            watching.cancel()
    return code


async def _until_stopped(
    running: RunningServer, settings: RuntimeSettings, stop: asyncio.Event
) -> int:
    """Load the model, serve until `stop` is set, then drain; the exit code."""
    loading = asyncio.create_task(load_model(running, settings), name="load-model")
    stopping = asyncio.create_task(stop.wait(), name="wait-for-signal")
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        stopping.cancel()
        logger.error("%s", loading.exception())
        await running.server.stop(0)
        running.executor.shutdown(wait=False)
        await running.close_metrics()
        return 1
    await stopping
    logger.info("signal received: draining (grace %.1fs)", settings.grace_s)
    if not loading.done():
        loading.cancel()
    await running.drain(settings.grace_s)
    return 0


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
        return value

    return parse


def _bounded(kind: type[int] | type[float], low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite number of `kind` in [low, high] (argparse names the flag
    in its error)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text[:40]!r}: use {low:g} to {high:g}")
        return value

    return parse


def _batch_size(text: str) -> int | None:
    if text == "auto":
        return None
    return int(_bounded(int, 1, MAX_BATCH_SIZE_LIMIT)(text))


def _class_tokens(path: Path) -> dict[str, PriorityClass]:
    """`--class-tokens FILE`: lines `CLASS TOKEN`; blank lines and `#` comments skipped.
    ValueError naming the line (never quoting a token) when one does not parse."""
    tokens: dict[str, PriorityClass] = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--class-tokens {path}: cannot be read ({err})") from err
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) != 2 or words[0] not in set(PriorityClass):
            raise ValueError(
                f"--class-tokens {path} line {number}: write 'CLASS TOKEN', CLASS one of "
                f"{', '.join(PriorityClass)}"
            )
        tokens[words[1]] = PriorityClass(words[0])
    return tokens


def _metrics_port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not METRICS_OFF <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: use 0..65535, or {METRICS_OFF} for none")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runtime.server",
        description="Serve one ONNX model over the Open Inference Protocol (KServe v2 gRPC).",
    )
    p.add_argument("--model", type=Path, required=True, help="the .onnx file to serve")
    p.add_argument("--name", help="name to serve the model under (default: the file's stem)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=_positive(int), default=8001, help="0 picks a free one")
    p.add_argument(
        "--metrics-port",
        type=_metrics_port,
        metavar="N",
        help="serve Prometheus metrics (GET /metrics, plain HTTP) on --host and this port: "
        "request counts, failures by gRPC status, latency and compute histograms, calls in "
        "flight and queued. No token needed: the page holds no tensor data, token or model "
        "path. 0 picks a free port (logged); -1 serves none "
        f"(default {DEFAULT_METRICS_PORT}, or a free port when --port is 0)",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        required=True,
        help="file holding the deployment's bearer token; every call but ServerLive needs "
        "'authorization: Bearer <token>'",
    )
    p.add_argument(
        "--tls-cert", type=Path, help="certificate (PEM) to serve TLS with (with --tls-key)"
    )
    p.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext on a --host other hosts can reach (without TLS only loopback "
        "addresses are allowed)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto: CUDA when a GPU is visible and onnxruntime-gpu is installed; cuda and "
        "tensorrt (TensorRT's execution provider, falling back to CUDA for what it cannot "
        "run) refuse to start without them, naming the providers this onnxruntime has",
    )
    p.add_argument(
        "--precision",
        choices=[str(c) for c in Precision],
        default=str(Precision.FP32),
        help="fp16: serve --fp16-model, the model's FP16 copy (python -m modelzoo.fp16), "
        "after checking it against --model at load: refused when an output deviates past "
        f"{FP16_MAX_DEVIATION:g} of its scale (default fp32)",
    )
    p.add_argument(
        "--fp16-model",
        type=Path,
        metavar="PATH",
        help="with --precision fp16: the FP16 copy of --model to serve (FP32 inputs and "
        "outputs; the runtime carries no converter)",
    )
    p.add_argument(
        "--gpu-mem-limit-mib",
        type=_positive(int),
        default=0,
        help="GPU memory share for this replica, 0 for no limit",
    )
    p.add_argument(
        "--max-message-bytes",
        type=_positive(int),
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="larger requests get RESOURCE_EXHAUSTED (default 64 MiB)",
    )
    p.add_argument(
        "--grace",
        type=_positive(float),
        default=10.0,
        help="seconds accepted inferences get to finish after SIGTERM",
    )
    p.add_argument(
        "--concurrency",
        type=_positive(int),
        default=2,
        help="inferences run at once in worker threads, for a model not run inline (default 2)",
    )
    p.add_argument(
        "--inline-below-ms",
        type=_positive(float),
        default=DEFAULT_INLINE_BELOW_MS,
        metavar="MS",
        help="run inferences on the event loop, one at a time, when the model's compute time "
        "measured at warm-up is at most MS (no thread hand-off: lower latency; a health "
        "check waits for at most one inference); 0: always in worker threads "
        f"(default {DEFAULT_INLINE_BELOW_MS:g})",
    )
    p.add_argument(
        "--intra-op-threads",
        type=_positive(int),
        default=0,
        help="ONNX Runtime threads per inference (0: one per CPU this process may run on, "
        "its affinity; ONNX Runtime's own default would pin threads to every core of the "
        "machine)",
    )
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="uvloop",
        help="uvloop (default): libuv's loop, which took about 0.05 ms off each call of a "
        "small model (docs/BENCHMARKS.md, bench.peers); asyncio: the standard library's",
    )
    p.add_argument(
        "--pin-event-loop",
        choices=PIN_CHOICES,
        default="small",
        help="small (default): when the model runs inline and computes in under "
        f"{PIN_LOOP_BELOW_MS:g} ms, pin the event loop's thread to one CPU of this process's "
        "affinity, so that core's cache keeps what the last call touched (the MLP's "
        "overhead in bench.peers: median ratio to KServe's 0.51 unpinned, 0.32 pinned; "
        "docs/BENCHMARKS.md); never: leave every thread to the scheduler",
    )
    batching = p.add_argument_group(
        "batching and priority (a model whose inputs and outputs have a dynamic first "
        "dimension; docs/OPERATIONS.md)"
    )
    batching.add_argument(
        "--max-batch-size",
        type=_batch_size,
        default=None,
        metavar="N",
        help="merge queued requests of the same shapes into one run of up to N rows; 1: "
        "batching off; auto (default): when every input and output has a dynamic first "
        "dimension and a two-row batch computes each row as alone, the largest of 1, 2, 4 .. "
        f"{SWEEP_SIZES[-1]} up to which each doubling computed a row at least "
        f"{MIN_GAIN * 100:.0f} %% quicker at load (a CNN on a CPU: often 1), else off",
    )
    batching.add_argument(
        "--max-queue-delay-us",
        type=_bounded(float, 0, MAX_QUEUE_DELAY_LIMIT_S * 1e6),
        default=0.0,
        metavar="D",
        help="how long a batch that is not full may wait for more requests while a session "
        "is free (default 0: run what has queued at once; batches then form from the "
        "requests that arrive while a batch computes)",
    )
    batching.add_argument(
        "--instances",
        type=_bounded(int, 1, MAX_INSTANCES_LIMIT),
        default=1,
        metavar="K",
        help="sessions of the model, each running one batch at a time (on a GPU each has "
        "its own CUDA stream, so K batches can overlap; default 1)",
    )
    batching.add_argument(
        "--io-binding",
        action="store_true",
        help="on CUDA, run batches through IO binding: each input copied into a device "
        "buffer kept for its shape instead of one allocated per run (docs/BENCHMARKS.md "
        "measures both)",
    )
    batching.add_argument(
        "--max-queued-per-class",
        type=_bounded(int, 1, MAX_QUEUED_LIMIT),
        default=DEFAULT_MAX_QUEUED_PER_CLASS,
        metavar="N",
        help="requests one priority class may have waiting (for a batch, or for a worker "
        "thread when the model does not batch); more get RESOURCE_EXHAUSTED "
        f"(default {DEFAULT_MAX_QUEUED_PER_CLASS})",
    )
    batching.add_argument(
        "--max-class-wait-ms",
        type=_bounded(float, 0, MAX_CLASS_WAIT_LIMIT_S * 1000),
        default=DEFAULT_MAX_CLASS_WAIT_MS,
        metavar="MS",
        help="a class whose oldest request has waited MS leads the next batch: no class "
        f"starves behind the others (default {DEFAULT_MAX_CLASS_WAIT_MS:g})",
    )
    batching.add_argument(
        "--priority-class",
        choices=[str(c) for c in PriorityClass],
        default=str(PriorityClass.STANDARD),
        help="the class of calls made with --token-file's token (the deployment's); critical "
        "batches go first while within their share, the classes share compute 4/2/1",
    )
    batching.add_argument(
        "--class-tokens",
        type=Path,
        metavar="FILE",
        help="more tokens this replica takes, one 'CLASS TOKEN' per line (clients sharing "
        "it, each with its class); keep it 0600",
    )
    batching.add_argument(
        "--clients-file",
        type=Path,
        metavar="PATH",
        help="the clients sharing this replica, one 'CLIENT_ID CLASS TOKEN_SHA256 [MAX_RPS]' "
        "per line (TOKEN_SHA256: the lowercase hex SHA-256 of the client's bearer token; "
        "MAX_RPS: its calls per second, bursts of max(1, MAX_RPS); 0 or absent: no limit); "
        f"at most {MAX_CLIENTS} clients; a first line '# generation N' is reported as the "
        "gauge offload_runtime_clients_generation. Read again at once on SIGHUP and "
        f"within {POLL_INTERVAL_S:g} s of each change: a client removed is refused from "
        "its next call; a file that does not parse keeps the clients read before; a "
        "missing file: no clients",
    )
    p.add_argument(
        "--warmup-inputs",
        type=Path,
        metavar="FILE.npz",
        help="every input for the warm-up inference (np.savez); default: zeros, each dynamic "
        "dimension 1 for the batch axis and 64 elsewhere",
    )
    return p


def settings_from_args(argv: Sequence[str] | None = None) -> RuntimeSettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model.is_file():
        parser.error(f"--model {args.model}: no such file")
    try:
        token = args.token_file.read_text().strip()
    except OSError as err:
        parser.error(f"--token-file {args.token_file}: {err.strerror}")
    if not token:
        parser.error(f"--token-file {args.token_file} is empty; write the deployment token in it")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    precision = Precision(args.precision)
    if precision is Precision.FP16 and args.fp16_model is None:
        parser.error(
            "--precision fp16 needs --fp16-model PATH, the model's FP16 copy: make it with "
            "python -m modelzoo.fp16 MODEL PATH (where onnx is installed: the runtime image "
            "carries no converter)"
        )
    if precision is Precision.FP32 and args.fp16_model is not None:
        parser.error("--fp16-model goes with --precision fp16")
    if args.fp16_model is not None and not args.fp16_model.is_file():
        parser.error(f"--fp16-model {args.fp16_model}: no such file")
    tls = None
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    try:
        if args.tls_cert is not None:
            tls = TlsIdentity(
                cert=read_pem(args.tls_cert, "--tls-cert"), key=read_pem(args.tls_key, "--tls-key")
            )
        check_listener(
            "--host",
            f"{args.host}:{args.port}",
            tls is not None,
            args.insecure,
            "--tls-cert and --tls-key",
        )
    except ValueError as err:
        parser.error(str(err))
    try:
        class_tokens = {} if args.class_tokens is None else _class_tokens(args.class_tokens)
        clients_file = None if args.clients_file is None else read_clients(args.clients_file)
    except ValueError as err:
        parser.error(str(err))
    metrics_port = args.metrics_port
    if metrics_port is None:  # a server on a free port is one of several: no fixed port
        metrics_port = 0 if args.port == 0 else DEFAULT_METRICS_PORT
    return RuntimeSettings(
        model=args.model,
        name=args.name or args.model.stem,
        token=token,
        host=args.host,
        port=args.port,
        device=args.device,
        gpu_mem_limit_mib=args.gpu_mem_limit_mib,
        max_message_bytes=args.max_message_bytes,
        grace_s=args.grace,
        concurrency=args.concurrency,
        inline_below_ms=args.inline_below_ms,
        intra_op_threads=args.intra_op_threads,
        warmup_inputs=args.warmup_inputs,
        event_loop=args.event_loop,
        pin_event_loop=args.pin_event_loop == "small",
        metrics_port=None if metrics_port == METRICS_OFF else metrics_port,
        tls=tls,
        max_batch_size=args.max_batch_size,
        batching=BatchPolicy(
            max_queue_delay_s=args.max_queue_delay_us / 1e6,
            max_queued_per_class=args.max_queued_per_class,
            max_class_wait_s=args.max_class_wait_ms / 1000,
            instances=args.instances,
        ),
        io_binding=args.io_binding,
        priority_class=PriorityClass(args.priority_class),
        class_tokens=class_tokens,
        clients_file=args.clients_file,
        clients=clients_file.entries if clients_file is not None else (),
        clients_generation=clients_file.generation if clients_file is not None else 0,
        precision=precision,
        fp16_model=args.fp16_model,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        logger.info("event loop: %s", settings.event_loop)
        if settings.event_loop == "uvloop":
            return uvloop.run(serve(settings))
        return asyncio.run(serve(settings))
    except (OSError, ModelLoadError) as err:
        logger.error("%s", err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
