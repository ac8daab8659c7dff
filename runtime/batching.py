"""Dynamic batching by priority class inside one replica: `Batcher`.

Requests to a model whose inputs and outputs all have a dynamic first dimension (the batch
axis) wait in one queue per priority class and are merged into one `session.run` of at most
`BatchPolicy.max_batch_size` rows; each request's outputs are cut back out of the batch's.
Only requests with the same *key* are merged: the same input datatypes, the same sizes beyond
the batch axis and the same requested outputs. Requests are checked (`OnnxModel.prepare`)
before they join: a bad one fails alone and never reaches a batch.

When a batch starts (the event loop, no thread):

- an instance must be free: `--instances K` sessions, each running one batch at a time (on a
  GPU each session has its own CUDA stream, so K batches can overlap);
- the *lead* class is chosen: critical first while its recent share of the replica's time is
  within its weight's share (4 of 4+2+1 when all three are busy), else the class whose oldest
  request has waited `max_class_wait_s` (a bounded wait: no class starves), else the class
  that used the least time for its weight (weighted fair sharing, 4/2/1: the resize policy's
  weights). So a critical request waits behind at most one running batch per instance;
- a class's time is its batches' compute and, per request, its measured cost on the event
  loop (receiving, parsing, answering: `Batcher.overhead_s`, the loop thread's CPU time per
  request outside compute). On a CPU a small model's replica is bound by its loop, not its
  compute, and the loop serves calls in the order they come;
- while the critical class is active (requests queued, or more than `ACTIVE_FRACTION` of the
  recent time used), the other classes are *paced*: together they start batches only while
  their credit lasts, refilled at their weights' share of the wall clock (1/5 beside critical
  alone) and spent by each batch's time (estimated at its start, measured at its end), one
  request a batch (a critical call waits behind one of theirs at most). Unpaced, they would
  fill the loop with their calls and a critical call would queue behind them before it ever
  reached its queue here. Their share is also cut while the loop itself queues (a callback
  made ready every `LAG_PROBE_S` waits past `LAG_TARGET_S`), to a quarter of it at least, and
  grows back when it does not: a loop kept busy is where a critical call waits, whatever the
  weights say. The probe runs only while the critical class is active;
- the batch takes that class's requests with one key, up to `max_batch_size` rows (one
  request of more rows runs alone), round-robin across the class's callers (the clients of
  a shared replica, `runtime.clients`; the deployment's own calls are one more caller): the
  caller served least recently first, then one request of each caller in turn, each
  caller's oldest first; the key is that of the first caller's oldest request. So a client
  flooding its class has one request in each batch while others wait, never all of them.
  Classes are not mixed: a critical batch is as small, and as quick, as the critical load;
- a request whose deadline leaves less than the model's compute time is answered `TooLate`
  (DEADLINE_EXCEEDED) and dropped, never computed for nobody; a cancelled one (its caller
  gone) is dropped too.

With `max_queue_delay_s` 0 (the default) a free instance takes what has queued at once:
batches form from the requests that arrive while the instances are busy, so one client never
waits for company; with D > 0 a batch that is not full waits until its oldest request has
waited D. A request that finds every session free and nothing of its class or a higher one
queued runs at once, recording only its client's part of the compute; the rest of its
bookkeeping is folded in `FOLD_AFTER_S` later (`Batcher._run_alone`). A batch of one request
of a model that computes within `inline_below_s`, or of a few whose rows compute within
`INLINE_BATCH_BELOW_S`, runs on the event loop (no thread hand-off, the latency of an
unbatched call) on a CPU; any larger batch, and every batch on CUDA, runs in its session's
own thread, so the loop keeps parsing the next requests while it computes. A session is run
from that one thread only: ONNX Runtime's CUDA provider keeps state per thread, and a
session run from alternating threads was 10-60x slower on an H200. On CUDA batches are also
padded to sizes warmed at load (`pad_to`).

Each class's queue holds at most `max_queued_per_class` requests, and one client (not the
deployment's own calls) at most `CLIENT_QUEUE_SHARE` of them: past either `QueueFull`
(RESOURCE_EXHAUSTED), so a flooding client leaves room for the rest of its class. Plain
Python over numpy and asyncio: nothing here knows about gRPC.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import itertools
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from runtime.errors import NotReady, QueueFull, RuntimeServerError, TooLate

logger = logging.getLogger(__name__)


class PriorityClass(enum.StrEnum):
    CRITICAL = "critical"
    STANDARD = "standard"
    BEST_EFFORT = "best-effort"


CLASSES = tuple(PriorityClass)
_UP_TO = {c: CLASSES[: CLASSES.index(c) + 1] for c in CLASSES}
"""Each class and those above it."""
WEIGHTS: Mapping[PriorityClass, int] = {
    PriorityClass.CRITICAL: 4,
    PriorityClass.STANDARD: 2,
    PriorityClass.BEST_EFFORT: 1,
}
"""Each class's weight in the compute time it gets when several are busy (the broker's resize
policy weighs deployments the same way)."""

SHARE_HALF_LIFE_S = 1.0
"""How fast the time used by each class is forgotten: its share is of the last few seconds,
not of the replica's life."""
ACTIVE_FRACTION = 0.01
"""A class is active while it has requests queued or has used more than this part of the
replica's recent time (`Batcher._fraction`)."""
LAG_PROBE_S = 0.005
LAG_TARGET_S = 0.0001
MIN_ROOM = 0.25
ROOM_CUT = 0.95
ROOM_STEP = 0.01
"""Every `LAG_PROBE_S` a callback is made ready on the event loop and its wait timed: over
`LAG_TARGET_S` (the loop is queueing calls), the paced classes' rate is cut by `ROOM_CUT`,
to `MIN_ROOM` of their weights' share at least (no class starves); under it, it grows back
by `ROOM_STEP` a probe, to their whole share."""
FOLD_AFTER_S = 0.02
"""How long the bookkeeping of requests that ran alone may wait to be folded in
(`Batcher._fold`); any figure read before then folds it first."""
OVERHEAD_WINDOW_S = 0.1
OVERHEAD_SMOOTHING = 0.2
"""Each request's cost on the event loop (receiving, parsing, answering) is measured over
windows of `OVERHEAD_WINDOW_S` and smoothed by this weight per window."""

MAX_BATCH_SIZE_LIMIT = 4096
MAX_QUEUE_DELAY_LIMIT_S = 1.0
MAX_QUEUED_LIMIT = 100_000
MAX_INSTANCES_LIMIT = 64
MAX_CLASS_WAIT_LIMIT_S = 60.0
INLINE_BATCH_BELOW_S = 0.0005
"""A batch of several requests runs on the event loop when its rows compute within this by
the model's one-request time (a tiny model: the thread hand-off costs more than the run)."""
CLIENT_QUEUE_SHARE = 0.5
"""The part of its class's queue bound one client may fill (rounded up): one flooding
client leaves the other half to the others of its class."""
DEPLOYMENT = ""
"""The caller id of the deployment's own calls (its token's, and those of
`--class-tokens`), to which `CLIENT_QUEUE_SHARE` does not apply; a client's is its id in
the clients file (`runtime.clients`)."""


SWEEP_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Batch sizes timed at load when --max-batch-size is auto (`choose_batch_size`)."""
SWEEP_BUDGET_S = 2.0
MIN_GAIN = 0.1
"""A larger batch is worth its wait when it computes a row at least this much quicker."""


def choose_batch_size(times: Mapping[int, float]) -> int:
    """The batch size to use from the time one run takes at each size (`OnnxModel.
    time_batches`): the sizes are walked up while each computes a row at least `MIN_GAIN`
    quicker than the one before; the last of those. A model whose rows cost the same alone
    or together (a large CNN on a CPU) gets 1: a larger batch would only add the wait for
    the rows before it."""
    chosen = 1
    sizes = sorted(times)
    for smaller, larger in itertools.pairwise(sizes):
        if times[larger] / larger > (1 - MIN_GAIN) * times[smaller] / smaller:
            break
        chosen = larger
    return chosen


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    max_batch_size: int = 32
    """The most rows one `session.run` takes; 1 turns batching off."""
    max_queue_delay_s: float = 0.0
    """How long a batch that is not full may wait for more requests while an instance is
    free (seconds); 0: a free instance runs what has queued at once."""
    max_queued_per_class: int = 1024
    """Requests one class may have waiting; more are refused (`QueueFull`)."""
    max_class_wait_s: float = 0.1
    """A class whose oldest request has waited this long leads the next batch (seconds)."""
    instances: int = 1
    """Sessions of the model, each running one batch at a time."""

    def __post_init__(self) -> None:
        check_range("max-batch-size", self.max_batch_size, 1, MAX_BATCH_SIZE_LIMIT)
        check_range("max-queue-delay", self.max_queue_delay_s, 0.0, MAX_QUEUE_DELAY_LIMIT_S)
        check_range("max-queued-per-class", self.max_queued_per_class, 1, MAX_QUEUED_LIMIT)
        check_range("max-class-wait", self.max_class_wait_s, 0.0, MAX_CLASS_WAIT_LIMIT_S)
        check_range("instances", self.instances, 1, MAX_INSTANCES_LIMIT)


def check_range(name: str, value: float, low: float, high: float) -> None:
    """ValueError naming `name` unless `value` is a finite number in [low, high]."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low:g} and {high:g}, not {value!r}")


def client_bound(max_queued_per_class: int) -> int:
    """The most requests one client may have queued in its class (`CLIENT_QUEUE_SHARE`)."""
    return math.ceil(max_queued_per_class * CLIENT_QUEUE_SHARE)


def client_queue_full(
    client: str, held: int, cls: PriorityClass, max_queued_per_class: int
) -> QueueFull:
    """The refusal of a request of `client`, which has `held` requests of `cls` queued."""
    return QueueFull(
        f"client {client} has {held} {cls} requests queued already, the most one client may "
        f"hold ({CLIENT_QUEUE_SHARE:.0%} of --max-queued-per-class {max_queued_per_class}); "
        "retry with backoff"
    )


class Runner(Protocol):
    """What the batcher runs a batch on: `OnnxModel` (one session). `run` blocks."""

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> list[np.ndarray]: ...


BatchObserver = Callable[[PriorityClass, int, float, Sequence[float]], None]
"""Called on the event loop after each batch: its class, its rows, its compute time (s) and
each request's wait in the queue (s)."""

AloneObserver = Callable[[PriorityClass, int, Sequence[float]], None]
"""Called on the event loop for the requests that ran alone on the loop without waiting
(`Batcher`'s lone path), a few milliseconds after them and before any figure is read: their
class, the rows each had, and each one's compute time (s). Each is a batch of its rows that
waited 0 s, as a `BatchObserver` would have been told one by one."""

RefusalObserver = Callable[[PriorityClass], None]
"""Called on the event loop for each request refused `QueueFull` because its class's queue
was full, with its class."""

ClientComputeObserver = Callable[[str, float], None]
"""Called on the event loop after each batch, once per request of a client (not the
deployment's): its client id and its part of the batch's compute time (s), by rows."""

Key = tuple[tuple[str, ...], tuple[tuple[str, str, tuple[int, ...]], ...]]


@dataclass(slots=True, eq=False)
class _Pending:
    feeds: Mapping[str, np.ndarray]
    names: tuple[str, ...]
    key: Key
    rows: int
    deadline: float | None
    """`time.monotonic()` after which nobody waits for the answer; None: no deadline."""
    arrived: float
    future: asyncio.Future[list[np.ndarray]]
    client: str = DEPLOYMENT


@dataclass(slots=True)
class _ClassState:
    queue: deque[_Pending] = field(default_factory=deque)
    used_s: float = 0.0
    """Time used, decayed by `SHARE_HALF_LIFE_S`: its batches' compute and its requests'
    cost on the event loop (`Batcher.overhead_s` each)."""
    total_s: float = 0.0
    """Compute time used since the start (for the metrics)."""
    served: dict[str, int] = field(default_factory=dict)
    """The turn at which each caller with requests queued was last served (round-robin);
    a caller with none queued is forgotten, and goes first when it comes back."""
    per_client: dict[str, int] = field(default_factory=dict)
    """Requests queued per caller (those with some)."""


def batch_key(feeds: Mapping[str, np.ndarray], names: Sequence[str]) -> Key:
    """What must be equal for two requests to share a batch."""
    shape_key = tuple((n, a.dtype.str, a.shape[1:]) for n, a in feeds.items())
    return tuple(names), tuple(sorted(shape_key))


def request_rows(feeds: Mapping[str, np.ndarray]) -> int:
    """A request's rows: its inputs' first dimension (checked equal across them before)."""
    return next(iter(feeds.values())).shape[0] if feeds else 1


class Batcher:
    """Queues, batches and runs one model's inferences (see the module docstring). Event
    loop only, except `close`."""

    def __init__(
        self,
        instances: Sequence[Runner],
        policy: BatchPolicy,
        compute_s: float,
        inline_below_s: float,
        observe: BatchObserver | None = None,
        pad_to: Sequence[int] = (),
        on_refused: RefusalObserver | None = None,
        on_client_compute: ClientComputeObserver | None = None,
        observe_alone: AloneObserver | None = None,
    ) -> None:
        """`instances`: `policy.instances` sessions of one model with a dynamic batch axis;
        `compute_s`: its compute time for one request (warm-up), the least a request's
        deadline must leave; `inline_below_s`: a lone request of a model computing within it
        runs on the loop (negative: never, as a CUDA session must not: each session keeps to
        its own thread); `pad_to`: the batch sizes to run (a batch is padded to the least of
        them that holds it; one larger than all runs as it is), empty for any size;
        `on_refused`: told of each request refused because its class's queue was full;
        `on_client_compute`: told of each client's part of each batch's compute;
        `observe_alone`: told of the requests that ran alone (`_run_alone`), folded.

        Why pad: CUDA's convolutions are tuned per input shape at their first run (ONNX
        Runtime's exhaustive cuDNN search, tens of milliseconds a shape), so every new batch
        size stalls its batch; with the sizes warmed at load, no batch meets a new shape."""
        if len(instances) != policy.instances:
            raise ValueError(f"{len(instances)} sessions for {policy.instances} instances")
        self._policy = policy
        self._free = list(instances)
        self._compute_s = compute_s
        self._inline = compute_s <= inline_below_s
        self._alone_ready = self._inline and not policy.max_queue_delay_s and not pad_to
        """Whether a request may take the lone path before any other check (`infer`)."""
        self._observe = observe
        self._observe_alone = observe_alone
        self._on_refused = on_refused
        self._on_client_compute = on_client_compute
        self._client_bound = client_bound(policy.max_queued_per_class)
        self._turn = 0
        self._classes = {c: _ClassState() for c in CLASSES}
        self._queued = 0
        self._next_expiry = math.inf
        """The earliest `time.monotonic()` at which a queued request's deadline leaves less
        than the compute time (`_drop_unwanted` looks at the queues only from then on, or
        after a caller cancelled)."""
        self._cancelled = False
        self._decayed_at = time.monotonic()
        self._credit = 0.0
        """Seconds of the replica's time the non-critical classes may still use while
        paced; below zero they wait (`_lower_rate`)."""
        self._credited_at = self._decayed_at
        self._pacing = False
        self._overhead_s = 0.0
        self._window: tuple[float, float] | None = None
        """When the overhead window began (`time.monotonic()`) and the loop thread's CPU
        time then (`time.thread_time()`); None before the first batch."""
        self._window_requests = 0
        self._window_inline_s = 0.0
        self._room = 1.0
        """How much of their weights' share the paced classes get now (`_probed`)."""
        self._probing = False
        self._quiet = True
        """The critical class was found inactive (`_may_start`) and no critical request has
        come since: the other classes are not paced, and a lone one may run at once."""
        self._alone: dict[tuple[PriorityClass, int], list[float]] = {}
        """The compute times of the requests that ran alone since the last fold, by class
        and rows (`_run_alone`)."""
        self._fold_timer: asyncio.TimerHandle | None = None
        # Each session has a thread of its own and is run from no other: ONNX Runtime's CUDA
        # provider keeps per-thread state, and one session run from alternating threads took
        # 10-60x its time on an H200. The threads start later, from the loop's thread, which
        # `runtime.server` may pin to one CPU by then: they take the CPUs the process has now.
        cpus = os.sched_getaffinity(0)
        self._threads = {
            id(runner): ThreadPoolExecutor(
                1,
                thread_name_prefix=f"batch-{index}",
                initializer=os.sched_setaffinity,
                initargs=(0, cpus),
            )
            for index, runner in enumerate(instances)
        }
        self._pad_to = sorted(pad_to)
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def queued(self) -> int:
        return self._queued

    def queued_in(self, cls: PriorityClass) -> int:
        return len(self._classes[cls].queue)

    @property
    def overhead_s(self) -> float:
        """Each request's measured cost on the event loop (its thread's CPU time outside the
        compute it runs, per request), charged to its class beside its batch's compute."""
        self._decay(time.monotonic())
        return self._overhead_s

    @property
    def paced_share(self) -> float:
        """The part of the wall clock the non-critical classes may use together while the
        critical class is active, now (`_lower_rate`)."""
        self._decay(time.monotonic())
        return self._lower_rate()

    def compute_seconds(self, cls: PriorityClass) -> float:
        """Compute time the class's batches used since the start (each batch's time, whole:
        classes are never mixed in one batch)."""
        self._decay(time.monotonic())
        return self._classes[cls].total_s

    async def infer(
        self,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        cls: PriorityClass,
        deadline: float | None,
        client: str = DEPLOYMENT,
    ) -> list[np.ndarray]:
        """The outputs `names` for checked `feeds`, computed in a batch with others of the
        same key. QueueFull when `cls` has `max_queued_per_class` waiting, or `client` (a
        client's id; `DEPLOYMENT` for the deployment's calls) its share; TooLate when the
        deadline (`time.monotonic()`) leaves less than the compute time before it starts;
        NotReady once closed; the model's own errors (InvalidInput, InferenceFailed) pass
        through. Cancelling the caller drops the request if its batch has not started."""
        if self._closed:
            raise _shutting_down()
        if cls is PriorityClass.CRITICAL:
            self._quiet = False
            if not self._probing:
                self._probing = True  # while the critical class is active (`_probed`)
                asyncio.get_running_loop().call_later(LAG_PROBE_S, self._probe)
        if (
            self._alone_ready
            and not self._queued
            and len(self._free) == self._policy.instances
            and (self._quiet or cls is PriorityClass.CRITICAL)
        ):
            # The lone path, checked first: nothing waits, nothing is paced.
            return self._run_alone(feeds, names, cls, deadline, client, None)
        state = self._classes[cls]
        if len(state.queue) >= self._policy.max_queued_per_class:
            if self._on_refused is not None:
                self._on_refused(cls)
            raise QueueFull(
                f"{len(state.queue)} {cls} requests are queued already, the most this replica "
                f"holds per class (--max-queued-per-class); retry with backoff"
            )
        held = state.per_client.get(client, 0)
        if client != DEPLOYMENT and held >= self._client_bound:
            raise client_queue_full(client, held, cls, self._policy.max_queued_per_class)
        rows = request_rows(feeds)
        if self._idle_inline(rows, cls) and self._may_start(cls, time.monotonic()):
            charged = self._spend(cls, 1, rows)
            return self._run_alone(feeds, names, cls, deadline, client, charged)
        loop = asyncio.get_running_loop()
        arrived = time.monotonic()
        pending = _Pending(
            feeds, tuple(names), batch_key(feeds, names), rows, deadline, arrived,
            loop.create_future(), client,
        )  # fmt: skip
        state.queue.append(pending)
        state.per_client[client] = held + 1
        self._queued += 1
        if deadline is not None:
            self._next_expiry = min(self._next_expiry, deadline - self._compute_s)
        self._schedule(loop)
        try:
            return await pending.future
        except asyncio.CancelledError:
            self._cancelled = True
            raise

    async def on_each_instance(self, work: Callable[[Runner], object]) -> None:
        """Run `work` on each session in the session's own thread, all at once (before the
        first request: warming a device's per-thread state and per-shape tuning where the
        batches will run). Blocking work, awaited."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(
                loop.run_in_executor(self._threads[id(runner)], work, runner)
                for runner in list(self._free)
            )
        )

    def close(self) -> None:
        """Refuse new requests, fail the queued ones (NotReady: UNAVAILABLE), and stop
        the threads once their batch is done (not waited for)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._fold_timer is not None:
            self._fold_timer.cancel()
            self._fold_timer = None
        for state in self._classes.values():
            while state.queue:
                pending = state.queue.popleft()
                if not pending.future.done():
                    pending.future.set_exception(_shutting_down())
            state.per_client.clear()
            state.served.clear()
        self._queued = 0
        for thread in self._threads.values():
            thread.shutdown(wait=False, cancel_futures=True)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        # After the callbacks that are ready now: the handlers of calls that arrived together
        # queue their requests before the batch is cut.
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        loop = asyncio.get_running_loop()
        while self._free and self._queued and not self._closed:
            now = time.monotonic()
            self._drop_unwanted(now)
            cls = self._lead(now)
            if cls is None:
                if self._queued:  # waiting only for the paced classes' credit to come back
                    wait = -self._credit / self._lower_rate()
                    self._timer = loop.call_at(loop.time() + wait, self._schedule, loop)
                return
            paced = cls is not PriorityClass.CRITICAL and self._pacing
            if self._policy.max_queue_delay_s:
                batch, rows, full = self._take(self._classes[cls], peek=True, one=paced)
                wait_until = min(p.arrived for p in batch) + self._policy.max_queue_delay_s
                if not full and now < wait_until:
                    self._timer = loop.call_at(
                        loop.time() + (wait_until - now), self._schedule, loop
                    )
                    return
            batch, rows, _ = self._take(self._classes[cls], peek=False, one=paced)
            self._queued -= len(batch)
            charged = self._spend(cls, len(batch), rows)
            runner = self._free.pop()
            waits = [now - p.arrived for p in batch]
            if self._runs_inline(len(batch), rows):
                self._run_inline(runner, cls, batch, rows, waits, charged)
            else:
                task = loop.run_in_executor(
                    self._threads[id(runner)], _run_batch, runner, batch, rows, self._padded(rows)
                )
                task.add_done_callback(
                    functools.partial(
                        self._finished,
                        runner=runner,
                        cls=cls,
                        batch=batch,
                        waits=waits,
                        charged=charged,
                    )
                )

    def _runs_inline(self, requests: int, rows: int) -> bool:
        """Whether a batch runs on the loop: one request of a model that computes within
        `inline_below_s`, or a few whose rows compute within `INLINE_BATCH_BELOW_S` by the
        one-request time (the hand-off to a thread and back costs more), and no padding."""
        if not self._inline or self._padded(rows) != rows:
            return False
        return requests == 1 or rows * self._compute_s <= INLINE_BATCH_BELOW_S

    def _padded(self, rows: int) -> int:
        return next((size for size in self._pad_to if size >= rows), rows)

    def _drop_unwanted(self, now: float) -> None:
        """Answer TooLate to each queued request whose deadline leaves less than the
        compute time, and forget cancelled ones (a look at the queues only when one may be
        due, or a caller cancelled: `_next_expiry`)."""
        if now < self._next_expiry and not self._cancelled:
            return
        self._cancelled = False
        self._next_expiry = math.inf
        for cls, state in self._classes.items():
            if not state.queue:
                continue
            kept: deque[_Pending] = deque()
            for pending in state.queue:
                if pending.future.done():
                    _forget(state, pending)
                    continue
                if pending.deadline is not None and pending.deadline - now < self._compute_s:
                    left = max(pending.deadline - now, 0.0)
                    pending.future.set_exception(
                        TooLate(
                            f"ModelInfer: {left * 1000:.1f} ms left of the call's deadline "
                            f"after {(now - pending.arrived) * 1000:.1f} ms in the {cls} "
                            f"queue, under the model's compute time "
                            f"({self._compute_s * 1000:.1f} ms); not computed"
                        )
                    )
                    _forget(state, pending)
                    continue
                kept.append(pending)
                if pending.deadline is not None:
                    self._next_expiry = min(self._next_expiry, pending.deadline - self._compute_s)
            self._queued -= len(state.queue) - len(kept)
            state.queue = kept

    def _lead(self, now: float) -> PriorityClass | None:
        """The class whose requests form the next batch (see the module docstring); None
        when nothing is queued or none may start now (the paced classes' credit is out)."""
        self._decay(now)
        busy = [c for c in CLASSES if self._classes[c].queue]
        if not busy:
            return None
        critical = PriorityClass.CRITICAL
        lower = [c for c in busy if c is not critical]
        lower_may = bool(lower) and self._may_start(lower[0], now)
        if critical in busy:
            weight_sum = sum(WEIGHTS[c] for c in CLASSES if self._recently_active(c))
            used_sum = sum(s.used_s for s in self._classes.values())
            share = self._classes[critical].used_s / used_sum if used_sum > 0 else 0.0
            if not lower_may or share <= WEIGHTS[critical] / max(weight_sum, WEIGHTS[critical]):
                return critical
        if not lower_may:
            return None
        waited = [
            (now - self._classes[c].queue[0].arrived, c)
            for c in busy
            if now - self._classes[c].queue[0].arrived >= self._policy.max_class_wait_s
        ]
        if waited:
            return max(waited)[1]
        return min(busy, key=lambda c: (self._classes[c].used_s / WEIGHTS[c], CLASSES.index(c)))

    def _may_start(self, cls: PriorityClass, now: float) -> bool:
        """Whether a batch of `cls` may start now: always for the critical class; for the
        others, while the critical class is active, only with credit left (refilled at
        `_lower_rate`, up to one request's cost)."""
        if cls is PriorityClass.CRITICAL:
            return True
        self._decay(now)
        elapsed = now - self._credited_at
        self._credited_at = now
        self._pacing = self._recently_active(PriorityClass.CRITICAL)
        if not self._pacing:
            self._credit = 0.0
            self._quiet = True
            return True
        self._credit = min(self._credit + elapsed * self._lower_rate(), self._request_cost())
        return self._credit >= 0

    def _lower_rate(self) -> float:
        """The part of the replica's time the non-critical classes may use together while
        the critical class is active: their weights' share beside it (1 of 4+1 for the
        best-effort class alone, 3 of 4+2+1 for both). Paced to it, not given what the
        critical class leaves: a saturated event loop is a FIFO queue, and a critical call
        arriving behind the others' calls waits for each of them."""
        critical = WEIGHTS[PriorityClass.CRITICAL]
        lower = sum(WEIGHTS[c] for c in CLASSES[1:] if self._recently_active(c))
        lower = lower or WEIGHTS[PriorityClass.BEST_EFFORT]
        return lower / (critical + lower) * self._room

    @staticmethod
    def _fraction(state: _ClassState) -> float:
        """The part of the replica's recent time a class used (its decayed time over the
        decayed length of time, `SHARE_HALF_LIFE_S` / ln 2)."""
        return state.used_s * math.log(2) / SHARE_HALF_LIFE_S

    def _request_cost(self) -> float:
        return self._overhead_s + self._compute_s

    def _spend(self, cls: PriorityClass, requests: int, rows: int) -> float | None:
        """Take a starting batch's estimated time off the credit when paced, and return
        the compute part of it (for `_account` to put its measured time in its place); None
        when not paced."""
        if cls is PriorityClass.CRITICAL or not self._pacing:
            return None
        compute = rows * self._compute_s
        self._credit -= requests * self._overhead_s + compute
        return compute

    def _recently_active(self, cls: PriorityClass) -> bool:
        state = self._classes[cls]
        return bool(state.queue) or self._fraction(state) > ACTIVE_FRACTION

    def _decay(self, now: float) -> None:
        """Bring each class's decayed time to `now`, and fold in the requests that ran alone
        since the last fold (`_fold`): whatever reads a class's time calls this first."""
        elapsed = now - self._decayed_at
        if elapsed > 0:
            factor = 0.5 ** (elapsed / SHARE_HALF_LIFE_S)
            for state in self._classes.values():
                state.used_s *= factor
            self._decayed_at = now
        if self._alone:
            self._fold(now)

    def _fold(self, now: float) -> None:
        """Account the requests that ran alone since the last fold as `_account` would have
        one by one (their time counted at `now`, at most `FOLD_AFTER_S` late: a small part
        of `SHARE_HALF_LIFE_S`), and tell `observe_alone`."""
        if self._fold_timer is not None:
            self._fold_timer.cancel()
            self._fold_timer = None
        alone, self._alone = self._alone, {}
        requests, inline_s = 0, 0.0
        for (cls, rows), times in alone.items():
            seconds = math.fsum(times)
            self._charge(cls, seconds, len(times))
            requests += len(times)
            inline_s += seconds
            if self._observe_alone is not None:
                self._observe_alone(cls, rows, times)
        self._measure_overhead(now, requests, inline_s)

    def _charge(self, cls: PriorityClass, seconds: float, requests: int) -> None:
        """Count `seconds` of compute for `requests` of `cls`: its decayed time (with each
        request's loop cost) and its total."""
        state = self._classes[cls]
        state.used_s += seconds + self._overhead_s * requests
        state.total_s += seconds

    def _folded(self) -> None:
        """The fold's timer (`FOLD_AFTER_S` after the first request left unfolded)."""
        self._fold_timer = None
        if not self._closed:
            self._decay(time.monotonic())

    def _take(
        self, state: _ClassState, peek: bool, one: bool = False
    ) -> tuple[list[_Pending], int, bool]:
        """The class's next batch, round-robin across its callers (see the module
        docstring), or its next request alone if `one` (paced): (its requests, their rows,
        whether it is full). Removed from the queue, and the callers' turns recorded, unless
        `peek`."""
        by_caller: dict[str, list[_Pending]] = {}
        for pending in state.queue:  # oldest first, so each caller's list is too
            if not pending.future.done():
                by_caller.setdefault(pending.client, []).append(pending)
        # Least recently served first; ties (never served) in the order they queued.
        order = sorted(by_caller, key=lambda caller: state.served.get(caller, -1))
        head = by_caller[order[0]][0]
        limit = self._policy.max_batch_size
        batch = [head]
        rows = head.rows
        if rows < limit and not one:
            same_key = [[p for p in by_caller[c] if p.key == head.key] for c in order]
            batch, rows = _round_robin(same_key, limit)
        if not peek:
            taken = set(map(id, batch))
            remaining = deque(p for p in state.queue if id(p) not in taken)
            state.queue.clear()
            state.queue.extend(remaining)
            for pending in batch:
                state.served[pending.client] = self._turn
                self._turn += 1
                _forget(state, pending)
        return batch, rows, rows >= limit or one

    def _idle_inline(self, rows: int, cls: PriorityClass) -> bool:
        """Whether a request of `rows` and `cls` runs at once, on the loop, as if unbatched:
        the model runs inline, no queue delay is asked for, nothing of its class or a higher
        one waits, and every session is free. (Lower classes' requests may wait: they come
        after it anyway.)"""
        return (
            self._inline
            and not self._policy.max_queue_delay_s
            and len(self._free) == self._policy.instances
            and (not self._queued or not any(self._classes[c].queue for c in _UP_TO[cls]))
            and (not self._pad_to or self._padded(rows) == rows)
        )

    def _run_alone(
        self,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        cls: PriorityClass,
        deadline: float | None,
        client: str,
        charged: float | None,
    ) -> list[np.ndarray]:
        """A lone request of an inline model, with nothing else to do: run it here, with no
        queue, future or hop through the loop (on a CPU a tiny model's requests never queue,
        the loop being theirs while each computes, so the batcher would only add its own
        cost: 10-20 % of the MLP's throughput at 16 clients in bench.serving). Its client's
        part of the compute is recorded at once; the rest of the bookkeeping (the class's
        time, the loop's cost per request, the compute histogram, the batching series) is
        folded in `FOLD_AFTER_S` later, or before any of it is read (`_fold`): a call of a
        model that computes in tens of microseconds pays for little else."""
        if deadline is not None and deadline - time.monotonic() < self._compute_s:
            left = max(deadline - time.monotonic(), 0.0)
            raise TooLate(
                f"ModelInfer: {left * 1000:.1f} ms left of the call's deadline, under the "
                f"model's compute time ({self._compute_s * 1000:.1f} ms); not computed"
            )
        runner = self._free.pop()
        started = time.perf_counter()
        try:
            return runner.run(feeds, names)
        finally:
            seconds = time.perf_counter() - started
            self._free.append(runner)
            if charged is not None:
                self._credit += charged - seconds
            key = (cls, request_rows(feeds))
            times = self._alone.get(key)
            if times is None:
                times = self._alone[key] = []
                if self._fold_timer is None:
                    loop = asyncio.get_running_loop()
                    self._fold_timer = loop.call_later(FOLD_AFTER_S, self._folded)
            times.append(seconds)
            if self._on_client_compute is not None and client != DEPLOYMENT:
                self._on_client_compute(client, seconds)
            if self._queued and not self._closed:
                self._schedule(asyncio.get_running_loop())

    def _run_inline(
        self,
        runner: Runner,
        cls: PriorityClass,
        batch: list[_Pending],
        rows: int,
        waits: list[float],
        charged: float | None,
    ) -> None:
        """`_run_batch` on the loop's thread, answering each request."""
        try:
            answers, seconds = _run_batch(runner, batch, rows, rows)
        except Exception as err:  # not ours: the caller's error mapper logs it as a bug
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(err)
            self._free.append(runner)
            return
        _answer(batch, answers)
        self._account(
            runner, cls, seconds, [(p.client, p.rows) for p in batch], waits, True, charged
        )

    def _finished(
        self,
        done: asyncio.Future[tuple[list[list[np.ndarray] | RuntimeServerError], float]],
        runner: Runner,
        cls: PriorityClass,
        batch: list[_Pending],
        waits: list[float],
        charged: float | None,
    ) -> None:
        """On the loop, after a batch's thread: answer each request, free the instance."""
        if done.cancelled() or done.exception() is not None:
            # Cancelled: the executor shut down before the batch ran. An exception that is
            # not ours is a bug: each caller's error mapper logs it and answers INTERNAL.
            error = done.exception() if not done.cancelled() else None
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error or _shutting_down())
            self._free.append(runner)
            return
        answers, seconds = done.result()
        _answer(batch, answers)
        self._account(
            runner, cls, seconds, [(p.client, p.rows) for p in batch], waits, False, charged
        )

    def _account(
        self,
        runner: Runner,
        cls: PriorityClass,
        seconds: float,
        callers: Sequence[tuple[str, int]],
        waits: list[float],
        on_loop: bool,
        charged: float | None = None,
    ) -> None:
        """Record a batch's compute time (each caller's part by its rows) and free the
        instance. `callers`: each request's caller and rows; `on_loop`: whether it computed
        on the event loop's thread; `charged`: the compute its paced class's credit paid
        for it by estimate, replaced now by what it took (None: not paced)."""
        rows = sum(r for _, r in callers)
        now = time.monotonic()
        self._decay(now)
        self._measure_overhead(now, len(callers), seconds if on_loop else 0.0)
        self._charge(cls, seconds, len(callers))
        if charged is not None:
            self._credit += charged - seconds
        self._free.append(runner)
        if self._observe is not None:
            self._observe(cls, rows, seconds, waits)
        if self._on_client_compute is not None:
            for client, client_rows in callers:
                if client != DEPLOYMENT:
                    self._on_client_compute(client, seconds * client_rows / rows)
        if self._queued and not self._closed:
            self._schedule(asyncio.get_running_loop())

    def _probe(self) -> None:
        if not self._closed:
            asyncio.get_running_loop().call_soon(self._probed, time.perf_counter())

    def _probed(self, made_ready: float) -> None:
        """How long a callback made ready waited for the loop: past `LAG_TARGET_S`, the
        paced classes' room shrinks (to `MIN_ROOM` at least), else it grows back to their
        whole share. What a critical call waits for, at each of its steps on the loop. The
        probing stops (and the room is whole again) once the critical class is not active:
        an idle replica is not woken 200 times a second."""
        if time.perf_counter() - made_ready > LAG_TARGET_S:
            self._room = max(MIN_ROOM, self._room * ROOM_CUT)
        else:
            self._room = min(1.0, self._room + ROOM_STEP)
        self._decay(time.monotonic())
        if self._recently_active(PriorityClass.CRITICAL):
            asyncio.get_running_loop().call_later(LAG_PROBE_S, self._probe)
        else:
            self._probing = False
            self._room = 1.0

    def _measure_overhead(self, now: float, requests: int, inline_s: float) -> None:
        """Count `requests` answered, of which `inline_s` computing on the loop, and close
        the window when it has lasted `OVERHEAD_WINDOW_S`: the loop thread's CPU time in it,
        less that compute, per request (a request's cost to the loop whatever its class).
        On the loop's thread."""
        if self._window is None:
            self._window = (now, time.thread_time())
            return
        self._window_requests += requests
        self._window_inline_s += inline_s
        began, cpu = self._window
        if now - began < OVERHEAD_WINDOW_S:
            return
        thread_cpu = time.thread_time()
        per_request = max(0.0, thread_cpu - cpu - self._window_inline_s) / self._window_requests
        self._overhead_s += OVERHEAD_SMOOTHING * (per_request - self._overhead_s)
        self._window = (now, thread_cpu)
        self._window_requests = 0
        self._window_inline_s = 0.0


def _answer(
    batch: Sequence[_Pending], answers: Sequence[list[np.ndarray] | RuntimeServerError]
) -> None:
    """Each request's outputs, or its error, to its caller (unless it has gone)."""
    for pending, answer in zip(batch, answers, strict=True):
        if pending.future.done():
            continue
        if isinstance(answer, RuntimeServerError):
            pending.future.set_exception(answer)
        else:
            pending.future.set_result(answer)


def _round_robin(lists: Sequence[Sequence[_Pending]], limit: int) -> tuple[list[_Pending], int]:
    """The first of each list in turn, then the second of each ... until `limit` rows, or
    one that does not fit: (them, their rows)."""
    batch: list[_Pending] = []
    rows = 0
    for depth in range(max(map(len, lists))):
        for requests in lists:
            if depth >= len(requests):
                continue
            pending = requests[depth]
            if rows + pending.rows > limit:
                return batch, rows
            batch.append(pending)
            rows += pending.rows
            if rows == limit:
                return batch, rows
    return batch, rows


def _forget(state: _ClassState, pending: _Pending) -> None:
    """`pending` has left `state`'s queue: count it off its caller's, and forget the
    caller's turn when it has none left."""
    left = state.per_client[pending.client] - 1
    if left:
        state.per_client[pending.client] = left
    else:
        del state.per_client[pending.client]
        state.served.pop(pending.client, None)


def _shutting_down() -> NotReady:
    return NotReady("the server is draining (shutting down); retry on the new endpoint")


def _run_batch(
    runner: Runner, batch: Sequence[_Pending], rows: int, size: int
) -> tuple[list[list[np.ndarray] | RuntimeServerError], float]:
    """In an instance's thread: one run of the merged feeds, padded to `size` rows with
    copies of the last row (a shape warmed at load), cut back per request. Returns each
    request's outputs or error, and the compute time.

    When the merged run fails (a value one request carries that the model rejects, such as
    a token id past the vocabulary), or its outputs do not have `size` rows (a model that
    mixes rows), the requests are run again one by one: a bad request fails alone and every
    answer is its own request's."""
    started = time.perf_counter()
    head = batch[0]
    if len(batch) > 1 or size > rows:
        feeds = {name: _merged([p.feeds[name] for p in batch], size - rows) for name in head.feeds}
        try:
            outputs = runner.run(feeds, head.names)
        except RuntimeServerError as err:
            logger.info("a batch of %d failed (%s): running them one by one", len(batch), err)
        else:
            if all(o.ndim > 0 and o.shape[0] == size for o in outputs):
                answers: list[list[np.ndarray] | RuntimeServerError] = []
                start = 0
                for pending in batch:
                    end = start + pending.rows
                    answers.append([o[start:end] for o in outputs])
                    start = end
                return answers, time.perf_counter() - started
            logger.warning(
                "a batch of %d rows gave outputs of shapes %s: running its requests one by one",
                size,
                [list(o.shape) for o in outputs],
            )
    return [_run_one(runner, p) for p in batch], time.perf_counter() - started


def _merged(arrays: list[np.ndarray], pad: int) -> np.ndarray:
    """`arrays` one after the other on the first axis, and `pad` copies of the last row."""
    if pad:
        arrays = [*arrays, np.repeat(arrays[-1][-1:], pad, axis=0)]
    return np.concatenate(arrays, axis=0)


def _run_one(runner: Runner, pending: _Pending) -> list[np.ndarray] | RuntimeServerError:
    try:
        return runner.run(pending.feeds, pending.names)
    except RuntimeServerError as err:
        return err
