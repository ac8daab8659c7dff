"""Mobility traces: where a device is, and for how long, as the demo moves it.

A trace is a YAML file of waypoints, or a generated vehicle trace (a `.json` file of
`edge_client.mobility.traces`, format version 1: `offload trace generate`), of which the demo
drives one vehicle's site sequence (`--vehicle`, else the vehicle with the most handovers):
each site it is handed to becomes a waypoint, its stay lasting until the next handover. The
YAML form::

    name: commute                     # optional; default: the file's stem
    waypoints:                        # at least one
      - {site: site-a, dwell_s: 8}    # the site the device is at, and seconds it stays
      - {site: site-b, dwell_s: 8}

`load_trace` checks every field of either form and names the file and line of anything wrong
(`TraceError`, a ValueError): a YAML error, a missing or unknown key, a site the cluster
does not have, a dwell that is not a positive number of seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import yaml

from edge_client.mobility import formats
from edge_client.mobility import traces as mobility_traces

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "commute.yaml"
MAX_DWELL_S = 3600.0
WANTED = (
    "what `offload demo --trace` reads: a YAML file of {site, dwell_s} waypoints, or a "
    f"{mobility_traces.WANTED.removeprefix('a ')} named .json"
)


class TraceError(ValueError):
    """The trace file is invalid; the message says where and how to fix it."""


@dataclass(frozen=True, slots=True)
class Waypoint:
    site: str
    dwell_s: float


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    waypoints: tuple[Waypoint, ...]
    others: tuple[tuple[str, ...], ...] = ()
    """The site sequences of a generated trace's other vehicles (those that stay in the
    cluster's sites): the traffic `--prewarm` teaches the broker with first."""

    def scaled(self, factor: float, minimum_s: float) -> Trace:
        """The same trace with every stay multiplied by `factor`, none shorter than
        `minimum_s` (the demo's --quick and --time-scale)."""
        return Trace(
            self.name,
            tuple(Waypoint(w.site, max(minimum_s, w.dwell_s * factor)) for w in self.waypoints),
            self.others,
        )


def load_trace(path: Path, sites: Collection[str], vehicle: str | None = None) -> Trace:
    """Read and check the trace at `path` against the cluster's `sites`; `vehicle` picks one
    of a generated trace (see the module docstring; TraceError for it with a YAML trace)."""
    if mobility_traces.is_trace_file(path):
        return _vehicle_trace(path, sites, vehicle)
    if vehicle is not None:
        raise TraceError(f"{path}: --vehicle needs a generated trace (.json), not waypoints")
    _refuse_other_formats(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TraceError(mobility_traces.not_a_trace(path, WANTED)) from None
    except OSError as err:
        raise TraceError(f"cannot read the trace {path}: {err.strerror}") from err
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as err:
        raise TraceError(f"{path}: not valid YAML: {err}") from err

    def at(node: yaml.Node) -> str:
        return f"{path}:{node.start_mark.line + 1}"

    if not isinstance(root, yaml.MappingNode):
        raise TraceError(f"{path}: expected a mapping with a `waypoints` list (see --help)")
    top = _mapping(root, {"name", "waypoints"}, at)
    name = path.stem
    if "name" in top:
        name = _string(top["name"], "name", at)
    waypoints_node = top.get("waypoints")
    if not isinstance(waypoints_node, yaml.SequenceNode) or not waypoints_node.value:
        where = at(waypoints_node) if waypoints_node is not None else str(path)
        raise TraceError(f"{where}: `waypoints` must be a non-empty list of {{site, dwell_s}}")
    waypoints = []
    for index, item in enumerate(waypoints_node.value, start=1):
        if not isinstance(item, yaml.MappingNode):
            raise TraceError(f"{at(item)}: waypoint {index} must be a mapping {{site, dwell_s}}")
        fields = _mapping(item, {"site", "dwell_s"}, at)
        for key in ("site", "dwell_s"):
            if key not in fields:
                raise TraceError(f"{at(item)}: waypoint {index} has no `{key}`")
        site = _string(fields["site"], "site", at)
        if site not in sites:
            raise TraceError(
                f"{at(fields['site'])}: waypoint {index}: unknown site {site!r}; the cluster's "
                f"sites are {', '.join(sorted(sites))}"
            )
        dwell_node = fields["dwell_s"]
        dwell = _seconds(dwell_node)
        if not 0 < dwell <= MAX_DWELL_S:
            raise TraceError(
                f"{at(dwell_node)}: waypoint {index}: dwell_s must be a number of seconds in "
                f"(0, {MAX_DWELL_S:.0f}], got {dwell_node.value!r}"
            )
        waypoints.append(Waypoint(site, dwell))
    return Trace(name, tuple(waypoints))


def _refuse_other_formats(path: Path) -> None:
    """TraceError naming the format of a file that is not YAML text (SUMO FCD, XML, CSV, a
    trace JSON without the .json suffix...) and the formats the demo reads."""
    try:
        kind = formats.sniff(path)
    except OSError:
        return  # reading it says why
    yaml_text = (formats.Form.TEXT, formats.Form.JSON, formats.Form.EMPTY)  # YAML reads JSON
    if kind.compressed or kind.form not in yaml_text:
        raise TraceError(mobility_traces.not_a_trace(path, WANTED))


def _vehicle_trace(path: Path, sites: Collection[str], vehicle_id: str | None) -> Trace:
    try:
        generated = mobility_traces.load(path)
    except mobility_traces.TraceFormatError as err:
        raise TraceError(str(err)) from err
    if not generated.vehicles:
        raise TraceError(f"{path}: the trace has no vehicles")
    if vehicle_id is None:
        vehicle = generated.busiest()
    else:
        try:
            vehicle = generated.vehicle(vehicle_id)
        except KeyError:
            raise TraceError(
                f"{path}: no vehicle {vehicle_id[:40]!r}; it has "
                f"{', '.join(v.id for v in generated.vehicles[:10])}"
                f"{' ...' if len(generated.vehicles) > 10 else ''}"
            ) from None
    unknown = sorted({site for _, site in vehicle.sites} - set(sites))
    if unknown:
        raise TraceError(
            f"{path}: vehicle {vehicle.id} visits site(s) {', '.join(unknown[:5])} that the "
            f"cluster does not have; its sites are {', '.join(sorted(sites))}"
        )
    ends = [t for t, _ in vehicle.sites[1:]] + [vehicle.end_s]
    waypoints = []
    for (t, site), end in zip(vehicle.sites, ends, strict=True):
        if end - t > MAX_DWELL_S:
            raise TraceError(
                f"{path}: vehicle {vehicle.id} stays {end - t:.0f} s at {site}, more than "
                f"{MAX_DWELL_S:.0f} s"
            )
        waypoints.append(Waypoint(site, end - t))
    others = tuple(
        tuple(site for _, site in other.sites)
        for other in generated.vehicles
        if other is not vehicle and {site for _, site in other.sites} <= set(sites)
    )
    return Trace(f"{generated.name}/{vehicle.id}", tuple(waypoints), others)


_Where = Callable[[yaml.Node], str]
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _seconds(node: yaml.Node) -> float:
    """A YAML int or float scalar as a float; NaN for anything else (a quoted string...)."""
    if isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS:
        try:
            return float(str(node.value).replace("_", ""))
        except ValueError:
            pass
    return float("nan")


def _mapping(node: yaml.MappingNode, allowed: set[str], at: _Where) -> dict[str, yaml.Node]:
    fields: dict[str, yaml.Node] = {}
    for key_node, value_node in node.value:
        key = str(key_node.value)
        if key not in allowed:
            raise TraceError(
                f"{at(key_node)}: unknown key {key!r} (expected {', '.join(sorted(allowed))})"
            )
        if key in fields:
            raise TraceError(f"{at(key_node)}: {key!r} is given twice")
        fields[key] = value_node
    return fields


def _string(node: yaml.Node, key: str, at: _Where) -> str:
    if not isinstance(node, yaml.ScalarNode) or not str(node.value).strip():
        raise TraceError(f"{at(node)}: `{key}` must be a non-empty string")
    return str(node.value)
