"""A synthetic cluster over a trace's sites, from real `nvidia-smi topo -m` captures.

As `bench.placement` builds its 10,000-node cluster: each node is one of the given captures
(read by the node daemon's capture parser), at a site drawn at random, with its own access
latency (0.2-2 ms), load (0-0.6), runtimes and CUDA version; the network is the trace's sites
and links (`broker.network.EdgeNetwork`). Seeded: a seed gives the same cluster.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from broker.network import EdgeNetwork, NodeLocation, SiteLink
from broker.placement import NodeSnapshot
from common.topology import Topology
from edge_client.mobility.traces import MobilityTrace
from node_daemon.inventory import GpuSpec, inventory_from_capture

DEMO_CAPTURES = Path(__file__).resolve().parent.parent / "demo" / "topologies"
"""The captures shipped with the package (the demo's): used when no directory is given."""
DEMO_SPECS = {
    "12": GpuSpec("A100-SXM4-40GB", 40960),
    "21": GpuSpec("Tesla V100-SXM2-16GB", 16384),
    "24": GpuSpec("RTX 6000 Ada", 49140),
}
"""Capture number -> its GPUs, for `DEMO_CAPTURES` (captures do not name the GPUs), as
`edge_client.demo.cluster.DEMO_NODES` gives them."""


@dataclass(frozen=True, slots=True)
class SimCluster:
    network: EdgeNetwork
    nodes: tuple[NodeSnapshot, ...]

    @property
    def gpus(self) -> int:
        return sum(node.gpu_count for node in self.nodes)


def random_nodes(
    rng: random.Random, sites: Sequence[str], topologies: Sequence[Topology], count: int
) -> tuple[list[NodeSnapshot], dict[str, NodeLocation]]:
    """`count` idle nodes `node-00000`...: each one of `topologies` at a random site, with
    its access latency (0.2-2 ms), runtimes (90 % both), CUDA version and load (0-0.6).
    Shared with `bench.placement`, whose figures depend on the same draws."""
    snapshots = []
    locations = {}
    for i in range(count):
        node_id = f"node-{i:05d}"
        site = rng.choice(sites)
        locations[node_id] = NodeLocation(site, round(rng.uniform(0.2, 2.0), 2))
        snapshots.append(
            NodeSnapshot.idle(
                node_id,
                site,
                rng.choice(topologies),
                runtimes=("docker", "process") if rng.random() < 0.9 else ("process",),
                cuda_version=rng.choices(["12.4", "12.2", "11.8"], [6, 3, 1])[0],
                load=round(rng.uniform(0.0, 0.6), 2),
            )
        )
    return snapshots, locations


def load_topologies(captures: Path, specs: Mapping[str, GpuSpec]) -> list[Topology]:
    """The topology of each capture `NN_*.txt` in `captures` whose NN is in `specs`.
    ValueError when one is missing."""
    topologies = []
    for number, spec in specs.items():
        found = sorted(captures.glob(f"{number}_*.txt"))
        if not found:
            raise ValueError(f"no capture {number}_*.txt in {captures}")
        topologies.append(Topology.from_inventory(inventory_from_capture(found[0], spec)))
    return topologies


def build_cluster(
    trace: MobilityTrace, topologies: Sequence[Topology], nodes: int, seed: int
) -> SimCluster:
    """`nodes` nodes over the trace's sites (see the module docstring)."""
    if nodes < 1 or not topologies:
        raise ValueError("a cluster needs at least one node and one topology")
    rng = random.Random(seed)
    sites = [site.name for site in trace.sites]
    snapshots, locations = random_nodes(rng, sites, topologies, nodes)
    links = [SiteLink(link.a, link.b, link.latency_ms) for link in trace.links]
    return SimCluster(EdgeNetwork.build(sites, links, locations), tuple(snapshots))
