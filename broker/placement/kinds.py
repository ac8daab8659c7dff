"""Node kinds: nodes with the same GPUs and links share one `NodeKind`, whose group choices
are computed once for all of them.

A kind answers "which GPUs would a node of this kind give this request, and what are their
score terms" from the node's free and shared GPUs alone, memoized: a cluster of 10,000 nodes
of five models sees a few thousand distinct answers, so placement mostly costs dict lookups.
GPUs are addressed inside a kind by position (the p-th smallest index), sets as bitmasks.

Memos grow only with distinct (request, GPU state) pairs and are emptied past `MEMO_LIMIT`
entries. Safe to share between threads under CPython (a race recomputes an entry).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from broker.placement.model import RejectReason, Strategy
from broker.placement.scoring import RANK_SCALE, GroupTerms, group_terms
from common.inventory import P2P_KINDS
from common.topology import Topology, set_bits

MEMO_LIMIT = 1 << 16
"""Entries per memo table before it is emptied."""

Shares = tuple[int, ...]
"""MiB held by memory shares per GPU position; () when no GPU is shared."""


class NodeKind:
    """The GPUs and links of one node model, and its memoized group choices.

    `topology` is the first node's; every node of the kind has the same GPU indices, link
    ranks, P2P links and GPU memory, so its `best_group` answers hold for all of them.
    """

    __slots__ = (
        "_adjacency",
        "_choices",
        "_futures",
        "_levels",
        "_p2p",
        "_rank",
        "_sizes",
        "indices",
        "memory",
        "n",
        "position",
        "topology",
    )

    def __init__(self, topology: Topology) -> None:
        gpus = sorted(topology.inventory.gpus, key=lambda g: g.index)
        self.topology = topology
        self.indices = tuple(g.index for g in gpus)
        """GPU index of each position."""
        self.position = {index: p for p, index in enumerate(self.indices)}
        self.n = len(gpus)
        self.memory = tuple(g.memory_total_mib for g in gpus)
        """Total MiB of each position's GPU."""
        n = self.n
        self._rank = [
            [topology.rank(a, b) if a != b else 0 for b in self.indices] for a in self.indices
        ]
        self._p2p = [
            sum(
                1 << q
                for q, b in enumerate(self.indices)
                if a != b and topology.inventory.link(a, b).kind in P2P_KINDS
            )
            for a in self.indices
        ]
        self._levels = sorted({self._rank[a][b] for a in range(n) for b in range(a + 1, n)})[::-1]
        self._adjacency = {
            level: [
                sum(1 << b for b in range(n) if b != a and self._rank[a][b] >= level)
                for a in range(n)
            ]
            for level in self._levels
        }
        sizes = []
        size = 2
        while size <= n:
            sizes.append(size)
            size *= 2
        self._sizes = tuple(sizes)
        self._futures: dict[int, tuple[int, ...]] = {}
        self._choices: dict[tuple[object, ...], GroupTerms | RejectReason] = {}

    @staticmethod
    def signature(topology: Topology) -> tuple[object, ...]:
        """What makes two topologies one kind: GPU indices, link ranks and kinds, which GPUs
        share a NUMA node (`best_group` prefers them), memory."""
        gpus = sorted(topology.inventory.gpus, key=lambda g: g.index)
        return (
            tuple((g.index, g.memory_total_mib) for g in gpus),
            tuple(
                (
                    a.index,
                    b.index,
                    str(topology.inventory.link(a.index, b.index)),
                    topology.same_numa(a.index, b.index),
                )
                for a, b in itertools.combinations(gpus, 2)
            ),
        )

    def mask(self, gpus: frozenset[int]) -> int:
        return sum(1 << self.position[g] for g in gpus)

    def shares(self, shared_mib: Mapping[int, int]) -> Shares:
        if not shared_mib:
            return ()
        return tuple(shared_mib.get(index, 0) for index in self.indices)

    def choose(
        self,
        gpus: int,
        memory_mib: int,
        p2p: bool,
        strategy: Strategy,
        free_mask: int,
        shares: Shares,
    ) -> GroupTerms | RejectReason:
        """The group a node of this kind in this state gives the request, with its terms;
        else why it cannot.

        Whole GPUs: `Topology.best_group` among the free GPUs. Memory shares: among the GPUs
        with that much memory left (free, or shared and not held whole), the better (lower
        `rest`) of the best group of already shared GPUs and the best group of all of them,
        so shares fill shared GPUs before they break a free one. With `p2p`, a group with a
        pair linked other than by NVLink, PIX or PXB does not count (`best_group` maximizes
        the slowest link first, so if its group is not P2P-capable, none is).
        """
        key = (gpus, memory_mib, p2p, strategy, free_mask, shares if memory_mib else ())
        found = self._choices.get(key)
        if found is None:
            found = self._choose(gpus, memory_mib, p2p, strategy, free_mask, shares)
            if len(self._choices) >= MEMO_LIMIT:
                self._choices.clear()
            self._choices[key] = found
        return found

    def _choose(
        self,
        k: int,
        memory_mib: int,
        p2p: bool,
        strategy: Strategy,
        free_mask: int,
        shares: Shares,
    ) -> GroupTerms | RejectReason:
        if memory_mib == 0:
            if free_mask.bit_count() < k:
                return RejectReason.TOO_FEW_GPUS
            options = [free_mask]
        else:
            eligible = shared = 0
            for p in range(self.n):
                bit = 1 << p
                if free_mask & bit:
                    if self.memory[p] >= memory_mib:
                        eligible |= bit
                elif shares and shares[p] and shares[p] + memory_mib <= self.memory[p]:
                    eligible |= bit
                    shared |= bit
            if eligible.bit_count() < k:
                return RejectReason.NO_MEMORY
            options = [eligible]
            if shared != eligible and shared.bit_count() >= k:
                options.insert(0, shared)
        best: GroupTerms | None = None
        for option in options:
            group = self._best_group(k, option)
            if p2p and not self._is_p2p(group):
                continue
            terms = self._terms(strategy, group, free_mask)
            if best is None or terms.rest < best.rest:
                best = terms
        return RejectReason.NO_P2P_GROUP if best is None else best

    def _best_group(self, k: int, option: int) -> int:
        if k == 0:
            return 0
        free = [self.indices[p] for p in range(self.n) if option >> p & 1]
        return self.mask(frozenset(self.topology.best_group(k, free)))

    def _is_p2p(self, group: int) -> bool:
        return all(group & ~(1 << p) & ~self._p2p[p] == 0 for p in set_bits(group))

    def _terms(self, strategy: Strategy, group: int, free_mask: int) -> GroupTerms:
        members = set_bits(group)
        ranks = [self._rank[a][b] for a, b in itertools.combinations(members, 2)]
        topology = 0.0
        if ranks:
            quality = (min(ranks) + sum(ranks) / len(ranks)) / (2 * RANK_SCALE)
            topology = max(0.0, 1.0 - quality)
        left = free_mask & ~group
        before, after = self._future(free_mask), self._future(left)
        fragmentation = sum(b - a for b, a in zip(before, after, strict=True)) / RANK_SCALE
        balance = 0.0
        if self.n:
            balance = left.bit_count() / self.n
            if strategy is Strategy.SPREAD:
                balance = 1.0 - balance
        gpus = tuple(self.indices[p] for p in members)
        return group_terms(strategy, gpus, topology, fragmentation, balance)

    def _future(self, mask: int) -> tuple[int, ...]:
        """future(s) for every s in 2, 4, 8, ... <= n: the best slowest-link rank of s GPUs
        inside `mask`, 0 when it has fewer than s."""
        cached = self._futures.get(mask)
        if cached is None:
            out = []
            levels = iter(self._levels)
            level = next(levels, 0)
            for size in self._sizes:
                # future(s) never rises with s: go on from the level the last size reached.
                while level and not _has_clique(mask, self._adjacency[level], size):
                    level = next(levels, 0)
                out.append(level)
            cached = tuple(out)
            if len(self._futures) >= MEMO_LIMIT:
                self._futures.clear()
            self._futures[mask] = cached
        return cached


class KindRegistry:
    """Interns `NodeKind`s by `NodeKind.signature`, with a fast path for a `Topology` object
    seen before (by identity; the entry keeps it alive, and the table is emptied past
    `MEMO_LIMIT` entries)."""

    __slots__ = ("_by_signature", "_by_topology")

    def __init__(self) -> None:
        self._by_signature: dict[tuple[object, ...], NodeKind] = {}
        self._by_topology: dict[int, tuple[Topology, NodeKind]] = {}

    def kind_of(self, topology: Topology) -> NodeKind:
        seen = self._by_topology.get(id(topology))
        if seen is not None and seen[0] is topology:
            return seen[1]
        signature = NodeKind.signature(topology)
        kind = self._by_signature.get(signature)
        if kind is None:
            kind = self._by_signature[signature] = NodeKind(topology)
        if len(self._by_topology) >= MEMO_LIMIT:
            self._by_topology.clear()
        # The entry keeps `topology` alive, so its id cannot be reused while it is here.
        self._by_topology[id(topology)] = (topology, kind)
        return kind


def _has_clique(candidates: int, adjacency: list[int], size: int) -> bool:
    """Whether `size` positions inside the mask `candidates` are pairwise adjacent."""
    if size <= 1:
        return candidates.bit_count() >= size
    while candidates.bit_count() >= size:
        lowest = candidates & -candidates
        candidates ^= lowest
        if _has_clique(candidates & adjacency[lowest.bit_length() - 1], adjacency, size - 1):
            return True
    return False
