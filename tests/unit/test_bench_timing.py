"""`bench.timing`: how many calls one contender's alternating block holds (`block_calls`),
how many it is timed for when no count is asked for (`sample_calls`), when a p99 is the
largest sample (`p99_is_the_maximum`), and the paired block bootstrap (`paired_bootstrap`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from bench.timing import (
    block_calls,
    p99_is_the_maximum,
    paired_bootstrap,
    percentiles,
    sample_calls,
)


def test_a_slow_model_gets_short_blocks_of_about_the_asked_duration() -> None:
    # ResNet-18 at 27 ms a run: 9 calls (0.24 s), 111 blocks of 1,000 calls, not 10 of 100.
    assert block_calls(1000, 10, 0.25, 0.027) == 9


def test_a_fast_model_keeps_the_fewest_blocks() -> None:
    # The MLP at 0.05 ms: 5,000 calls would fill 0.25 s; 10 blocks of 100 instead.
    assert block_calls(1000, 10, 0.25, 0.00005) == 100


@pytest.mark.parametrize(
    "call_s", [10.0, 0.0, -1.0], ids=["longer-than-a-block", "zero", "negative"]
)
def test_a_block_holds_at_least_one_call(call_s: float) -> None:
    assert block_calls(1000, 10, 0.25, call_s) >= 1
    assert block_calls(5, 10, 0.25, call_s) == 1


def test_a_fast_model_is_timed_for_about_the_asked_seconds_up_to_the_most() -> None:
    # The MLP's least call (ORT 0.04 ms + echo 0.6 ms): 10 s would be 15,625 calls.
    assert sample_calls(0.00064, 10.0, 1000, 10_000) == 10_000
    # A 2 ms call, within the bounds: 10 s of them.
    assert sample_calls(0.002, 10.0, 1000, 10_000) == 5000


def test_a_slow_model_keeps_the_least_calls() -> None:
    # ResNet-18 at 21 ms: 476 calls would fill 10 s; 1,000 still, as the issue measured.
    assert sample_calls(0.021, 10.0, 1000, 10_000) == 1000


@pytest.mark.parametrize("call_s", [0.0, -1.0], ids=["zero", "negative"])
def test_a_call_time_of_zero_or_less_gives_the_most(call_s: float) -> None:
    assert sample_calls(call_s, 10.0, 1000, 10_000) == 10_000


@pytest.mark.parametrize("n", [1, 10, 20, 30, 51])
def test_a_p99_of_up_to_51_samples_is_their_maximum(n: int) -> None:
    samples = [float(i) for i in range(n)]
    assert p99_is_the_maximum(n)
    assert percentiles(samples)["p99"] == max(samples)


@pytest.mark.parametrize("n", [52, 60, 100])
def test_a_p99_of_more_than_51_leaves_the_largest_out(n: int) -> None:
    samples = [float(i) for i in range(n)]
    assert not p99_is_the_maximum(n)
    assert percentiles(samples)["p99"] == n - 2  # the second largest


def _rate_ratio(drawn: Sequence[tuple[float, float]]) -> float:
    return sum(a for a, _ in drawn) / sum(b for _, b in drawn)


def test_the_bootstrap_interval_brackets_the_ratio_and_is_the_same_for_the_same_figures() -> None:
    # Ten rounds of two contenders whose rounds disagree: A is 10 % ahead in half of them.
    pairs = [(110.0, 100.0), (100.0, 100.0)] * 5
    low, high = paired_bootstrap(pairs, _rate_ratio)
    assert 1.0 <= low < _rate_ratio(pairs) < high <= 1.1
    assert paired_bootstrap(pairs, _rate_ratio) == (low, high)


def test_rounds_that_all_agree_give_no_spread() -> None:
    pairs = [(90.0, 100.0), (45.0, 50.0), (9.0, 10.0)]
    assert paired_bootstrap(pairs, _rate_ratio) == pytest.approx((0.9, 0.9))


def test_nothing_to_resample_is_refused() -> None:
    with pytest.raises(ValueError, match="no pairs"):
        paired_bootstrap([], _rate_ratio)
