"""`offload trace generate`: vehicle traces from Eclipse SUMO, as site sequences.

1. A road network: `netgenerate` grid (or spider) of `junctions` x `junctions`, `spacing_m`
   apart.
2. Trips: `randomTrips.py`, `vehicles` of them departing evenly over `depart_window_s`, each
   through `intermediate` random edges (long trips keep a vehicle on the road for most of the
   trace).
3. `sumo` drives them for `duration_s` and writes every vehicle's position every `period_s`
   (`--fcd-output`).
4. Sites: base stations on a grid of `cell_m` cells over the network's extent (a site at each
   cell's centre, radius 0.75 x `cell_m`, so the cells overlap and cover every corner), linked
   to their four neighbours with `link_base_ms + link_ms_per_km x distance`; or the sites (and
   optionally links) of a `--sites` YAML file (`edge_client.mobility.sites`).
5. Each vehicle's positions become a site sequence (`edge_client.mobility.handover`).

The same options and seed give the same trace, byte for byte, on one SUMO version (the
version is recorded in the trace's `generator`). Work files go to a temporary directory,
removed at the end.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edge_client.mobility import sumo
from edge_client.mobility.handover import CellTracker, check_settings
from edge_client.mobility.sites import SiteDefaults, link_latency_ms, read_sites
from edge_client.mobility.traces import HandoverSettings, Link, MobilityTrace, Site

Positions = dict[str, list[tuple[float, float, float]]]
"""Vehicle id -> its (t, x, y) samples."""


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    seed: int = 1
    vehicles: int = 20
    duration_s: float = 600.0
    depart_window_s: float | None = None
    """Departures spread over [0, this); None: a quarter of the duration, at most 300 s."""
    junctions: int = 10
    spacing_m: float = 200.0
    lanes: int = 2
    spider: bool = False
    intermediate: int = 20
    period_s: float = 1.0
    """Position sample period, seconds (handovers happen on samples)."""
    mesoscopic: bool = False
    """SUMO's mesoscopic model (`--mesosim`): for traces of thousands of vehicles."""
    cell_m: float = 500.0
    access_ms: float = 1.0
    link_base_ms: float = 2.0
    link_ms_per_km: float = 4.0
    hysteresis_m: float = 50.0
    time_to_trigger_s: float = 2.0
    sites_file: Path | None = None
    name: str = ""

    def check(self) -> None:
        """ValueError for an option out of range."""
        checks = [
            (self.vehicles >= 1, "vehicles must be >= 1"),
            (0 < self.duration_s <= 24 * 3600, "duration_s must be in (0, 86400]"),
            (2 <= self.junctions <= 200, "junctions must be in [2, 200]"),
            (self.spacing_m >= 20, "spacing_m must be >= 20"),
            (1 <= self.lanes <= 6, "lanes must be in [1, 6]"),
            (0 <= self.intermediate <= 500, "intermediate must be in [0, 500]"),
            (0 < self.period_s <= 60, "period_s must be in (0, 60]"),
            (self.cell_m >= 50, "cell_m must be >= 50"),
        ]
        if self.depart_window_s is not None:
            checks.append(
                (0 < self.depart_window_s <= self.duration_s, "depart window in (0, duration]")
            )
        for value in (self.access_ms, self.link_base_ms, self.link_ms_per_km):
            checks.append((math.isfinite(value) and value >= 0, "latencies must be >= 0"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        check_settings(HandoverSettings(self.hysteresis_m, self.time_to_trigger_s))

    @property
    def site_defaults(self) -> SiteDefaults:
        return SiteDefaults(self.access_ms, self.link_base_ms, self.link_ms_per_km)

    @property
    def window_s(self) -> float:
        if self.depart_window_s is not None:
            return self.depart_window_s
        return min(300.0, self.duration_s / 4)


@dataclass(frozen=True, slots=True)
class Generated:
    trace: MobilityTrace
    positions: Positions | None = None
    """Every sample, when asked for (`keep_positions`): for checks on small traces."""
    timings_s: dict[str, float] = field(default_factory=dict)


def generate_trace(options: GenerateOptions, *, keep_positions: bool = False) -> Generated:
    """Run SUMO and build the trace (see the module docstring). Blocking; minutes for
    10,000 vehicles over an hour. ValueError for bad options, SumoError when SUMO fails."""
    options.check()
    settings = HandoverSettings(options.hysteresis_m, options.time_to_trigger_s)
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="offload-trace-") as tmp:
        work = Path(tmp)
        net = sumo.grid_network(
            work / "net.net.xml",
            junctions=options.junctions,
            spacing_m=options.spacing_m,
            lanes=options.lanes,
            seed=options.seed,
            spider=options.spider,
        )
        bounds = sumo.network_bounds(net)
        if options.sites_file is not None:
            sites, links = read_sites(options.sites_file, options.site_defaults)
        else:
            sites, links = grid_sites(bounds, options)
        trips = sumo.random_trips(
            net,
            work / "trips.xml",
            vehicles=options.vehicles,
            depart_window_s=options.window_s,
            intermediate=options.intermediate,
            seed=options.seed,
        )
        timings["network_and_trips_s"] = time.perf_counter() - clock
        clock = time.perf_counter()
        fcd = sumo.simulate(
            net,
            trips,
            work / "fcd.xml",
            duration_s=options.duration_s,
            period_s=options.period_s,
            seed=options.seed,
            mesoscopic=options.mesoscopic,
        )
        timings["sumo_s"] = time.perf_counter() - clock
        clock = time.perf_counter()
        tracker = CellTracker(sites, settings)
        positions: Positions | None = defaultdict(list) if keep_positions else None
        for t, ids, xs, ys in sumo.positions(fcd):
            if t >= options.duration_s:
                break
            tracker.step(t, ids, xs, ys)
            if positions is not None:
                for vehicle_id, x, y in zip(ids, xs.tolist(), ys.tolist(), strict=True):
                    positions[vehicle_id].append((t, x, y))
        timings["handover_s"] = time.perf_counter() - clock
    generator = {
        "tool": f"eclipse-sumo {sumo.version()}",
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()},
        "depart_window_s": options.window_s,
    }
    generator.pop("name")
    trace = MobilityTrace(
        name=options.name or f"{'spider' if options.spider else 'grid'}-s{options.seed}",
        duration_s=options.duration_s,
        sites=tuple(sites),
        links=tuple(links),
        vehicles=tuple(tracker.vehicles(options.period_s, options.duration_s)),
        handover=settings,
        generator=generator,
    )
    return Generated(trace, None if positions is None else dict(positions), timings)


def grid_sites(bounds: sumo.Bounds, options: GenerateOptions) -> tuple[list[Site], list[Link]]:
    """A site at the centre of each `cell_m` cell over `bounds`, linked to its neighbours."""
    cell = options.cell_m
    cols = max(1, math.ceil((bounds.x1 - bounds.x0) / cell))
    rows = max(1, math.ceil((bounds.y1 - bounds.y0) / cell))
    width = max(2, len(str(max(rows, cols) - 1)))
    names = {(r, c): f"cell-{r:0{width}d}-{c:0{width}d}" for r in range(rows) for c in range(cols)}
    sites = [
        Site(
            names[(r, c)],
            round(bounds.x0 + (c + 0.5) * cell, 3),
            round(bounds.y0 + (r + 0.5) * cell, 3),
            round(0.75 * cell, 3),
            options.access_ms,
        )
        for r in range(rows)
        for c in range(cols)
    ]
    hop = link_latency_ms(cell, options.site_defaults)
    links = [
        Link(names[(r, c)], names[(r + dr, c + dc)], hop)
        for r in range(rows)
        for c in range(cols)
        for dr, dc in ((0, 1), (1, 0))
        if (r + dr, c + dc) in names
    ]
    return sites, links


# --- the command line --------------------------------------------------------------------------


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    d = GenerateOptions()
    parser.add_argument("-o", "--out", type=Path, required=True, help="the trace file (.json)")
    parser.add_argument("--cluster-out", type=Path, help="also write the broker's cluster file")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"(default {d.seed})")
    parser.add_argument("--vehicles", type=int, default=d.vehicles, help=f"(default {d.vehicles})")
    parser.add_argument(
        "--duration", type=float, default=d.duration_s, help=f"seconds (default {d.duration_s:g})"
    )
    parser.add_argument(
        "--depart-window",
        type=float,
        default=None,
        help="departures spread over this many seconds (default: a quarter of the duration, "
        "at most 300)",
    )
    parser.add_argument("--spider", action="store_true", help="a spider network, not a grid")
    parser.add_argument(
        "--junctions", type=int, default=d.junctions, help=f"per side (default {d.junctions})"
    )
    parser.add_argument(
        "--spacing", type=float, default=d.spacing_m, help=f"metres (default {d.spacing_m:g})"
    )
    parser.add_argument("--lanes", type=int, default=d.lanes, help=f"(default {d.lanes})")
    parser.add_argument(
        "--intermediate",
        type=int,
        default=d.intermediate,
        help=f"random edges each trip passes (default {d.intermediate})",
    )
    parser.add_argument(
        "--period",
        type=float,
        default=d.period_s,
        help=f"position sample period, seconds (default {d.period_s:g})",
    )
    parser.add_argument(
        "--cell",
        type=float,
        default=d.cell_m,
        help=f"site grid cell, metres (default {d.cell_m:g})",
    )
    parser.add_argument(
        "--sites", type=Path, help="a YAML file of sites (name, x, y, radius_m) instead of a grid"
    )
    add_site_arguments(
        parser,
        d.site_defaults,
        access="radio access latency",
        links="site link latency",
    )
    add_handover_arguments(parser, d.hysteresis_m, d.time_to_trigger_s)
    parser.add_argument(
        "--meso", action="store_true", help="SUMO's mesoscopic model (thousands of vehicles)"
    )
    parser.add_argument("--name", default="", help="the trace's name (default: grid-s<seed>)")


def add_site_arguments(
    parser: argparse.ArgumentParser, d: SiteDefaults, access: str, links: str
) -> None:
    """--access-ms, --link-base-ms and --link-ms-per-km, with `d`'s defaults; `access` and
    `links` say what the first and the other two are in this command."""
    parser.add_argument(
        "--access-ms", type=float, default=d.access_ms,
        help=f"{access} (default {d.access_ms:g})",
    )  # fmt: skip
    parser.add_argument(
        "--link-base-ms", type=float, default=d.link_base_ms,
        help=f"{links} at 0 m (default {d.link_base_ms:g})",
    )  # fmt: skip
    parser.add_argument(
        "--link-ms-per-km", type=float, default=d.link_ms_per_km,
        help=f"{links} per km (default {d.link_ms_per_km:g})",
    )  # fmt: skip


def add_handover_arguments(
    parser: argparse.ArgumentParser, hysteresis_m: float, time_to_trigger_s: float
) -> None:
    """--hysteresis-m and --time-to-trigger: the handover rule's settings."""
    parser.add_argument(
        "--hysteresis-m", type=float, default=hysteresis_m,
        help=f"handover margin, metres closer (default {hysteresis_m:g})",
    )  # fmt: skip
    parser.add_argument(
        "--time-to-trigger", type=float, default=time_to_trigger_s,
        help=f"handover time-to-trigger, seconds (default {time_to_trigger_s:g})",
    )  # fmt: skip


def write_trace(args: argparse.Namespace, trace: MobilityTrace, how: str) -> None:
    """Write `trace` to --out (and its cluster file to --cluster-out) and say what it holds,
    `how` (in brackets) after."""
    args.out.write_text(trace.dumps(), encoding="utf-8")
    if args.cluster_out is not None:
        args.cluster_out.write_text(trace.cluster_yaml(), encoding="utf-8")
    handovers = sum(v.handovers for v in trace.vehicles)
    print(
        f"{args.out}: {len(trace.vehicles)} vehicles, {len(trace.sites)} sites, "
        f"{handovers} handovers over {trace.duration_s:g} s ({how})"
    )


def options_from(args: argparse.Namespace) -> GenerateOptions:
    return GenerateOptions(
        seed=args.seed,
        vehicles=args.vehicles,
        duration_s=args.duration,
        depart_window_s=args.depart_window,
        junctions=args.junctions,
        spacing_m=args.spacing,
        lanes=args.lanes,
        spider=args.spider,
        intermediate=args.intermediate,
        period_s=args.period,
        mesoscopic=args.meso,
        cell_m=args.cell,
        access_ms=args.access_ms,
        link_base_ms=args.link_base_ms,
        link_ms_per_km=args.link_ms_per_km,
        hysteresis_m=args.hysteresis_m,
        time_to_trigger_s=args.time_to_trigger,
        sites_file=args.sites,
        name=args.name,
    )


def run_generate(args: argparse.Namespace) -> int:
    try:
        generated = generate_trace(options_from(args))
    except (ValueError, sumo.SumoError) as err:
        print(f"offload trace generate: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    timings = ", ".join(f"{k} {v:.1f}" for k, v in generated.timings_s.items())
    write_trace(args, generated.trace, timings)
    return 0
