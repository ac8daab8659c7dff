"""`offload trace import FCD --sites FILE`: a mobility trace from SUMO output you have.

1. Sites: the `--sites` file (`edge_client.mobility.sites`: name, x, y, radius_m; links
   optional).
2. Positions: the FCD file (`edge_client.mobility.fcd`: SUMO's XML or CSV, gzip-compressed or
   not), timestep by timestep.
3. Each vehicle's positions become a site sequence with the handover rule of `offload trace
   generate` (`edge_client.mobility.handover`: the nearest site within its radius, closer
   than the serving one by `--hysteresis-m` for `--time-to-trigger` seconds).

The trace covers [0, last timestep + period); a vehicle leaves one period after its last
position. The period is the FCD's sample period (the smallest step between its timesteps)
unless `--period` says. The result is the trace JSON that `offload simulate --trace` and
`offload demo --trace` read; the same files give the same trace, byte for byte.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edge_client.mobility import fcd
from edge_client.mobility.generate import add_handover_arguments, add_site_arguments, write_trace
from edge_client.mobility.handover import CellTracker, check_settings
from edge_client.mobility.sites import SiteDefaults, read_sites
from edge_client.mobility.traces import HandoverSettings, MobilityTrace, parse


@dataclass(frozen=True, slots=True)
class ImportOptions:
    hysteresis_m: float = 50.0
    time_to_trigger_s: float = 2.0
    period_s: float | None = None
    """Position sample period, seconds; None: the FCD's."""
    sites: SiteDefaults = field(default_factory=SiteDefaults)
    name: str = ""
    """The trace's name; "": the FCD file's."""

    def check(self) -> None:
        """ValueError for an option out of range."""
        check_settings(HandoverSettings(self.hysteresis_m, self.time_to_trigger_s))
        if self.period_s is not None and not 0 < self.period_s <= 3600:
            raise ValueError(f"--period must be in (0, 3600] seconds, not {self.period_s:g}")
        for value in asdict(self.sites).values():
            if not math.isfinite(value) or value < 0:
                raise ValueError("latencies must be finite numbers >= 0")


def import_trace(fcd_file: Path, sites_file: Path, options: ImportOptions) -> MobilityTrace:
    """The trace of the vehicles of `fcd_file` among the sites of `sites_file` (see the module
    docstring). Blocking: reads both files. ValueError (FcdError, SitesError) when an option
    or a file is bad, OSError when a file cannot be read."""
    options.check()
    settings = HandoverSettings(options.hysteresis_m, options.time_to_trigger_s)
    sites, links = read_sites(sites_file, options.sites)
    tracker = CellTracker(sites, settings)
    last: float | None = None
    step = math.inf
    for t, ids, xs, ys in fcd.timesteps(fcd_file):
        if last is not None:
            step = min(step, t - last)
        last = t
        tracker.step(t, ids, xs, ys)
    if last is None:
        raise fcd.FcdError(f"{fcd_file}: no vehicle in it")
    period = options.period_s if options.period_s is not None else step
    if not math.isfinite(period):
        raise ValueError(f"{fcd_file}: one timestep only: give its sample period with --period")
    duration = last + period
    trace = MobilityTrace(
        name=options.name or _stem(fcd_file),
        duration_s=duration,
        sites=tuple(sites),
        links=tuple(links),
        vehicles=tuple(tracker.vehicles(period, duration)),
        handover=settings,
        generator={
            "tool": "offload trace import",
            "fcd": fcd_file.name,
            "sites_file": sites_file.name,
            "period_s": period,
            **asdict(options.sites),
        },
    )
    # What is written is what every reader accepts.
    return parse(trace.to_json(), f"the trace imported from {fcd_file}")


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".xml", ".csv"):
        name = name.removesuffix(suffix)
    return name or "trace"


# --- the command line --------------------------------------------------------------------------


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    d = ImportOptions()
    parser.add_argument("fcd", type=Path, metavar="FCD", help="the SUMO FCD file (XML or CSV)")
    parser.add_argument(
        "--sites",
        type=Path,
        required=True,
        help="a YAML or JSON file of sites: {sites: [{name, x, y, radius_m}], links: [...]}",
    )
    parser.add_argument("-o", "--out", type=Path, required=True, help="the trace file (.json)")
    parser.add_argument("--cluster-out", type=Path, help="also write the broker's cluster file")
    parser.add_argument(
        "--period",
        type=float,
        default=None,
        help="position sample period, seconds (default: the FCD's step between timesteps)",
    )
    add_handover_arguments(parser, d.hysteresis_m, d.time_to_trigger_s)
    add_site_arguments(
        parser,
        d.sites,
        access="radio access latency of a site that gives none",
        links="without links in --sites: link latency",
    )
    parser.add_argument("--name", default="", help="the trace's name (default: the FCD file's)")


def run_import(args: argparse.Namespace) -> int:
    options = ImportOptions(
        hysteresis_m=args.hysteresis_m,
        time_to_trigger_s=args.time_to_trigger,
        period_s=args.period,
        sites=SiteDefaults(args.access_ms, args.link_base_ms, args.link_ms_per_km),
        name=args.name,
    )
    try:
        trace = import_trace(args.fcd, args.sites, options)
    except (ValueError, OSError) as err:
        print(f"offload trace import: {err}", file=sys.stderr)
        return 2
    write_trace(args, trace, f"sample period {trace.generator['period_s']:g} s")
    return 0
