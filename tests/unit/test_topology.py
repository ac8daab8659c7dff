"""common.topology: link ranks, the topo-tree, and best_group against its brute force."""

from __future__ import annotations

import functools
import itertools

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.topology import (
    NO_LINK_RANK,
    TopoKind,
    Topology,
    best_group_brute_force,
    link_rank,
)
from node_daemon.inventory import (
    Gpu,
    GpuDetails,
    GpuSpec,
    Inventory,
    Link,
    LinkKind,
    build_inventory,
    inventory_from_capture,
    parse_topology,
)
from tests.data import TOPOLOGIES

CAPTURES = sorted(p.name for p in TOPOLOGIES.glob("*.txt"))
DGX1 = "21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt"


def link(code: str) -> Link:
    if code.startswith("NV"):
        return Link(LinkKind.NV, int(code[2:]))
    return Link(LinkKind(code))


def inventory(
    table: dict[tuple[int, int], str], numa: dict[int, int | None] | None = None
) -> Inventory:
    """The GPUs named in `table` ((a, b) -> link code, a < b), on the NUMA nodes `numa` says
    (default: unknown), with nothing else known."""
    indices = sorted({g for pair in table for g in pair})
    gpus = tuple(
        Gpu(index=i, uuid=f"GPU-{i}", name="test", memory_total_mib=1024,
            numa_node=(numa or {}).get(i))
        for i in indices
    )  # fmt: skip
    return Inventory(gpus=gpus, links={pair: link(code) for pair, code in table.items()})


def all_sys_two_sockets_capture() -> str:
    """`nvidia-smi topo -m` of an 8-GPU PCIe box (8x RTX 4090 style) whose every GPU pair is
    SYS: GPUs 0-3 on NUMA node 0, 4-7 on node 1, as the driver prints it (tabs)."""
    names = [f"GPU{i}" for i in range(8)]
    lines = ["\t" + "\t".join([*names, "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])]
    for i in range(8):
        cells = [" X " if i == j else "SYS" for j in range(8)]
        cpus, node = ("0-31,64-95", "0") if i < 4 else ("32-63,96-127", "1")
        lines.append("\t".join([f"GPU{i}", *cells, cpus, node, "", "N/A"]))
    return "\n".join([*lines, "", "Legend:", "", "  X    = Self"]) + "\n"


@functools.cache
def all_sys_two_sockets() -> Topology:
    topology = parse_topology(all_sys_two_sockets_capture())
    details = [GpuDetails(uuid=f"GPU-{i}", name="RTX 4090", memory_total_mib=24564)
               for i in range(8)]  # fmt: skip
    return Topology.from_inventory(build_inventory(topology, details))


def matrix(rows: str) -> dict[tuple[int, int], str]:
    """Link table from a `topo -m` style square of codes (X on the diagonal)."""
    cells = [row.split() for row in rows.strip().splitlines()]
    return {(a, b): cells[a][b] for a in range(len(cells)) for b in range(a + 1, len(cells))}


@functools.cache
def capture(name: str) -> Topology:
    return Topology.from_inventory(inventory_from_capture(TOPOLOGIES / name, GpuSpec("t", 1)))


@functools.cache
def nvswitch16() -> Topology:
    """16 GPUs, every pair NV6: an NVSwitch node like a DGX-2."""
    return Topology.from_inventory(
        inventory({pair: "NV6" for pair in itertools.combinations(range(16), 2)})
    )


def check_against_brute_force(topology: Topology, free: frozenset[int]) -> None:
    for k in range(1, len(free) + 1):
        fast = topology.best_group(k, free)
        reference = best_group_brute_force(topology, k, free)
        assert len(fast) == k
        assert set(fast) <= free
        assert list(fast) == sorted(set(fast))
        assert topology.score(fast, free) == topology.score(reference, free)
        assert fast == reference


# --- link ranks ----------------------------------------------------------------------------


def test_rank_is_one_total_order_nvlink_count_first_then_pcie_distance() -> None:
    order = ["NV18", "NV12", "NV2", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS"]
    ranks = [link_rank(link(code)) for code in order]
    assert ranks == sorted(ranks, reverse=True)
    assert len(set(ranks)) == len(ranks)
    assert [link_rank(link(c)) for c in ("SYS", "NODE", "PHB", "PXB", "PIX")] == [1, 2, 3, 4, 5]
    assert link_rank(link("NV12")) == 22
    assert min(ranks) > NO_LINK_RANK


# --- best_group against the brute force ----------------------------------------------------


@pytest.mark.parametrize("name", CAPTURES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_best_group_is_the_brute_force_optimum_on_every_capture(
    name: str, data: st.DataObject
) -> None:
    topology = capture(name)
    gpus = sorted(topology.graph.nodes)
    free = data.draw(st.sets(st.sampled_from(gpus), min_size=1), label="free")
    check_against_brute_force(topology, frozenset(free))


@pytest.mark.parametrize("name", CAPTURES)
def test_every_k_on_the_idle_capture_is_the_brute_force_optimum(name: str) -> None:
    topology = capture(name)
    check_against_brute_force(topology, frozenset(topology.graph.nodes))


@settings(max_examples=15, deadline=None)
@given(free=st.sets(st.integers(0, 15), min_size=1, max_size=11))
def test_best_group_is_the_brute_force_optimum_on_a_16_gpu_nvswitch_node(
    free: set[int],
) -> None:
    check_against_brute_force(nvswitch16(), frozenset(free))


@pytest.mark.parametrize("k", [1, 2, 8, 15, 16])
def test_16_gpu_nvswitch_node_all_free(k: int) -> None:
    topology = nvswitch16()
    everything = frozenset(range(16))
    assert topology.best_group(k, everything) == best_group_brute_force(topology, k, everything)
    assert topology.best_group(k, everything) == tuple(range(k))


CODES = ["SYS", "NODE", "PHB", "PXB", "PIX", "NV1", "NV2", "NV4", "NV12"]


@st.composite
def link_tables(draw: st.DrawFn) -> tuple[Inventory, frozenset[int]]:
    """Random link tables over random (not always contiguous) GPU indices, random NUMA nodes
    (some unknown), a random free set.

    A small alphabet per table makes ties and twin GPUs common, which the search exploits.
    """
    indices = sorted(draw(st.sets(st.integers(0, 11), min_size=1, max_size=8)))
    alphabet = draw(st.lists(st.sampled_from(CODES), min_size=1, max_size=4, unique=True))
    table = {pair: draw(st.sampled_from(alphabet)) for pair in itertools.combinations(indices, 2)}
    numa = {i: draw(st.sampled_from([None, 0, 1, 2])) for i in indices}
    if len(indices) == 1:
        gpus = (Gpu(index=indices[0], uuid="GPU-0", name="test", memory_total_mib=1),)
        inv = Inventory(gpus=gpus, links={})
    else:
        inv = inventory(table, numa)
    free = draw(st.sets(st.sampled_from(indices), min_size=1))
    return inv, frozenset(free)


@settings(max_examples=500, deadline=None)
@given(case=link_tables())
def test_best_group_is_the_brute_force_optimum_on_random_link_tables(
    case: tuple[Inventory, frozenset[int]],
) -> None:
    inv, free = case
    check_against_brute_force(Topology.from_inventory(inv), free)


# --- best_group behaviour ------------------------------------------------------------------


def test_one_gpu_goes_to_the_worst_connected_so_nvlink_pairs_stay_whole() -> None:
    # Two NVLink-bridged pairs (0-2, 1-3) and a lone GPU 4; everything else NODE.
    table = {pair: "NODE" for pair in itertools.combinations(range(5), 2)}
    table[(0, 2)] = table[(1, 3)] = "NV2"
    topology = Topology.from_inventory(inventory(table))
    assert topology.best_group(1, range(5)) == (4,)
    assert topology.best_group(1, [0, 1, 3]) == (0,)  # its partner is busy: 1-3 stay whole
    assert topology.best_group(2, range(5)) == (0, 2)


def test_one_gpu_spares_the_switch_a_busy_gpu_will_return_to() -> None:
    # Switches {0, 1, 2, 3} and {4, 5}, PHB between them; GPU1 is busy.
    table = {pair: "PHB" for pair in itertools.combinations(range(6), 2)}
    table.update({pair: "PIX" for pair in itertools.combinations(range(4), 2)})
    table[(4, 5)] = "PIX"
    topology = Topology.from_inventory(inventory(table))
    # Among the free GPUs either choice leaves a PIX pair and no PIX quad; once GPU1 is back,
    # only taking GPU4 leaves the quad whole (the idle terms of the score).
    assert topology.best_group(1, [0, 2, 3, 4, 5]) == (4,)
    assert (
        topology.score([0], [0, 2, 3, 4, 5]).future == topology.score([4], [0, 2, 3, 4, 5]).future
    )


def test_one_gpu_on_the_dgx1_keeps_the_nvlink_quad_whole() -> None:
    topology = capture(DGX1)
    # GPU4 has a single NVLink (to GPU0) into this free set; 0-3 are an NVLink quad.
    assert topology.best_group(1, [0, 1, 2, 3, 4]) == (4,)


def test_four_gpus_on_the_dgx1_hybrid_cube_mesh_are_an_nvlink_quad() -> None:
    topology = capture(DGX1)
    quad = topology.best_group(4, range(8))
    assert quad == (0, 1, 2, 3)
    assert all(topology.graph.edges[a, b]["link"].kind is LinkKind.NV
               for a, b in itertools.combinations(quad, 2))  # fmt: skip
    assert topology.best_group(4, [1, 2, 3, 4, 5, 6, 7]) == (4, 5, 6, 7)
    # A pair takes NV2 inside one socket, not the cross-socket NV2 that breaks both quads.
    assert topology.best_group(2, range(8)) == (0, 3)


def test_three_out_of_five_free() -> None:
    topology = capture(DGX1)
    free = [0, 1, 4, 5, 6]
    group = topology.best_group(3, free)
    assert group == (4, 5, 6)  # NV1, NV1, NV2: every pair NVLink
    assert group == best_group_brute_force(topology, 3, free)


# --- NUMA locality -------------------------------------------------------------------------


def numa_nodes_used(topology: Topology, group: tuple[int, ...]) -> set[int | None]:
    return {topology.graph.nodes[g]["gpu"].numa_node for g in group}


def test_all_sys_capture_reads_two_numa_nodes_and_the_tree_shows_them() -> None:
    topology = all_sys_two_sockets()
    assert {str(link) for link in topology.inventory.links.values()} == {"SYS"}
    assert [(n.kind, n.label, n.gpus) for n in topology.tree.children] == [
        (TopoKind.NUMA, "NUMA 0", (0, 1, 2, 3)),
        (TopoKind.NUMA, "NUMA 1", (4, 5, 6, 7)),
    ]
    assert topology.same_numa(0, 3) and not topology.same_numa(3, 4)


@pytest.mark.parametrize(
    ("k", "free", "group"), [(2, [0, 4, 5], (4, 5)), (3, [0, 1, 4, 5, 6], (4, 5, 6))]
)
def test_all_sys_groups_from_the_issue_stay_on_one_numa_node(
    k: int, free: list[int], group: tuple[int, ...]
) -> None:
    topology = all_sys_two_sockets()
    assert topology.best_group(k, free) == group
    assert best_group_brute_force(topology, k, free) == group


def test_all_sys_best_group_stays_on_one_numa_node_whenever_it_can() -> None:
    topology = all_sys_two_sockets()
    nodes = ({0, 1, 2, 3}, {4, 5, 6, 7})
    for size in range(1, 9):
        for free in map(frozenset, itertools.combinations(range(8), size)):
            check_against_brute_force(topology, free)
            for k in range(1, size + 1):
                group = topology.best_group(k, free)
                fits = any(len(free & node) >= k for node in nodes)
                assert (len(numa_nodes_used(topology, group)) == 1) == fits, (k, sorted(free))


def test_nvswitch_pairs_stay_on_their_numa_node() -> None:
    # DGX A100 in NPS4 mode: every pair NV12, two GPUs per NUMA node (3, 1, 7, 5).
    topology = capture("12_dgx-a100-8gpu-nv12-10nic-nps4.txt")
    assert topology.best_group(2, [0, 2, 3]) == (2, 3)
    assert topology.best_group(2, [1, 3, 4, 6, 7]) == (6, 7)
    assert [n.gpus for n in topology.tree.children] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_better_links_beat_one_numa_node() -> None:
    # 0 and 1 share NUMA node 0 but are SYS apart; 2 on node 1 has an NVLink to 0.
    table = {(0, 1): "SYS", (0, 2): "NV1", (1, 2): "SYS"}
    topology = Topology.from_inventory(inventory(table, {0: 0, 1: 0, 2: 1}))
    assert topology.best_group(2, [0, 1, 2]) == (0, 2)
    assert topology.score([0, 1], [0, 1, 2]).local == 1
    assert topology.score([0, 2], [0, 1, 2]).local == 0


def test_unknown_numa_node_is_never_local() -> None:
    table = dict.fromkeys(itertools.combinations(range(3), 2), "SYS")
    topology = Topology.from_inventory(inventory(table, {0: None, 1: 1, 2: 1}))
    assert not topology.same_numa(0, 1) and topology.same_numa(1, 2)
    assert topology.best_group(2, [0, 1, 2]) == (1, 2)


@pytest.mark.parametrize(
    ("k", "free", "message"),
    [
        (0, [0, 1], r"k=0"),
        (-1, [0, 1], r"k=-1"),
        (3, [0, 1], r"k=3 GPU\(s\) out of 2 free"),
        (1, [], r"k=1 GPU\(s\) out of 0 free"),
        (1, [0, 9], r"GPU\(s\) \[9\] not in this topology"),
        (1, [0, 0, 1], r"free GPUs repeat"),
    ],
)
def test_bad_requests_are_value_errors(k: int, free: list[int], message: str) -> None:
    topology = Topology.from_inventory(inventory({(0, 1): "NV2", (0, 2): "SYS", (1, 2): "SYS"}))
    with pytest.raises(ValueError, match=message):
        topology.best_group(k, free)
    with pytest.raises(ValueError, match=message):
        best_group_brute_force(topology, k, free)


def test_score_follows_its_definition() -> None:
    topology = Topology.from_inventory(inventory(matrix("""
        X    NV2  PIX  SYS  SYS
        NV2  X    PIX  SYS  SYS
        PIX  PIX  X    SYS  SYS
        SYS  SYS  SYS  X    PHB
        SYS  SYS  SYS  PHB  X
    """)))  # fmt: skip
    score = topology.score([0, 1], [0, 1, 2, 3])
    assert (score.slowest, score.total, score.local) == (12, 12, 0)  # NUMA nodes unknown
    assert score.future == (1,)  # the free GPUs left, 2 and 3, are SYS apart
    assert score.idle_future == (3,)  # outside the group, 3-4 (PHB) is the best pair
    assert score.idle_total == 1 + 1 + 3
    assert topology.score(range(5), range(5)).future == ()
    assert topology.score([2], range(5)).slowest == NO_LINK_RANK
    with pytest.raises(ValueError, match="must be distinct GPUs out of free"):
        topology.score([0, 1], [0, 2])


def test_inventory_without_every_pair_is_refused() -> None:
    inv = inventory({(0, 1): "NV2", (0, 2): "SYS", (1, 2): "SYS"})
    broken = Inventory(gpus=inv.gpus, links={(0, 1): Link(LinkKind.NV, 2)})
    with pytest.raises(ValueError, match=r"no link for GPU pair\(s\) \[\(0, 2\), \(1, 2\)\]"):
        Topology.from_inventory(broken)


# --- graph and topo-tree -------------------------------------------------------------------


def test_graph_has_every_gpu_and_pair_with_link_and_rank_and_is_frozen() -> None:
    inv = inventory({(0, 1): "NV2", (0, 2): "PIX", (1, 2): "SYS"})
    graph = Topology.from_inventory(inv).graph
    assert sorted(graph.nodes) == [0, 1, 2]
    assert graph.nodes[1]["gpu"] == inv.gpus[1]
    assert graph.edges[0, 1]["link"] == Link(LinkKind.NV, 2)
    assert graph.edges[2, 0]["rank"] == link_rank(Link(LinkKind.PIX))
    assert graph.number_of_edges() == 3
    with pytest.raises(nx.NetworkXError):
        graph.add_edge(0, 5)


def test_dgx1_tree_splits_numa_nodes_where_links_are_sys() -> None:
    topology = capture(DGX1)
    tree = topology.tree
    assert tree.kind is TopoKind.SYSTEM and tree.gpus == tuple(range(8))
    assert [(n.kind, n.gpus) for n in tree.children] == [
        (TopoKind.NUMA, (0, 1, 2, 3)),
        (TopoKind.NUMA, (4, 5, 6, 7)),
    ]
    for a, b in itertools.product(range(4), range(4, 8)):
        link = topology.graph.edges[a, b]["link"]
        assert link.kind is LinkKind.SYS or (b - a == 4 and link.kind is LinkKind.NV)
    assert topology.nvlink_groups == (tuple(range(8)),)
    assert topology.nvlink_cliques[:2] == ((0, 1, 2, 3), (4, 5, 6, 7))
    text = topology.describe()
    assert "NUMA node (CPUs 0-11,24-35): GPU0 GPU1 GPU2 GPU3" in text
    assert "NVLink group GPU0 GPU1 GPU2 GPU3 GPU4 GPU5 GPU6 GPU7 (NV1, NV2)" in text


def test_numa_nodes_are_inferred_from_links_alone() -> None:
    # The DGX-1 cube mesh with no NUMA or CPU affinity at all: the SYS pairs still split it.
    table = matrix("""
        X   NV1 NV1 NV2 NV2 SYS SYS SYS
        NV1 X   NV2 NV1 SYS NV2 SYS SYS
        NV1 NV2 X   NV2 SYS SYS NV1 SYS
        NV2 NV1 NV2 X   SYS SYS SYS NV1
        NV2 SYS SYS SYS X   NV1 NV1 NV2
        SYS NV2 SYS SYS NV1 X   NV2 NV1
        SYS SYS NV1 SYS NV1 NV2 X   NV2
        SYS SYS SYS NV1 NV2 NV1 NV2 X
    """)  # fmt: skip
    tree = Topology.from_inventory(inventory(table)).tree
    assert [n.gpus for n in tree.children] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_pcie_tree_of_switches_and_host_bridges() -> None:
    rig = capture("35_7gforce-7gpu-gtx10x0-pix-phb-oldlegend.txt").tree
    (numa,) = rig.children
    (bridge,) = numa.children
    assert bridge.kind is TopoKind.HOST_BRIDGE
    assert [(n.kind, n.gpus) for n in bridge.children] == [
        (TopoKind.SWITCH, (0, 1, 2)),
        (TopoKind.SWITCH, (3, 4, 5, 6)),
    ]
    assert all(leaf.kind is TopoKind.GPU for n in bridge.children for leaf in n.children)
    mixed = capture("30_5gpu-mixed-2x5090-3x4090-numa-split.txt").tree
    assert [(n.label, n.gpus) for n in mixed.children] == [
        ("NUMA 1", (0,)),
        ("NUMA 0", (1, 2, 3, 4)),
    ]
    assert [(n.kind, n.gpus) for n in mixed.children[1].children] == [
        (TopoKind.HOST_BRIDGE, (1, 2)),
        (TopoKind.HOST_BRIDGE, (3, 4)),
    ]


def test_pxb_group_that_is_one_switch_shows_as_the_switch_only() -> None:
    table = matrix("""
        X   PIX PXB PXB
        PIX X   PXB PXB
        PXB PXB X   PIX
        PXB PXB PIX X
    """)  # fmt: skip
    tree = Topology.from_inventory(inventory(table)).tree
    (numa,) = tree.children
    (switches,) = numa.children  # host bridge and switch tree hold the same GPUs: finest kept
    assert switches.kind is TopoKind.SWITCH_TREE
    assert [(n.kind, n.gpus) for n in switches.children] == [
        (TopoKind.SWITCH, (0, 1)),
        (TopoKind.SWITCH, (2, 3)),
    ]
    assert tree.render().splitlines()[:3] == [
        "system: GPU0 GPU1 GPU2 GPU3",
        "  NUMA node: GPU0 GPU1 GPU2 GPU3",
        "    PCIe switches: GPU0 GPU1 GPU2 GPU3",
    ]
