"""The sites file of `offload trace generate --sites` and `offload trace import --sites`.

YAML, or JSON (which YAML reads too)::

    sites:                                   # at least one; names unique
      - {name: site-a, x: 0, y: 450, radius_m: 450}
      - {name: site-b, x: 450, y: 450, radius_m: 450, access_ms: 2}
    links:                                   # optional
      - {a: site-a, b: site-b, latency_ms: 10}

`x`, `y` and `radius_m` are metres in the coordinates of the vehicles' positions (SUMO's
network coordinates: not `--fcd-output.geo`'s longitude and latitude); a vehicle is handed
to a site only within its radius. `access_ms` is the radio access latency in the cell (by
default the command's `--access-ms`). Without `links` each site is linked to its 3 nearest
and along a minimum spanning tree, at `link_base_ms + link_ms_per_km x distance` (so every
site is reachable). An unknown key, a value that is not a finite number, a repeated name is
refused with `SitesError` naming the file and the entry, quoting at most a short prefix of
the bad value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import yaml

from edge_client.mobility import formats
from edge_client.mobility.traces import FORMAT, VERSION, Link, Site, TraceFormatError, parse

SITE_KEYS = ("name", "x", "y", "radius_m", "access_ms")
LINK_KEYS = ("a", "b", "latency_ms")
TOP_KEYS = ("sites", "links")


class SitesError(ValueError):
    """The sites file is invalid; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class SiteDefaults:
    access_ms: float = 1.0
    """A site's radio access latency when the file gives none, ms."""
    link_base_ms: float = 2.0
    """A computed link's latency at 0 m, ms."""
    link_ms_per_km: float = 4.0


def link_latency_ms(distance_m: float, defaults: SiteDefaults) -> float:
    return round(defaults.link_base_ms + defaults.link_ms_per_km * distance_m / 1000, 3)


def read_sites(path: Path, defaults: SiteDefaults) -> tuple[list[Site], list[Link]]:
    """The sites and links of the file at `path` (see the module docstring). Blocking.
    SitesError when it cannot be read or is invalid."""
    source = f"--sites {path}"
    try:
        kind = formats.sniff(path)
        if kind.compressed or kind.form not in (formats.Form.TEXT, formats.Form.JSON):
            raise SitesError(
                f"{source}: {kind.describe()}; --sites wants a YAML or JSON file of sites "
                "({sites: [{name, x, y, radius_m}], links: [{a, b, latency_ms}]})"
            )
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SitesError(f"{source}: cannot read it: {err}") from err
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SitesError(f"{source}: not valid YAML: {err}") from err
    if not isinstance(doc, dict):
        raise SitesError(f"{source}: expected a mapping with a `sites` list")
    _known_keys(doc, TOP_KEYS, "top level", source)
    site_docs = doc.get("sites")
    link_docs = doc.get("links") or []
    for key, items, allowed in (("sites", site_docs, SITE_KEYS), ("links", link_docs, LINK_KEYS)):
        if not isinstance(items, list):
            raise SitesError(f"{source}: `{key}` must be a list")
        for i, item in enumerate(items):
            if isinstance(item, dict):
                _known_keys(item, allowed, f"{key}[{i}]", source)
    assert isinstance(site_docs, list)
    try:
        checked = parse(
            {
                "format": FORMAT,
                "version": VERSION,
                "duration_s": 1,
                "handover": {"hysteresis_m": 0, "time_to_trigger_s": 0},
                "sites": [
                    {"access_ms": defaults.access_ms, **s} if isinstance(s, dict) else s
                    for s in site_docs
                ],
                "links": link_docs,
                "vehicles": [],
            },
            source,
        )
    except TraceFormatError as err:
        raise SitesError(str(err)) from err
    sites = list(checked.sites)
    if checked.links:
        return sites, list(checked.links)
    return sites, nearest_links(sites, defaults)


def nearest_links(sites: list[Site], defaults: SiteDefaults) -> list[Link]:
    """Each site to its 3 nearest, and a minimum spanning tree: every site reachable."""
    graph = nx.Graph()
    for a in sites:
        graph.add_node(a.name)
        others = sorted(sites, key=lambda b: (math.dist((a.x, a.y), (b.x, b.y)), b.name))
        for b in others[1:4]:
            graph.add_edge(a.name, b.name, weight=math.dist((a.x, a.y), (b.x, b.y)))
    full = nx.Graph()
    for i, a in enumerate(sites):
        for b in sites[i + 1 :]:
            full.add_edge(a.name, b.name, weight=math.dist((a.x, a.y), (b.x, b.y)))
    graph.add_edges_from(nx.minimum_spanning_tree(full).edges(data=True))
    order = {s.name: i for i, s in enumerate(sites)}
    links = []
    for a, b, data in graph.edges(data=True):
        first, second = sorted((a, b), key=order.__getitem__)
        links.append(Link(first, second, link_latency_ms(data["weight"], defaults)))
    links.sort(key=lambda k: (order[k.a], order[k.b]))
    return links


def _known_keys(entry: dict[Any, Any], allowed: tuple[str, ...], where: str, source: str) -> None:
    for key in entry:
        if key not in allowed:
            raise SitesError(
                f"{source}: {where}: unknown key {str(key)[:20]!r} (expected {', '.join(allowed)})"
            )
