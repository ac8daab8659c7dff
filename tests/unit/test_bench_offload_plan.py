"""`bench.offload`'s plan: the contenders judged against each other take turns, in orders
that give none of them a better neighbour, and `fastest` is judged against figures from its
own link's turns."""

from collections import Counter
from itertools import pairwise
from typing import Any

import pytest

from bench.offload import FULL, LINKS, QUICK, plan, summarize, vars_of
from bench.offload_device import turn


@pytest.mark.parametrize("n", [3, 4, 5])
def test_over_a_cycle_of_turns_each_member_follows_each_other_one_as_often(n: int) -> None:
    members = [{"label": str(i)} for i in range(n)]
    follows: Counter[tuple[str, str]] = Counter()
    first: Counter[str] = Counter()
    # 2n turns: whole cycles of the design for even and odd n, and under the 50 turns a
    # full-mode unit has. Lexicographic permutations of five fail: the first 24 all start
    # with the same member. A rotation fails too: (0, 1) always, (1, 0) never.
    for index in range(2 * n):
        order = [m["label"] for m in turn(members, index)]
        assert sorted(order) == sorted(m["label"] for m in members)
        first[order[0]] += 1
        follows.update(pairwise(order))
    assert len(first) == n and len(set(first.values())) == 1
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_each_fastest_shares_its_links_unit_with_both_sides_and_baselines_run_alone() -> None:
    for mode in (FULL, QUICK):
        units = plan(mode, switch=False)["units"]
        labels = [m["label"] for u in units for m in u["members"]]
        assert len(labels) == len(set(labels))
        for link in ("lan", "slow"):
            (unit,) = (u for u in units if f"fastest/{link}" in [m["label"] for m in u["members"]])
            assert unit["conditions"] == list(vars_of(LINKS[link]))
            contenders = {m["contender"] for m in unit["members"]}
            assert contenders == {"local", "remote", f"fastest/{link}"}
        for alone in ("ort-default", "local"):
            (unit,) = (u for u in units if alone in [m["label"] for m in u["members"]])
            assert len(unit["members"]) == 1


def _contender(latencies: list[float], target: str) -> dict[str, Any]:
    return {"latencies_ms": latencies, "targets": [target] * len(latencies)}


def test_fastest_is_judged_against_the_local_figures_of_its_own_links_turns() -> None:
    device = {
        "contenders": {
            "ort-default": _contender([400.0] * 3, "local"),
            "local": _contender([200.0] * 3, "local"),  # in a row: the speedup's baseline
            "local/lan": _contender([100.0] * 3, "local"),
            "local/slow": _contender([120.0] * 3, "local"),
            "remote/lan": _contender([150.0] * 3, "remote"),
            "remote/slow": _contender([700.0] * 3, "remote"),
            "fastest/lan": _contender([105.0] * 3, "local"),
            "fastest/slow": _contender([126.0] * 3, "local"),
            "local/lan#2": _contender([110.0] * 3, "local"),
            "remote/lan#2": _contender([140.0] * 3, "remote"),
            "local/slow#2": _contender([132.0] * 3, "local"),
        },
        "switch": [],
        "failures": 0,
    }
    summary = summarize(device)
    assert summary["fastest_vs_best_lan"] == 105.0 / 100.0
    assert summary["fastest_vs_best_slow"] == 126.0 / 120.0
    assert summary["speedup_vs_ours"] == 200.0 / 150.0
    # The better side (local, on both links) timed again, over its first sample.
    assert summary["same_side_lan"] == 110.0 / 100.0
    assert summary["same_side_slow"] == 132.0 / 120.0
    # Every fastest request ran locally, the better side on both links.
    assert summary["fastest_on_best_lan"] == {
        "side": "local",
        "requests": 3,
        "of": 3,
        "p50_ratio": 105.0 / 100.0,
    }


def test_fastests_requests_on_the_better_side_are_split_from_its_probes() -> None:
    """On lan the replica is better; fastest's two local probes (slower) move its p50,
    its replica requests alone are what its choices cost apart from them."""
    contenders = {
        label: _contender([100.0] * 5, "local")
        for label in ("ort-default", "local", "local/lan", "local/slow", "local/lan#2")
    }
    contenders |= {
        label: _contender([40.0] * 5, "remote")
        for label in ("remote/lan", "remote/slow", "remote/lan#2", "local/slow#2")
    }
    contenders["fastest/lan"] = {
        "latencies_ms": [42.0, 100.0, 44.0, 100.0, 46.0],
        "targets": ["remote", "local", "remote", "local", "remote"],
    }
    contenders["fastest/slow"] = _contender([100.0] * 5, "local")
    summary = summarize({"contenders": contenders, "switch": [], "failures": 0})
    assert summary["fastest_vs_best_lan"] == 46.0 / 40.0
    assert summary["fastest_on_best_lan"] == {
        "side": "remote",
        "requests": 3,
        "of": 5,
        "p50_ratio": 44.0 / 40.0,
    }
    assert summary["fastest_on_best_slow"] is None  # remote was better there, never used
