"""GPU topology of one node: a graph of GPUs and links, the topo-tree, the best group for k GPUs.

Pure values built from an `Inventory` (whatever its source: NVML or a `nvidia-smi topo -m`
capture); no I/O. `Topology.best_group` is the allocation primitive the node daemon and the
broker's placement use; `best_group_brute_force` is its reference (tests and the benchmark
`python -m bench.gpu_allocation` check the two agree).

Link rank, one total order over `Link`s (higher is faster), by `link_rank`:

    SYS = 1 < NODE = 2 < PHB = 3 < PXB = 4 < PIX = 5 < NV<n> = 10 + n   (NV1 = 11 ... NV18 = 28)

Measured peer-to-peer bandwidth supports it (`p2pBandwidthLatencyTest` outputs in
`tests/data/p2p_bandwidth`): on a DGX-1 V100, NV2 96.9 GB/s > NV1 48.5 GB/s >
SYS 14.5 GB/s (bidirectional); two H100 PCIe with an NV12 bridge 509 GB/s bidirectional against
35 GB/s through the host; A100 NV12 about 274 GB/s and H100 NV18 about 376 GB/s unidirectional,
so more NVLinks is faster across generations too. Inside PCIe the order follows the path length:
7 GTX 10x0 behind two switches move 1.64 GB/s over PIX against 1.32 GB/s over PHB; RTX 6000 Ada
pairs reach 52.1 GB/s over both NODE and SYS, but SYS is never faster and costs latency
(13.6-14.2 us against 10.3-10.7 us without P2P), and on older hosts (Azure M60 pair, SOC) SYS has
no P2P at all (5.5 GB/s through host memory).

The link code is not all: on machines where every pair is SYS (or every pair the same code)
the matrix cannot tell sockets apart, yet P2P within one socket is faster (about 50 against
40-42 GB/s measured on an 8x RTX 4090 box, as reported in issue 11) and host traffic stays
local. So `best_group` compares, in this order (`GroupScore`, each field higher is better):

    1. slowest   the lowest link rank inside the group
    2. total     the sum of the link ranks inside the group
    3. local     the pairs inside the group known to share a NUMA node (`same_numa`)
    4. future, idle_future, idle_total   fragmentation: what the group leaves to others

then the smallest indices. A group within one NUMA node thus wins over any group with the
same links that spans nodes, and never over one with better links. Two GPUs share a NUMA
node when both report one (`Gpu.numa_node`: NVML, or a capture's NUMA Affinity) and it is the
same; else when both report a CPU affinity and it is the same (old captures have no NUMA
column); else it is unknown and counts as not shared. A capture's GPU NUMA ID is the GPU's
own memory node (Grace Hopper), distinct per GPU, and tells nothing about locality.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import networkx as nx

from common.inventory import Gpu, Inventory, Link, LinkKind

_PCIE_RANK = {
    LinkKind.SYS: 1,
    LinkKind.NODE: 2,
    LinkKind.PHB: 3,
    LinkKind.PXB: 4,
    LinkKind.PIX: 5,
}
NV_RANK_BASE = 10
"""NV<n> ranks NV_RANK_BASE + n: above every PCIe kind, and more bonded links rank higher."""

NO_LINK_RANK = 0
"""`GroupScore.slowest` of a one-GPU group: it has no link, and every real rank is above 0."""

_CACHE_LIMIT = 4096
"""Entries per memo table before it is emptied: bounds memory on long-lived daemons."""


def link_rank(link: Link) -> int:
    """The link's place in the one total order above (higher is faster)."""
    if link.kind is LinkKind.NV:
        return NV_RANK_BASE + link.nvlinks
    return _PCIE_RANK[link.kind]


class TopoKind(enum.StrEnum):
    """Levels of the topo-tree, from the root down."""

    SYSTEM = "system"
    NUMA = "numa"
    """GPUs whose CPU affinity is one NUMA node (socket, or a part of one in NPS modes)."""
    HOST_BRIDGE = "host-bridge"
    """GPUs with PHB (or closer) between each other: one PCIe host bridge."""
    SWITCH_TREE = "pcie-switches"
    """GPUs with PXB (or closer): one tree of PCIe switches below the host bridge."""
    SWITCH = "pcie-switch"
    """GPUs with PIX: one PCIe switch."""
    GPU = "gpu"


# The PCIe levels below NUMA, coarse to fine, and the link kinds that put two GPUs in one node.
_PCIE_LEVELS = (
    (TopoKind.HOST_BRIDGE, "host bridge", frozenset({LinkKind.PHB, LinkKind.PXB, LinkKind.PIX})),
    (TopoKind.SWITCH_TREE, "PCIe switches", frozenset({LinkKind.PXB, LinkKind.PIX})),
    (TopoKind.SWITCH, "PCIe switch", frozenset({LinkKind.PIX})),
)


@dataclass(frozen=True, slots=True)
class TopoNode:
    """One node of the topo-tree: system > NUMA node > host bridge > PCIe switches > switch > GPU.

    Levels that tell nothing are left out: a PCIe level appears only for two or more GPUs that
    the links prove share it, and only its finest form (a group that is one switch is not also
    shown as a switch tree). GPUs joined by NVLink only hide their PCIe path in a capture, so
    they hang directly below their NUMA node.
    """

    kind: TopoKind
    label: str
    children: tuple[TopoNode, ...]
    gpus: tuple[int, ...]
    """Every GPU index in this subtree, ascending."""

    def render(self) -> str:
        """The subtree as indented text, one node a line (for the ops page and logs)."""
        lines: list[str] = []
        self._render_into(lines, 0)
        return "\n".join(lines)

    def _render_into(self, lines: list[str], depth: int) -> None:
        if self.kind is TopoKind.GPU:
            lines.append(f"{'  ' * depth}{self.label}")
            return
        members = " ".join(f"GPU{g}" for g in self.gpus)
        lines.append(f"{'  ' * depth}{self.label}: {members}")
        for child in self.children:
            child._render_into(lines, depth + 1)


@dataclass(frozen=True, slots=True, order=True)
class GroupScore:
    """What `best_group` maximizes, compared field by field in this order.

    For a group G taken out of the free GPUs F of a node with GPUs A: R = F - G are the free
    GPUs left behind and A - G the GPUs outside G. `future` (s) of a set S of GPUs is the best
    slowest-link rank a group of s GPUs inside S could get: the largest t such that S holds s
    GPUs with every pair ranked >= t.

    The last three fields are the fragmentation term. `future` keeps the best groups among the
    free GPUs whole for the next requests. `idle_future` and `idle_total` are static (they do
    not depend on which GPUs are busy), so the same kind of request lands on the same GPUs
    every time: allocations pack instead of scattering, and the best-connected GPUs of the
    machine are the last handed out to small requests. In the benchmark (`bench.gpu_allocation`,
    1000 sequences) this beats tie-breaking on the free GPUs' own links, which scatters.
    """

    slowest: int
    """Lowest link rank over the pairs inside G; NO_LINK_RANK for a single GPU."""
    total: int
    """Sum of the link ranks over every pair inside G."""
    local: int
    """Pairs inside G known to share a NUMA node (`Topology.same_numa`): among groups with
    the same links, one NUMA node beats several."""
    future: tuple[int, ...]
    """future(s) of R for s = 2, 4, 8, ... up to |R|, smallest s first: keep the best pair
    left whole first, then the best quad, and so on."""
    idle_future: tuple[int, ...]
    """future(s) of A - G for s = 2, 4, 8, ... up to |A - G|: the same once every other
    allocation is released."""
    idle_total: int
    """Sum of the link ranks over every pair inside A - G: cut the fewest good links of the
    machine (for k = 1, with the futures equal, take the worst-connected GPU)."""


@dataclass(frozen=True, slots=True)
class Topology:
    """The GPUs of one node, how they are linked, and the best groups to hand out.

    Build with `Topology.from_inventory`. Immutable and safe to share between threads; the
    only state is the search's memo (answers by (k, free set), fragmentation by GPU set).
    """

    inventory: Inventory
    graph: nx.Graph
    """Frozen: nodes are GPU indices (attribute `gpu`: the `Gpu`); an edge for every pair with
    attributes `link` (the `Link`), `rank` (`link_rank` of it) and `same_numa` (see
    `same_numa`)."""
    tree: TopoNode
    nvlink_groups: tuple[tuple[int, ...], ...]
    """Connected components of the NVLink graph with two or more GPUs, by lowest index."""
    nvlink_cliques: tuple[tuple[int, ...], ...]
    """Maximal sets of GPUs with NVLink between every two of them (two or more), largest first."""
    _search: _GroupSearch = field(repr=False, compare=False)

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> Topology:
        """ValueError when a GPU index repeats or a GPU pair has no link."""
        indices = sorted(gpu.index for gpu in inventory.gpus)
        if len(set(indices)) != len(indices):
            raise ValueError(f"GPU indices repeat in the inventory: {indices}")
        missing = [p for p in itertools.combinations(indices, 2) if p not in inventory.links]
        if missing:
            raise ValueError(f"the inventory has no link for GPU pair(s) {missing}")
        graph = nx.Graph()
        gpus = {gpu.index: gpu for gpu in inventory.gpus}
        for index in indices:
            graph.add_node(index, gpu=gpus[index])
        for a, b in itertools.combinations(indices, 2):
            link = inventory.links[(a, b)]
            same = _same_numa(gpus[a], gpus[b]) is True
            graph.add_edge(a, b, link=link, rank=link_rank(link), same_numa=same)
        nvlink = nx.Graph()
        nvlink.add_edges_from(
            (a, b) for a, b, link in graph.edges(data="link") if link.kind is LinkKind.NV
        )
        groups = sorted(tuple(sorted(c)) for c in nx.connected_components(nvlink))
        cliques = sorted(
            (tuple(sorted(c)) for c in nx.find_cliques(nvlink)), key=lambda c: (-len(c), c)
        )
        rank = [[graph.edges[a, b]["rank"] if a != b else 0 for b in indices] for a in indices]
        local = [[a != b and graph.edges[a, b]["same_numa"] for b in indices] for a in indices]
        return cls(
            inventory=inventory,
            graph=nx.freeze(graph),
            tree=_build_tree(inventory, indices),
            nvlink_groups=tuple(groups),
            nvlink_cliques=tuple(cliques),
            _search=_GroupSearch(tuple(indices), rank, local),
        )

    def rank(self, a: int, b: int) -> int:
        """`link_rank` of the link between GPUs a and b; KeyError for a == b or unknown GPUs."""
        if a == b:
            raise KeyError(f"GPU{a} has no link to itself")
        return int(self.graph.edges[a, b]["rank"])

    def same_numa(self, a: int, b: int) -> bool:
        """Whether GPUs a and b are known to share a NUMA node (see the module docstring);
        False when they are not or it is unknown. KeyError for a == b or unknown GPUs."""
        if a == b:
            raise KeyError(f"GPU{a} has no link to itself")
        return bool(self.graph.edges[a, b]["same_numa"])

    def describe(self) -> str:
        """The topo-tree and the NVLink groups as text (for the ops page and logs)."""
        lines = [self.tree.render()]
        if not self.nvlink_groups:
            lines.append("NVLink: none")
        for group in self.nvlink_groups:
            kinds = sorted(
                {
                    link.nvlinks
                    for _, _, link in self.graph.subgraph(group).edges(data="link")
                    if link.kind is LinkKind.NV
                }
            )
            cliques = [c for c in self.nvlink_cliques if set(c) <= set(group)]
            lines.append(
                f"NVLink group {' '.join(f'GPU{g}' for g in group)}"
                f" ({', '.join(f'NV{n}' for n in kinds)});"
                f" all-to-all: {', '.join('{' + ' '.join(map(str, c)) + '}' for c in cliques)}"
            )
        return "\n".join(lines)

    def score(self, group: Collection[int], free: Collection[int]) -> GroupScore:
        """The `GroupScore` of taking `group` out of `free`, straight from its definition.

        The reference objective (exponential in the worst case; `best_group` does not call it).
        ValueError when `free` is invalid (see `best_group`), `group` is empty, repeats a GPU
        or is not inside `free`.
        """
        free_set = self._check_free(free)
        members = sorted(set(group))
        if not members or len(members) != len(group) or not free_set.issuperset(members):
            raise ValueError(
                f"group {sorted(group)} must be distinct GPUs out of free {sorted(free_set)}"
            )
        ranks = [self.rank(a, b) for a, b in itertools.combinations(members, 2)]
        outside = sorted(set(self.graph.nodes).difference(members))
        return GroupScore(
            slowest=min(ranks, default=NO_LINK_RANK),
            total=sum(ranks),
            local=sum(self.same_numa(a, b) for a, b in itertools.combinations(members, 2)),
            future=self._future(sorted(free_set.difference(members))),
            idle_future=self._future(outside),
            idle_total=sum(self.rank(a, b) for a, b in itertools.combinations(outside, 2)),
        )

    def best_group(self, k: int, free: Collection[int]) -> tuple[int, ...]:
        """The k GPUs out of `free` with the highest `GroupScore`, ascending.

        Ties go to the lexicographically smallest tuple of indices, so the answer is the first
        optimum `itertools.combinations(sorted(free), k)` meets: `best_group_brute_force`.
        Never returns a GPU outside `free`. Memoized by (k, free set); fast on 8 GPUs and on
        16-GPU NVSwitch nodes, because GPUs with identical links are searched as one class.

        ValueError when k < 1 or k > len(free), when `free` repeats a GPU, or names a GPU
        not in this topology.
        """
        return self._search.best(k, self._check_request(k, free))

    def _check_request(self, k: int, free: Collection[int]) -> frozenset[int]:
        free_set = self._check_free(free)
        if not 1 <= k <= len(free_set):
            raise ValueError(
                f"cannot take k={k} GPU(s) out of {len(free_set)} free: need 1 <= k <= free"
            )
        return free_set

    def _check_free(self, free: Collection[int]) -> frozenset[int]:
        free_set = frozenset(free)
        if len(free_set) != len(free):
            raise ValueError(f"free GPUs repeat: {sorted(free)}")
        unknown = free_set.difference(self.graph.nodes)
        if unknown:
            raise ValueError(
                f"GPU(s) {sorted(unknown)} not in this topology (GPUs {sorted(self.graph.nodes)})"
            )
        return free_set

    def _future(self, gpus: Sequence[int]) -> tuple[int, ...]:
        """`GroupScore.future` of `gpus`, by trying every subset."""
        levels = sorted(
            {self.rank(a, b) for a, b in itertools.combinations(gpus, 2)}, reverse=True
        )
        future = []
        size = 2
        while size <= len(gpus):
            future.append(
                next(
                    level
                    for level in levels
                    if any(
                        all(self.rank(a, b) >= level for a, b in itertools.combinations(sub, 2))
                        for sub in itertools.combinations(gpus, size)
                    )
                )
            )
            size *= 2
        return tuple(future)


def best_group_brute_force(topology: Topology, k: int, free: Collection[int]) -> tuple[int, ...]:
    """Reference for `Topology.best_group`: scores every k-subset of `free` with
    `Topology.score` and keeps the first best. Same contract and errors; exponential time."""
    free_set = topology._check_request(k, free)
    best: tuple[int, ...] = ()
    best_score: GroupScore | None = None
    for group in itertools.combinations(sorted(free_set), k):
        score = topology.score(group, free)
        if best_score is None or score > best_score:
            best, best_score = group, score
    return best


class _GroupSearch:
    """`best_group` over bitmasks of GPU positions (position p is the p-th smallest index).

    The pair weight rank * scale + local (local: 1 when the two share a NUMA node, scale above
    any count of local pairs) sums to total * scale + local over a group, so comparing weight
    sums compares (total, local) in order.

    1. Twin classes: GPUs u, v with weight(u, w) == weight(v, w) for every other GPU w of the
       node (all of them, not only the free ones, as the idle terms look at all). Swapping two
       free twins maps every group to one with the same score, so the search picks how many
       GPUs to take from each class, always its lowest indices (also the tie-break's choice).
    2. For slowest-link thresholds t from the highest down: enumerate the count vectors whose
       every pair ranks >= t (classes whose inner rank is below t give at most one GPU;
       classes linked below t exclude each other), pruned by an upper bound on the weight
       sum; the first t with any group is the optimum slowest link; keep all groups of top
       weight sum (total, then local).
    3. Rank those by the fragmentation terms (clique numbers of the free GPUs left, and of all
       GPUs outside the group, at each threshold: bitmask branch and bound, memoized by set),
       then by the tie-break.
    """

    __slots__ = (
        "_adjacency",
        "_groups",
        "_index",
        "_levels",
        "_position",
        "_profiles",
        "_rank",
        "_twins",
        "_weight",
    )

    def __init__(
        self, index: tuple[int, ...], rank: list[list[int]], local: list[list[bool]]
    ) -> None:
        n = len(index)
        self._index = index
        self._position = {gpu: p for p, gpu in enumerate(index)}
        self._rank = rank
        scale = n * (n - 1) // 2 + 1
        weight = [[rank[a][b] * scale + local[a][b] for b in range(n)] for a in range(n)]
        self._weight = weight
        self._levels = sorted({rank[a][b] for a in range(n) for b in range(a + 1, n)})[::-1]
        self._adjacency = {
            level: [
                sum(1 << b for b in range(n) if b != a and rank[a][b] >= level) for a in range(n)
            ]
            for level in self._levels
        }
        twins: list[int] = []
        for a in range(n):
            for i, members in enumerate(twins):
                b = members.bit_length() - 1
                if all(weight[a][w] == weight[b][w] for w in range(n) if w not in (a, b)):
                    twins[i] |= 1 << a
                    break
            else:
                twins.append(1 << a)
        self._twins = twins
        self._groups: dict[tuple[int, int], tuple[int, ...]] = {}
        self._profiles: dict[int, tuple[tuple[int, ...], int]] = {}

    def best(self, k: int, free: frozenset[int]) -> tuple[int, ...]:
        free_mask = sum(1 << self._position[gpu] for gpu in free)
        key = (k, free_mask)
        cached = self._groups.get(key)
        if cached is None:
            cached = tuple(self._index[p] for p in set_bits(self._solve(k, free_mask)))
            if len(self._groups) >= _CACHE_LIMIT:
                self._groups.clear()
            self._groups[key] = cached
        return cached

    def _solve(self, k: int, free_mask: int) -> int:
        if k == free_mask.bit_count():
            return free_mask
        candidates = self._top_groups(k, [c & free_mask for c in self._twins if c & free_mask])
        if len(candidates) == 1:
            return candidates[0]
        every = (1 << len(self._index)) - 1
        # (future, (idle_future, idle_total)), then the smallest positions: largest negated.
        return max(
            candidates,
            key=lambda g: (
                self._profile(free_mask & ~g)[0],
                self._profile(every & ~g),
                tuple(-p for p in set_bits(g)),
            ),
        )

    def _top_groups(self, k: int, classes: list[int]) -> list[int]:
        """Canonical group masks with the best slowest link, and among them the best total,
        then the most pairs on one NUMA node."""
        if k == 1:
            return [c & -c for c in classes]
        reps = [c.bit_length() - 1 for c in classes]
        sizes = [c.bit_count() for c in classes]
        seconds = [(c & -c).bit_length() - 1 for c in classes]
        rank = _ClassMatrix(
            inner=[self._rank[r][s] for r, s in zip(reps, seconds, strict=True)],
            cross=[[self._rank[a][b] for b in reps] for a in reps],
        )
        weight = _ClassMatrix(
            inner=[self._weight[r][s] for r, s in zip(reps, seconds, strict=True)],
            cross=[[self._weight[a][b] for b in reps] for a in reps],
        )
        levels = sorted(
            {rank.inner[i] for i in range(len(classes)) if sizes[i] > 1}
            | {rank.cross[i][j] for i in range(len(classes)) for j in range(i)},
            reverse=True,
        )
        for level in levels:
            found = _densest(k, level, sizes, rank, weight)
            if found:
                return [_canonical(classes, counts) for counts in found]
        raise AssertionError("unreachable: every group meets the lowest level")

    def _profile(self, left: int) -> tuple[tuple[int, ...], int]:
        """(future, sum of pair ranks) of the GPUs in the mask `left`, memoized."""
        cached = self._profiles.get(left)
        if cached is None:
            cached = self._compute_profile(left)
            if len(self._profiles) >= _CACHE_LIMIT:
                self._profiles.clear()
            self._profiles[left] = cached
        return cached

    def _compute_profile(self, left: int) -> tuple[tuple[int, ...], int]:
        sizes = []
        size = 2
        while size <= left.bit_count():
            sizes.append(size)
            size *= 2
        future: list[int] = []
        for level in self._levels:
            if len(future) == len(sizes):
                break
            clique = _clique_number(left, self._adjacency[level], enough=sizes[-1])
            while len(future) < len(sizes) and sizes[len(future)] <= clique:
                future.append(level)
        members = list(set_bits(left))
        total = sum(self._rank[a][b] for a, b in itertools.combinations(members, 2))
        return tuple(future), total


@dataclass(frozen=True, slots=True)
class _ClassMatrix:
    """A pair matrix over twin classes."""

    inner: list[int]
    """Between two GPUs of class i (0 for a class of one GPU: it has no such pair)."""
    cross: list[list[int]]
    """Between a GPU of class i and one of class j."""


def _densest(
    k: int, level: int, sizes: list[int], rank: _ClassMatrix, weight: _ClassMatrix
) -> list[list[int]]:
    """Count vectors (GPUs taken per twin class) of the k-groups whose every pair ranks
    >= `level` and whose weight sum is the highest; [] when there is no such group.

    `sizes[i]`: free GPUs in class i; `rank`, `weight`: the pair ranks and weights.
    """
    inner, cross = weight.inner, weight.cross
    top = max([*inner, *(max(row) for row in cross)])
    caps = [size if rank.inner[i] >= level else 1 for i, size in enumerate(sizes)]
    reach = [sum(caps[i:]) for i in range(len(caps) + 1)]
    counts = [0] * len(sizes)
    chosen: list[int] = []
    best_total = -1
    found: list[list[int]] = []

    def visit(i: int, left: int, total: int, taken: int) -> None:
        nonlocal best_total, found
        if left == 0:
            if total > best_total:
                best_total, found = total, [counts.copy()]
            elif total == best_total:
                found.append(counts.copy())
            return
        # Prune: too few GPUs left to take, or even top-ranked links could not reach the best.
        if reach[i] < left or total + (left * taken + left * (left - 1) // 2) * top < best_total:
            return
        if all(rank.cross[i][j] >= level for j in chosen):
            links = sum(counts[j] * cross[i][j] for j in chosen)
            chosen.append(i)
            for c in range(min(caps[i], left), 0, -1):
                counts[i] = c
                visit(i + 1, left - c, total + c * (c - 1) // 2 * inner[i] + c * links, taken + c)
            chosen.pop()
            counts[i] = 0
        visit(i + 1, left, total, taken)

    visit(0, k, 0, 0)
    return found


def _canonical(classes: list[int], counts: list[int]) -> int:
    """The group taking the `counts[i]` lowest positions of each class mask `classes[i]`."""
    group = 0
    for members, count in zip(classes, counts, strict=True):
        for _ in range(count):
            lowest = members & -members
            group |= lowest
            members ^= lowest
    return group


def _clique_number(candidates: int, adjacency: list[int], enough: int) -> int:
    """Size of the largest clique inside the mask `candidates`, or `enough` once one is found."""
    best = 0

    def grow(size: int, cand: int) -> None:
        nonlocal best
        while cand:
            if best >= enough or size + cand.bit_count() <= best:
                return
            lowest = cand & -cand
            cand ^= lowest
            grow(size + 1, cand & adjacency[lowest.bit_length() - 1])
        best = max(best, size)

    grow(0, candidates)
    return min(best, enough)


def set_bits(mask: int) -> list[int]:
    """Positions of the set bits of `mask`, ascending."""
    out = []
    while mask:
        lowest = mask & -mask
        out.append(lowest.bit_length() - 1)
        mask ^= lowest
    return out


def _build_tree(inventory: Inventory, indices: list[int]) -> TopoNode:
    gpus = {gpu.index: gpu for gpu in inventory.gpus}
    pcie = [
        (kind, label, _components(indices, inventory, kinds))
        for kind, label, kinds in _PCIE_LEVELS
    ]

    def below(members: tuple[int, ...], level: int) -> list[TopoNode]:
        if level == len(pcie):
            return [_gpu_leaf(gpus[g]) for g in members]
        clusters = [c for c in pcie[level][2] if set(c) <= set(members)]
        nodes = []
        for cluster in clusters:
            if len(cluster) == 1:
                nodes.append(_gpu_leaf(gpus[cluster[0]]))
                continue
            finest = level
            while finest + 1 < len(pcie) and cluster in pcie[finest + 1][2]:
                finest += 1
            kind, label, _ = pcie[finest]
            nodes.append(TopoNode(kind, label, tuple(below(cluster, finest + 1)), cluster))
        return sorted(nodes, key=lambda node: node.gpus)

    numa = [
        TopoNode(
            TopoKind.NUMA,
            _numa_label([gpus[g] for g in members]),
            tuple(below(members, 0)),
            members,
        )
        for members in _numa_nodes(inventory, indices)
    ]
    return TopoNode(TopoKind.SYSTEM, "system", tuple(numa), tuple(indices))


def _gpu_leaf(gpu: Gpu) -> TopoNode:
    label = f"GPU{gpu.index} {gpu.name}".rstrip()
    return TopoNode(TopoKind.GPU, label, (), (gpu.index,))


def _numa_label(gpus: list[Gpu]) -> str:
    numa = {gpu.numa_node for gpu in gpus}
    if len(numa) == 1 and None not in numa:
        return f"NUMA {numa.pop()}"
    affinity = {gpu.cpu_affinity for gpu in gpus}
    if len(affinity) == 1 and "" not in affinity:
        return f"NUMA node (CPUs {affinity.pop()})"
    return "NUMA node"


def _components(
    indices: list[int], inventory: Inventory, kinds: frozenset[LinkKind]
) -> list[tuple[int, ...]]:
    """GPUs joined (transitively) by links of `kinds`, each group ascending, by lowest index."""
    graph = nx.Graph()
    graph.add_nodes_from(indices)
    graph.add_edges_from(
        (a, b) for a, b in itertools.combinations(indices, 2) if inventory.link(a, b).kind in kinds
    )
    return sorted(tuple(sorted(c)) for c in nx.connected_components(graph))


def _numa_nodes(inventory: Inventory, indices: list[int]) -> list[tuple[int, ...]]:
    """Partition the GPUs by NUMA node.

    Where both GPUs of a pair report their NUMA node (`numa_node`, else `cpu_affinity`), that
    decides: on a machine whose every pair is SYS, GPUs of one socket still share a node.
    Otherwise the links do, a hierarchical clustering by link level: SYS pairs sit on
    different NUMA nodes, NODE/PHB/PXB/PIX pairs on the same one, and an NVLink hides the PCIe
    path, so NV pairs stay undecided. Those are merged best link first, unless that would put
    a pair known to be apart into one node: on a DGX-1 the NV2/NV1 links inside each socket
    join it, and the cross-socket NVLinks stay apart because of their SYS neighbours.
    """
    gpus = {gpu.index: gpu for gpu in inventory.gpus}
    node = {g: frozenset({g}) for g in indices}
    apart: set[frozenset[int]] = set()
    undecided: list[tuple[int, int, int]] = []

    def merge(a: int, b: int) -> None:
        joined = node[a] | node[b]
        for g in joined:
            node[g] = joined

    for a, b in itertools.combinations(indices, 2):
        link = inventory.link(a, b)
        same = _same_numa(gpus[a], gpus[b])
        if same is None and link.kind is not LinkKind.NV:
            same = link.kind is not LinkKind.SYS
        if same is False:
            apart.add(frozenset({a, b}))
        elif same:
            merge(a, b)
        else:
            undecided.append((-link_rank(link), a, b))
    for _, a, b in sorted(undecided):
        if not any(frozenset({x, y}) in apart for x in node[a] for y in node[b]):
            merge(a, b)
    return sorted({tuple(sorted(members)) for members in node.values()})


def _same_numa(a: Gpu, b: Gpu) -> bool | None:
    """Whether two GPUs share a NUMA node by what they report; None when not both report it."""
    if a.numa_node is not None and b.numa_node is not None:
        return a.numa_node == b.numa_node
    if a.cpu_affinity and b.cpu_affinity:
        return a.cpu_affinity == b.cpu_affinity
    return None
