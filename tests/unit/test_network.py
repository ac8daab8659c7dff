"""broker.network: the cluster file's validation (each message), shortest paths, nodes."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest

from broker.network import (
    DEFAULT_ACCESS_MS,
    ClusterConfigError,
    EdgeNetwork,
    NodeLocation,
    SiteLink,
    UnknownSite,
    load_cluster_network,
)

CLUSTER = """\
sites: [site-a, site-b, site-c, site-d]
links:
  - {a: site-a, b: site-b, latency_ms: 8}
  - {a: site-b, b: site-c, latency_ms: 12}
  - {a: site-a, b: site-c, latency_ms: 30}
  - {a: site-c, b: site-d, latency_ms: 1.5}
nodes:
  node-1: {site: site-a, latency_ms: 0.25}
  node-2: {site: site-d}
broker:
  listen: 127.0.0.1:7000
"""


def network(text: str = CLUSTER) -> EdgeNetwork:
    return EdgeNetwork.from_yaml(text, "cluster.yaml")


# --- shortest paths ------------------------------------------------------------------------


def test_latency_is_the_shortest_path_plus_the_nodes_access_latency() -> None:
    net = network()
    assert net.distance_ms("site-a", "site-a") == 0.0
    assert net.distance_ms("site-a", "site-c") == 20.0  # via site-b, not the 30 ms link
    assert net.distance_ms("site-c", "site-a") == 20.0
    assert net.distance_ms("site-a", "site-d") == 21.5
    assert net.latency_ms("site-a", "site-a", "node-1") == 0.25
    assert net.latency_ms("site-b", "site-d", "node-2") == 13.5 + DEFAULT_ACCESS_MS
    assert net.latency_ms("site-b", "site-c", "not-listed") == 12 + DEFAULT_ACCESS_MS
    assert net.latency_ms("site-b", "site-c") == 12 + DEFAULT_ACCESS_MS


def test_nearest_lists_every_site_by_distance_then_name() -> None:
    net = network()
    assert net.nearest("site-b") == (
        (0.0, "site-b"),
        (8.0, "site-a"),
        (12.0, "site-c"),
        (13.5, "site-d"),
    )
    equal = EdgeNetwork.build(["x", "z", "y"], [SiteLink("x", "z", 2), SiteLink("x", "y", 2)], {})
    assert equal.nearest("x") == ((0.0, "x"), (2.0, "y"), (2.0, "z"))


def test_the_graph_holds_sites_links_and_nodes_read_only() -> None:
    net = network()
    graph = net.graph
    assert graph.nodes["site-a"]["kind"] == "site"
    assert graph.nodes["node-1"] == {"kind": "node", "site": "site-a"}
    assert graph.edges["site-a", "site-b"]["latency_ms"] == 8.0
    assert graph.edges["node-1", "site-a"]["latency_ms"] == 0.25
    with pytest.raises(nx.NetworkXError):
        graph.add_edge("site-a", "site-d")
    assert net.sites == ("site-a", "site-b", "site-c", "site-d")


def test_unknown_top_level_keys_are_left_to_others_and_links_may_be_absent() -> None:
    net = network("sites: [only]\nbroker: {listen: x}\n")
    assert net.sites == ("only",)
    assert net.nearest("only") == ((0.0, "only"),)


def test_an_unknown_client_site_is_a_clear_error() -> None:
    net = network()
    with pytest.raises(UnknownSite, match=r"unknown site 'site-x' \(known sites: site-a, "):
        net.latency_ms("site-x", "site-a")
    with pytest.raises(UnknownSite, match="site-x"):
        net.nearest("site-x")
    with pytest.raises(UnknownSite, match="site-y"):
        net.distance_ms("site-a", "site-y")
    assert isinstance(UnknownSite("s", []), ValueError)
    assert not net.has_site("site-x")


# --- nodes ---------------------------------------------------------------------------------


def test_add_node_records_the_site_and_keeps_a_listed_access_latency() -> None:
    net = network()
    net.add_node("node-9", "site-c")
    assert net.site_of("node-9") == "site-c"
    assert net.access_ms("node-9") == DEFAULT_ACCESS_MS
    net.add_node("node-1", "site-a")  # listed: keeps 0.25 ms
    assert net.access_ms("node-1") == 0.25
    net.add_node("node-9", "site-c", 0.1)  # again, with an access latency: idempotent update
    assert net.access_ms("node-9") == 0.1
    assert net.min_access_ms == 0.1
    assert net.graph.edges["node-9", "site-c"]["latency_ms"] == 0.1
    assert net.site_of("nobody") is None


@pytest.mark.parametrize(
    ("node_id", "site", "access", "message"),
    [
        ("node-9", "site-x", None, r"node 'node-9': unknown site 'site-x' \(sites: site-a, "),
        ("node-1", "site-b", None, "registers at site 'site-b' but the cluster file puts it at"),
        ("site-a", "site-a", None, "node id is also a site name"),
        ("node-9", "site-a", -1.0, "latency must be finite and >= 0 ms, not -1.0"),
    ],
)
def test_add_node_refuses_what_contradicts_the_network(
    node_id: str, site: str, access: float | None, message: str
) -> None:
    net = network()
    with pytest.raises(ClusterConfigError, match=message):
        net.add_node(node_id, site, access)
    assert net.site_of("node-9") is None


# --- validation ----------------------------------------------------------------------------


def replaced(old: str, new: str) -> str:
    assert old in CLUSTER
    return CLUSTER.replace(old, new)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            replaced("b: site-c, latency_ms: 12", "b: site-x, latency_ms: 12"),
            r"cluster.yaml:4: links\[1\]: unknown site 'site-x' "
            r"\(sites: site-a, site-b, site-c, site-d\)",
        ),
        (
            replaced("node-2: {site: site-d}", "node-2: {site: site-q}"),
            r"cluster.yaml:9: nodes.node-2: unknown site 'site-q'",
        ),
        (
            replaced("latency_ms: 12}", "latency_ms: -3}"),
            r"cluster.yaml:4: links\[1\].latency_ms: latency must be finite and >= 0 ms, not -3",
        ),
        (
            replaced("latency_ms: 12}", "latency_ms: fast}"),
            r"cluster.yaml:4: links\[1\].latency_ms: latency must be a number of ms, not 'fast'",
        ),
        (
            replaced("latency_ms: 12}", "latency_ms: .nan}"),
            r"links\[1\].latency_ms: latency must be finite and >= 0 ms, not nan",
        ),
        (
            replaced("latency_ms: 12}", "latency_ms: true}"),
            r"links\[1\].latency_ms: latency must be a number of ms, not True",
        ),
        (
            replaced("latency_ms: 0.25}", "latency_ms: -1}"),
            r"cluster.yaml:8: nodes.node-1.latency_ms: latency must be finite and >= 0 ms",
        ),
        (
            replaced("site-d]", "site-d, site-b]"),
            r"cluster.yaml:1: sites\[4\]: site 'site-b' is listed twice",
        ),
        (
            replaced("site-d]", "site-d, e, f]"),
            r"cluster.yaml:1: sites: site\(s\) e, f not connected to 'site-a' by any chain of li",
        ),
        (
            replaced("{a: site-c, b: site-d,", "{a: site-d, b: site-d,"),
            r"cluster.yaml:6: links\[3\]: link from site 'site-d' to itself",
        ),
        (
            replaced("{a: site-c, b: site-d,", "{a: site-c, b: site-d, jitter_ms: 1,"),
            r"cluster.yaml:6: links\[3\]: unknown key\(s\) jitter_ms \(expected a, b, latency_",
        ),
        (
            replaced("{a: site-c, b: site-d, latency_ms: 1.5}", "{a: site-c, b: site-d}"),
            r"cluster.yaml:6: links\[3\]: missing latency_ms",
        ),
        (
            replaced("a: site-a, b: site-c, latency_ms: 30", "a: site-c, b: site-d, latency_ms: 3")
            .replace("b: site-d, latency_ms: 1.5", "b: site-c, latency_ms: 2")
            .replace("a: site-c, b: site-c", "a: site-d, b: site-c"),
            r"cluster.yaml:6: links\[3\]: sites 'site-d' and 'site-c' linked twice",
        ),
        (
            replaced("node-2: {site: site-d}", "site-b: {site: site-d}"),
            r"cluster.yaml:9: nodes.site-b: node id 'site-b' is also a site name",
        ),
        (
            replaced("node-2: {site: site-d}", "node-2: {latency_ms: 1}"),
            r"cluster.yaml:9: nodes.node-2: missing site",
        ),
        (
            replaced("node-2: {site: site-d}", "node-1: {site: site-d}"),
            r"cluster.yaml:9: nodes: key 'node-1' appears twice",
        ),
        (
            replaced("links:\n", "links: 7\nunused:\n"),
            r"cluster.yaml:2: links: must be a list of links",
        ),
        (
            replaced("  - {a: site-a, b: site-b, latency_ms: 8}", "  - site-a"),
            r"cluster.yaml:3: links\[0\]: must be a mapping with keys a, b, latency_ms",
        ),
        ("sites: []\n", r"cluster.yaml:1: sites: at least one site is required"),
        ("sites: site-a\n", r"cluster.yaml:1: sites: a list of site names is required"),
        ("links: []\n", r"cluster.yaml:1: sites: a list of site names is required"),
        ("sites: ['']\n", r"cluster.yaml:1: sites\[0\]: a site name must be a non-empty string"),
        ("- a\n- b\n", r"cluster.yaml:1: the cluster file must be a mapping"),
        ("", r"cluster.yaml:1: the cluster file must be a mapping"),
        ("sites: [a\n", r"cluster.yaml:2: not valid YAML: expected ',' or ']'"),
        ("sites: [a]\nnodes: [n]\n", r"cluster.yaml:2: nodes: must map node ids to locations"),
    ],
)  # fmt: skip
def test_each_invalid_cluster_file_names_what_and_where(text: str, message: str) -> None:
    with pytest.raises(ClusterConfigError, match=message):
        network(text)


def test_build_validates_values_as_the_file_does() -> None:
    with pytest.raises(ClusterConfigError, match=r"links\[0\]: unknown site 'z'"):
        EdgeNetwork.build(["a"], [SiteLink("a", "z", 1)])
    with pytest.raises(ClusterConfigError, match=r"nodes.n: access latency_ms: latency must"):
        EdgeNetwork.build(["a"], [], {"n": NodeLocation("a", -0.5)})
    with pytest.raises(ClusterConfigError, match=r"sites: site\(s\) b not connected to 'a'"):
        EdgeNetwork.build(["a", "b"], [])


def test_load_cluster_network_reads_the_file_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    assert load_cluster_network(path).distance_ms("site-a", "site-d") == 21.5
    path.write_text(CLUSTER.replace("latency_ms: 8", "latency_ms: -8"))
    with pytest.raises(ClusterConfigError, match=rf"{path}:3: links\[0\].latency_ms"):
        load_cluster_network(path)
    with pytest.raises(ClusterConfigError, match="cannot read the cluster file"):
        load_cluster_network(tmp_path / "missing.yaml")
    path.write_bytes(b"sites: [\xff]\n")
    with pytest.raises(ClusterConfigError, match="cannot read the cluster file"):
        load_cluster_network(path)
