"""The placement lock's accounting (`broker.timed_lock`)."""

from __future__ import annotations

import asyncio

import pytest

from broker.timed_lock import TimedLock


async def test_each_holder_reports_its_wait_and_hold_once_released() -> None:
    uses: list[tuple[str, float, float]] = []
    order: list[str] = []
    lock = TimedLock(lambda use, waited, held: uses.append((use, waited, held)))
    first_in = asyncio.Event()
    let_go = asyncio.Event()

    async def first() -> None:
        async with lock.use("first"):
            first_in.set()
            await let_go.wait()
            order.append("first out")

    async def second() -> None:
        await first_in.wait()
        async with lock.use("second"):
            order.append("second in")

    tasks = [asyncio.create_task(first()), asyncio.create_task(second())]
    await first_in.wait()
    await asyncio.sleep(0.05)  # the second task is now queued on the lock
    assert uses == []  # nothing reported while held
    let_go.set()
    await asyncio.gather(*tasks)
    assert order == ["first out", "second in"]  # one holder at a time
    assert [who for who, _, _ in uses] == ["first", "second"]
    (_, first_waited, first_held), (_, second_waited, _) = uses
    # The second was queued through the sleep, while the first held the lock.
    assert first_waited < second_waited and second_waited >= 0.04 and first_held >= 0.04


async def test_a_holder_that_raises_still_releases_and_reports() -> None:
    uses: list[str] = []
    lock = TimedLock(lambda use, waited, held: uses.append(use))
    with pytest.raises(RuntimeError):
        async with lock.use("decide"):
            raise RuntimeError("the decision failed")
    assert uses == ["decide"]
    async with lock.use("delete"):  # free again
        pass
    assert uses == ["decide", "delete"]


async def test_a_waiter_cancelled_in_the_queue_reports_nothing() -> None:
    uses: list[str] = []
    lock = TimedLock(lambda use, waited, held: uses.append(use))

    async def wait_in_queue() -> None:
        async with lock.use("waiter"):
            pass

    async with lock.use("holder"):
        waiter = asyncio.create_task(wait_in_queue())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert uses == ["holder"]  # only the holder's use
    async with lock.use("next"):  # the cancelled waiter left no hold behind
        pass
    assert uses == ["holder", "next"]
