"""Choose a node for one request: filter, score, choose, explain; preempt when nothing fits.

`place` returns the same choice, the same top candidates and the same scores as
`place_brute_force`, which scores every node of the snapshot, but looks at few of them:

1. Sites nearest to the client first (`EdgeNetwork.nearest`). Every score term is >= 0, so a
   node at distance d costs at least ``latency_bound(d + min_access)``; once that exceeds the
   worst of the `TOP_CANDIDATES` best found so far, no node at this site or any farther one
   can enter the top: stop (the branch-and-bound; nodes left are counted `NOT_REACHED`).
2. Inside a site, nodes sit in buckets by free-GPU count and by everything that decides their
   group (`broker.placement.snapshot`). Whole-GPU requests skip the counts below k at once. The
   filters (runtime, CUDA, free GPUs, memory, P2P) and the group's terms (`rest`) are computed
   once per bucket (`NodeKind.choose`, memoized).
3. Buckets are visited by ascending `rest`; inside one, nodes by ascending load. A node's
   bound is its penalty with its latency lowered to d + min_access; a bucket's first node
   bounds the bucket, and a bucket with load 0 bounds every later bucket. Nodes whose bound
   exceeds the worst top candidate are skipped (`OUTSCORED`), as are those whose bound equals
   it with a larger node id (ties go to the smallest id): with the nodes after it of the same
   load, in one step, so a site of idle nodes costs a few bounds, not one per node. Only the
   rest are scored in full.

All bounds are evaluated with `scoring.penalty` in the same operation order as the score
itself, so they hold in floating point too (IEEE rounding is monotonic) and the fast path
agrees with the brute force exactly (tests/unit/test_placement.py checks it on random
clusters).

Preemption (only when nothing fits and the request's class is above best-effort): on each node
that would fit after evicting allocations of strictly lower priority, the cheapest eviction
set is the one with the fewest allocations, then the lowest priorities (compared highest
first); nodes are ranked by that, then by latency, then by penalty and node id. Sites are
visited nearest first and the search stops early once the top options all evict a single
best-effort allocation and the next site is farther than all of them.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from broker.network import EdgeNetwork
from broker.placement.kinds import NodeKind, Shares
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
    parse_cuda,
)
from broker.placement.scoring import GroupTerms, latency_bound, penalty, score_terms
from broker.placement.snapshot import Bucket, BucketKey, ClusterSnapshot, SiteIndex, bucket_key

TOP_CANDIDATES = 3
"""Candidates kept, scored and explained (the chosen one and its runners-up)."""
MAX_LISTED_REJECTIONS = 20
"""Rejected nodes listed one by one in an explanation; the rest are only counted."""
MAX_EVICTABLE = 12
"""Lower-priority allocations considered for eviction per node (lowest priorities first):
bounds the subsets tried on a node to 2**12."""

_FLOOR = (1, (int(PriorityClass.STANDBY),))
"""The cheapest eviction there can be: one standby replica."""


def largest_possible(snapshot: ClusterSnapshot) -> tuple[int, str | None]:
    """(GPUs, node id) of the node with the most GPUs, whatever their use: a request for more
    can never fit (the broker answers FAILED_PRECONDITION naming this). (0, None) without nodes.
    """
    return snapshot.largest()


def place(snapshot: ClusterSnapshot, request: PlacementRequest, network: EdgeNetwork) -> Decision:
    """The node and GPUs for `request`, with the explanation (see the module docstring).

    Deterministic: ties go to the smallest node id. Pure: reads the snapshot and the network,
    changes neither. UnknownSite when the network does not know the request's site.
    """
    nearest = network.nearest(request.site)
    search = _Search(snapshot, request, network)
    search.scan_nearest(nearest)
    return search.decide(lambda: search.preempt_nearest(nearest))


def place_brute_force(
    snapshot: ClusterSnapshot, request: PlacementRequest, network: EdgeNetwork
) -> Decision:
    """`place` by scoring every node (and trying every node for preemption): the reference
    the fast path must equal. Same contract; O(nodes)."""
    network.nearest(request.site)
    search = _Search(snapshot, request, network)
    nodes = sorted(snapshot, key=lambda n: n.node_id)
    for node in nodes:
        search.score_node(node)
    return search.decide(lambda: search.preempt_all(nodes))


@dataclass(frozen=True, slots=True)
class _Option:
    """A node that fits, as it is or after evicting `evict`."""

    node_id: str
    site: str
    latency_ms: float
    load: float
    terms: GroupTerms
    evict: tuple[Allocation, ...] = ()


class _Top:
    """The `TOP_CANDIDATES` options with the smallest keys, smallest first."""

    __slots__ = ("keys", "options")

    def __init__(self) -> None:
        self.keys: list[tuple[Any, ...]] = []
        self.options: list[_Option] = []

    def full(self) -> bool:
        return len(self.keys) == TOP_CANDIDATES

    def worst(self) -> tuple[Any, ...]:
        """The largest key kept (only when full)."""
        return self.keys[-1]

    def add(self, key: tuple[Any, ...], option: _Option) -> int:
        """Keep `option` if it belongs in the top; return how many options fell out (0 or 1)."""
        if self.full() and not key < self.keys[-1]:
            return 1
        at = bisect.bisect_left(self.keys, key)
        self.keys.insert(at, key)
        self.options.insert(at, option)
        if len(self.keys) > TOP_CANDIDATES:
            self.keys.pop()
            self.options.pop()
            return 1
        return 0


class _Search:
    """One request's search: its top options, its rejections, and the decision."""

    def __init__(
        self, snapshot: ClusterSnapshot, request: PlacementRequest, network: EdgeNetwork
    ) -> None:
        self.snapshot = snapshot
        self.request = request
        self.network = network
        self.strategy = request.strategy
        self.min_cuda = parse_cuda(request.min_cuda) if request.min_cuda else None
        self.floor = network.min_access_ms
        """Lowest access latency of any node: d + floor bounds every node at distance d."""
        self.top = _Top()
        """Keys (penalty, node id)."""
        self.preemptions = _Top()
        """Keys (evictions, priorities evicted highest first, latency, penalty, node id)."""
        self.counts: Counter[RejectReason] = Counter()
        self.listed: list[Rejection] = []
        self.scored = 0

    # --- the fast path ------------------------------------------------------------------------

    def scan_nearest(self, nearest: Sequence[tuple[float, str]]) -> None:
        slo = self.request.latency_slo_ms
        for i, (distance, site) in enumerate(nearest):
            index = self.snapshot._site(site)
            if index is None:
                continue
            closest = distance + self.floor
            if slo is not None and closest > slo:
                self._skip(nearest[i:], RejectReason.LATENCY_SLO, f">= {closest:.2f} ms")
                break
            if self.top.full() and latency_bound(self.strategy, closest) > self.top.worst()[0]:
                self._skip(nearest[i:], RejectReason.NOT_REACHED, "")
                break
            self._scan_site(distance, site, index)
        for site in self.snapshot.sites:
            index = self.snapshot._site(site)
            if index is not None and not self.network.has_site(site):
                self._reject(RejectReason.UNKNOWN_SITE, index.count, _ids(index), site)

    def _scan_site(self, distance: float, site: str, index: SiteIndex) -> None:
        request = self.request
        if index.not_ready:
            self._reject(RejectReason.NOT_READY, len(index.not_ready), sorted(index.not_ready))
        fitting: list[tuple[float, Bucket, GroupTerms]] = []
        for free, group in index.buckets.items():
            if request.gpu_memory_mib == 0 and free < request.gpus:
                self._reject(
                    RejectReason.TOO_FEW_GPUS,
                    index.sizes[free],
                    (node_id for bucket in group.values() for _, node_id in bucket),
                    f"{free} GPU(s) free",
                )
                continue
            for key, bucket in group.items():
                terms = self._fit(key, (node_id for _, node_id in bucket), len(bucket))
                if terms is not None:
                    fitting.append((terms.rest, bucket, terms))
        fitting.sort(key=lambda item: item[0])
        closest = distance + self.floor
        strategy = self.strategy
        slo = request.latency_slo_ms
        top = self.top
        for i, (rest, bucket, terms) in enumerate(fitting):
            if top.full() and penalty(strategy, closest, 0.0, rest) > top.worst()[0]:
                self.counts[RejectReason.OUTSCORED] += sum(len(b) for _, b, _ in fitting[i:])
                break
            j, size = 0, len(bucket)
            while j < size:
                load, node_id = bucket[j]
                if top.full():
                    worst_penalty, worst_id = top.worst()
                    bound = penalty(strategy, closest, load, rest)
                    if bound > worst_penalty:
                        self.counts[RejectReason.OUTSCORED] += size - j
                        break
                    if bound == worst_penalty and node_id > worst_id:
                        # The nodes after it of the same load have larger ids and the same
                        # bound: all outscored (a cluster of idle nodes is one such run).
                        end = bisect.bisect_right(bucket, load, j, key=_load)
                        self.counts[RejectReason.OUTSCORED] += end - j
                        j = end
                        continue
                j += 1
                latency = distance + self.network.access_ms(node_id)
                if slo is not None and latency > slo:
                    self._reject(RejectReason.LATENCY_SLO, 1, (node_id,), f"{latency:.2f} ms")
                    continue
                self._offer(node_id, site, latency, load, terms)

    def _skip(self, sites: Sequence[tuple[float, str]], reason: RejectReason, detail: str) -> None:
        """Count every node at `sites` as rejected for `reason` without looking at them."""
        for _, site in sites:
            index = self.snapshot._site(site)
            if index is not None:
                listed = _ids(index) if reason is RejectReason.LATENCY_SLO else ()
                self._reject(reason, index.count, listed, detail)

    def preempt_nearest(self, nearest: Sequence[tuple[float, str]]) -> None:
        slo = self.request.latency_slo_ms
        for distance, site in nearest:
            closest = distance + self.floor
            if slo is not None and closest > slo:
                return
            if self.preemptions.full():
                worst = self.preemptions.worst()
                if (worst[0], worst[1]) == _FLOOR and closest > worst[2]:
                    return
            index = self.snapshot._site(site)
            if index is None:
                continue
            for group in index.buckets.values():
                for key, bucket in group.items():
                    if self._static(key) is None:
                        for _, node_id in bucket:
                            latency = distance + self.network.access_ms(node_id)
                            self._try_eviction(node_id, latency)

    # --- the brute force ----------------------------------------------------------------------

    def score_node(self, node: NodeSnapshot) -> None:
        node_id = node.node_id
        if not node.ready:
            self._reject(RejectReason.NOT_READY, 1, (node_id,))
            return
        if not self.network.has_site(node.site):
            self._reject(RejectReason.UNKNOWN_SITE, 1, (node_id,), node.site)
            return
        if self.request.gpu_memory_mib == 0 and len(node.free) < self.request.gpus:
            self._reject(RejectReason.TOO_FEW_GPUS, 1, (node_id,), f"{len(node.free)} GPU(s) free")
            return
        terms = self._fit(self._key(node), (node_id,), 1)
        if terms is None:
            return
        latency = self.network.latency_ms(self.request.site, node.site, node_id)
        slo = self.request.latency_slo_ms
        if slo is not None and latency > slo:
            self._reject(RejectReason.LATENCY_SLO, 1, (node_id,), f"{latency:.2f} ms")
            return
        self._offer(node_id, node.site, latency, node.load, terms)

    def preempt_all(self, nodes: Iterable[NodeSnapshot]) -> None:
        for node in nodes:
            usable = node.ready and self.network.has_site(node.site)
            if usable and self._static(self._key(node)) is None:
                latency = self.network.latency_ms(self.request.site, node.site, node.node_id)
                self._try_eviction(node.node_id, latency)

    def _key(self, node: NodeSnapshot) -> BucketKey:
        """The bucket key of a ready node, as the snapshot's index computes it."""
        key = bucket_key(node, self.snapshot._kind(node.node_id))
        assert key is not None, "only ready nodes have a bucket"
        return key

    # --- shared by both -----------------------------------------------------------------------

    def _static(self, key: BucketKey) -> tuple[RejectReason, str] | None:
        """Why nodes with bucket key `key` cannot take the request whatever their GPUs."""
        _, _, _, runtimes, cuda = key
        if self.request.runtime is not None and self.request.runtime not in runtimes:
            return RejectReason.RUNTIME, f"offers {', '.join(sorted(runtimes)) or 'none'}"
        if self.min_cuda is not None and (not cuda or parse_cuda(cuda) < self.min_cuda):
            return RejectReason.CUDA, f"CUDA {cuda or 'unknown'}"
        return None

    def _fit(self, key: BucketKey, node_ids: Iterable[str], count: int) -> GroupTerms | None:
        """The group terms of nodes with bucket key `key`, or None after rejecting them."""
        static = self._static(key)
        if static is not None:
            self._reject(static[0], count, node_ids, static[1])
            return None
        kind, free_mask, shares, _, _ = key
        request = self.request
        found = kind.choose(
            request.gpus,
            request.gpu_memory_mib,
            request.p2p_required,
            self.strategy,
            free_mask,
            shares,
        )
        if isinstance(found, RejectReason):
            self._reject(found, count, node_ids, f"{free_mask.bit_count()} GPU(s) free")
            return None
        return found

    def _offer(
        self, node_id: str, site: str, latency: float, load: float, terms: GroupTerms
    ) -> None:
        self.scored += 1
        key = (penalty(self.strategy, latency, load, terms.rest), node_id)
        option = _Option(node_id, site, latency, load, terms)
        self.counts[RejectReason.OUTSCORED] += self.top.add(key, option)

    def _try_eviction(self, node_id: str, latency: float) -> None:
        """Offer the node's cheapest eviction set that makes room, if any beats the top."""
        request = self.request
        slo = request.latency_slo_ms
        if slo is not None and latency > slo:
            return
        entry = self.snapshot._entry(node_id)
        assert entry is not None
        node, kind = entry.node, entry.kind
        evictable = sorted(
            (a for a in node.allocations if a.priority < request.priority),
            key=lambda a: (a.priority, a.deployment_id),
        )[:MAX_EVICTABLE]
        if not evictable:
            return
        # Keys start (evictions, priorities, latency): nothing here beats `bound` once this
        # node's cheapest conceivable start does not.
        bound = self.preemptions.worst()[:3] if self.preemptions.full() else None
        if bound is not None and (1, (int(evictable[0].priority),), latency) > bound:
            return
        if self._room_after(kind, node, evictable) is None:
            return
        for count in range(1, len(evictable) + 1):
            for subset in sorted(itertools.combinations(evictable, count), key=_priorities):
                cost = (count, _priorities(subset))
                if bound is not None and (*cost, latency) > bound:
                    return
                terms = self._room_after(kind, node, subset)
                if terms is not None:
                    key = (*cost, latency, penalty(self.strategy, latency, node.load, terms.rest))
                    option = _Option(node_id, node.site, latency, node.load, terms, subset)
                    self.preemptions.add((*key, node_id), option)
                    return

    def _room_after(
        self, kind: NodeKind, node: NodeSnapshot, evicted: Sequence[Allocation]
    ) -> GroupTerms | None:
        """The group the node would give once `evicted` are gone; None if still none fits."""
        free = kind.mask(node.free)
        shares = list(kind.shares(node.shared_mib)) or [0] * kind.n
        for allocation in evicted:
            for index in allocation.gpus:
                p = kind.position[index]
                if allocation.memory_mib:
                    shares[p] = max(0, shares[p] - allocation.memory_mib)
                    if shares[p]:
                        continue
                free |= 1 << p
        left: Shares = tuple(shares) if any(shares) else ()
        request = self.request
        found = kind.choose(
            request.gpus,
            request.gpu_memory_mib,
            request.p2p_required,
            self.strategy,
            free,
            left,
        )
        return None if isinstance(found, RejectReason) else found

    def _reject(
        self, reason: RejectReason, count: int, node_ids: Iterable[str], detail: str = ""
    ) -> None:
        self.counts[reason] += count
        room = MAX_LISTED_REJECTIONS - len(self.listed)
        if room > 0:
            self.listed.extend(
                Rejection(node_id, reason, detail) for node_id in itertools.islice(node_ids, room)
            )

    # --- the decision -------------------------------------------------------------------------

    def decide(self, preempt: Callable[[], None]) -> Decision:
        """The decision from the top options; else, for a class above standby, from
        `preempt`'s options (a best-effort request may evict standbys only); else none, with
        the reason."""
        request = self.request
        if self.top.options:
            candidates = [self._candidate(o) for o in self.top.options]
            return self._decision(candidates, _deciding(candidates), "")
        reason = f"no node fits {_describe(request)}: {self._summary()}"
        if request.priority == PriorityClass.STANDBY:
            reason += "; standby replicas preempt nothing"
        else:
            preempt()
            if self.preemptions.options:
                best = self.preemptions.options[0]
                evicted = ", ".join(
                    f"{a.deployment_id} ({a.priority.name.lower()})" for a in best.evict
                )
                note = (
                    f"nothing fits as it is; preempts {len(best.evict)} allocation(s) of lower "
                    f"priority than {request.priority.name.lower()} on {best.node_id}: {evicted}"
                )
                candidates = [self._candidate(o) for o in self.preemptions.options]
                keys = self.preemptions.keys
                return self._decision(candidates, _deciding_preemption(candidates, keys), note)
            reason += (
                f"; no eviction of allocations below {request.priority.name.lower()} "
                "makes room either"
            )
        explanation = self._explanation(None, [], (), reason)
        return Decision(node_id=None, gpus=(), explanation=explanation, reason=reason)

    def _decision(
        self, candidates: list[Candidate], deciding: tuple[str, ...], note: str
    ) -> Decision:
        chosen = candidates[0]
        return Decision(
            node_id=chosen.node_id,
            gpus=chosen.gpus,
            explanation=self._explanation(chosen, candidates, deciding, note),
            preempt=chosen.preempt,
        )

    def _explanation(
        self,
        chosen: Candidate | None,
        candidates: list[Candidate],
        deciding: tuple[str, ...],
        note: str,
    ) -> Explanation:
        order = list(RejectReason)
        counts = sorted(self.counts.items(), key=lambda item: (-item[1], order.index(item[0])))
        return Explanation(
            chosen=chosen,
            top=tuple(candidates),
            deciding=deciding,
            rejected=tuple(self.listed),
            rejected_counts=tuple(RejectionCount(r, n) for r, n in counts if n),
            nodes=len(self.snapshot),
            scored=self.scored,
            note=note,
        )

    def _candidate(self, option: _Option) -> Candidate:
        return Candidate(
            node_id=option.node_id,
            site=option.site,
            gpus=option.terms.gpus,
            latency_ms=option.latency_ms,
            score=score_terms(self.strategy, option.latency_ms, option.load, option.terms),
            preempt=tuple(a.deployment_id for a in option.evict),
        )

    def _summary(self) -> str:
        if not self.counts:
            return "the cluster has no nodes"
        return "; ".join(f"{n:,} node(s) {reason}" for reason, n in self.counts.most_common(3))


def _priorities(allocations: Sequence[Allocation]) -> tuple[int, ...]:
    """Priorities of `allocations`, highest first: evicting less important ones compares less."""
    return tuple(sorted((int(a.priority) for a in allocations), reverse=True))


def _deciding(candidates: Sequence[Candidate]) -> tuple[str, ...]:
    """The terms in which the winner beat the runner-up, largest margin first."""
    if len(candidates) < 2:
        return ()
    winner, runner_up = candidates[0].score, candidates[1].score
    if winner.total == runner_up.total:
        return ("node id",)
    margins = [
        (theirs.weighted - ours.weighted, str(ours.name))
        for ours, theirs in zip(winner.terms, runner_up.terms, strict=True)
    ]
    return tuple(name for margin, name in sorted(margins, key=lambda m: -m[0]) if margin > 0)


def _deciding_preemption(
    candidates: Sequence[Candidate], keys: Sequence[tuple[Any, ...]]
) -> tuple[str, ...]:
    if len(keys) < 2:
        return ()
    first, second = keys[0], keys[1]
    if first[0] != second[0]:
        return ("evictions",)
    if first[1] != second[1]:
        return ("evicted priority",)
    if first[2] != second[2]:
        return ("latency",)
    return _deciding(candidates)


def _describe(request: PlacementRequest) -> str:
    words = [f"{request.gpus} GPU(s)"]
    if request.gpu_memory_mib:
        words.append(f"with {request.gpu_memory_mib} MiB each")
    if request.p2p_required and request.gpus > 1:
        words.append("linked for P2P")
    if request.latency_slo_ms is not None:
        words.append(f"within {request.latency_slo_ms:g} ms of {request.site}")
    if request.runtime is not None:
        words.append(f"on runtime {request.runtime}")
    if request.min_cuda is not None:
        words.append(f"with CUDA >= {request.min_cuda}")
    return " ".join(words)


def _load(item: tuple[float, str]) -> float:
    return item[0]


def _ids(index: SiteIndex) -> Iterator[str]:
    """Every node id at a site: the not-ready ones, then by bucket."""
    yield from sorted(index.not_ready)
    for group in index.buckets.values():
        for bucket in group.values():
            for _, node_id in bucket:
                yield node_id
