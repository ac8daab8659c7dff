"""Placement: choose a node and GPUs for a deployment. Pure functions over an immutable
`ClusterSnapshot`; no I/O.

`place` filters the nodes (ready, runtime, CUDA, free GPUs or memory, a P2P-capable group,
latency SLO), scores them (`scoring`: network latency from the client's site, load, the GPU
group's topology, the fragmentation it leaves, pack or spread), chooses (ties to the smallest
node id) and explains (`Explanation`); when nothing fits, a higher priority class may preempt
lower ones. `search` says how it avoids looking at most of a 10,000-node cluster and stays
equal to `place_brute_force`. Modules: `model` (the values), `scoring` (the terms and
weights), `kinds` (memoized group choices per node model), `snapshot` (the cluster index),
`search` (filter, score, choose, preempt).
"""

from broker.placement.model import (
    Allocation,
    Candidate,
    Decision,
    Explanation,
    NodeSnapshot,
    PlacementRequest,
    PriorityClass,
    Rejection,
    RejectionCount,
    RejectReason,
    ScoreTerm,
    ScoreTerms,
    Strategy,
    Term,
)
from broker.placement.scoring import WEIGHTS, Weights
from broker.placement.search import largest_possible, place, place_brute_force
from broker.placement.snapshot import ClusterSnapshot

__all__ = [
    "WEIGHTS",
    "Allocation",
    "Candidate",
    "ClusterSnapshot",
    "Decision",
    "Explanation",
    "NodeSnapshot",
    "PlacementRequest",
    "PriorityClass",
    "RejectReason",
    "Rejection",
    "RejectionCount",
    "ScoreTerm",
    "ScoreTerms",
    "Strategy",
    "Term",
    "Weights",
    "largest_possible",
    "place",
    "place_brute_force",
]
