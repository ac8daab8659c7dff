"""`broker.placement.ledger`: placement's view kept change by change equals the view made
again from scratch after any sequence of changes, and places the same."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.placement import Allocation, ClusterSnapshot, NodeSnapshot, PriorityClass, place
from broker.placement.ledger import PlacementLedger
from tests.unit.test_placement import POOL, choice, line, request

SITES = ["s0", "s1", "s2"]


@dataclass
class Rebuilt:
    """The reference: what the broker knows, each node made again from it when asked."""

    nodes: dict[str, dict[str, object]] = field(default_factory=dict)
    allocations: dict[str, dict[str, Allocation]] = field(default_factory=dict)

    def node(self, node_id: str) -> NodeSnapshot:
        held = self.allocations.get(node_id, {})
        idle = NodeSnapshot.idle(node_id, **self.nodes[node_id])  # type: ignore[arg-type]
        return idle.with_allocations(held[k] for k in sorted(held))

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot.of(self.node(n) for n in self.nodes)


def fits(rebuilt: Rebuilt, node_id: str) -> bool:
    """Whether the node's allocations fit it (vacuously, for a node not known)."""
    if node_id not in rebuilt.nodes:
        return True
    try:
        rebuilt.node(node_id)
    except ValueError:
        return False
    return True


def node_fields(draw: st.DrawFn) -> dict[str, object]:
    return {
        "site": draw(st.sampled_from(SITES)),
        "topology": POOL[draw(st.sampled_from(["dgx1", "pcie4", "pair"]))](),
        "ready": draw(st.integers(0, 5)) > 0,
        "runtimes": ("docker",),
        "cuda_version": "12.4",
        "load": draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])),
    }


def allocation(draw: st.DrawFn, ids: list[str]) -> Allocation:
    share = draw(st.sampled_from([0, 0, 2048, 6000]))
    gpus = draw(st.sets(st.integers(0, 7), min_size=1, max_size=1 if share else 2))
    return Allocation(
        draw(st.sampled_from(ids)),
        draw(st.sampled_from(list(PriorityClass))),
        tuple(sorted(gpus)),
        share,
    )


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_ledger_changed_step_by_step_is_the_view_made_again(data: st.DataObject) -> None:
    draw = data.draw
    ledger, rebuilt = PlacementLedger(), Rebuilt()
    node_ids = [f"n{i}" for i in range(5)]
    allocation_ids = [f"d{i}" for i in range(8)]
    for _ in range(draw(st.integers(1, 40), label="steps")):
        action = draw(
            st.sampled_from(["put", "load", "remove", "allocate", "allocate", "release"])
        )
        node_id = draw(st.sampled_from(node_ids))
        if action == "put":
            fields = draw(st.composite(lambda d: node_fields(d))())
            before = dict(rebuilt.nodes)
            rebuilt.nodes[node_id] = fields
            if not fits(rebuilt, node_id):
                # A node's GPUs do not change under the deployments on it.
                rebuilt.nodes = before
                continue
            ledger.put_node(node_id, **fields)  # type: ignore[arg-type]
        elif action == "load" and node_id in rebuilt.nodes:
            load = draw(st.sampled_from([0.0, 0.25, 1.0]))
            rebuilt.nodes[node_id] = {**rebuilt.nodes[node_id], "load": load}
            ledger.set_load(node_id, load)
        elif action == "remove":
            rebuilt.nodes.pop(node_id, None)
            ledger.remove_node(node_id)
        elif action == "allocate":
            new = draw(st.composite(lambda d: allocation(d, allocation_ids))())
            held = rebuilt.allocations.setdefault(node_id, {})
            before = dict(held)
            held[new.deployment_id] = new
            if not fits(rebuilt, node_id):
                # Decisions allocate only what fits (checked under the placement lock).
                rebuilt.allocations[node_id] = before
                continue
            ledger.allocate(node_id, new)
        elif action == "release":
            gone = draw(st.sampled_from(allocation_ids))
            rebuilt.allocations.get(node_id, {}).pop(gone, None)
            if not rebuilt.allocations.get(node_id, True):
                del rebuilt.allocations[node_id]
            ledger.release(node_id, gone)
        if draw(st.booleans(), label="look now"):
            assert sorted(ledger.snapshot(), key=lambda n: n.node_id) == sorted(
                rebuilt.snapshot(), key=lambda n: n.node_id
            )
    kept, fresh = ledger.snapshot(), rebuilt.snapshot()
    assert sorted(kept, key=lambda n: n.node_id) == sorted(fresh, key=lambda n: n.node_id)
    assert (len(kept), kept.largest(), kept.sites) == (len(fresh), fresh.largest(), fresh.sites)
    for node_id in node_ids:
        assert ledger.allocations(node_id) == rebuilt.allocations.get(node_id, {})
    net = line(1, 2)
    for gpus in (1, 2, 4):
        ask = request(
            site=draw(st.sampled_from(SITES)), gpus=gpus, priority=PriorityClass.CRITICAL
        )
        assert choice(place(kept, ask, net)) == choice(place(fresh, ask, net))


def test_allocations_wait_for_their_node_and_a_contradiction_is_refused_when_read() -> None:
    ledger = PlacementLedger()
    ledger.allocate("n1", Allocation("d1", PriorityClass.STANDARD, (0,)))
    assert len(ledger) == 0 and len(ledger.snapshot()) == 0
    ledger.put_node(
        "n1", "s0", POOL["pair"](), ready=True, runtimes=("docker",), cuda_version="", load=0.0
    )
    good = ledger.snapshot()
    node = good.node("n1")
    assert node.free == frozenset({1}) and [a.deployment_id for a in node.allocations] == ["d1"]
    # Nothing changed: the same snapshot.
    assert ledger.snapshot() is good
    # Re-allocating an id replaces it (a deployment pinned while it starts).
    ledger.allocate("n1", Allocation("d1", PriorityClass.CRITICAL, (0,)))
    assert ledger.snapshot().node("n1").allocations[0].priority is PriorityClass.CRITICAL
    # Two allocations of one whole GPU contradict each other: refused when read, the last
    # good view kept, until the contradiction is gone.
    pinned = ledger.snapshot()
    ledger.allocate("n1", Allocation("d2", PriorityClass.STANDARD, (0,)))
    with pytest.raises(ValueError, match="GPU0 is not free"):
        ledger.snapshot()
    ledger.release("n1", "d2")
    assert ledger.snapshot().node("n1") == pinned.node("n1")
    # A node gone keeps its allocations for its return; releasing twice is harmless.
    ledger.remove_node("n1")
    assert "n1" not in ledger.snapshot() and set(ledger.allocations("n1")) == {"d1"}
    ledger.release("n1", "d1")
    ledger.release("n1", "d1")
    assert ledger.allocations("n1") == {}
