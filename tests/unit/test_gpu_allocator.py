"""GPU bookkeeping: whole GPUs are exclusive, memory shares fit, groups follow the topology."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_daemon.errors import GpusExhausted, InvalidRequest
from node_daemon.gpu_allocator import GpuAllocator
from node_daemon.inventory import Gpu, Inventory, Link, LinkKind

MIB = 16_384


def two_nvlink_pairs() -> Inventory:
    """GPU0-GPU1 and GPU2-GPU3 by NV2, every other pair SYS."""
    gpus = tuple(Gpu(i, f"GPU-{i}", "test", MIB) for i in range(4))
    links = {
        (a, b): Link(LinkKind.NV, 2) if {a, b} in ({0, 1}, {2, 3}) else Link(LinkKind.SYS)
        for a, b in itertools.combinations(range(4), 2)
    }
    return Inventory(gpus, links)


def test_whole_gpus_are_not_given_twice() -> None:
    allocator = GpuAllocator(two_nvlink_pairs())
    first = allocator.allocate("a", count=2)
    assert set(first.gpus) in ({0, 1}, {2, 3})
    second = allocator.allocate("b", count=2)
    assert set(first.gpus).isdisjoint(second.gpus)
    with pytest.raises(GpusExhausted, match=r"asked for 1 GPU\(s\); GPUs free: none \(0 of 4\)"):
        allocator.allocate("c", count=1)
    allocator.release("a")
    assert set(allocator.allocate("c", count=2).gpus) == set(first.gpus)


def test_too_many_gpus_says_what_is_free() -> None:
    allocator = GpuAllocator(two_nvlink_pairs())
    allocator.allocate("a", uuids=["GPU-1"])
    with pytest.raises(GpusExhausted, match=r"asked for 4 GPU\(s\); GPUs free: GPU0, GPU2, GPU3"):
        allocator.allocate("b", count=4)


def test_memory_shares_fit_and_exclude_whole_requests() -> None:
    allocator = GpuAllocator(two_nvlink_pairs())
    one = allocator.allocate("a", uuids=["GPU-0"], memory_mib=10_000)
    two = allocator.allocate("b", uuids=["GPU-0"], memory_mib=6_000)
    assert one.gpus == two.gpus == (0,)
    with pytest.raises(GpusExhausted, match="GPU0 cannot take this request"):
        allocator.allocate("c", uuids=["GPU-0"], memory_mib=1_000)
    with pytest.raises(GpusExhausted, match="GPU0 cannot take this request"):
        allocator.allocate("d", uuids=["GPU-0"])
    assert allocator.holder_of(0) == ["a", "b"]
    with pytest.raises(GpusExhausted, match="exceeds every GPU's memory"):
        allocator.allocate("e", count=1, memory_mib=MIB + 1)


def test_p2p_required_refuses_a_group_without_peer_links() -> None:
    allocator = GpuAllocator(two_nvlink_pairs())
    allocator.allocate("a", uuids=["GPU-0"])
    allocator.allocate("b", uuids=["GPU-2"])
    with pytest.raises(GpusExhausted, match="links GPU1 and GPU3 by SYS; P2P needs NVLink"):
        allocator.allocate("c", count=2, p2p_required=True)
    assert allocator.free() == [1, 3]  # nothing was taken by the failed request
    assert allocator.allocate("c", count=2).gpus == (1, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"uuids": ["GPU-9"]}, "unknown GPU UUID"),
        ({"uuids": ["GPU-0", "GPU-0"]}, "more than once"),
        ({"count": 2, "uuids": ["GPU-0"]}, "gpu_count 2 but 1 GPU UUIDs"),
        ({"count": -1}, "must not be negative"),
    ],
)
def test_inconsistent_requests_are_invalid(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        GpuAllocator(two_nvlink_pairs()).allocate("a", **kwargs)


def test_restore_refuses_a_clash() -> None:
    allocator = GpuAllocator(two_nvlink_pairs())
    allocator.restore("a", (0, 1), 0)
    with pytest.raises(InvalidRequest, match="claims GPU"):
        allocator.restore("b", (1,), 0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 4), st.sampled_from([0, 4_000, 9_000])),
        min_size=1,
        max_size=30,
    )
)
def test_never_more_than_fits(ops: list[tuple[int, int, int]]) -> None:
    """Random requests and releases: no GPU is ever over-committed."""
    inventory = two_nvlink_pairs()
    allocator = GpuAllocator(inventory)
    held: dict[str, tuple[tuple[int, ...], int]] = {}
    for step, (owner, count, memory) in enumerate(ops):
        name = f"r{owner}"
        if name in held:
            allocator.release(name)
            del held[name]
            continue
        try:
            allocation = allocator.allocate(name, count=count, memory_mib=memory)
        except GpusExhausted:
            continue
        held[name] = (allocation.gpus, memory)
        for index in range(4):
            users = [(g, m) for g, m in held.values() if index in g]
            wholes = [m for _, m in users if m == 0]
            assert len(wholes) <= 1 and (not wholes or len(users) == 1), (step, held)
            assert sum(m for _, m in users) <= MIB, (step, held)
