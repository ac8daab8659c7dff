"""`bench.timing.block_calls`: how many calls one contender's alternating block holds."""

from __future__ import annotations

import pytest

from bench.timing import block_calls


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
