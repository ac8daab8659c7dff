"""Per-client quotas (`broker.quotas`): each refusal is RESOURCE_EXHAUSTED's domain error and
names the limit and the flag that sets it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from broker.errors import ResourceExhausted
from broker.quotas import (
    ClientLimits,
    Quotas,
    Slots,
    check_deployments,
    check_model_bytes,
    within_idle_timeout,
)


def test_deployments_up_to_the_limit() -> None:
    quotas = Quotas(deployments=3)
    check_deployments(quotas, "alice", 2)
    with pytest.raises(ResourceExhausted, match=r"alice has 3 deployments, its limit "
                       r"\(--max-deployments-per-client 3\)"):  # fmt: skip
        check_deployments(quotas, "alice", 3)


def test_model_bytes_up_to_the_limit() -> None:
    quotas = Quotas(model_bytes=1000)
    check_model_bytes(quotas, "alice", 600, 400)
    with pytest.raises(ResourceExhausted, match=r"to 1001 bytes, over its limit "
                       r"\(--max-model-bytes-per-client 1000\)"):  # fmt: skip
        check_model_bytes(quotas, "alice", 600, 401)


def test_slots_are_per_client_and_released_whatever_ends_the_block() -> None:
    slots = Slots(2, "uploads", "--max-uploads-per-client")
    full = r"alice has 2 uploads open, its limit \(--max-uploads-per-client 2\)"
    with (
        slots.hold("alice"),
        slots.hold("alice"),
        slots.hold("bob"),
        pytest.raises(ResourceExhausted, match=full),
        slots.hold("alice"),
    ):
        pass
    with pytest.raises(RuntimeError), slots.hold("alice"), slots.hold("alice"):
        raise RuntimeError("the upload failed")
    with slots.hold("alice"), slots.hold("alice"):
        pass


def test_client_limits_use_their_quotas() -> None:
    limits = ClientLimits(Quotas(uploads=1, watch_streams=1))
    with (
        limits.uploads.hold("alice"),
        pytest.raises(ResourceExhausted, match="--max-uploads-per-client 1"),
        limits.uploads.hold("alice"),
    ):
        pass
    with (
        limits.watch_streams.hold("alice"),
        pytest.raises(ResourceExhausted, match="--max-watch-streams-per-client 1"),
        limits.watch_streams.hold("alice"),
    ):
        pass


@pytest.mark.parametrize(
    "fields",
    [{"deployments": 0}, {"model_bytes": -1}, {"uploads": 0}, {"watch_streams": 0},
     {"upload_idle_timeout_s": 0}, {"upload_idle_timeout_s": float("inf")},
     {"upload_idle_timeout_s": float("nan")}],
)  # fmt: skip
def test_quotas_that_would_refuse_everything_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        Quotas(**fields)  # type: ignore[arg-type]


async def test_a_stream_that_stalls_is_cut_off() -> None:
    resume = asyncio.Event()

    async def chunks() -> AsyncIterator[int]:
        yield 1
        yield 2
        await resume.wait()
        yield 3

    seen = []
    with pytest.raises(ResourceExhausted, match=r"no chunk for 0.05 s \(--upload-idle-timeout\)"):
        async for item in within_idle_timeout(chunks(), 0.05):
            seen.append(item)
    assert seen == [1, 2]


async def test_a_stream_that_keeps_sending_goes_through() -> None:
    async def chunks() -> AsyncIterator[int]:
        for item in range(5):
            await asyncio.sleep(0)
            yield item

    assert [item async for item in within_idle_timeout(chunks(), 5.0)] == [0, 1, 2, 3, 4]
