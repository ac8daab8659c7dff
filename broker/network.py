"""The edge network: sites joined by links with latencies, and the nodes at each site.

A networkx graph with a vertex per site (attribute ``kind="site"``) and per node
(``kind="node"``, attribute ``site``); site-site edges carry the link's ``latency_ms``, a node's
edge to its site carries the node's access latency. Latency from a client at site S to a node at
site T is the shortest path S -> T (Dijkstra over the site links) plus the node's access latency.
Sites are few (tens to hundreds), so every site-to-site distance is computed once when the
network is built: a lookup is O(1). The broker loads it once at start (`load_cluster_network`);
nodes join at run time with their site (`EdgeNetwork.add_node`).

The cluster file (YAML). Only ``sites``, ``links`` and ``nodes`` are read here; other top-level
keys belong to other parts of the broker and are ignored::

    sites: [site-a, site-b, site-c]          # required, at least one, each named once
    links:                                   # undirected; latency_ms: a number >= 0, in ms
      - {a: site-a, b: site-b, latency_ms: 8}
      - {a: site-b, b: site-c, latency_ms: 12}
    nodes:                                   # optional: where known nodes sit
      node-1: {site: site-a, latency_ms: 0.5}    # latency_ms: access latency, default 0.5

Every site must be reachable from every other through the links. Errors are
`ClusterConfigError` (a ValueError) naming the file, the line and the entry: a malformed file,
an unknown site in a link or node, a negative or non-numeric latency, a site or link listed
twice, a link from a site to itself, a site not connected to the others, a node id that is
also a site name, an unknown key inside a link or node entry. A client's site the network does
not know is `UnknownSite` (a ValueError; the broker answers INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import yaml

DEFAULT_ACCESS_MS = 0.5
"""Access latency of a node the cluster file does not list and that joined without one, in ms."""

_LINK_KEYS = frozenset({"a", "b", "latency_ms"})
_NODE_KEYS = frozenset({"site", "latency_ms"})


class ClusterConfigError(ValueError):
    """The cluster file (or a node's registration against it) is invalid; the message says
    what and where."""


class UnknownSite(ValueError):
    """A site the network does not know (from a client's request or location report)."""

    def __init__(self, site: str, known: Iterable[str]) -> None:
        super().__init__(f"unknown site {site!r} (known sites: {', '.join(known)})")
        self.site = site


@dataclass(frozen=True, slots=True)
class SiteLink:
    """An undirected network link between two sites."""

    a: str
    b: str
    latency_ms: float
    """One-way latency over the link, in milliseconds (>= 0)."""


@dataclass(frozen=True, slots=True)
class NodeLocation:
    site: str
    access_ms: float = DEFAULT_ACCESS_MS
    """Latency from the node to its site's network, in milliseconds (>= 0)."""


class EdgeNetwork:
    """Sites, links and node locations, with every site-to-site distance precomputed.

    Build with `from_yaml`, `load_cluster_network` or `build`. Lookups never change it; the only
    mutation is `add_node`, which records a node's site and access latency (it never changes a
    site-to-site distance). Not thread-safe against concurrent `add_node`.
    """

    __slots__ = ("_distance", "_graph", "_min_access_ms", "_nearest", "_nodes", "_sites")

    def __init__(
        self,
        sites: tuple[str, ...],
        graph: nx.Graph,
        distance: dict[str, dict[str, float]],
        nodes: dict[str, NodeLocation],
    ) -> None:
        """Use `build`, `from_yaml` or `load_cluster_network`: they validate; this does not."""
        self._sites = sites
        self._graph = graph
        self._distance = distance
        self._nodes = nodes
        self._nearest = {
            site: tuple(sorted((d, other) for other, d in distance[site].items()))
            for site in sites
        }
        self._min_access_ms = min([DEFAULT_ACCESS_MS, *(loc.access_ms for loc in nodes.values())])

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        sites: Sequence[str],
        links: Iterable[SiteLink],
        nodes: Mapping[str, NodeLocation] | None = None,
    ) -> EdgeNetwork:
        """A validated network from values (errors as for the cluster file, located by index)."""
        return _build(
            [(site, f"sites[{i}]") for i, site in enumerate(sites)],
            [(link, f"links[{i}]") for i, link in enumerate(links)],
            [(node_id, loc, f"nodes.{node_id}") for node_id, loc in (nodes or {}).items()],
            where_sites="sites",
        )

    @classmethod
    def from_yaml(cls, text: str, source: str = "<cluster>") -> EdgeNetwork:
        """Parse and validate a cluster file's text; `source` names it in error messages."""
        return _Document(text, source).network()

    # --- lookups ------------------------------------------------------------------------------

    @property
    def sites(self) -> tuple[str, ...]:
        """Every site, in the order the file lists them."""
        return self._sites

    @property
    def graph(self) -> nx.Graph:
        """A read-only view of the graph of sites and nodes (see the module docstring)."""
        view: nx.Graph = self._graph.copy(as_view=True)
        return view

    @property
    def min_access_ms(self) -> float:
        """The lowest access latency any node has or would get by default, in ms: a lower
        bound for `access_ms` of every node, listed or not."""
        return self._min_access_ms

    def has_site(self, site: str) -> bool:
        return site in self._distance

    def distance_ms(self, a: str, b: str) -> float:
        """Shortest-path latency between sites `a` and `b`, in ms (0 for a == b).
        UnknownSite for a site the network does not know. O(1)."""
        try:
            return self._distance[a][b]
        except KeyError:
            raise UnknownSite(a if a not in self._distance else b, self._sites) from None

    def access_ms(self, node_id: str) -> float:
        """The node's access latency in ms: as listed or added, else `DEFAULT_ACCESS_MS`."""
        location = self._nodes.get(node_id)
        return DEFAULT_ACCESS_MS if location is None else location.access_ms

    def latency_ms(self, site: str, node_site: str, node_id: str = "") -> float:
        """Latency from a client at `site` to node `node_id` at `node_site`, in ms: the shortest
        path between the sites plus the node's access latency (`access_ms`). UnknownSite for
        either site unknown."""
        return self.distance_ms(site, node_site) + self.access_ms(node_id)

    def nearest(self, site: str) -> tuple[tuple[float, str], ...]:
        """Every site as (distance in ms, site) from `site`, nearest first (ties by name); the
        first is `site` itself at 0. UnknownSite for an unknown site. O(1)."""
        try:
            return self._nearest[site]
        except KeyError:
            raise UnknownSite(site, self._sites) from None

    def site_of(self, node_id: str) -> str | None:
        """The site a node is listed or added at; None when the network does not know it."""
        location = self._nodes.get(node_id)
        return None if location is None else location.site

    # --- mutation -----------------------------------------------------------------------------

    def add_node(self, node_id: str, site: str, access_ms: float | None = None) -> None:
        """Record that `node_id` sits at `site` (a node registering). Idempotent.

        `access_ms` None keeps the cluster file's access latency for a listed node, else the
        default. ClusterConfigError when the site is unknown, when the file lists the node at
        another site, when the node id is a site name, or when `access_ms` is not a number >= 0.
        """
        where = f"node {node_id!r}"
        if site not in self._distance:
            raise ClusterConfigError(
                f"{where}: unknown site {site!r} (sites: {', '.join(self._sites)})"
            )
        if node_id in self._distance:
            raise ClusterConfigError(f"{where}: the node id is also a site name")
        listed = self._nodes.get(node_id)
        if listed is not None and listed.site != site:
            raise ClusterConfigError(
                f"{where}: registers at site {site!r} but the cluster file puts it at "
                f"{listed.site!r}"
            )
        if access_ms is None:
            access = DEFAULT_ACCESS_MS if listed is None else listed.access_ms
        else:
            access = _latency(access_ms, f"{where}: access latency_ms")
        if self._graph.has_node(node_id):
            self._graph.remove_node(node_id)
        self._graph.add_node(node_id, kind="node", site=site)
        self._graph.add_edge(node_id, site, latency_ms=access)
        self._nodes[node_id] = NodeLocation(site, access)
        self._min_access_ms = min(self._min_access_ms, access)


def load_cluster_network(path: Path) -> EdgeNetwork:
    """The network of the cluster file at `path`. Blocking (reads the file).
    ClusterConfigError when it cannot be read or is invalid."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ClusterConfigError(f"{path}: cannot read the cluster file: {err}") from err
    return EdgeNetwork.from_yaml(text, str(path))


def _latency(value: object, where: str) -> float:
    """`value` as a latency in ms: a finite number >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClusterConfigError(f"{where}: latency must be a number of ms, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ClusterConfigError(f"{where}: latency must be finite and >= 0 ms, not {value!r}")
    return float(value)


def _build(
    sites: list[tuple[object, str]],
    links: list[tuple[SiteLink, str]],
    nodes: list[tuple[object, NodeLocation, str]],
    where_sites: str,
) -> EdgeNetwork:
    """Validate and assemble; each item comes with where it was written (for messages)."""
    if not sites:
        raise ClusterConfigError(f"{where_sites}: at least one site is required")
    names: list[str] = []
    for site, where in sites:
        if not isinstance(site, str) or not site.strip():
            raise ClusterConfigError(f"{where}: a site name must be a non-empty string")
        if site in names:
            raise ClusterConfigError(f"{where}: site {site!r} is listed twice")
        names.append(site)
    known = set(names)
    graph = nx.Graph()
    graph.add_nodes_from(names, kind="site")
    for link, where in links:
        for end in (link.a, link.b):
            if end not in known:
                raise ClusterConfigError(
                    f"{where}: unknown site {end!r} (sites: {', '.join(names)})"
                )
        if link.a == link.b:
            raise ClusterConfigError(f"{where}: link from site {link.a!r} to itself")
        if graph.has_edge(link.a, link.b):
            raise ClusterConfigError(f"{where}: sites {link.a!r} and {link.b!r} linked twice")
        latency = _latency(link.latency_ms, f"{where} ({link.a} - {link.b})")
        graph.add_edge(link.a, link.b, latency_ms=latency)
    components = sorted(nx.connected_components(graph), key=lambda c: names.index(min(c)))
    if len(components) > 1:
        main = next(c for c in components if names[0] in c)
        apart = [site for site in names if site not in main]
        raise ClusterConfigError(
            f"{where_sites}: site(s) {', '.join(apart)} not connected to {names[0]!r} "
            "by any chain of links"
        )
    distance = {
        site: {other: float(d) for other, d in lengths.items()}
        for site, lengths in nx.all_pairs_dijkstra_path_length(graph, weight="latency_ms")
    }
    located: dict[str, NodeLocation] = {}
    for node_id, location, where in nodes:
        if not isinstance(node_id, str) or not node_id.strip():
            raise ClusterConfigError(f"{where}: a node id must be a non-empty string")
        if node_id in known:
            raise ClusterConfigError(f"{where}: node id {node_id!r} is also a site name")
        if location.site not in known:
            raise ClusterConfigError(
                f"{where}: unknown site {location.site!r} (sites: {', '.join(names)})"
            )
        access = _latency(location.access_ms, f"{where}: access latency_ms")
        graph.add_node(node_id, kind="node", site=location.site)
        graph.add_edge(node_id, location.site, latency_ms=access)
        located[node_id] = NodeLocation(location.site, access)
    return EdgeNetwork(tuple(names), graph, distance, located)


def _label(path: tuple[str | int, ...]) -> str:
    """("links", 1, "latency_ms") -> "links[1].latency_ms"."""
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path).lstrip(".")


class _Document:
    """A cluster file parsed with its node tree kept, so errors can name their line."""

    def __init__(self, text: str, source: str) -> None:
        self._source = source
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            self._root = root
            self._data: Any = None if root is None else loader.construct_document(root)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            at = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err)
            raise ClusterConfigError(f"{source}{at}: not valid YAML: {problem}") from err
        finally:
            loader.dispose()
        if root is not None:
            self._check_duplicate_keys(root, ())

    def where(self, *path: str | int) -> str:
        """ "source:line: path" for the deepest node of `path` the document has."""
        node = self._root
        line = 1 if node is None else node.start_mark.line + 1
        for step in path:
            child = None
            if isinstance(node, yaml.MappingNode):
                child = next((v for k, v in node.value if k.value == step), None)
            elif isinstance(node, yaml.SequenceNode) and isinstance(step, int):
                child = node.value[step] if step < len(node.value) else None
            if child is None:
                break
            node = child
            line = node.start_mark.line + 1
        return f"{self._source}:{line}: {_label(path)}" if path else f"{self._source}:{line}"

    def _check_duplicate_keys(self, node: yaml.Node, path: tuple[str | int, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode):
                    continue
                if key.value in seen:
                    raise ClusterConfigError(
                        f"{self._source}:{key.start_mark.line + 1}: "
                        f"{_label(path) if path else 'top level'}: key {key.value!r} appears twice"
                    )
                seen.add(key.value)
                self._check_duplicate_keys(value, (*path, key.value))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_duplicate_keys(item, (*path, i))

    def network(self) -> EdgeNetwork:
        data = self._data
        if not isinstance(data, dict):
            raise ClusterConfigError(f"{self.where()}: the cluster file must be a mapping")
        sites = data.get("sites")
        if not isinstance(sites, list):
            raise ClusterConfigError(f"{self.where('sites')}: a list of site names is required")
        links = data.get("links") or []
        if not isinstance(links, list):
            raise ClusterConfigError(f"{self.where('links')}: must be a list of links")
        nodes = data.get("nodes") or {}
        if not isinstance(nodes, dict):
            raise ClusterConfigError(f"{self.where('nodes')}: must map node ids to locations")
        return _build(
            [(site, self.where("sites", i)) for i, site in enumerate(sites)],
            [(self._link(i, entry), self.where("links", i)) for i, entry in enumerate(links)],
            [
                (node_id, self._node(node_id, entry), self.where("nodes", str(node_id)))
                for node_id, entry in nodes.items()
            ],
            where_sites=self.where("sites"),
        )

    def _entry(self, entry: object, keys: frozenset[str], *path: str | int) -> dict[str, Any]:
        where = self.where(*path)
        if not isinstance(entry, dict):
            raise ClusterConfigError(
                f"{where}: must be a mapping with keys {', '.join(sorted(keys))}"
            )
        unknown = sorted(str(k) for k in entry if k not in keys)
        if unknown:
            raise ClusterConfigError(
                f"{where}: unknown key(s) {', '.join(unknown)}"
                f" (expected {', '.join(sorted(keys))})"
            )
        return entry

    def _link(self, i: int, entry: object) -> SiteLink:
        fields = self._entry(entry, _LINK_KEYS, "links", i)
        missing = sorted(_LINK_KEYS.difference(fields))
        if missing:
            raise ClusterConfigError(f"{self.where('links', i)}: missing {', '.join(missing)}")
        latency = _latency(fields["latency_ms"], f"{self.where('links', i, 'latency_ms')}")
        return SiteLink(str(fields["a"]), str(fields["b"]), latency)

    def _node(self, node_id: object, entry: object) -> NodeLocation:
        fields = self._entry(entry, _NODE_KEYS, "nodes", str(node_id))
        if "site" not in fields:
            raise ClusterConfigError(f"{self.where('nodes', str(node_id))}: missing site")
        access = fields.get("latency_ms", DEFAULT_ACCESS_MS)
        return NodeLocation(
            str(fields["site"]),
            _latency(access, f"{self.where('nodes', str(node_id), 'latency_ms')}"),
        )
