"""The mobility trace format, version 1: edge sites, their links, and where each vehicle is.

A JSON document (`offload trace generate` writes it; `offload demo --trace`, `offload
simulate` and `python -m bench.mobility` read it)::

    {
      "format": "edge-offload-mobility-trace",
      "version": 1,
      "name": "grid-s1",
      "duration_s": 3600.0,               # the trace covers [0, duration_s)
      "generator": {...},                 # how it was made (tool versions, seed, options)
      "handover": {"hysteresis_m": 50.0, "time_to_trigger_s": 2.0},
      "sites": [                          # base stations; each one an edge site
        {"name": "cell-00-00", "x": 250.0, "y": 250.0, "radius_m": 375.0, "access_ms": 1.0}
      ],
      "links": [                          # the broker's cluster file links (ms one way)
        {"a": "cell-00-00", "b": "cell-00-01", "latency_ms": 4.0}
      ],
      "vehicles": [                       # one client each
        {"id": "veh0", "end_s": 412.0,
         "sites": [[0.0, "cell-00-00"], [37.0, "cell-00-01"]]}
      ]
    }

`x`, `y` and `radius_m` are metres in SUMO's network coordinates. `access_ms` is the radio
access latency of a device in the cell, in ms. A vehicle's `sites` are (t in seconds, site)
pairs: it appears at the first t in that site's cell and is handed over to each later site at
its t (strictly increasing times, consecutive sites differ); it leaves at `end_s` (after its
last t, at most `duration_s`). `links` connect every site (the broker's cluster file, see
`broker.network`); `cluster_yaml` writes them as one. A version other than 1 is refused: a
reader never guesses at a format it does not know.

`load` checks every field and raises `TraceFormatError` (a ValueError) naming the file and
the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from edge_client.mobility import formats

FORMAT = "edge-offload-mobility-trace"
VERSION = 1


class TraceFormatError(ValueError):
    """The trace document is invalid; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class Site:
    name: str
    x: float
    """Metres, network coordinates."""
    y: float
    radius_m: float
    """The cell's radius: a vehicle farther than this from the site is not handed to it."""
    access_ms: float = 1.0
    """Radio access latency of a device in the cell, in ms."""


@dataclass(frozen=True, slots=True)
class Link:
    a: str
    b: str
    latency_ms: float


@dataclass(frozen=True, slots=True)
class Vehicle:
    id: str
    sites: tuple[tuple[float, str], ...]
    """(t in seconds, site): where it appears, then each handover."""
    end_s: float
    """When it leaves (the trace's end if it is still driving then)."""

    @property
    def start_s(self) -> float:
        return self.sites[0][0]

    @property
    def handovers(self) -> int:
        return len(self.sites) - 1


@dataclass(frozen=True, slots=True)
class HandoverSettings:
    hysteresis_m: float
    """A site must be this much closer than the serving one to take the vehicle over."""
    time_to_trigger_s: float
    """...for this long, without interruption."""


@dataclass(frozen=True, slots=True)
class MobilityTrace:
    name: str
    duration_s: float
    sites: tuple[Site, ...]
    links: tuple[Link, ...]
    vehicles: tuple[Vehicle, ...]
    handover: HandoverSettings
    generator: Mapping[str, Any] = field(default_factory=dict)

    def site(self, name: str) -> Site:
        return next(s for s in self.sites if s.name == name)

    def vehicle(self, vehicle_id: str) -> Vehicle:
        """KeyError when the trace has no such vehicle."""
        for vehicle in self.vehicles:
            if vehicle.id == vehicle_id:
                return vehicle
        raise KeyError(vehicle_id)

    def busiest(self) -> Vehicle:
        """The vehicle with the most handovers (the first in the file among equals)."""
        return max(self.vehicles, key=lambda v: v.handovers)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "duration_s": self.duration_s,
            "generator": dict(self.generator),
            "handover": {
                "hysteresis_m": self.handover.hysteresis_m,
                "time_to_trigger_s": self.handover.time_to_trigger_s,
            },
            "sites": [
                {
                    "name": s.name,
                    "x": s.x,
                    "y": s.y,
                    "radius_m": s.radius_m,
                    "access_ms": s.access_ms,
                }
                for s in self.sites
            ],
            "links": [{"a": k.a, "b": k.b, "latency_ms": k.latency_ms} for k in self.links],
            "vehicles": [
                {"id": v.id, "end_s": v.end_s, "sites": [[t, s] for t, s in v.sites]}
                for v in self.vehicles
            ],
        }

    def dumps(self) -> str:
        """The document as text: one vehicle a line, so a diff of two traces reads well.
        Equal traces give equal text (keys in a fixed order, floats as Python prints them)."""
        doc = self.to_json()
        lists = {key: doc.pop(key) for key in ("sites", "links", "vehicles")}
        head = json.dumps(doc, indent=1)[:-2]
        parts = [head]
        for key, items in lists.items():
            rows = ",\n  ".join(json.dumps(item, separators=(",", ":")) for item in items)
            parts.append(f'"{key}": [\n  {rows}\n ]' if items else f'"{key}": []')
        return ",\n ".join(parts) + "\n}\n"

    def cluster_yaml(self) -> str:
        """The broker's `--cluster` file for these sites and links (see `broker.network`)."""
        return yaml.safe_dump(
            {
                "sites": [s.name for s in self.sites],
                "links": [{"a": k.a, "b": k.b, "latency_ms": k.latency_ms} for k in self.links],
            },
            sort_keys=False,
        )


def is_trace_file(path: Path) -> bool:
    """Whether `path` names a file of this format (by its suffix: `.json`)."""
    return path.suffix.lower() == ".json"


WANTED = (
    f"a mobility trace JSON (format {FORMAT!r}, written by `offload trace generate` or "
    "`offload trace import`)"
)


def load(path: Path) -> MobilityTrace:
    """Read and check the trace at `path`. Blocking. TraceFormatError when it is invalid, or
    a file of another format (named, with the format wanted)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TraceFormatError(not_a_trace(path)) from None
    except OSError as err:
        raise TraceFormatError(f"cannot read the trace {path}: {err}") from err
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        if text.lstrip("\ufeff \t\r\n")[:1] not in ("{", "["):
            raise TraceFormatError(not_a_trace(path)) from None
        raise TraceFormatError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from err
    return parse(doc, str(path))


def not_a_trace(path: Path, wanted: str = WANTED) -> str:
    """The error for a file at `path` that is not what a trace command wants: what it is
    (`formats.sniff`), what is `wanted`, and how to import it if it is SUMO FCD."""
    try:
        kind = formats.sniff(path)
    except OSError as err:
        return f"cannot read the trace {path}: {err}"
    message = f"{path}: {kind.describe()}, not {wanted}"
    if kind.is_fcd:
        message += (
            f"; make one from SUMO FCD with `offload trace import {path} --sites SITES.yaml "
            "-o TRACE.json`"
        )
    return message


def parse(doc: object, source: str = "<trace>") -> MobilityTrace:
    """Check a decoded document (see the module docstring). TraceFormatError when invalid."""

    def fail(where: str, what: str) -> TraceFormatError:
        return TraceFormatError(f"{source}: {where}: {what}")

    if not isinstance(doc, dict):
        raise fail("top level", "must be an object")
    if doc.get("format") != FORMAT:
        raise fail("format", f"must be {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise fail(
            "version", f"{str(doc.get('version'))[:20]!r} is not supported (only {VERSION})"
        )
    duration = _number(doc.get("duration_s"), "duration_s", fail, positive=True)
    handover_doc = _object(doc.get("handover"), "handover", fail)
    handover = HandoverSettings(
        _number(handover_doc.get("hysteresis_m"), "handover.hysteresis_m", fail),
        _number(handover_doc.get("time_to_trigger_s"), "handover.time_to_trigger_s", fail),
    )
    sites: list[Site] = []
    for i, item in enumerate(_list(doc.get("sites"), "sites", fail)):
        where = f"sites[{i}]"
        entry = _object(item, where, fail)
        sites.append(
            Site(
                _name(entry.get("name"), f"{where}.name", fail),
                _number(entry.get("x"), f"{where}.x", fail, signed=True),
                _number(entry.get("y"), f"{where}.y", fail, signed=True),
                _number(entry.get("radius_m"), f"{where}.radius_m", fail, positive=True),
                _number(entry.get("access_ms", 1.0), f"{where}.access_ms", fail),
            )
        )
    if not sites:
        raise fail("sites", "at least one site is required")
    names = {s.name for s in sites}
    if len(names) != len(sites):
        raise fail("sites", "a site name repeats")
    links: list[Link] = []
    for i, item in enumerate(_list(doc.get("links", []), "links", fail)):
        where = f"links[{i}]"
        entry = _object(item, where, fail)
        a = _name(entry.get("a"), f"{where}.a", fail)
        b = _name(entry.get("b"), f"{where}.b", fail)
        for end in (a, b):
            if end not in names:
                raise fail(where, f"unknown site {end[:40]!r}")
        links.append(Link(a, b, _number(entry.get("latency_ms"), f"{where}.latency_ms", fail)))
    vehicles: list[Vehicle] = []
    seen: set[str] = set()
    for i, item in enumerate(_list(doc.get("vehicles"), "vehicles", fail)):
        where = f"vehicles[{i}]"
        entry = _object(item, where, fail)
        vehicle_id = _name(entry.get("id"), f"{where}.id", fail)
        if vehicle_id in seen:
            raise fail(f"{where}.id", f"vehicle {vehicle_id[:40]!r} appears twice")
        seen.add(vehicle_id)
        steps: list[tuple[float, str]] = []
        for j, pair in enumerate(_list(entry.get("sites"), f"{where}.sites", fail)):
            at = f"{where}.sites[{j}]"
            if not isinstance(pair, list) or len(pair) != 2:
                raise fail(at, "must be a [t, site] pair")
            t = _number(pair[0], f"{at}[0]", fail)
            site = _name(pair[1], f"{at}[1]", fail)
            if site not in names:
                raise fail(f"{at}[1]", f"unknown site {site[:40]!r}")
            if steps and t <= steps[-1][0]:
                raise fail(f"{at}[0]", "times must increase")
            if steps and site == steps[-1][1]:
                raise fail(f"{at}[1]", "a handover must change the site")
            steps.append((t, site))
        if not steps:
            raise fail(f"{where}.sites", "at least one [t, site] pair is required")
        end_s = _number(entry.get("end_s"), f"{where}.end_s", fail)
        if not steps[-1][0] < end_s <= duration:
            raise fail(f"{where}.end_s", "must be after its last handover, within duration_s")
        vehicles.append(Vehicle(vehicle_id, tuple(steps), end_s))
    generator = doc.get("generator", {})
    if not isinstance(generator, dict):
        raise fail("generator", "must be an object")
    return MobilityTrace(
        name=_name(doc.get("name", "trace"), "name", fail),
        duration_s=duration,
        sites=tuple(sites),
        links=tuple(links),
        vehicles=tuple(vehicles),
        handover=handover,
        generator=generator,
    )


def _number(
    value: object, where: str, fail: Any, *, positive: bool = False, signed: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise fail(where, f"must be a finite number, not {str(value)[:20]!r}")
    if positive and value <= 0:
        raise fail(where, "must be > 0")
    if not signed and value < 0:
        raise fail(where, "must be >= 0")
    return float(value)


def _name(value: object, where: str, fail: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise fail(where, "must be a non-empty string")
    return value


def _object(value: object, where: str, fail: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise fail(where, "must be an object")
    return value


def _list(value: object, where: str, fail: Any) -> Sequence[Any]:
    if not isinstance(value, list):
        raise fail(where, "must be a list")
    return value
