"""`broker.loop_lag`: how late the event loop ran lately, for the lost-node check."""

from __future__ import annotations

import asyncio
import time

import pytest

from broker.loop_lag import LoopLag


def test_the_worst_lateness_within_the_window_counts_and_older_is_forgotten() -> None:
    lag = LoopLag(window_s=5.0)
    assert lag.worst(now=100.0) == 0.0
    lag.note(100.0, 2.5)
    lag.note(101.0, 0.1)
    lag.note(102.0, -0.01)  # early (timer granularity): on time
    assert lag.worst(now=104.0) == 2.5
    assert lag.worst(now=105.5) == 0.1  # the 2.5 s one is past the window
    assert lag.worst(now=200.0) == 0.0


async def test_a_blocked_loop_is_seen_even_before_the_monitor_runs_again() -> None:
    lag = LoopLag(window_s=5.0, tick_s=0.05)
    monitor = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.2)
        time.sleep(0.6)  # noqa: ASYNC251 - blocking the loop is the point: the monitor is overdue
        assert lag.worst() >= 0.5
        await asyncio.sleep(0.2)  # the monitor ran and noted it
        assert lag.worst() >= 0.5
    finally:
        monitor.cancel()
        await asyncio.gather(monitor, return_exceptions=True)


def test_a_window_or_tick_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError):
        LoopLag(window_s=0.0)
    with pytest.raises(ValueError):
        LoopLag(window_s=5.0, tick_s=-1.0)
