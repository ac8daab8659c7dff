"""The node's resource manager: re-divides the node's CPU among its replicas while they run
(issue 13, DeepRes / FlowCon), from the telemetry's sample (`node_daemon.telemetry`).

It runs on the node, not in the broker: it decides from figures the node reads every
sampling interval (cgroup throttling, the runtime's latency and queue), and a resize is a
local `docker update` / cgroup write, so neither waits on the broker's round trip nor stops
when the broker is unreachable. It is stepped by the node's sampling loop
(`node_daemon.broker_link`), which samples at the broker's heartbeat interval: it starts once
the node has registered, and goes on while the broker is unreachable after that.

Only replicas started with a CPU limit (`cpus > 0`) are managed, each within its floor and
ceiling (`cpus_min`, `cpus_max` on the sample). The policies:

- `static`: never resizes (the baseline: every replica keeps the CPU it was started with).
- `usage` (DeepRes): each replica's demand is the CPU it used plus headroom (more headroom
  when its quota throttled it); when the node's cores cover every demand each gets its
  demand, else each gets its floor and the rest is shared out in proportion to its priority
  class's weight (critical 4, standard 2, best-effort 1, standby 0.5), no one over its
  demand.
- `gain` (FlowCon): every replica starts at its floor; the node's cores are handed out a
  step at a time to the replica whose measured marginal gain per core, weighted by
  priority, is highest: a throttled replica gains, more when its requests queue (latency
  well over compute time), less the closer it is to its ceiling; one that uses clearly
  less than its quota gains nothing past its use plus headroom, and so gives the rest back.

Hysteresis: a change under `min_change_cores` or `min_change_ratio` of the current quota is
not made; CPU is taken from a replica only once its last change is `shrink_after_s` old
(growing is immediate: a burst must be served now). A sample with `interval_s` 0 (the first)
changes nothing. `plan_cpus` is a pure function of the sample; `ResourceManager` adds the
history (the last change of each replica) and applies the plan.

Failure behaviour: a replica whose runtime cannot be resized (`Unsupported`, e.g. the
process runtime without a writable cgroup) is logged once and left alone from then on;
any other error of `apply` is logged and the change is tried again at the next step.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from node_daemon.errors import Unsupported
from node_daemon.runtimes.base import ResourceUpdateUnsupported

if TYPE_CHECKING:
    from node_daemon.telemetry import NodeSample, ReplicaSample

logger = logging.getLogger(__name__)

POLICIES = ("static", "usage", "gain")
PRIORITY_WEIGHTS = {3: 4.0, 2: 2.0, 1: 1.0, 0: 0.5}
"""Priority class (0 standby, 1 best-effort, 2 standard, 3 critical) -> its share weight."""
PRIORITY_NAMES = {3: "critical", 2: "standard", 1: "best-effort", 0: "standby"}
MAX_REASON = 512
IDLE_GAIN = 0.5
"""The `gain` policy's gain per core of headroom over what an unthrottled replica uses."""
EVENT_WINDOW = 32
"""How many resize events `ResourceManager.events` keeps (the heartbeat carries them)."""


@dataclass(frozen=True, slots=True)
class ResizeSettings:
    throttle_threshold: float = 0.1
    """A replica throttled in more than this share of the interval's periods wants more."""
    headroom_cores: float = 0.25
    """Demand over what a replica used (cores), so a quota is not cut to exactly its use."""
    throttled_factor: float = 1.5
    """A throttled replica's demand: at least this x what it used."""
    step_cores: float = 0.1
    """The `gain` policy hands out cores in steps of this."""
    min_change_cores: float = 0.1
    min_change_ratio: float = 0.1
    """No change smaller than `min_change_cores` or this share of the current quota."""
    shrink_after_s: float = 3.0
    """CPU is taken from a replica only once its last change is this old (seconds)."""


@dataclass(frozen=True, slots=True)
class ResizeEvent:
    event_id: str
    """Unique across daemon restarts: the manager's random run id and a sequence number."""
    replica_id: str
    deployment_id: str
    cpus_before: float
    """Cores."""
    cpus_after: float
    policy: str
    """"usage" or "gain"."""
    reason: str
    """For people; at most `MAX_REASON` characters, no control characters."""
    at: float
    """Unix seconds."""


def _finite(r: ReplicaSample) -> bool:
    figures = (r.cpus, r.cpus_min, r.cpus_max, r.cpu_limit, r.cpu_used_cores, r.throttled_ratio)
    return all(math.isfinite(x) for x in figures)


def _weight(priority: int) -> float:
    return PRIORITY_WEIGHTS.get(priority, 1.0)


def _current(r: ReplicaSample) -> float:
    """Its quota now (cores): the limit read from its cgroup, else what it started with."""
    return r.cpu_limit if r.cpu_limit > 0 else r.cpus


def _bounds(r: ReplicaSample, cores: float) -> tuple[float, float]:
    ceiling = min(r.cpus_max if r.cpus_max > 0 else cores, cores)
    floor = min(r.cpus_min if r.cpus_min > 0 else r.cpus / 2, ceiling)
    return floor, max(floor, ceiling)


def _throttled(r: ReplicaSample, settings: ResizeSettings) -> bool:
    return r.throttled_ratio > settings.throttle_threshold


def _demand(r: ReplicaSample, settings: ResizeSettings) -> float:
    """Cores it wants: what it used plus headroom; when its quota throttled it, at least
    `throttled_factor` x its use, up to one more x when its requests queue."""
    used = r.cpu_used_cores
    if _throttled(r, settings):
        factor = settings.throttled_factor + _queueing(r)
        return max(used * factor, used + settings.headroom_cores)
    return used + settings.headroom_cores


def _queueing(r: ReplicaSample) -> float:
    """0..1: how much its requests wait over their compute time (latency p50 / compute p50),
    with its queue length; 0 without request figures."""
    figures = r.requests
    if figures is None:
        return 0.0
    inflation = 0.0
    if figures.compute_p50_ms > 0 and figures.latency_p50_ms > 0:
        inflation = min(1.0, max(0.0, figures.latency_p50_ms / figures.compute_p50_ms - 1) / 3)
    return max(inflation, min(1.0, figures.queued / 4))


def _describe(r: ReplicaSample, settings: ResizeSettings, interval_s: float, why: str) -> str:
    """The event's reason: what was measured, the priority class, and the policy's why."""
    over = f"of the last {interval_s:.1f} s at {_current(r):.2f} cores"
    state = (
        f"throttled {r.throttled_ratio:.0%} {over}"
        if _throttled(r, settings)
        else f"used {r.cpu_used_cores:.2f} cores {over}"
    )
    text = f"{state}; {PRIORITY_NAMES.get(r.priority, 'standard')}; {why}"
    return "".join(c if c.isprintable() else " " for c in text)[:MAX_REASON]


def _water_fill(
    alloc: dict[str, float], cap: dict[str, float], weights: dict[str, float], left: float
) -> float:
    """Share `left` cores among `alloc` in proportion to `weights`, none over its `cap`; what
    one cannot take goes to the others. Updates `alloc`; returns what is left over."""
    open_ = {rid: w for rid, w in weights.items() if cap[rid] - alloc[rid] > 1e-9}
    while left > 1e-9 and open_:
        total = sum(open_.values())
        spent = 0.0
        for rid, w in list(open_.items()):
            give = min(left * w / total, cap[rid] - alloc[rid])
            alloc[rid] += give
            spent += give
            if cap[rid] - alloc[rid] <= 1e-9:
                del open_[rid]
        left -= spent
        if spent <= 1e-9:
            break
    return left


def _fit_usage(
    managed: Sequence[ReplicaSample], cores: float, settings: ResizeSettings
) -> dict[str, tuple[float, str]]:
    """`usage`: each its floor, then its demand shared by priority weight when the cores do
    not cover every demand; cores still left go to the throttled ones (by weight, up to
    their ceiling), so a busy node's CPU is not left idle."""
    bounds = {r.replica_id: _bounds(r, cores) for r in managed}
    demand = {
        r.replica_id: min(
            max(_demand(r, settings), bounds[r.replica_id][0]), bounds[r.replica_id][1]
        )
        for r in managed
    }
    weights = {r.replica_id: _weight(r.priority) for r in managed}
    alloc = {rid: lo for rid, (lo, _) in bounds.items()}
    left = _water_fill(alloc, demand, weights, cores - sum(alloc.values()))
    throttled = {r.replica_id: weights[r.replica_id] for r in managed if _throttled(r, settings)}
    _water_fill(alloc, {rid: hi for rid, (_, hi) in bounds.items()}, throttled, left)
    total = sum(demand.values())
    short = f", {total:.2f} asked of {cores:.2f}: shared by priority" if total > cores else ""
    return {
        r.replica_id: (
            alloc[r.replica_id],
            f"demand {demand[r.replica_id]:.2f} cores{short} (weight {_weight(r.priority):g})",
        )
        for r in managed
    }


def _fit_gain(
    managed: Sequence[ReplicaSample], cores: float, settings: ResizeSettings
) -> dict[str, tuple[float, str]]:
    """`gain`: floors first, then steps of `step_cores` to the highest weighted marginal
    gain per core: a throttled replica's is its throttled share (up to twice that when its
    requests queue), falling as it nears its ceiling; an unthrottled one's is full up to
    what it uses, `IDLE_GAIN` for its headroom, and nothing beyond."""
    bounds = {r.replica_id: _bounds(r, cores) for r in managed}
    alloc = {rid: lo for rid, (lo, _) in bounds.items()}
    # How far each can usefully grow: a throttled one up to its ceiling (with a gain that
    # falls as it nears it); one that is not, only to its use plus headroom.
    limit: dict[str, float] = {}
    pressure: dict[str, float] = {}
    for r in managed:
        lo, hi = bounds[r.replica_id]
        if _throttled(r, settings):
            limit[r.replica_id] = hi
            pressure[r.replica_id] = r.throttled_ratio * (1 + _queueing(r))
        else:
            limit[r.replica_id] = min(hi, max(lo, _demand(r, settings)))
            pressure[r.replica_id] = IDLE_GAIN
    left = cores - sum(alloc.values())
    step = max(settings.step_cores, 0.01)

    def gain(r: ReplicaSample) -> float:
        rid = r.replica_id
        if limit[rid] - alloc[rid] <= 1e-9:
            return 0.0
        if alloc[rid] < r.cpu_used_cores and not _throttled(r, settings):
            # Cores it uses now: taking them would throttle it, a full loss.
            return _weight(r.priority)
        hi = bounds[rid][1]
        return _weight(r.priority) * pressure[rid] * (1 - alloc[rid] / (hi + step))

    while left > 1e-9:
        best = max(managed, key=gain)
        g = gain(best)
        if g <= 0:
            break
        give = min(step, left, limit[best.replica_id] - alloc[best.replica_id])
        alloc[best.replica_id] += give
        left -= give
    return {
        r.replica_id: (
            alloc[r.replica_id],
            f"marginal gain {pressure[r.replica_id] * _weight(r.priority):.2f}/core "
            f"(weight {_weight(r.priority):g}, queueing {_queueing(r):.0%})",
        )
        for r in managed
    }


def _available(sample: NodeSample, fixed: Collection[str] = ()) -> float:
    """Cores for the managed replicas: the node's, less what the unmanaged ones used and the
    quotas of the `fixed` ones."""
    unmanaged = sum(r.cpu_used_cores for r in sample.replicas if r.cpus <= 0)
    held = sum(_current(r) for r in sample.replicas if r.cpus > 0 and r.replica_id in fixed)
    return max(0.0, sample.cpu_cores - unmanaged - held)


def plan_cpus(
    policy: str,
    sample: NodeSample,
    settings: ResizeSettings | None = None,
    fixed: Collection[str] = (),
) -> dict[str, tuple[float, str]]:
    """replica_id -> (new quota in cores, reason) for the managed replicas whose quota should
    change now; empty for `static`, for a first sample (`interval_s` 0), and when every change
    would be under the hysteresis threshold. The sum of the quotas it leaves stays within
    the node's cores (less what unmanaged replicas use) as long as the floors fit. Pure: no
    history (see `ResourceManager` for the shrink hold). The replicas named in `fixed` keep
    their quota (the manager's Unsupported ones). ValueError for an unknown policy."""
    settings = settings or ResizeSettings()
    if policy not in POLICIES:
        raise ValueError(f"unknown resize policy {policy[:32]!r}: one of {', '.join(POLICIES)}")
    if policy == "static" or sample.interval_s <= 0 or not math.isfinite(sample.cpu_cores):
        return {}
    # A replica with a figure that is not a number is left as it is, this time.
    fixed = {*fixed, *(r.replica_id for r in sample.replicas if not _finite(r))}
    managed = [r for r in sample.replicas if r.cpus > 0 and r.replica_id not in fixed]
    if not managed:
        return {}
    cores = _available(sample, fixed)
    fit = _fit_usage if policy == "usage" else _fit_gain
    targets = fit(managed, cores, settings)
    plan: dict[str, tuple[float, str]] = {}
    for r in managed:
        target, why = targets[r.replica_id]
        target = round(target, 2)
        now = _current(r)
        change = abs(target - now)
        if change < settings.min_change_cores or change < settings.min_change_ratio * now:
            continue
        plan[r.replica_id] = (target, why)
    # A grow let through beside a shrink held back by the threshold must not overcommit.
    after = {r.replica_id: plan.get(r.replica_id, (_current(r), ""))[0] for r in managed}
    over = sum(after.values()) - cores
    if over > 1e-6:
        for r in managed:
            target, why = targets[r.replica_id]
            if r.replica_id not in plan and target < _current(r):
                plan[r.replica_id] = (round(target, 2), why)
    by_id = {r.replica_id: r for r in managed}
    return {
        rid: (target, _describe(by_id[rid], settings, sample.interval_s, why))
        for rid, (target, why) in plan.items()
    }


class ResourceManager:
    """Applies a policy's plan at every sample and records what it changed. One per node;
    `step` is not re-entrant (the node calls it from its sampling loop)."""

    def __init__(
        self,
        policy: str,
        apply: Callable[[str, float], Awaitable[None]],
        settings: ResizeSettings | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`apply(replica_id, cores)` sets a replica's CPU quota (the node agent's
        `update_resources`); it raises `Unsupported` where its runtime cannot. ValueError for
        an unknown policy."""
        if policy not in POLICIES:
            raise ValueError(
                f"unknown resize policy {policy[:32]!r}: one of {', '.join(POLICIES)}"
            )
        self.policy = policy
        self.settings = settings or ResizeSettings()
        self._apply = apply
        self._clock = clock
        self._run_id = uuid.uuid4().hex[:12]
        self._sequence = 0
        self._events: deque[ResizeEvent] = deque(maxlen=EVENT_WINDOW)
        self._last_change: dict[str, float] = {}
        self._first_seen: dict[str, float] = {}
        self._unsupported: set[str] = set()

    async def step(self, sample: NodeSample) -> list[ResizeEvent]:
        """Decide from `sample`, apply, record; returns the changes made. Never raises for a
        replica's failed resize (logged; see the module docstring)."""
        now = self._clock()
        present = {r.replica_id for r in sample.replicas}
        for kept in (self._last_change, self._first_seen):
            for gone in set(kept) - present:
                del kept[gone]
        self._unsupported &= present
        for replica_id in present:
            self._first_seen.setdefault(replica_id, now)
        planned = plan_cpus(self.policy, sample, self.settings, fixed=self._unsupported)
        plan = self._hold(planned, sample, now)
        made: list[ResizeEvent] = []
        # Shrinks first: the quotas' sum never goes over the node's cores on the way.
        ordered = sorted(
            (r for r in sample.replicas if r.replica_id in plan),
            key=lambda r: plan[r.replica_id][0] - _current(r),
        )
        for r in ordered:
            cores, reason = plan[r.replica_id]
            before = _current(r)
            try:
                await self._apply(r.replica_id, cores)
            except (Unsupported, ResourceUpdateUnsupported) as err:
                self._unsupported.add(r.replica_id)
                logger.warning(
                    "replica=%s deployment=%s: not resizable, left alone from now on: %s",
                    r.replica_id,
                    r.deployment_id,
                    err,
                )
                continue
            # Any other failure (the replica stopped meanwhile, the engine did not answer):
            # the next step plans again from a fresh sample.
            except Exception as err:
                logger.error(
                    "replica=%s deployment=%s: resize %.2f -> %.2f cores failed (retried at the "
                    "next step): %r",
                    r.replica_id,
                    r.deployment_id,
                    before,
                    cores,
                    err,
                )
                continue
            self._sequence += 1
            event = ResizeEvent(
                event_id=f"{self._run_id}-{self._sequence}",
                replica_id=r.replica_id,
                deployment_id=r.deployment_id,
                cpus_before=round(before, 3),
                cpus_after=cores,
                policy=self.policy,
                reason=reason,
                at=now,
            )
            self._last_change[r.replica_id] = now
            self._events.append(event)
            made.append(event)
            logger.info(
                "replica=%s deployment=%s cpus %.2f -> %.2f (%s): %s",
                r.replica_id,
                r.deployment_id,
                before,
                cores,
                self.policy,
                reason,
            )
        return made

    def _hold(
        self, plan: dict[str, tuple[float, str]], sample: NodeSample, now: float
    ) -> dict[str, tuple[float, str]]:
        """The plan less what waits. A shrink waits while the replica's last change, or its
        first sample here (whose CPU figure reads 0: nothing to take a difference from), is
        under `shrink_after_s` old, unless a replica of the same or a higher priority class
        grows into those cores now; the replicas left alone (Unsupported) are dropped.
        Should the quotas still not fit the node's cores, the grows are cut to fit (one
        dropped when its cut leaves it under the hysteresis threshold)."""
        settings = self.settings
        kept = {rid: v for rid, v in plan.items() if rid not in self._unsupported}
        managed = [
            r for r in sample.replicas if r.cpus > 0 and r.replica_id not in self._unsupported
        ]
        cores = _available(sample, self._unsupported)

        def over(chosen: dict[str, tuple[float, str]]) -> float:
            return sum(chosen.get(r.replica_id, (_current(r), ""))[0] for r in managed) - cores

        held = set()
        for r in managed:
            if r.replica_id not in kept or kept[r.replica_id][0] >= _current(r):
                continue
            since = max(self._last_change.get(r.replica_id, 0.0), self._first_seen[r.replica_id])
            if now - since < settings.shrink_after_s:
                held.add(r.replica_id)
        waiting = {rid: v for rid, v in kept.items() if rid not in held}
        if held and over(waiting) > 1e-6:
            # Cores a replica of the same or a higher class asks for are not held from it.
            priority = {r.replica_id: r.priority for r in managed}
            growing = [
                priority[r.replica_id]
                for r in managed
                if r.replica_id in kept and kept[r.replica_id][0] > _current(r)
            ]
            top = max(growing, default=-1)
            waiting = {
                rid: v for rid, v in kept.items() if rid not in held or priority[rid] <= top
            }
        kept = waiting
        excess = over(kept)
        grows = {
            r.replica_id: kept[r.replica_id][0] - _current(r)
            for r in managed
            if r.replica_id in kept and kept[r.replica_id][0] > _current(r)
        }
        grown = sum(grows.values())
        if excess > 1e-6 and grown > 0:
            scale = max(0.0, 1 - excess / grown)
            for r in managed:
                if r.replica_id not in grows:
                    continue
                quota = _current(r)
                step = round(grows[r.replica_id] * scale, 2)
                if step < settings.min_change_cores or step < settings.min_change_ratio * quota:
                    del kept[r.replica_id]
                else:
                    kept[r.replica_id] = (round(quota + step, 2), kept[r.replica_id][1])
        return kept

    def events(self) -> list[ResizeEvent]:
        """The last `EVENT_WINDOW` changes, newest last."""
        return list(self._events)
