"""Speculative rebalancing (SpeCon): which deployment to move off a node that stays hot.

Pure and synchronous, like `migration.policy`: the broker builds plain views of its nodes and
of the deployments that could move (`NodeView`, `DeploymentView`, from its load history,
its records, the network and a placement dry run), with the moves it made lately and those
in flight, and `plan_rebalances` answers which moves to start now, each with its reason, or
why none (`RebalanceVerdict`, for logs and `offload explain`). It starts nothing itself.

Every time here is in seconds on one clock: `now`, the histories and the moves' times must
come from the same one.

When. A node is *hot* when its load has stayed at or above `hot_load` for `sustain_s`: the
trailing run of samples >= `hot_load` spans at least `sustain_s` (one sample under the
threshold restarts it). Samples taken before the end of the last move that touched the node
(as source or target) do not count: they describe the node with or without what moved, so
each move is judged on the figures it left behind (this, not only the cooldown, is what
keeps two rounds from moving twice for the same heat). A *target* is a ready node whose
load (the highest sample of the last `sustain_s`) is at most `target_max_load` and at least
`min_load_gap` under the source's, that no move touched in the last `sustain_s`, and that
no move in flight touches. Nodes a move in flight touches are no source either.

Which. For a deployment d on hot node S (load U_S, the mean of its hot run) and a target T
(load U_T), with `settings` weights w_*:

    score  = gain / cost                                   (higher is better)
    relief = c_d / C_S when both are known (CPU cores used by d, cores of S), else
             U_S * r_d / sum of r over S's deployments (its share of the request rate),
             else U_S / (deployments on S); at most U_S
    added  = c_d / C_T when relief is by CPU and C_T is known, else relief
                                                           (the load T takes on)
    gain   = U_S - max(U_S - relief, U_T + added)         (how much the hotter of the
                                                            two nodes cools)
    cost   = P[priority] + w_latency * max(0, L_T - L_S) / B
             + w_rate * r_d / (r_d + r_ref) + w_trend * (clamp(g_d, -0.5, 1) + 0.5)

    P      `priority_weights`, by class (0 standby, 1 best-effort, 2 standard, 3 critical):
           the lower the class, the cheaper its move
    L_T, L_S  network latency (ms) from d's client to T and to S (L_S unknown: 0)
    B      d's latency SLO (ms), or `latency_ref_ms` without one: added latency costs in
           proportion to the budget it eats
    r_d    d's request rate now (req/s, `rate_trend`): a busy deployment's switch disturbs
           more requests; saturates at 1 (r_ref = `rate_ref_per_s` gives 0.5)
    g_d    d's relative growth over the trend window (`rate_trend`): 0 for falling by half
           or more, 0.5 steady, 1.5 doubling or more. SpeCon moves slow-growing work off a
           busy node so that the fast-growing work there gets the room it will need

A move is a candidate only when the gain is at least `min_improvement`, T would stay under
`hot_load` (U_T + added < `hot_load`: no move makes a new hot node), the deployment fits on
T (the broker's dry run) and the move keeps d's SLO: L_T + its p99 latency (the measured
compute time; on a hot node it includes queueing, so this errs on the safe side) stays
within the SLO, or T is no farther from the client than S (the move cannot make it worse).
A deployment whose last move (whatever triggered it) ended less than `cooldown_s` ago is
not moved, so it is never moved back to the node it left within the cooldown either: after
a move its figures on the new node are too young to judge it anyway.

Candidates are taken best first: highest score, then lowest priority, then deployment id,
then target node id (so equal inputs give one answer whatever their order); each round moves
at most one deployment off each hot node, onto each target, up to `max_concurrent` minus
the rebalances in flight. The dry run (`DeploymentView.fits`) is asked last, in that order,
and only until the moves are chosen: it is the one test that may cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

PRIORITY_NAMES = {0: "standby", 1: "best-effort", 2: "standard", 3: "critical"}
"""Priority classes by number (`broker.placement.PriorityClass`, which this package must not
import)."""

_RATE_FLOOR_PER_S = 0.1
"""Growth is measured against at least this rate: below a tenth of a request a second, a
change is noise, not a trend."""
_LISTED = 5
"""Nodes named one by one in a reason; the rest are counted."""

Samples = tuple[tuple[float, float], ...]
"""(time s, value) pairs, oldest first."""


@dataclass(frozen=True, slots=True)
class RebalanceSettings:
    """The rebalancing policy's knobs (see the module docstring for how each is used)."""

    hot_load: float = 0.8
    """A node at or above this load (0..1) is hot once it stays there `sustain_s`."""
    sustain_s: float = 10.0
    """How long the heat must last; also how long a target's load must have stayed low and
    how long a node settles after a move touched it."""
    target_max_load: float = 0.5
    """A target's load over the last `sustain_s` must stay at or under this..."""
    min_load_gap: float = 0.2
    """...and at least this much under the source's."""
    min_improvement: float = 0.05
    """A move must cool the hotter of source and target by at least this much load."""
    cooldown_s: float = 120.0
    """A deployment that moved is not moved again (nor back) sooner than this."""
    max_concurrent: int = 1
    """Rebalances in flight at once, cluster-wide; 0 turns rebalancing off."""
    trend_window_s: float = 60.0
    """The request-rate history the trend and the current rate are fitted over."""
    priority_weights: tuple[float, float, float, float] = (1.0, 1.0, 2.0, 4.0)
    """P: the base cost of moving a deployment of class 0 (standby), 1 (best-effort),
    2 (standard), 3 (critical)."""
    latency_weight: float = 1.0
    """w_latency: cost of added network latency equal to the whole SLO."""
    rate_weight: float = 1.0
    """w_rate: cost of moving a deployment far busier than `rate_ref_per_s`."""
    trend_weight: float = 1.0
    """w_trend: cost per unit of the growth term (0 falling .. 1.5 doubling)."""
    rate_ref_per_s: float = 10.0
    """The request rate whose move costs half of `rate_weight`."""
    latency_ref_ms: float = 20.0
    """The latency budget added latency is measured against for a deployment without SLO."""

    def __post_init__(self) -> None:
        numbers = (
            self.hot_load,
            self.sustain_s,
            self.target_max_load,
            self.min_load_gap,
            self.min_improvement,
            self.cooldown_s,
            self.trend_window_s,
            self.latency_weight,
            self.rate_weight,
            self.trend_weight,
            self.rate_ref_per_s,
            self.latency_ref_ms,
            *self.priority_weights,
        )
        if not all(math.isfinite(x) for x in numbers):
            raise ValueError("rebalance settings must be finite numbers")
        if not 0 < self.hot_load <= 1 or not 0 <= self.target_max_load < self.hot_load:
            raise ValueError("rebalance: 0 < hot_load <= 1 and 0 <= target_max_load < hot_load")
        if min(self.sustain_s, self.min_load_gap, self.min_improvement, self.cooldown_s) < 0:
            raise ValueError(
                "rebalance: sustain_s, min_load_gap, min_improvement and cooldown_s >= 0"
            )
        if self.max_concurrent < 0:
            raise ValueError("rebalance: max_concurrent >= 0")
        if min(self.trend_window_s, self.rate_ref_per_s, self.latency_ref_ms) <= 0:
            raise ValueError("rebalance: trend_window_s, rate_ref_per_s and latency_ref_ms > 0")
        if min(self.latency_weight, self.rate_weight, self.trend_weight) < 0:
            raise ValueError("rebalance: the weights must not be negative")
        if len(self.priority_weights) != len(PRIORITY_NAMES) or min(self.priority_weights) <= 0:
            raise ValueError("rebalance: four priority_weights (classes 0..3), each > 0")

    @property
    def enabled(self) -> bool:
        return self.max_concurrent > 0


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the policy sees it. ValueError on a sample that is not finite or a load
    outside 0..1."""

    node_id: str
    site: str
    load_history: Sequence[tuple[float, float]]
    """(time s, load 0..1), any order (kept oldest first); the broker's recent samples, at
    least `sustain_s` of them for the node to be judged hot."""
    ready: bool = True
    """Registered, heartbeating and not draining: neither source nor target otherwise."""
    cpu_cores: float = 0.0
    """Cores the node offers to replicas; 0 when unknown (relief falls back to rate shares)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "load_history", _samples(self.load_history, f"node {self.node_id}")
        )
        if any(not 0 <= load <= 1 for _, load in self.load_history):
            raise ValueError(f"node {self.node_id[:64]}: a load outside 0..1")
        if not (math.isfinite(self.cpu_cores) and self.cpu_cores >= 0):
            raise ValueError(f"node {self.node_id[:64]}: cpu_cores must be >= 0")


@dataclass(frozen=True, slots=True)
class DeploymentView:
    """One running deployment that rebalancing may move (not one being moved or deleted, not
    a standby). ValueError on a figure that is not finite or out of range."""

    deployment_id: str
    node_id: str
    """The node it serves on now."""
    priority: int
    """Its class: 0 standby, 1 best-effort, 2 standard, 3 critical."""
    rate_history: Sequence[tuple[float, float]]
    """(time s, requests/s), any order (kept oldest first); only what it served on
    `node_id` should be in it."""
    latency_ms: Mapping[str, float]
    """Node id -> network latency (ms) from its client's site to that node, for its current
    node and the candidate targets; a node missing here is no target."""
    fits: Mapping[str, bool] | Callable[[str], bool]
    """Whether it fits on a node (the broker's placement dry run): a table (missing: no) or
    a function, called only for targets that passed every other test."""
    latency_slo_ms: float = 0.0
    """Its end-to-end latency SLO in ms; 0: none."""
    p99_ms: float = 0.0
    """Its replica's recent p99 latency (compute and queueing) in ms; 0: unknown."""
    cpu_used_cores: float = 0.0
    """CPU cores its replica uses now; 0: unknown."""

    def __post_init__(self) -> None:
        where = f"deployment {self.deployment_id[:64]}"
        object.__setattr__(self, "rate_history", _samples(self.rate_history, where))
        if any(rate < 0 for _, rate in self.rate_history):
            raise ValueError(f"{where}: a negative request rate")
        if self.priority not in PRIORITY_NAMES:
            raise ValueError(f"{where}: priority must be 0..3, not {self.priority!r:.20}")
        for name in ("latency_slo_ms", "p99_ms", "cpu_used_cores"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{where}: {name} must be >= 0, not {value!r:.20}")
        if not all(math.isfinite(ms) and ms >= 0 for ms in self.latency_ms.values()):
            raise ValueError(f"{where}: latencies must be >= 0 ms")
        object.__setattr__(self, "latency_ms", MappingProxyType(dict(self.latency_ms)))

    def fits_on(self, node_id: str) -> bool:
        if isinstance(self.fits, Mapping):
            return bool(self.fits.get(node_id, False))
        return bool(self.fits(node_id))


@dataclass(frozen=True, slots=True)
class MoveRecord:
    """A migration, of any trigger, as far as the policy cares."""

    deployment_id: str
    source_node: str
    target_node: str
    at: float
    """When it ended (a recent move) or started (one in flight), in seconds."""


@dataclass(frozen=True, slots=True)
class Trend:
    rate_per_s: float
    """The request rate now: the fitted line's value at the newest sample (less noisy than
    the newest sample alone); 0 without samples."""
    growth: float
    """Relative change over the window: slope x span / mean rate (0.5: up by half of its
    mean rate); 0 with fewer than two samples."""

    @property
    def label(self) -> str:
        if self.growth < -0.1:
            return "falling"
        if self.growth > 0.5:
            return "fast-growing"
        if self.growth > 0.1:
            return "growing"
        return "steady"


@dataclass(frozen=True, slots=True)
class Rebalance:
    """One move to start: the broker reserves it as a `rebalance` migration."""

    deployment_id: str
    source_node: str
    target_node: str
    reason: str
    """Why, in one sentence, for the migration record, logs and `offload explain`."""
    score: float
    """gain / cost (module docstring); higher is better."""


@dataclass(frozen=True, slots=True)
class RebalanceVerdict:
    moves: tuple[Rebalance, ...]
    """Best first; at most `max_concurrent` minus the rebalances in flight."""
    reason: str
    """What moved, or why nothing did, in one sentence."""
    hot_nodes: tuple[str, ...] = ()
    """Nodes hot (sustained) in this round, hottest first."""
    details: tuple[str, ...] = ()
    """One line per node or deployment considered: why it was or was not used."""

    def render(self) -> str:
        """The verdict as indented text, for `offload explain` and logs."""
        return "\n".join([self.reason, *(f"  {line}" for line in self.details)])


def rate_trend(history: Iterable[tuple[float, float]], now: float, window_s: float) -> Trend:
    """The request rate now and its growth, by least squares over the samples of the last
    `window_s` before `now`: a line through every sample is steadier than the newest one
    or the first against the last, and a burst of a sample or two moves it little."""
    points = [(t, r) for t, r in history if now - window_s <= t <= now]
    if not points:
        return Trend(0.0, 0.0)
    points.sort()
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_r = sum(r for _, r in points) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in points)
    if n < 2 or sxx == 0:
        return Trend(points[-1][1], 0.0)
    slope = sum((t - mean_t) * (r - mean_r) for t, r in points) / sxx
    span = points[-1][0] - points[0][0]
    rate = max(0.0, mean_r + slope * (points[-1][0] - mean_t))
    return Trend(rate, slope * span / max(mean_r, _RATE_FLOOR_PER_S))


@dataclass(frozen=True, slots=True)
class _Heat:
    load: float
    """Mean load over the trailing run at or above the threshold."""
    duration_s: float
    """How long that run spans."""


@dataclass(frozen=True, slots=True)
class _Candidate:
    deployment: DeploymentView
    target: str
    score: float
    reason: str

    @property
    def key(self) -> tuple[float, int, str, str]:
        return (-self.score, self.deployment.priority, self.deployment.deployment_id, self.target)


def plan_rebalances(
    nodes: Sequence[NodeView],
    deployments: Sequence[DeploymentView],
    settings: RebalanceSettings,
    now: float,
    recent: Sequence[MoveRecord] = (),
    in_flight: Sequence[MoveRecord] = (),
) -> RebalanceVerdict:
    """The rebalances to start now (see the module docstring), or why none.

    `recent`: the migrations (any trigger) that ended within the last `cooldown_s` (older
    ones are ignored); `in_flight`: the rebalances running now (each counts against
    `max_concurrent`; their nodes and deployment are left alone). Call it on a timer, every
    heartbeat interval or so: it only reads its arguments, and a round that starts nothing
    costs a pass over the hot nodes' deployments.
    """
    s = settings
    if not s.enabled:
        return RebalanceVerdict((), "rebalancing is off (max_concurrent 0)")
    busy = {m.source_node for m in in_flight} | {m.target_node for m in in_flight}
    moving = {m.deployment_id for m in in_flight}
    settled: dict[str, float] = {}
    """node id -> end of the last move that touched it."""
    last_move: dict[str, MoveRecord] = {}
    for move in recent:
        for node_id in (move.source_node, move.target_node):
            settled[node_id] = max(settled.get(node_id, -math.inf), move.at)
        previous = last_move.get(move.deployment_id)
        if previous is None or move.at > previous.at:
            last_move[move.deployment_id] = move

    details: list[str] = []
    hot: list[tuple[NodeView, _Heat]] = []
    for node in sorted(nodes, key=lambda n: n.node_id):
        heat = _heat(node, s.hot_load, settled.get(node.node_id, -math.inf))
        if heat is None:
            continue
        what = f"{node.node_id} load {heat.load:.2f} for {heat.duration_s:.0f} s"
        if heat.duration_s < s.sustain_s:
            details.append(f"{what}, not yet {s.sustain_s:g} s")
        elif not node.ready:
            details.append(f"{what}, but not ready: left alone")
        elif node.node_id in busy:
            details.append(f"{what}, but a rebalance in flight touches it: waiting")
        else:
            hot.append((node, heat))
    hot.sort(key=lambda nh: (-nh[1].load, nh[0].node_id))
    hot_ids = tuple(n.node_id for n, _ in hot)
    threshold = f"load >= {s.hot_load:.2f} for {s.sustain_s:g} s"
    if not hot:
        why = f"nothing moved: no node is hot ({threshold})"
        if details:
            why += f"; {_listed(details)}"
        return RebalanceVerdict((), why, (), tuple(details))
    heats = "; ".join(_heat_text(n, h) for n, h in hot)
    room = s.max_concurrent - len(in_flight)
    if room <= 0:
        return RebalanceVerdict(
            (),
            f"nothing moved: {heats}, but {len(in_flight)} rebalance(s) in flight "
            f"(cap {s.max_concurrent})",
            hot_ids,
            tuple(details),
        )

    targets: dict[str, tuple[NodeView, float]] = {}
    refused: list[str] = []
    for node in sorted(nodes, key=lambda n: n.node_id):
        if node.node_id in hot_ids:
            continue
        why, load = _target_state(node, s, now, settled, busy)
        if why:
            refused.append(f"{node.node_id} {why}")
        else:
            targets[node.node_id] = (node, load)
    if not targets:
        listed = _listed(refused)
        return RebalanceVerdict(
            (),
            f"nothing moved: {heats}, but no node has headroom (load <= "
            f"{s.target_max_load:.2f} for {s.sustain_s:g} s)" + (f": {listed}" if listed else ""),
            hot_ids,
            tuple(details),
        )
    details.append(
        "targets: "
        + ", ".join(f"{t} (load {load:.2f})" for t, (_, load) in targets.items())
        + (f"; not targets: {_listed(refused)}" if refused else "")
    )

    on_node: dict[str, list[DeploymentView]] = {}
    for deployment in deployments:
        on_node.setdefault(deployment.node_id, []).append(deployment)
    options: list[_Candidate] = []
    refusals: dict[str, list[str]] = {}
    """deployment id -> why each target was refused (the dry run's refusals come later)."""
    lines: dict[str, str] = {}
    """deployment id -> why it cannot move at all (cooldown, in flight)."""
    for node, heat in hot:
        here = on_node.get(node.node_id, [])
        trends = {d.deployment_id: rate_trend(d.rate_history, now, s.trend_window_s) for d in here}
        total_rate = sum(t.rate_per_s for t in trends.values())
        for deployment in here:
            did = deployment.deployment_id
            last = last_move.get(did)
            if did in moving:
                lines[did] = f"{did} on {node.node_id}: being moved"
            elif last is not None and now - last.at < s.cooldown_s:
                lines[did] = (
                    f"{did} on {node.node_id}: cooling down (moved {last.source_node} -> "
                    f"{last.target_node} {now - last.at:.0f} s ago; not moved again, nor back, "
                    f"within {s.cooldown_s:g} s)"
                )
            else:
                found, no = _options(
                    deployment, node, heat, trends[did], total_rate, len(here), targets, s
                )
                options.extend(found)
                refusals[did] = no

    # Best first; the dry run is asked only here, for the options reached.
    moves: list[Rebalance] = []
    used: set[str] = set()
    unfit: set[tuple[str, str]] = set()
    for option in sorted(options, key=lambda c: c.key):
        if len(moves) >= room:
            break
        d = option.deployment
        if {d.deployment_id, d.node_id, option.target} & used:
            continue
        if not d.fits_on(option.target):
            unfit.add((d.deployment_id, option.target))
            refusals[d.deployment_id].append(f"{option.target} does not fit")
            continue
        used |= {d.deployment_id, d.node_id, option.target}
        moves.append(
            Rebalance(d.deployment_id, d.node_id, option.target, option.reason, option.score)
        )
    chosen = {m.deployment_id: m for m in moves}
    open_options: dict[str, _Candidate] = {}
    """deployment id -> its best option the dry run did not refuse."""
    for option in sorted(options, key=lambda c: c.key):
        key = (option.deployment.deployment_id, option.target)
        if key not in unfit:
            open_options.setdefault(key[0], option)

    stuck: list[str] = []
    """Per hot node, why none of its deployments can move."""
    for node, heat in hot:
        node_lines = []
        for deployment in sorted(on_node.get(node.node_id, []), key=lambda d: d.deployment_id):
            did = deployment.deployment_id
            where = f"{did} on {node.node_id}"
            if did in lines:
                line = lines[did]
            elif did in chosen:
                line = (
                    f"{where}: moving to {chosen[did].target_node}, score {chosen[did].score:.3f}"
                )
            elif did in open_options:
                top = open_options[did]
                line = (
                    f"{where}: not chosen (its best option, {top.target}, scores "
                    f"{top.score:.3f}; a better move or the cap came first)"
                )
            else:
                line = f"{where}: no target: {_listed(refusals[did])}"
            node_lines.append(line)
        details.extend(node_lines)
        if not node_lines:
            stuck.append(f"{_heat_text(node, heat)}, but it runs nothing rebalancing may move")
        else:  # read only when nothing moved
            stuck.append(
                f"{_heat_text(node, heat)}, but no deployment on it can move: "
                + "; ".join(node_lines)
            )
    if not moves:
        return RebalanceVerdict((), "nothing moved: " + " | ".join(stuck), hot_ids, tuple(details))
    summary = "; ".join(f"{m.deployment_id} {m.source_node} -> {m.target_node}" for m in moves)
    return RebalanceVerdict(tuple(moves), f"rebalancing: {summary}", hot_ids, tuple(details))


def _heat_text(node: NodeView, heat: _Heat) -> str:
    return f"node {node.node_id} load {heat.load:.2f} for {heat.duration_s:.0f} s"


def _options(
    d: DeploymentView,
    source: NodeView,
    heat: _Heat,
    trend: Trend,
    total_rate: float,
    count: int,
    targets: Mapping[str, tuple[NodeView, float]],
    s: RebalanceSettings,
) -> tuple[list[_Candidate], list[str]]:
    """Every target `d` could move to off hot `source`, as far as can be told without the
    dry run, and why each other target is refused."""
    did = d.deployment_id
    if source.cpu_cores > 0 and d.cpu_used_cores > 0:
        relief = d.cpu_used_cores / source.cpu_cores
    elif total_rate > 0:
        relief = heat.load * trend.rate_per_s / total_rate
    else:
        relief = heat.load / count
    relief = min(relief, heat.load)
    current_ms = d.latency_ms.get(source.node_id)
    budget = d.latency_slo_ms or s.latency_ref_ms
    rate_cost = s.rate_weight * trend.rate_per_s / (trend.rate_per_s + s.rate_ref_per_s)
    trend_cost = s.trend_weight * (min(max(trend.growth, -0.5), 1.0) + 0.5)
    base_cost = s.priority_weights[d.priority] + rate_cost + trend_cost
    what = (
        f"{did} ({PRIORITY_NAMES[d.priority]}, {trend.rate_per_s:.1f} req/s, {trend.label}, "
        f"{relief:.2f} of the node's load)"
    )
    found: list[_Candidate] = []
    refusals: list[str] = []
    for target_id, (target, load) in targets.items():
        if load > heat.load - s.min_load_gap:
            refusals.append(f"{target_id} load {load:.2f} not {s.min_load_gap:.2f} under")
            continue
        target_ms = d.latency_ms.get(target_id)
        if target_ms is None:
            refusals.append(f"{target_id} client latency unknown")
            continue
        delta_ms = target_ms - (current_ms or 0.0)
        compute_ms = d.p99_ms
        total_ms = target_ms + compute_ms
        if d.latency_slo_ms and total_ms > d.latency_slo_ms and delta_ms > 0:
            refusals.append(
                f"{target_id} too far for its SLO ({target_ms:.1f} ms network + "
                f"{compute_ms:.1f} ms p99 = {total_ms:.1f} ms > {d.latency_slo_ms:g} ms)"
            )
            continue
        if target.cpu_cores > 0 and d.cpu_used_cores > 0 and source.cpu_cores > 0:
            added = d.cpu_used_cores / target.cpu_cores
        else:
            added = relief
        after = load + added
        if after >= s.hot_load:
            refusals.append(f"{target_id} would turn hot (load {load:.2f} -> {after:.2f})")
            continue
        gain = heat.load - max(heat.load - relief, after)
        if gain < s.min_improvement:
            refusals.append(
                f"{target_id} gains too little ({gain:.2f} < {s.min_improvement:.2f} load)"
            )
            continue
        cost = base_cost + s.latency_weight * max(0.0, delta_ms) / budget
        score = gain / cost
        slo = (
            f"SLO {d.latency_slo_ms:g} ms: {target_ms:.1f} ms network + {compute_ms:.1f} ms p99"
            if d.latency_slo_ms
            else "no SLO"
        )
        network = (
            f"{target_ms:.1f} ms network latency"
            if current_ms is None
            else f"{delta_ms:+.1f} ms network latency"
        )
        reason = (
            f"{_heat_text(source, heat)} (threshold {s.hot_load:.2f}); moving {what} to "
            f"{target_id} (load {load:.2f} -> {after:.2f}, {network}, {slo})"
        )
        found.append(_Candidate(d, target_id, score, reason))
    return found, refusals


def _heat(node: NodeView, hot_load: float, settled_at: float) -> _Heat | None:
    """The trailing run of samples at or above `hot_load` taken after `settled_at`; None
    when the newest sample is under it (or there is none)."""
    run: list[tuple[float, float]] = []
    for t, load in reversed(node.load_history):
        if load < hot_load or t <= settled_at:
            break
        run.append((t, load))
    if not run:
        return None
    return _Heat(sum(load for _, load in run) / len(run), run[0][0] - run[-1][0])


def _target_state(
    node: NodeView,
    s: RebalanceSettings,
    now: float,
    settled: Mapping[str, float],
    busy: set[str],
) -> tuple[str, float]:
    """("", load) for a node with headroom, its load the highest of the last `sustain_s`;
    (why not, 0) otherwise."""
    if not node.ready:
        return "not ready", 0.0
    if node.node_id in busy:
        return "touched by a rebalance in flight", 0.0
    settled_at = settled.get(node.node_id, -math.inf)
    if now - settled_at < s.sustain_s:
        return f"settling after a move {now - settled_at:.0f} s ago", 0.0
    if not node.load_history:
        return "reports no load", 0.0
    window = [load for t, load in node.load_history if t >= now - s.sustain_s]
    load = max([*window, node.load_history[-1][1]])
    if load > s.target_max_load:
        return f"load {load:.2f}", 0.0
    return "", load


def _samples(samples: Iterable[tuple[float, float]], where: str) -> Samples:
    points = tuple(sorted((float(t), float(v)) for t, v in samples))
    if not all(math.isfinite(t) and math.isfinite(v) for t, v in points):
        raise ValueError(f"{where[:80]}: samples must be finite numbers")
    return points


def _listed(items: Sequence[str]) -> str:
    shown = "; ".join(items[:_LISTED])
    return shown + (f"; {len(items) - _LISTED} more" if len(items) > _LISTED else "")
