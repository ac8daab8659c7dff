"""Where each inference runs: on the remote replica or on the device's own model.

Pure bookkeeping over figures and times the caller passes in (monotonic seconds); no clock,
no I/O, so it is tested with explicit figures (as `edge_client.observer` is).

Policies (`Policy`):

- ``remote``: always the replica (the default without a local model).
- ``local``: always the local model.
- ``remote-then-local``: the replica while it answers; the local model only while it does
  not (a fallback), probing the replica again with backoff.

A probe of the replica while it is down, or while its estimate is over `RACE_ABOVE` times
the local model's (a slow link), races the local model (`Decision.local_reason`): the client
runs the request on both at once and answers with the first, and the other side's figure is
recorded when it comes, not counted as a request. A dead or slow link then costs the
application little when it is probed; a recovered one answers first. Little, not nothing: on
a device under a CPU quota the two runs share the CPU. The replica's request, serialized and
sent beside the local run, slows it (`bench.offload`, slow link: raced local answers a median
5 % slower than the local model alone, up to 17 % in a cell), so while a slow link stays
slow its raced probes space out, as every probe does (below). The local run in turn slows
the replica's request (its client-side work), which skews a close comparison
(`bench.offload`: a near tie's races took twice either side alone; a recovered link's raced
probes, slowed so, never beat a 1-CPU device), so a replica about as fast as the local
model, or faster, is probed alone; and a raced probe that finds the replica's figures stale
drops them without taking its own place: the probes that follow, alone, measure the
replica again. One race at a time: while a raced probe is out, a probe that falls due waits
(the winner serves) and a replica short of figures is not sent another. A probe of the
local model never races.
- ``fastest`` (the default with a local model): the side whose recent figures are lower. A
  figure is one request's latency as the client measured it: for the replica the whole round
  trip, transfer included; for the local model its compute time. Each side's estimate is the
  median of its last `AdaptiveSettings.window` (9) figures. The side that loses is still
  sent one request (a probe) every `probe_every` requests, or sooner once `probe_interval_s`
  has passed and at least `probe_min_requests` went to the winner since the last probe, so
  that a recovered link or an idle device is noticed. Time alone never makes a probe: a
  device that sends a request now and then would otherwise send each one to the losing side.
  Nor does cost: a probe that runs alone goes out only while its expected extra time (the
  loser's estimate minus the winner's) is at most `probe_cost_budget` (a tenth) of what the
  requests since the last probe took at the winner's estimate, so exploring costs the
  application at most about a tenth of its time: a loser k times slower is probed once per
  (k - 1) / `probe_cost_budget` requests (a 0.25-CPU device's CNN, 7x a LAN replica: once
  per 60, where one every 20 had added a third of the replica's latency on average). A raced
  probe costs the application little and goes out every `probe_every` requests, so a
  recovered link is seen as soon as before. While probes find the losing side as slow as
  before, they space out: the time rule's interval doubles at each such probe, up to
  `PROBE_BACKOFF_MAX` times `probe_interval_s`, and starts over when a probe beats the
  winner (or, for the replica, comes in under half its own figures) or the winner changes;
  the count rule (`probe_every`) is unchanged, so a changed side is seen within that many
  requests at worst. A probe of the local model costs more than its own time: under a CPU
  quota it spends the quota the next requests' client-side work (serializing the replica's
  request) needed (`bench.offload`, LAN, 0.5 CPU, runs 31-36: `fastest`'s replica requests
  right after a local probe a median 5 % slower than the replica alone, the others 1 %).
  A probe of the replica that beats the winner's
  estimate, or comes in under half the replica's own, replaces its older figures (they
  describe the link before it changed) and is followed by another at once, until the
  estimates agree which side is faster. A probe of the local model only adds its figure:
  under a CPU quota (a container's `--cpus`, a cgroup) a request after a pause runs on a
  refilled quota, several times faster than the same requests back to back (PP-OCR on a
  quarter CPU: 21-27 against about 100 ms in `bench.offload`), so one fast local figure says
  little about the next ones. The winner changes only when the other side is better by
  `margin` (hysteresis); the old winner is then probed again after `RECHECK_AFTER` requests
  (within the budget, like any probe), so that a short run of slow figures on one side
  (noise, not a changed link) costs a few requests rather than a probe period.

Reachability: a remote attempt that fails (unreachable, refused, past its deadline, no
endpoint) marks the replica down; while it is down every request goes to the local model
(policies other than ``remote``), and one request at a time probes the replica again after
a backoff that doubles from `retry_min_s` to `retry_max_s`. The first success ends it.

Each decision carries its reason (`Reason`); `OffloadChooser.summary` counts them per side.
"""

from __future__ import annotations

import enum
import statistics
from collections import Counter, deque
from dataclasses import dataclass

from edge_client.errors import InvalidInput

RECHECK_AFTER = 3
"""fastest: requests to the new winner before the old one is probed again."""
RACE_ABOVE = 2.0
"""A probe of a replica whose estimate is over this many times the local model's races the
local model (module docstring)."""
PROBE_BACKOFF_MAX = 8
"""fastest: the time rule's interval grows up to this many times
`AdaptiveSettings.probe_interval_s` while probes find the losing side as slow as before."""
STALE_BELOW = 0.5
"""fastest: a probe under this fraction of the losing side's own estimate means its figures
are stale (a slow link recovered) even when it does not beat the winner yet."""


class Policy(enum.StrEnum):
    REMOTE = "remote"
    LOCAL = "local"
    FASTEST = "fastest"
    REMOTE_THEN_LOCAL = "remote-then-local"


class Target(enum.StrEnum):
    REMOTE = "remote"
    """The deployment's replica."""
    LOCAL = "local"
    """The device's own model."""


class Reason(enum.StrEnum):
    POLICY = "policy"
    """The policy sends every request to this side (or to it while it answers)."""
    FASTER = "faster"
    """fastest: this side's estimate is the lower."""
    MEASURING = "measuring"
    """fastest: this side has too few figures yet (only before the first comparison)."""
    PROBE = "probe"
    """The losing side, occasionally, or the replica again after it failed."""
    REMOTE_DOWN = "remote-down"
    """The replica failed recently (or has no endpoint): local until the next probe."""
    FALLBACK = "fallback"
    """The replica failed this very request; it was served locally."""


@dataclass(frozen=True, slots=True)
class Decision:
    target: Target
    reason: Reason
    local_reason: Reason | None = None
    """Set on a probe of the replica that races the local model: the reason the local run
    counts under when its answer is the one the application gets. The caller runs both, and
    calls `race_over` once the replica's side has ended, whatever its outcome."""


@dataclass(frozen=True, slots=True)
class AdaptiveSettings:
    """How `fastest` and the reachability probes behave (module docstring)."""

    window: int = 9
    """Figures per side whose median is the side's estimate: a change shows after five
    (a majority), and a run of up to four slow figures (a CPU quota spent, a busy
    replica) does not turn it."""
    min_figures: int = 2
    """fastest measures each side this many times before comparing."""
    probe_every: int = 20
    """fastest: the losing side is probed after this many requests to the winner..."""
    probe_interval_s: float = 3.0
    """...or sooner once this long passed since the last probe..."""
    probe_min_requests: int = 5
    """...and at least this many requests went to the winner since; either way only while
    `probe_cost_budget` allows."""
    probe_cost_budget: float = 0.1
    """fastest: a probe that runs alone goes out only while its expected extra time (the
    loser's estimate minus the winner's) is at most this share of what the requests since
    the last probe took at the winner's estimate: a loser k times slower than the winner is
    probed at most once per (k - 1) / `probe_cost_budget` requests."""
    margin: float = 0.05
    """fastest: the other side must be better by this fraction to become the winner."""
    retry_min_s: float = 0.25
    """First wait before probing a replica that failed; doubles at each failed probe."""
    retry_max_s: float = 4.0
    probe_timeout_s: float = 2.0
    """Deadline of a probe of a replica that failed (a normal call has the client's)."""

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_figures <= self.window:
            raise InvalidInput("window must be >= 1 and min_figures within 1..window")
        if self.probe_every < 1 or not 1 <= self.probe_min_requests <= self.probe_every:
            raise InvalidInput("probe_every must be >= 1 and probe_min_requests in 1..probe_every")
        if not 0 <= self.margin < 1:
            raise InvalidInput("margin must be in [0, 1)")
        if not self.probe_cost_budget > 0:
            raise InvalidInput("probe_cost_budget must be > 0")
        times = (self.probe_interval_s, self.retry_min_s, self.retry_max_s, self.probe_timeout_s)
        if not all(t > 0 for t in times) or self.retry_min_s > self.retry_max_s:
            raise InvalidInput("probe and retry times must be > 0, retry_min_s <= retry_max_s")


@dataclass(frozen=True, slots=True)
class DecisionCount:
    target: Target
    reason: Reason
    requests: int


@dataclass(frozen=True, slots=True)
class OffloadStats:
    """Where the client's requests ran, and why, since it started."""

    policy: Policy
    local_model: str
    """The local model's file name; empty without one."""
    decisions: tuple[DecisionCount, ...]
    """Requests per (side, reason) that succeeded or were answered by the side (a request
    that fell back counts once, as local/fallback; a raced probe once, under the side whose
    answer the application got)."""
    remote_requests: int
    local_requests: int
    fallbacks: int
    """Requests the replica failed and the local model then served."""
    raced: int
    """Probes of the replica raced against the local model (each counted once in
    `decisions`, under the side whose answer came first)."""
    remote_estimate_ms: float | None
    """Median of the replica's recent round trips; None without figures."""
    local_estimate_ms: float | None
    remote_reachable: bool
    """False between a failed remote attempt and the next success."""
    preferred: Target
    """Where a request goes now, probes aside."""


def parse_policy(name: str | None, has_local: bool) -> Policy:
    """The policy called `name` (None: ``fastest`` with a local model, else ``remote``).
    InvalidInput for an unknown name, or a policy that needs a local model without one."""
    if name is None:
        return Policy.FASTEST if has_local else Policy.REMOTE
    try:
        policy = Policy(name)
    except ValueError:
        valid = ", ".join(p.value for p in Policy)
        raise InvalidInput(f"unknown offload policy {name[:40]!r}; use one of {valid}") from None
    if policy != Policy.REMOTE and not has_local:
        raise InvalidInput(f"offload policy {policy} needs a local model (local_model=PATH)")
    return policy


class OffloadChooser:
    """The decisions of one client. Not thread-safe: call it from the client's event loop."""

    def __init__(
        self, policy: Policy, settings: AdaptiveSettings | None = None, local_model: str = ""
    ) -> None:
        self.policy = policy
        self.settings = settings or AdaptiveSettings()
        self._local_model = local_model
        self._figures = {t: deque[float](maxlen=self.settings.window) for t in Target}
        self._winner = Target.REMOTE
        self._since_probe = 0
        self._last_probe_at: float | None = None
        self._confirm = False
        self._compared = False
        self._down = False
        self._retry_at = 0.0
        self._retry_wait_s = self.settings.retry_min_s
        self._down_probe_in_flight = False
        self._racing = False
        self._raced = 0
        self._probe_interval_s = self.settings.probe_interval_s
        self._counts: Counter[tuple[Target, Reason]] = Counter()
        self._fallbacks = 0

    @property
    def can_fall_back(self) -> bool:
        """Whether a failed remote attempt is served locally."""
        return self.policy in (Policy.FASTEST, Policy.REMOTE_THEN_LOCAL)

    def estimate(self, target: Target) -> float | None:
        """The median of `target`'s recent figures (seconds); None without figures."""
        figures = self._figures[target]
        return statistics.median(figures) if figures else None

    def choose(self, now: float) -> Decision:
        """Where the next request goes. A remote decision with reason PROBE while the replica
        is down must be followed by `remote_succeeded` or `remote_failed`."""
        if self.policy == Policy.REMOTE:
            return Decision(Target.REMOTE, Reason.POLICY)
        if self.policy == Policy.LOCAL:
            return Decision(Target.LOCAL, Reason.POLICY)
        if self._down:
            if now >= self._retry_at and not self._down_probe_in_flight and not self._racing:
                self._down_probe_in_flight = True
                return self._probe_remote(Reason.REMOTE_DOWN)
            return Decision(Target.LOCAL, Reason.REMOTE_DOWN)
        if self.policy == Policy.REMOTE_THEN_LOCAL:
            return Decision(Target.REMOTE, Reason.POLICY)
        for target in Target:
            if len(self._figures[target]) >= self.settings.min_figures:
                continue
            if not self._compared:
                return Decision(target, Reason.MEASURING)
            # Once compared, a side short of figures lost them to a probe that found them
            # stale (`_figure`): the request that refills them confirms that probe.
            if target == Target.LOCAL:
                return Decision(target, Reason.PROBE)
            if self._racing:
                return Decision(self._winner, Reason.FASTER)
            return self._probe_remote(Reason.FASTER)
        self._compared = True
        self._update_winner()
        loser = Target.LOCAL if self._winner == Target.REMOTE else Target.REMOTE
        self._since_probe += 1
        if self._last_probe_at is None:
            self._last_probe_at = now
        due = self._confirm or (
            (
                self._since_probe > self.settings.probe_every
                or (
                    self._since_probe > self.settings.probe_min_requests
                    and now - self._last_probe_at >= self._probe_interval_s
                )
            )
            and self._probe_affordable(loser)
        )
        if not due or (loser == Target.REMOTE and self._racing):
            return Decision(self._winner, Reason.FASTER)
        self._confirm = False
        self._since_probe = 0
        self._last_probe_at = now
        if loser == Target.REMOTE:
            return self._probe_remote(Reason.FASTER)
        return Decision(loser, Reason.PROBE)

    def _probe_remote(self, local_reason: Reason) -> Decision:
        """A probe of the replica: raced against the local model while the replica is down
        or far slower (`RACE_ABOVE`), alone otherwise."""
        if not (self._down or self._remote_slow()):
            return Decision(Target.REMOTE, Reason.PROBE)
        self._racing = True
        self._raced += 1
        return Decision(Target.REMOTE, Reason.PROBE, local_reason)

    def race_over(self) -> None:
        """The replica's side of a raced probe ended (answered, failed or abandoned)."""
        self._racing = False

    def _remote_slow(self) -> bool:
        """Whether the replica's estimate is over `RACE_ABOVE` times the local model's."""
        remote = self.estimate(Target.REMOTE)
        local = self.estimate(Target.LOCAL)
        return remote is not None and local is not None and remote > RACE_ABOVE * local

    def _probe_affordable(self, loser: Target) -> bool:
        """A raced probe costs the application nothing (the local model answers); one alone
        only while `probe_cost_budget` allows."""
        if loser == Target.REMOTE and self._remote_slow():
            return True
        winner = self.estimate(self._winner)
        losing = self.estimate(loser)
        assert winner is not None and losing is not None
        extra = losing - winner
        return extra <= self.settings.probe_cost_budget * self._since_probe * winner

    @property
    def probing_down_remote(self) -> bool:
        """Whether the replica is down and a probe of it is out now."""
        return self._down and self._down_probe_in_flight

    def remote_succeeded(self, decision: Decision, seconds: float, counted: bool = True) -> None:
        """The replica answered a request sent by `decision` in `seconds` (round trip);
        `counted` False: a raced probe whose other side answered the application first."""
        self._down = False
        self._down_probe_in_flight = False
        self._retry_wait_s = self.settings.retry_min_s
        self._figure(Target.REMOTE, seconds, raced=decision.local_reason is not None)
        if counted:
            self._counts[decision.target, decision.reason] += 1

    def remote_failed(self, now: float) -> None:
        """A remote attempt failed at `now` (unreachable, refused, deadline, no endpoint):
        the replica is down until a probe succeeds; the next probe waits a backoff."""
        if self._down and not self._down_probe_in_flight:
            return  # a request sent before it was known down: the backoff already runs
        if self._down:
            self._retry_wait_s = min(self.settings.retry_max_s, self._retry_wait_s * 2)
        self._down = True
        self._down_probe_in_flight = False
        self._retry_at = now + self._retry_wait_s

    def remote_abandoned(self) -> None:
        """A remote attempt ended with neither an answer nor a failure of the replica (the
        request's own error, a cancellation): a probe of a down replica may go out again."""
        if self._down:
            self._down_probe_in_flight = False

    def local_succeeded(self, decision: Decision, seconds: float, counted: bool = True) -> None:
        """The local model answered a request sent by `decision` (or by a fallback) in
        `seconds`; a fallback counts as local/fallback whatever `decision` said. `counted`
        False: the local side of a raced probe that the replica answered first."""
        if decision.target == Target.LOCAL and decision.reason == Reason.PROBE:
            winner = self.estimate(self._winner)
            beats = winner is not None and seconds < winner * (1 - self.settings.margin)
            self._space_probes(changed=beats)
        self._figure(Target.LOCAL, seconds)
        if not counted:
            return
        if decision.target == Target.REMOTE:
            self._fallbacks += 1
            self._counts[Target.LOCAL, Reason.FALLBACK] += 1
        else:
            self._counts[decision.target, decision.reason] += 1

    def _figure(self, target: Target, seconds: float, raced: bool = False) -> None:
        if self.policy != Policy.FASTEST or target in (self._winner, Target.LOCAL):
            self._figures[target].append(seconds)
            return
        winner = self.estimate(self._winner)
        own = self.estimate(target)
        # A probe of the replica that beats the winner, or one far below its own figures:
        # those figures are stale (the link changed); look again at once rather than a
        # period later.
        beats = winner is not None and seconds < winner * (1 - self.settings.margin)
        changed = own is not None and seconds < own * STALE_BELOW
        self._space_probes(changed=beats or changed)
        if (beats or changed) and not self._confirm:
            self._figures[target].clear()  # the first such probe; keep the next
            if raced:
                # Measured beside the local model, on the device's CPU: evidence that the
                # link changed, but a figure skewed by that run; the probes that follow
                # (alone) give the new figures.
                self._confirm = True
                return
        self._confirm = beats or changed
        self._figures[target].append(seconds)

    def _update_winner(self) -> None:
        remote = self.estimate(Target.REMOTE)
        local = self.estimate(Target.LOCAL)
        assert remote is not None and local is not None
        keep = 1 - self.settings.margin
        if self._winner == Target.REMOTE and local < remote * keep:
            self._winner = Target.LOCAL
        elif self._winner == Target.LOCAL and remote < local * keep:
            self._winner = Target.REMOTE
        else:
            return
        # A new winner: the old one is probed again after RECHECK_AFTER requests rather than
        # a whole period later, in case a short run of slow figures tipped the medians.
        self._confirm = False
        self._since_probe = max(0, self.settings.probe_every - RECHECK_AFTER)
        self._probe_interval_s = self.settings.probe_interval_s

    def _space_probes(self, changed: bool) -> None:
        """A probe of the losing side found it `changed` (the next one goes out on the
        time rule's first interval again) or as slow as before (twice the interval, up to
        `PROBE_BACKOFF_MAX` times the first; the count rule is unchanged)."""
        first = self.settings.probe_interval_s
        self._probe_interval_s = (
            first if changed else min(self._probe_interval_s * 2, PROBE_BACKOFF_MAX * first)
        )

    def summary(self) -> OffloadStats:
        remote = self.estimate(Target.REMOTE)
        local = self.estimate(Target.LOCAL)
        if self.policy == Policy.LOCAL or self._down:
            preferred = Target.LOCAL
        elif self.policy == Policy.FASTEST:
            preferred = self._winner
        else:
            preferred = Target.REMOTE
        return OffloadStats(
            policy=self.policy,
            local_model=self._local_model,
            decisions=tuple(
                DecisionCount(target, reason, n)
                for (target, reason), n in sorted(self._counts.items())
            ),
            remote_requests=sum(n for (t, _), n in self._counts.items() if t == Target.REMOTE),
            local_requests=sum(n for (t, _), n in self._counts.items() if t == Target.LOCAL),
            fallbacks=self._fallbacks,
            raced=self._raced,
            remote_estimate_ms=remote * 1000 if remote is not None else None,
            local_estimate_ms=local * 1000 if local is not None else None,
            remote_reachable=not self._down,
            preferred=preferred,
        )
