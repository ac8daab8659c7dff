"""The score: a penalty in points (1 point = 1 ms of network latency), lower is better.

For a node N at latency L (ms) from the client, reporting load U, that would give the group G
of k GPUs out of its free GPUs F (R = F - G stay free; n GPUs in all):

    penalty = (1.0 * latency + 1.0 * load) + rest
    rest    = (2.0 * topology + w_frag * fragmentation) + 1.0 * balance

    latency       L, in ms: shortest path between the sites plus the node's access latency
    load          U, 0..1
    topology      1 - (slowest(G) + mean(G)) / (2 * 28), 0 for k <= 1: the link ranks
                  (`common.topology.link_rank`) of the group's slowest link and its mean
                  pair, against NV18 (rank 28, the fastest link of any capture); 0..1
    fragmentation sum over s = 2, 4, 8, ... <= n of (future_F(s) - future_R(s)) / 28, where
                  future_X(s) is the best slowest-link rank of any s GPUs inside X (0 when X
                  has fewer than s): the group sizes this placement takes away from the next
                  requests, as `Topology.score` defines `future`. w_frag = 1.0 for `pack`,
                  0 for `spread` (spreading accepts breaking whole groups)
    balance       pack: |R| / n (fill nodes already in use); spread: 1 - |R| / n (prefer the
                  emptiest); 0 on a node without GPUs

Latency dominates: every other term together stays under 8 points (load 1, topology 2,
fragmentation 1 per group size, balance 1), so a node 8 ms farther never wins. Every term is
>= 0, so the latency alone is a lower bound of the penalty: `place` visits sites nearest
first and stops once that bound exceeds the candidates it has (see `broker.placement.search`).

`rest` depends only on the node's kind (GPUs and links), its free and shared GPUs and the
request, so it is computed once for every node in that state (`broker.placement.kinds`).
The penalty is always computed by `penalty` in this one order, so the search, its bound and
the brute-force reference see bit-equal numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.placement.model import ScoreTerm, ScoreTerms, Strategy, Term
from common.topology import NV_RANK_BASE

RANK_SCALE = NV_RANK_BASE + 18
"""The link rank of NV18 (H100 SXM): the fastest link in any capture; topology and
fragmentation are measured against it."""


@dataclass(frozen=True, slots=True)
class Weights:
    """Penalty points per unit of each term (see the module docstring)."""

    latency: float
    load: float
    topology: float
    fragmentation: float
    balance: float


WEIGHTS = {
    Strategy.PACK: Weights(latency=1.0, load=1.0, topology=2.0, fragmentation=1.0, balance=1.0),
    Strategy.SPREAD: Weights(latency=1.0, load=1.0, topology=2.0, fragmentation=0.0, balance=1.0),
}


@dataclass(frozen=True, slots=True)
class GroupTerms:
    """The node-independent part of a node's score: the group it would give and its terms."""

    gpus: tuple[int, ...]
    """GPU indices, ascending."""
    topology: float
    fragmentation: float
    balance: float
    rest: float
    """The weighted sum of these three terms (`rest` in the module docstring)."""


def group_terms(
    strategy: Strategy,
    gpus: tuple[int, ...],
    topology: float,
    fragmentation: float,
    balance: float,
) -> GroupTerms:
    w = WEIGHTS[strategy]
    rest = (w.topology * topology + w.fragmentation * fragmentation) + w.balance * balance
    return GroupTerms(gpus, topology, fragmentation, balance, rest)


def penalty(strategy: Strategy, latency_ms: float, load: float, rest: float) -> float:
    """The penalty of a node (see the module docstring); the one place it is computed."""
    w = WEIGHTS[strategy]
    return (w.latency * latency_ms + w.load * load) + rest


def latency_bound(strategy: Strategy, latency_ms: float) -> float:
    """A lower bound of `penalty` for every node at least `latency_ms` away (in floats too:
    the other terms are >= 0 and IEEE rounding is monotonic)."""
    return WEIGHTS[strategy].latency * latency_ms


def score_terms(
    strategy: Strategy, latency_ms: float, load: float, group: GroupTerms
) -> ScoreTerms:
    """Every term of one candidate, with its weight, and the total (= `penalty`)."""
    w = WEIGHTS[strategy]
    return ScoreTerms(
        terms=(
            ScoreTerm(Term.LATENCY, latency_ms, w.latency),
            ScoreTerm(Term.LOAD, load, w.load),
            ScoreTerm(Term.TOPOLOGY, group.topology, w.topology),
            ScoreTerm(Term.FRAGMENTATION, group.fragmentation, w.fragmentation),
            ScoreTerm(Term.BALANCE, group.balance, w.balance),
        ),
        total=penalty(strategy, latency_ms, load, group.rest),
    )
