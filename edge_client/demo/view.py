"""What the demo shows: the live view (rich) while it runs, and the report at the end.

The live view is drawn from a `Snapshot` the demo refreshes twice a second from the broker's
ops API (`/api/nodes`, `/api/deployments`, `/api/migrations`) and from the client's own
counters. Events (a move, a migration starting or ending, a failed request) are printed as
lines above it, so they stay in the terminal's scrollback, and are all a log or CI sees when
stdout is not a terminal.
"""

from __future__ import annotations

import enum
import itertools
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from edge_client.observer import percentile
from migration.mechanism import PHASE_EVENTS, phase_at, span_allowance_ms, worst_gap

RECENT_S = 5.0
"""The window of the live request rate and latency."""


@dataclass
class LoadStats:
    """The demo client's requests: every latency, and the last few seconds for the view."""

    ok: int = 0
    failed: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    recent: deque[tuple[float, float]] = field(default_factory=deque)
    """(time.monotonic() at completion, latency in ms) of the last RECENT_S seconds."""
    answered_at: list[float] = field(default_factory=list)
    """time.time() of each successful answer (the broker's timelines use the same clock)."""

    def record_ok(self, latency_ms: float) -> None:
        self.ok += 1
        self.latencies_ms.append(latency_ms)
        self.answered_at.append(time.time())
        now = time.monotonic()
        self.recent.append((now, latency_ms))
        while self.recent and self.recent[0][0] < now - RECENT_S:
            self.recent.popleft()

    @property
    def sent(self) -> int:
        return self.ok + self.failed

    def recent_summary(self) -> str:
        now = time.monotonic()
        recent = sorted(ms for at, ms in self.recent if at >= now - RECENT_S)
        if not recent:
            return "no answer in the last few seconds"
        return (
            f"{len(recent) / RECENT_S:.1f} req/s, p50 {percentile(recent, 0.5):.1f} ms, "
            f"p99 {percentile(recent, 0.99):.1f} ms (last {RECENT_S:.0f} s)"
        )


@dataclass
class Snapshot:
    """What the live view draws."""

    title: str
    nodes: list[dict[str, Any]] = field(default_factory=list)
    deployments: list[dict[str, Any]] = field(default_factory=list)
    migrations: list[dict[str, Any]] = field(default_factory=list)
    client_site: str = ""
    step: str = ""
    load: LoadStats = field(default_factory=LoadStats)
    gaps_ms: dict[str, float] = field(default_factory=dict)
    """Migration id -> the longest gap the client saw across its switch."""
    span_gaps_ms: dict[str, float] = field(default_factory=dict)
    """Migration id -> the longest gap the client saw over the whole of it (decision to the
    old replica stopped)."""


def gpu_cells(node: dict[str, Any], ours: set[str]) -> Text:
    """One block per GPU: green free, magenta held by the demo's deployment, yellow other."""
    text = Text()
    for gpu in node["gpus"]:
        if gpu["free"]:
            text.append("■", style="green")
        elif set(gpu["holders"]) & ours:
            text.append("■", style="bold magenta")
        else:
            text.append("■", style="yellow")
    return text


def live_view(snapshot: Snapshot) -> RenderableType:
    """About 15 lines: the nodes with their GPUs and the replica, the client, the last
    migrations."""
    ours = {d["deployment_id"]: d for d in snapshot.deployments}
    nodes = Table(
        "node", "site", "state", "GPUs", "GPU model", "replica",
        box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
        title=Text.assemble(snapshot.title, "   GPUs: ", ("■", "green"), " free ",
                            ("■", "bold magenta"), " ours ", ("■", "yellow"), " others"),
    )  # fmt: skip
    for node in snapshot.nodes:
        gpus = node["gpus"]
        here = [d for d in ours.values() if d["node_id"] == node["node_id"]]
        nodes.add_row(
            node["node_id"],
            node["site"],
            node["state"],
            gpu_cells(node, set(ours)),
            gpus[0]["name"] if gpus else "-",
            ", ".join(f"◀ epoch {d['epoch']} {d['state']}" for d in here),
        )
    load = snapshot.load
    lines = Text(
        f"client at {snapshot.client_site} ({snapshot.step}): {load.sent} requests, "
        f"{load.failed} failed; {load.recent_summary()}\n"
    )
    for d in ours.values():
        lines.append(f"placement: {d['explanation'] or d['state']}", style="dim")
    migrations = Table(
        "migration", "trigger", "from → to", "state", "took", "client gap", "worst gap",
        box=box.SIMPLE_HEAD, pad_edge=False,
    )  # fmt: skip
    for m in snapshot.migrations[:3]:
        migrations.add_row(*migration_cells(m, snapshot.gaps_ms, snapshot.span_gaps_ms))
    return Group(nodes, lines, migrations)


def migration_cells(
    m: dict[str, Any], gaps_ms: dict[str, float], span_gaps_ms: dict[str, float] | None = None
) -> tuple[str, ...]:
    """The row of one migration: id, trigger, route, state, time taken, the client's gap
    across the switch and over the whole migration (the client's own figures, else the
    broker's copy of them)."""
    timeline = m["timeline"]
    took = (
        f"{(timeline[-1]['at'] - timeline[0]['at']) * 1000:.0f} ms"
        if m["outcome"] and len(timeline) > 1
        else "-"
    )
    gap = gaps_ms.get(m["migration_id"], m["downtime_ms"])
    span = (span_gaps_ms or {}).get(m["migration_id"], m.get("span_gap_ms"))
    return (
        m["migration_id"],
        m["trigger"],
        f"{m['source'] or '-'} → {m['target'] or '-'}",
        m["outcome"] or "under way",
        took,
        "-" if gap is None else f"{gap:.1f} ms",
        "-" if span is None else f"{span:.1f} ms",
    )


STILL_STARTING_MS = 20.0
"""A pre-warmed move whose target took longer than this to be ready waited for its standby
to finish starting. A ready standby's "start" hands its endpoint back without yielding to
the broker's event loop, so its `target_started` and `target_ready` are microseconds apart;
one still starting adds the rest of its start (up to the full 1.4-1.6 s of a cold one)."""


class MoveKind(enum.StrEnum):
    PREWARMED = "pre-warmed"
    STILL_STARTING = "standby still starting"
    COLD = "cold"


def standby_wait_ms(m: dict[str, Any]) -> float | None:
    """How long a pre-warmed migration waited for its standby to be ready, by its timeline
    (`target_started` to `target_ready`), in ms; None for a cold one or a timeline without
    both events (a rollback before the target was ready)."""
    if not m.get("prewarmed"):
        return None
    events = {e["event"]: e["at"] for e in m["timeline"]}
    if "target_started" not in events or "target_ready" not in events:
        return None
    return (events["target_ready"] - events["target_started"]) * 1000


def move_kind(m: dict[str, Any]) -> MoveKind:
    """Pre-warmed (its standby was ready), standby still starting (it waited for it: see
    STILL_STARTING_MS), or cold."""
    if not m.get("prewarmed"):
        return MoveKind.COLD
    wait = standby_wait_ms(m)
    if wait is not None and wait > STILL_STARTING_MS:
        return MoveKind.STILL_STARTING
    return MoveKind.PREWARMED


def move_summary(report: Report) -> str:
    """The report's line on moves: the median time from each move's report to the first
    answer at the new site (the mean of the two middle ones for an even count), pre-warmed,
    standby still starting and cold apart when pre-warm is on."""
    timed = [
        (move_kind(m), report.moved_to_served_ms[m["migration_id"]])
        for m in report.migrations
        if m["migration_id"] in report.moved_to_served_ms
    ]

    def median(kind: MoveKind) -> str:
        values = [ms for k, ms in timed if k is kind]
        return f"median {statistics.median(values):.1f} ms (n={len(values)})" if values else "-"

    if not report.prewarm:
        return f"report to first answer at the new site: {median(MoveKind.COLD)}; pre-warm off"
    kinds = [move_kind(m) for m in report.migrations]
    return (
        f"pre-warm on (budget {report.prewarm}): {kinds.count(MoveKind.PREWARMED)} of "
        f"{len(kinds)} moves pre-warmed, {kinds.count(MoveKind.STILL_STARTING)} waited for a "
        f"standby still starting; report to first answer at the new site: "
        f"{median(MoveKind.PREWARMED)} pre-warmed, {median(MoveKind.STILL_STARTING)} "
        f"standby still starting, {median(MoveKind.COLD)} cold"
    )


def prewarm_label(m: dict[str, Any]) -> str:
    """What a migration's line says of its standby: "" (cold), " (pre-warmed)", or
    " (pre-warmed, standby still starting: waited 1450 ms)"."""
    kind = move_kind(m)
    if kind is MoveKind.COLD:
        return ""
    if kind is MoveKind.PREWARMED:
        return " (pre-warmed)"
    return f" (pre-warmed, standby still starting: waited {standby_wait_ms(m):.0f} ms)"


def span_gap_where(answered_at: list[float], timeline: list[dict[str, Any]]) -> str:
    """Where the longest gap between answers over a migration (its timeline's first to last
    event) fell, by the answers the demo saw: "135.0 ms, +85 to +220 ms, in start" (times
    from the decision; the phase as `migration.mechanism.phase_at` names it, when the
    timeline has its events); "" without two answers over it."""
    if not timeline:
        return ""
    decided, end = timeline[0]["at"], timeline[-1]["at"]
    try:
        a, b = worst_gap(answered_at, decided, end)
    except ValueError:
        return ""
    events = {e["event"]: e["at"] for e in timeline}
    phase = f", in {phase_at(events, b)}" if events.keys() >= PHASE_EVENTS else ""
    since = f"{(a - decided) * 1000:+.0f} to {(b - decided) * 1000:+.0f} ms"
    return f"{(b - a) * 1000:.1f} ms, {since}{phase}"


def longest_gaps_ms(
    answered_at: list[float], windows: list[tuple[float, float]]
) -> tuple[float, float]:
    """The longest gap between consecutive answers outside every window, and inside one (a
    gap that overlaps a window counts as inside), in ms; 0 where there is none."""
    outside = inside = 0.0
    for a, b in itertools.pairwise(answered_at):
        if any(a < end and b > start for start, end in windows):
            inside = max(inside, b - a)
        else:
            outside = max(outside, b - a)
    return outside * 1000, inside * 1000


def span_bound(model: str, outside_ms: float, inside_ms: float) -> str:
    """Whether the longest gap during a migration is within `span_allowance_ms` of the
    longest between migrations, the demo's stand-in for the same load's gap with none."""
    excess = inside_ms - outside_ms
    allowed = span_allowance_ms(model, outside_ms)
    verdict = "within it" if excess <= allowed else "over it"
    return (
        f"during a migration {excess:+.1f} ms over the longest gap between them, "
        f"{allowed:.1f} ms allowed: {verdict}"
    )


@dataclass
class Report:
    runtime: str
    model: str
    """The model's name, size and digest, as the report shows them."""
    model_name: str
    """The zoo's name for it (`mlp`, `resnet18`, ...): the span bound depends on it."""
    trace: str
    seconds: float
    load: LoadStats
    period_ms: float
    """The client sends one request every period (never two at once)."""
    retried: int
    migrations: list[dict[str, Any]]
    gaps_ms: dict[str, float]
    failed_in_window: dict[str, int]
    explanations: list[tuple[str, str]]
    """(heading, explanation text) of each placement the deployment had."""
    dashboard: str
    kept: bool
    span_gaps_ms: dict[str, float] = field(default_factory=dict)
    """Migration id -> the longest gap the client saw over the whole migration."""
    moved_to_served_ms: dict[str, float] = field(default_factory=dict)
    """Migration id -> from the client's report of its new site to its first answer from
    the new replica."""
    prewarm: int = 0
    """The broker's standby budget; 0: pre-warm off."""
    cpus: str = ""
    """Which CPUs the sites' nodes run on (`site_plans`)."""

    @property
    def succeeded(self) -> bool:
        return (
            self.load.ok > 0
            and self.load.failed == 0
            and all(m["outcome"] == "succeeded" for m in self.migrations)
        )


def print_report(console: Console, report: Report) -> None:
    load = report.load
    ordered = sorted(load.latencies_ms)
    console.rule("report")
    summary = Table.grid(padding=(0, 2))
    summary.add_row("runtime", report.runtime)
    if report.cpus:
        summary.add_row("CPUs", report.cpus)
    summary.add_row("model", report.model)
    summary.add_row("trace", report.trace)
    summary.add_row("ran for", f"{report.seconds:.1f} s")
    summary.add_row(
        "requests",
        f"{load.sent} sent, {load.ok} ok, {load.failed} failed "
        f"({report.retried} retried on the newest replica)",
    )
    if ordered:
        summary.add_row(
            "latency",
            "p50 {:.2f} ms, p90 {:.2f} ms, p99 {:.2f} ms, max {:.2f} ms".format(
                *(percentile(ordered, q) for q in (0.5, 0.9, 0.99, 1.0))
            ),
        )
    windows = [
        (m["timeline"][0]["at"], m["timeline"][-1]["at"])
        for m in report.migrations
        if m["timeline"]
    ]
    outside, inside = longest_gaps_ms(load.answered_at, windows)
    summary.add_row(
        "answer gaps",
        f"longest {outside:.1f} ms between migrations, {inside:.1f} ms during one "
        f"(a request every {report.period_ms:g} ms)",
    )
    if windows and outside:
        summary.add_row("span bound", span_bound(report.model_name, outside, inside))
    succeeded = sum(m["outcome"] == "succeeded" for m in report.migrations)
    summary.add_row("migrations", f"{len(report.migrations)}, {succeeded} succeeded")
    summary.add_row("moves", move_summary(report))
    summary.add_row("outputs", "every answer equal to in-process ONNX Runtime (np.allclose)")
    console.print(summary)

    console.print("\n[bold]placements[/bold] (the broker's explanation of each)")
    for heading, text in report.explanations:
        console.print(f"  {heading}", markup=False)
        for line in text.splitlines():
            console.print(f"    {line}", markup=False, highlight=False)

    if report.migrations:
        console.print(
            "\n[bold]migrations[/bold] (timeline from the broker; gaps seen by the client: "
            "across the switch, and over the whole migration from the decision to the old "
            "replica stopped)"
        )
        for m in report.migrations:
            cells = migration_cells(m, report.gaps_ms, report.span_gaps_ms)
            failed = report.failed_in_window.get(m["migration_id"])
            moved = report.moved_to_served_ms.get(m["migration_id"])
            console.print(
                f"  {cells[0]} {m['trigger']} {cells[2]} {m['strategy']}"
                f"{prewarm_label(m)}: {cells[3]}, took "
                f"{cells[4]}; client-observed downtime {cells[5]}, "
                f"{'-' if failed is None else failed} failed request(s), worst gap over the "
                f"whole migration {cells[6]}, report to first answer at the new site "
                f"{'-' if moved is None else f'{moved:.1f} ms'}",
                markup=False,
                highlight=False,
            )
            start = m["timeline"][0]["at"] if m["timeline"] else 0.0
            steps = "  ".join(
                f"{e['event']} +{(e['at'] - start) * 1000:.0f}" for e in m["timeline"]
            )
            where = span_gap_where(report.load.answered_at, m["timeline"])
            console.print(
                f"      {steps} (ms)"
                + (f"; longest gap between answers: {where}" if where else ""),
                markup=False,
                highlight=False,
            )
    else:
        console.print("\nno migration: the trace never moved the client to a better site")

    where = report.dashboard
    console.print(
        f"\ndashboard  {where}"
        + (
            "  (kept running: Ctrl-C stops the cluster)"
            if report.kept
            else "  (stopped with the demo; --keep leaves it running)"
        ),
        markup=False,
        highlight=False,
    )
    console.print(
        "result     "
        + ("ok: no failed request" if report.succeeded else "FAILED: see the lines above"),
        markup=False,
        highlight=False,
    )
