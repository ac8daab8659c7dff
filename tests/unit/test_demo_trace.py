"""Mobility traces: the packaged one parses; every mistake names its file, line and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.network import load_cluster_network
from edge_client.demo.cluster import CLUSTER_FILE, DEMO_NODES
from edge_client.demo.trace import DEFAULT_TRACE, Trace, TraceError, Waypoint, load_trace

SITES = ("site-a", "site-b", "site-c")


def test_the_packaged_trace_tours_every_site_and_returns() -> None:
    trace = load_trace(DEFAULT_TRACE, SITES)
    assert trace.name == "commute"
    assert [w.site for w in trace.waypoints] == ["site-a", "site-b", "site-c", "site-a"]
    assert all(w.dwell_s == 8 for w in trace.waypoints)


def test_the_demo_cluster_has_a_node_at_each_site_of_its_network() -> None:
    network = load_cluster_network(CLUSTER_FILE)
    assert set(network.sites) == {plan.site for plan in DEMO_NODES} == set(SITES)
    assert all(plan.capture.is_file() for plan in DEMO_NODES)


def test_scaled_keeps_a_minimum_stay() -> None:
    trace = Trace("t", (Waypoint("site-a", 8), Waypoint("site-b", 2)))
    assert trace.scaled(0.25, 1.5).waypoints == (Waypoint("site-a", 2), Waypoint("site-b", 1.5))


def test_name_defaults_to_the_file_stem(tmp_path: Path) -> None:
    path = tmp_path / "my-walk.yaml"
    path.write_text("waypoints:\n- {site: site-b, dwell_s: 0.5}\n")
    assert load_trace(path, SITES) == Trace("my-walk", (Waypoint("site-b", 0.5),))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("waypoints: [", ": not valid YAML"),
        ("- site-a\n", ": expected a mapping with a `waypoints` list"),
        ("name: x\n", ": `waypoints` must be a non-empty list"),
        ("waypoints: []\n", ":1: `waypoints` must be a non-empty list"),
        ("waypoints:\n- site-a\n", ":2: waypoint 1 must be a mapping"),
        ("waypoints:\n- {site: site-a}\n", ":2: waypoint 1 has no `dwell_s`"),
        ("waypoints:\n- {dwell_s: 1}\n", ":2: waypoint 1 has no `site`"),
        ("waypoints:\n- {site: x, dwell_s: 1}\n", ":2: waypoint 1: unknown site 'x'; the cluster"),
        ("waypoints:\n- {site: site-a, dwell_s: 0}\n", ":2: waypoint 1: dwell_s must be"),
        ("waypoints:\n- {site: site-a, dwell_s: -3}\n", "got '-3'"),
        ("waypoints:\n- {site: site-a, dwell_s: '5'}\n", "got '5'"),
        ("waypoints:\n- {site: site-a, dwell_s: .inf}\n", "got '.inf'"),
        ("waypoints:\n- {site: site-a, dwell_s: 99999}\n", "in (0, 3600]"),
        ("waypoints:\n- {site: site-a, dwell_s: 1, speed: 3}\n", ":2: unknown key 'speed'"),
        ("name: a\nname: b\nwaypoints: []\n", ":2: 'name' is given twice"),
        ("name: ''\nwaypoints:\n- {site: site-a, dwell_s: 1}\n", ":1: `name` must be a non-empty"),
        ("waypoints:\n- {site: [a], dwell_s: 1}\n", ":2: `site` must be a non-empty string"),
    ],
)
def test_a_bad_trace_is_refused_with_where_and_why(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "trace.yaml"
    path.write_text(text)
    with pytest.raises(TraceError) as caught:
        load_trace(path, SITES)
    assert str(caught.value).startswith(str(path))
    assert message in str(caught.value)


def test_an_unreadable_trace_says_so(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"cannot read the trace .*: No such file"):
        load_trace(tmp_path / "missing.yaml", SITES)
