"""Eclipse SUMO, as installed from PyPI (`eclipse-sumo`): network, trips, and positions.

The only module that starts processes for mobility. Every function here is blocking (it
waits for a SUMO binary or `randomTrips.py`); callers in an event loop run it in a thread.
The binaries and `tools/randomTrips.py` are found through the `sumo` Python package
(`sumo.SUMO_HOME`), never on PATH, so a fresh `pip install` is all it needs. Each is run with
SUMO_HOME set (randomTrips imports `sumolib` from its tools) and its seed, so a seed gives the
same files on every run of one SUMO version. `SumoError` (a RuntimeError) carries the last
lines of a failing tool's output.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class SumoError(RuntimeError):
    """A SUMO tool failed or SUMO is not installed."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """The network's extent, metres (SUMO's `convBoundary`)."""

    x0: float
    y0: float
    x1: float
    y1: float


def home() -> Path:
    """SUMO_HOME of the installed `eclipse-sumo` wheel. SumoError when it is missing."""
    try:
        import sumo
    except ImportError as err:
        raise SumoError(
            "Eclipse SUMO is not installed: pip install 'edge-offload[sim]' (or "
            "eclipse-sumo alone)"
        ) from err
    return Path(sumo.SUMO_HOME)


def version() -> str:
    """The installed `eclipse-sumo` distribution's version ("unknown" when not installed)."""
    try:
        return importlib.metadata.version("eclipse-sumo")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _run(argv: list[str], cwd: Path) -> None:
    env = {**os.environ, "SUMO_HOME": str(home())}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise SumoError(
            f"{Path(argv[1] if argv[0] == sys.executable else argv[0]).name} "
            f"exited {done.returncode}:\n{tail}"
        )


def grid_network(
    out: Path, *, junctions: int, spacing_m: float, lanes: int, seed: int, spider: bool = False
) -> Path:
    """A grid (or spider) road network of `junctions` x `junctions` (`netgenerate`)."""
    binary = str(home() / "bin" / "netgenerate")
    if spider:
        shape = [
            "--spider",
            f"--spider.arm-number={max(3, junctions)}",
            f"--spider.circle-number={max(1, junctions)}",
            f"--spider.space-radius={spacing_m:g}",
        ]
    else:
        shape = ["--grid", f"--grid.number={junctions}", f"--grid.length={spacing_m:g}"]
    _run(
        [binary, *shape, f"--default.lanenumber={lanes}", f"--seed={seed}", "-o", str(out)],
        out.parent,
    )
    return out


def network_bounds(net: Path) -> Bounds:
    """The network's `convBoundary`. SumoError when the file has none."""
    for _, element in ET.iterparse(net, events=("start",)):
        if element.tag == "location":
            x0, y0, x1, y1 = (float(v) for v in element.attrib["convBoundary"].split(","))
            return Bounds(x0, y0, x1, y1)
    raise SumoError(f"{net.name}: no <location convBoundary=...>")


def random_trips(
    net: Path,
    out: Path,
    *,
    vehicles: int,
    depart_window_s: float,
    intermediate: int,
    seed: int,
) -> Path:
    """`vehicles` random trips departing evenly over `depart_window_s`, each through
    `intermediate` random edges on the way (long trips keep vehicles on the road)."""
    script = home() / "tools" / "randomTrips.py"
    period = depart_window_s / vehicles
    _run(
        [
            sys.executable,
            str(script),
            "-n",
            str(net),
            "-o",
            str(out),
            f"--seed={seed}",
            "--begin=0",
            # half a period short of the window: floating point must not add a trip
            f"--end={depart_window_s - period / 2:.6f}",
            f"--period={period:.6f}",
            f"--intermediate={intermediate}",
            "--prefix=veh",
            "--no-validate",
        ],
        out.parent,
    )
    return out


def simulate(
    net: Path,
    trips: Path,
    out: Path,
    *,
    duration_s: float,
    period_s: float,
    seed: int,
    mesoscopic: bool = False,
) -> Path:
    """Run `sumo` for `duration_s` and write each vehicle's x, y every `period_s` seconds
    (`--fcd-output`). Trips are routed at insertion with A* (on a grid it explores a fraction
    of Dijkstra's edges: routing, not driving, is most of a large trace's time).
    `mesoscopic`: SUMO's queue model (`--mesosim`), several times faster for thousands of
    vehicles; positions move along ~100 m edge segments instead of metre by metre."""
    _run(
        [
            str(home() / "bin" / "sumo"),
            "-n",
            str(net),
            "-r",
            str(trips),
            "--begin=0",
            f"--end={duration_s:g}",
            f"--seed={seed}",
            "--fcd-output",
            str(out),
            "--fcd-output.attributes=x,y",
            f"--device.fcd.period={period_s:g}",
            "--routing-algorithm=astar",
            *(["--mesosim=true"] if mesoscopic else []),
            "--no-step-log=true",
            "--no-warnings=true",
            "--ignore-route-errors=true",
        ],
        out.parent,
    )
    return out


def positions(fcd: Path) -> Iterator[tuple[float, list[str], np.ndarray, np.ndarray]]:
    """(t, vehicle ids, x, y) for each timestep of an FCD file, in time order; streamed
    (the file of a large trace does not fit in memory as objects)."""
    t = 0.0
    ids: list[str] = []
    xs: list[float] = []
    ys: list[float] = []
    context = ET.iterparse(fcd, events=("start", "end"))
    root = None
    for event, element in context:
        if root is None:
            root = element
        if event == "start":
            if element.tag == "timestep":
                t = float(element.attrib["time"])
                ids, xs, ys = [], [], []
            continue
        if element.tag == "vehicle":
            attrib = element.attrib
            ids.append(attrib["id"])
            xs.append(float(attrib["x"]))
            ys.append(float(attrib["y"]))
        elif element.tag == "timestep":
            yield t, ids, np.array(xs), np.array(ys)
            root.clear()
