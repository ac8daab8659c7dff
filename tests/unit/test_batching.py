"""`runtime.batching.Batcher` on real ONNX Runtime sessions of a small model: padding, the
order of classes, deadlines, cancellation and the queue bound.

Where a test must hold a batch running to build a queue behind it, the session is wrapped
in `Gate`, which waits for the test's go before each run and records what ran: the order
is then decided by the batcher alone, never by timing."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from runtime.batching import (
    Batcher,
    BatchPolicy,
    PriorityClass,
    check_range,
    choose_batch_size,
)
from runtime.errors import QueueFull, TooLate
from runtime.model import OnnxModel
from tests.batching_support import build_mixer

CRITICAL, STANDARD, BEST_EFFORT = (
    PriorityClass.CRITICAL,
    PriorityClass.STANDARD,
    PriorityClass.BEST_EFFORT,
)


@pytest.fixture(scope="module")
def mixer(tmp_path_factory: pytest.TempPathFactory) -> OnnxModel:
    path = build_mixer(tmp_path_factory.mktemp("models") / "mixer.onnx")
    return OnnxModel.load(Path(path), "mixer", device="cpu", intra_op_threads=1)


class Gate:
    """A session that runs only when the test lets it, recording each run's first `x`
    values (each request below has a distinct one)."""

    def __init__(self, model: OnnxModel) -> None:
        self._model = model
        self._go = threading.Semaphore(0)
        self.runs: list[list[float]] = []
        self.started = threading.Event()

    def allow(self, runs: int = 1) -> None:
        for _ in range(runs):
            self._go.release()

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> list[np.ndarray]:
        self.started.set()
        assert self._go.acquire(timeout=30), "the test never let the run go"
        self.runs.append([float(v) for v in feeds["x"][:, 0]])
        return self._model.run(feeds, outputs)


class Slow:
    """A session whose every run takes `seconds` more, whatever its rows."""

    def __init__(self, model: OnnxModel, seconds: float) -> None:
        self._model = model
        self._seconds = seconds

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> list[np.ndarray]:
        time.sleep(self._seconds)
        return self._model.run(feeds, outputs)


def feeds(value: float, rows: int = 1) -> dict[str, np.ndarray]:
    x = np.full((rows, 2), value, dtype=np.float32)
    x[:, 1] = np.arange(rows)
    return {"x": x, "ids": np.zeros((rows, 3), dtype=np.int64)}


def batcher(runner: object, **policy: object) -> Batcher:
    return Batcher(
        [runner],  # type: ignore[list-item]
        BatchPolicy(**policy),  # type: ignore[arg-type]
        compute_s=0.0,
        inline_below_s=-1.0,  # never inline: the gate would hold the loop
    )


async def wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


async def test_padded_batches_answer_each_request_with_its_own_rows(mixer: OnnxModel) -> None:
    runs: list[int] = []

    class Counting:
        def run(self, f: Mapping[str, np.ndarray], o: Sequence[str]) -> list[np.ndarray]:
            runs.append(len(f["x"]))
            return mixer.run(f, o)

    queue = Batcher([Counting()], BatchPolicy(max_batch_size=8), 0.0, -1.0, pad_to=(1, 2, 4, 8))
    try:
        requests = [feeds(float(i), rows) for i, rows in enumerate([1, 2, 2])]
        answers = await asyncio.gather(
            *(queue.infer(r, ("y", "s"), STANDARD, None) for r in requests)
        )
    finally:
        queue.close()
    for request, (y, s) in zip(requests, answers, strict=True):
        expected_y, expected_s = mixer.run(request, ("y", "s"))
        assert np.array_equal(y, expected_y) and np.array_equal(s, expected_s)
    assert runs == [8]  # 5 rows together, padded to the next warmed size


async def test_a_critical_request_runs_next_after_the_running_batch(mixer: OnnxModel) -> None:
    gate = Gate(mixer)
    queue = batcher(gate, max_batch_size=4)
    try:
        first = asyncio.ensure_future(queue.infer(feeds(0), ("y",), BEST_EFFORT, None))
        await wait_for(gate.started.is_set, "the first batch never started")
        waiting = [
            asyncio.ensure_future(queue.infer(feeds(float(v)), ("y",), BEST_EFFORT, None))
            for v in (1, 2, 3)
        ]
        critical = asyncio.ensure_future(queue.infer(feeds(9), ("y",), CRITICAL, None))
        await wait_for(lambda: queue.queued == 4, "the requests never queued")
        gate.allow(3)
        await asyncio.gather(first, critical, *waiting)
    finally:
        queue.close()
    assert gate.runs == [[0.0], [9.0], [1.0, 2.0, 3.0]]


async def test_an_expired_request_is_dropped_before_it_runs(mixer: OnnxModel) -> None:
    gate = Gate(mixer)
    queue = batcher(gate, max_batch_size=4)
    try:
        first = asyncio.ensure_future(queue.infer(feeds(0), ("y",), STANDARD, None))
        await wait_for(gate.started.is_set, "the first batch never started")
        late = asyncio.ensure_future(
            queue.infer(feeds(5), ("y",), STANDARD, time.monotonic() + 0.01)
        )
        kept = asyncio.ensure_future(queue.infer(feeds(6), ("y",), STANDARD, None))
        await wait_for(lambda: queue.queued == 2, "the requests never queued")
        await asyncio.sleep(0.02)  # the deadline passes while the first batch holds
        gate.allow(2)
        with pytest.raises(TooLate):
            await late
        await asyncio.gather(first, kept)
    finally:
        queue.close()
    assert gate.runs == [[0.0], [6.0]]


async def test_a_cancelled_request_is_never_computed(mixer: OnnxModel) -> None:
    gate = Gate(mixer)
    queue = batcher(gate, max_batch_size=4)
    try:
        first = asyncio.ensure_future(queue.infer(feeds(0), ("y",), STANDARD, None))
        await wait_for(gate.started.is_set, "the first batch never started")
        gone = asyncio.ensure_future(queue.infer(feeds(5), ("y",), STANDARD, None))
        kept = asyncio.ensure_future(queue.infer(feeds(6), ("y",), STANDARD, None))
        await wait_for(lambda: queue.queued == 2, "the requests never queued")
        gone.cancel()
        gate.allow(2)
        await asyncio.gather(first, kept)
    finally:
        queue.close()
    assert gate.runs == [[0.0], [6.0]]


async def test_a_full_class_is_refused_and_the_others_still_queue(mixer: OnnxModel) -> None:
    gate = Gate(mixer)
    queue = batcher(gate, max_batch_size=1, max_queued_per_class=2)
    try:
        first = asyncio.ensure_future(queue.infer(feeds(0), ("y",), BEST_EFFORT, None))
        await wait_for(gate.started.is_set, "the first batch never started")
        held = [
            asyncio.ensure_future(queue.infer(feeds(v), ("y",), BEST_EFFORT, None)) for v in (1, 2)
        ]
        await wait_for(lambda: queue.queued_in(BEST_EFFORT) == 2, "never queued")
        with pytest.raises(QueueFull, match="2 best-effort requests are queued"):
            await queue.infer(feeds(3), ("y",), BEST_EFFORT, None)
        other = asyncio.ensure_future(queue.infer(feeds(4), ("y",), STANDARD, None))
        await wait_for(lambda: queue.queued_in(STANDARD) == 1, "standard never queued")
        gate.allow(4)
        await asyncio.gather(first, other, *held)
    finally:
        queue.close()


async def test_no_class_starves_under_a_critical_flood(mixer: OnnxModel) -> None:
    gate = Gate(mixer)
    queue = batcher(gate, max_batch_size=1, max_class_wait_s=0.0)
    gate.allow(1000)
    try:
        lowest = asyncio.ensure_future(queue.infer(feeds(7), ("y",), BEST_EFFORT, None))
        flood = [
            asyncio.ensure_future(queue.infer(feeds(1), ("y",), CRITICAL, None)) for _ in range(50)
        ]
        await asyncio.gather(lowest, *flood)
    finally:
        queue.close()
    assert [7.0] in gate.runs[:-1], "the best-effort request waited for the whole flood"
    assert queue.compute_seconds(CRITICAL) > 0 and queue.compute_seconds(BEST_EFFORT) > 0


def test_batch_size_doubles_while_a_row_gets_quicker() -> None:
    assert choose_batch_size({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0, 16: 4.2}) == 8
    assert choose_batch_size({1: 27.0, 2: 55.0, 4: 108.0}) == 1
    assert choose_batch_size({1: 1.0}) == 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "between 1 and 4096"),
        (-3, "between 1 and 4096"),
        (10**9, "between 1 and 4096"),
        (math.nan, "finite"),
        (math.inf, "finite"),
    ],
)
def test_policy_refuses_nonsense(value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_range("max-batch-size", value, 1, 4096)
    with pytest.raises(ValueError, match="max-batch-size"):
        BatchPolicy(max_batch_size=value)  # type: ignore[arg-type]


async def test_a_lone_request_of_an_inline_model_runs_at_once_on_the_loop(
    mixer: OnnxModel,
) -> None:
    threads: list[int] = []

    class Recording:
        def run(self, f: Mapping[str, np.ndarray], o: Sequence[str]) -> list[np.ndarray]:
            threads.append(threading.get_ident())
            return mixer.run(f, o)

    batches: list[PriorityClass] = []
    alone: list[tuple[PriorityClass, int, list[float]]] = []
    queue = Batcher(
        [Recording()],
        BatchPolicy(max_batch_size=8),
        compute_s=0.0,
        inline_below_s=1.0,
        observe=lambda cls, _r, _s, _w: batches.append(cls),
        observe_alone=lambda cls, rows, times: alone.append((cls, rows, list(times))),
    )
    try:
        (y,) = await queue.infer(feeds(3.0, 2), ("y",), CRITICAL, None)
        assert alone == []  # folded later, not on the call's path
        seconds = queue.compute_seconds(CRITICAL)  # a read folds first
    finally:
        queue.close()
    assert np.array_equal(y, mixer.run(feeds(3.0, 2), ("y",))[0])
    assert threads == [threading.get_ident()]  # the loop's own thread, no hand-off
    assert batches == []
    assert [(cls, rows) for cls, rows, _ in alone] == [(CRITICAL, 2)]
    assert seconds == alone[0][2][0] > 0


async def test_requests_that_ran_alone_are_folded_in_soon_unread(mixer: OnnxModel) -> None:
    """Nobody reads the batcher's figures: the lone calls' bookkeeping still reaches the
    observer, each call once, by the fold's timer."""
    alone: list[tuple[PriorityClass, int, int]] = []
    queue = Batcher(
        [mixer],
        BatchPolicy(max_batch_size=8),
        compute_s=0.0,
        inline_below_s=1.0,
        observe_alone=lambda cls, rows, times: alone.append((cls, rows, len(times))),
    )
    try:
        for value, rows, cls in ((1.0, 1, STANDARD), (2.0, 1, STANDARD), (3.0, 3, BEST_EFFORT)):
            await queue.infer(feeds(value, rows), ("y",), cls, None)
        await wait_for(lambda: len(alone) == 2, "the fold never came")
    finally:
        queue.close()
    assert sorted(alone) == sorted([(STANDARD, 1, 2), (BEST_EFFORT, 3, 1)])


async def test_after_critical_calls_on_the_lone_path_the_others_are_paced(
    mixer: OnnxModel,
) -> None:
    """Critical calls that ran alone (their time not folded in yet) make the critical class
    active: best-effort calls right after them are paced, and one waits in the queue for its
    credit, where with no critical call before they all run alone at once."""

    async def best_effort_after(critical_calls: int) -> list[PriorityClass]:
        queued: list[PriorityClass] = []
        queue = Batcher(
            [Slow(mixer, 0.002)],
            BatchPolicy(max_batch_size=8),
            compute_s=0.002,
            inline_below_s=1.0,
            observe=lambda cls, _r, _s, _w: queued.append(cls),
        )
        try:
            for _ in range(critical_calls):
                await queue.infer(feeds(1.0), ("y",), CRITICAL, None)
            for _ in range(5):
                await queue.infer(feeds(2.0), ("y",), BEST_EFFORT, None)
        finally:
            queue.close()
        return queued

    assert await best_effort_after(0) == []
    assert BEST_EFFORT in await best_effort_after(20)


async def test_a_class_is_served_round_robin_across_its_clients(mixer: OnnxModel) -> None:
    gate = Gate(mixer)
    computed: list[tuple[str, float]] = []
    queue = Batcher(
        [gate],
        BatchPolicy(max_batch_size=1),
        0.0,
        -1.0,
        on_client_compute=lambda client, s: computed.append((client, s)),
    )
    try:
        first = asyncio.ensure_future(queue.infer(feeds(0), ("y",), STANDARD, None, "flood"))
        await wait_for(gate.started.is_set, "the first batch never started")
        flood = [
            asyncio.ensure_future(queue.infer(feeds(v), ("y",), STANDARD, None, "flood"))
            for v in (1, 2, 3)
        ]
        quiet = asyncio.ensure_future(queue.infer(feeds(9), ("y",), STANDARD, None, "quiet"))
        own = asyncio.ensure_future(queue.infer(feeds(7), ("y",), STANDARD, None))
        await wait_for(lambda: queue.queued == 5, "the requests never queued")
        gate.allow(6)
        await asyncio.gather(first, quiet, own, *flood)
    finally:
        queue.close()
    # One request of each caller in turn (the deployment's own calls are one more caller),
    # not the flood's three before the others' one each.
    assert gate.runs == [[0.0], [1.0], [9.0], [7.0], [2.0], [3.0]]
    assert [client for client, _ in computed] == ["flood", "flood", "quiet", "flood", "flood"]


async def test_a_batch_takes_one_request_of_each_client_in_turn(mixer: OnnxModel) -> None:
    gate = Gate(mixer)
    queue = batcher(gate, max_batch_size=4)
    try:
        first = asyncio.ensure_future(queue.infer(feeds(0), ("y",), STANDARD, None, "a"))
        await wait_for(gate.started.is_set, "the first batch never started")
        waiting = [
            asyncio.ensure_future(queue.infer(feeds(v), ("y",), STANDARD, None, "a"))
            for v in (1, 2, 3, 4, 5)
        ]
        waiting.append(asyncio.ensure_future(queue.infer(feeds(9), ("y",), STANDARD, None, "b")))
        await wait_for(lambda: queue.queued == 6, "the requests never queued")
        gate.allow(3)
        await asyncio.gather(first, *waiting)
    finally:
        queue.close()
    assert gate.runs == [[0.0], [1.0, 9.0, 2.0, 3.0], [4.0, 5.0]]


async def test_one_client_holds_at_most_half_of_its_class_queue(mixer: OnnxModel) -> None:
    gate = Gate(mixer)
    queue = batcher(gate, max_batch_size=1, max_queued_per_class=4)
    try:
        first = asyncio.ensure_future(queue.infer(feeds(0), ("y",), STANDARD, None, "a"))
        await wait_for(gate.started.is_set, "the first batch never started")
        held = [
            asyncio.ensure_future(queue.infer(feeds(v), ("y",), STANDARD, None, "a"))
            for v in (1, 2)
        ]
        await wait_for(lambda: queue.queued_in(STANDARD) == 2, "never queued")
        with pytest.raises(QueueFull) as caught:
            await queue.infer(feeds(3), ("y",), STANDARD, None, "a")
        assert str(caught.value) == (
            "client a has 2 standard requests queued already, the most one client may hold "
            "(50% of --max-queued-per-class 4); retry with backoff"
        )
        # Another client, and the deployment's own calls, still queue.
        others = [
            asyncio.ensure_future(queue.infer(feeds(4), ("y",), STANDARD, None, "b")),
            asyncio.ensure_future(queue.infer(feeds(5), ("y",), STANDARD, None)),
        ]
        await wait_for(lambda: queue.queued_in(STANDARD) == 4, "the others never queued")
        gate.allow(5)
        await asyncio.gather(first, *held, *others)
        # Its queued requests done, the client may queue again.
        gate.allow(1)
        await queue.infer(feeds(6), ("y",), STANDARD, None, "a")
    finally:
        queue.close()


async def test_best_effort_is_paced_to_its_weight_share_while_critical_is_busy(
    mixer: OnnxModel,
) -> None:
    """A critical client calling back to back and 40 best-effort requests queued at once:
    while the critical class is busy, best-effort batches take one request each and about
    a fifth of the batches (its weight, 1 of 4+1), not all 40 rows in one batch between two
    critical calls; every best-effort request is answered."""

    batches: list[tuple[PriorityClass, int]] = []
    queue = Batcher(
        [Slow(mixer, 0.01)],
        BatchPolicy(max_batch_size=64),
        compute_s=0.01,
        inline_below_s=-1.0,
        observe=lambda cls, rows, _s, _w: batches.append((cls, rows)),
    )
    calls = 0

    async def critical_client() -> None:
        nonlocal calls
        while calls < 100:
            await queue.infer(feeds(1), ("y",), CRITICAL, None)
            calls += 1

    try:
        critical = asyncio.ensure_future(critical_client())
        await wait_for(lambda: calls >= 10, "the critical client never got going")
        lowest = [
            asyncio.ensure_future(queue.infer(feeds(7), ("y",), BEST_EFFORT, None))
            for _ in range(40)
        ]
        await critical
        during = list(batches)
        await asyncio.gather(*lowest)
    finally:
        queue.close()
    best_effort = [rows for cls, rows in during if cls is BEST_EFFORT]
    assert best_effort, "best-effort waited for the whole critical run"
    assert max(best_effort) == 1, f"best-effort batches of {best_effort} while critical ran"
    assert len(best_effort) <= 0.35 * len(during), f"{len(best_effort)} of {len(during)}"
    assert queue.overhead_s > 0  # the loop's cost per request was measured


async def test_the_paced_share_shrinks_while_the_loop_queues_and_grows_back(
    mixer: OnnxModel,
) -> None:
    """A critical client calling back to back, and callbacks that hold the event loop 1 ms
    each: the probe's callback waits past the target, and the share the paced classes get
    falls from their weights' (1 of 4+1) towards a quarter of it; once the loop is free it
    grows back."""

    queue = Batcher([Slow(mixer, 0.005)], BatchPolicy(max_batch_size=8), 0.005, -1.0)
    loop = asyncio.get_running_loop()
    calling = True

    async def critical_client() -> None:
        while calling:
            await queue.infer(feeds(1), ("y",), CRITICAL, None)

    critical = asyncio.ensure_future(critical_client())
    try:
        await asyncio.sleep(0.1)  # the probing starts with the first critical call
        # The share is whole; a probe made late by this machine (another process) cuts it,
        # and the next ones restore it.
        await wait_for(
            lambda: queue.paced_share == pytest.approx(1 / 5), "the share never started whole"
        )
        stop = time.monotonic() + 0.3

        def hog() -> None:
            end = time.perf_counter() + 0.001
            while time.perf_counter() < end:
                pass
            if time.monotonic() < stop:
                loop.call_soon(hog)

        for _ in range(3):
            loop.call_soon(hog)
        await asyncio.sleep(0.35)
        assert queue.paced_share < 0.5 / 5, queue.paced_share
        assert queue.paced_share >= 0.25 / 5  # never below a quarter: no class starves
        await wait_for(lambda: queue.paced_share > 0.99 / 5, "the share never grew back")
    finally:
        calling = False
        await critical
        queue.close()
