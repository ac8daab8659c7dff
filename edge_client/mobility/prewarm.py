"""Predictive pre-warm in the policy simulator (issue 14, item 3): what the broker's pre-warm
does, on the simulator's clock and cluster.

- Every report of a site (arrival, handover) feeds `migration.prediction.TransitionModel`. A
  standby held for the client at another site is released then: the prediction lapsed.
- Once the client's deployment is settled (served, no move in flight: after its arrival, a
  handover that moved nothing, a migration's switch), its most likely next site is asked for.
  Likely enough and with fewer than the budget's standbys held cluster-wide (asked before
  placing, as the broker does: a budget refusal costs no placement),
  `migration.policy.prewarm_verdict` weighs it (probability, the latency from its node to
  that site against the best node's there); when it says yes, a standby replica takes the
  best node for that site (real placement, class STANDBY, seeing deployments and other
  standbys: it preempts nothing) until the client gets there, or `ttl_s` passes, or a
  deployment takes any of its GPUs (placement of deployments does not see standbys: the
  simulator evicts those under what it chose).
- When the client reports that site, the simulator moves it to the standby's node if the
  move passes the hysteresis (no cooldown: it costs no start), without placing anew: a hit,
  ready after the switch alone. Otherwise the standby is released (declined) and today's
  policy decides.

At most one standby per client. Its GPU-seconds count GPUs held (a memory share holds one)
times the seconds from its placement to its release or claim.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from broker.placement import Candidate
from migration.policy import Hysteresis, PrewarmSettings, prewarm_verdict
from migration.prediction import TransitionModel

STANDBY_SUFFIX = "~standby"
"""A standby's allocation id is its client's id with this suffix (one per client)."""


class PrewarmHost(Protocol):
    """What the simulator offers the pre-warmer: latencies, placement, holds and a clock."""

    def latency_ms(self, site: str, node_id: str) -> float:
        """Network latency from a client at `site` to `node_id` (what the hysteresis weighs)."""
        ...

    def best_standby(self, client: str, site: str) -> Candidate | None:
        """Where a standby of `client`'s deployment for a client at `site` would go: `place`'s
        choice with class STANDBY (it fits as it is); None when nothing does."""
        ...

    def hold(self, client: str, candidate: Candidate, allocation: str) -> None:
        """Hold `candidate`'s GPUs for `client`'s standby, as class STANDBY."""
        ...

    def release(self, node_id: str, allocation: str) -> None: ...

    def alarm(self, client: str, t: float, token: int) -> None:
        """Call `MarkovPrewarmer.expire(client, t, token)` at `t`."""
        ...


@dataclass(frozen=True, slots=True)
class Standby:
    site: str
    node_id: str
    gpus: tuple[int, ...]
    since: float
    serial: int
    """Which standby (the count started before it): tells a stale alarm from a live one."""


class MarkovPrewarmer:
    """The pre-warm policy over one run (see the module docstring); counts what it did."""

    def __init__(
        self,
        settings: PrewarmSettings,
        hysteresis: Hysteresis,
        host: PrewarmHost,
        model: TransitionModel | None = None,
    ) -> None:
        if not settings.enabled:
            raise ValueError("pre-warm needs a standby budget of at least 1")
        self.settings = settings
        self.hysteresis = hysteresis
        self.host = host
        self.model = TransitionModel() if model is None else model
        self.held: dict[str, Standby] = {}
        self.started = self.hits = self.declined = self.lapsed = 0
        self.expired = self.preempted = 0
        self.refused_budget = self.refused_capacity = 0
        self.max_held = 0
        self.gpu_s = 0.0

    def report(self, client: str, t: float, site: str) -> None:
        """`client` reports `site` (arrival or handover), before any decision."""
        self.model.observe(client, site)
        standby = self.held.get(client)
        if standby is not None and standby.site != site:
            self._release(client, t)
            self.lapsed += 1

    def standby_for(self, client: str, site: str) -> Standby | None:
        """The standby `client` holds for `site`, if any."""
        standby = self.held.get(client)
        return standby if standby is not None and standby.site == site else None

    def claim(self, client: str, t: float) -> Standby:
        """The move to `client`'s standby is made: its hold ends here (the simulator holds the
        same GPUs for the move's target at once)."""
        self.hits += 1
        return self._release(client, t)

    def decline(self, client: str, t: float) -> None:
        """The client reached its standby's site, but a move there fails the hysteresis."""
        self._release(client, t)
        self.declined += 1

    def settled(self, client: str, t: float, site: str, node_id: str) -> None:
        """`client` is served at `site` by `node_id` with no move in flight: warm a standby
        at its likely next site if that pays and the budget has room."""
        assert client not in self.held, "every report releases or claims the standby"
        prediction = self.model.predict(client)
        # The verdict's first test and the budget, asked before paying for a placement.
        if prediction is None or prediction.probability < self.settings.min_probability:
            return
        if len(self.held) >= self.settings.budget:
            self.refused_budget += 1
            return
        candidate = self.host.best_standby(client, prediction.site)
        if candidate is None:
            self.refused_capacity += 1
            return
        current_ms = self.host.latency_ms(prediction.site, node_id)
        verdict = prewarm_verdict(
            prediction.probability,
            current_ms,
            candidate.latency_ms,
            self.hysteresis,
            self.settings,
        )
        if not verdict.move:
            return
        self.host.hold(client, candidate, client + STANDBY_SUFFIX)
        standby = Standby(prediction.site, candidate.node_id, candidate.gpus, t, self.started)
        self.held[client] = standby
        self.started += 1
        self.max_held = max(self.max_held, len(self.held))
        self.host.alarm(client, t + self.settings.ttl_s, standby.serial)

    def expire(self, client: str, t: float, token: int) -> None:
        """`client`'s standby number `token` reached its TTL (nothing if it is gone)."""
        standby = self.held.get(client)
        if standby is not None and standby.serial == token:
            self._release(client, t)
            self.expired += 1

    def preempt(self, allocations: Iterable[str], t: float) -> None:
        """A deployment took GPUs these standbys held: they are evicted."""
        for allocation in allocations:
            client = allocation.removesuffix(STANDBY_SUFFIX)
            assert client != allocation and client in self.held, f"{allocation} is no standby"
            self._release(client, t)
            self.preempted += 1

    def depart(self, client: str, t: float) -> None:
        """The client left: its standby goes, and the model forgets it (a vehicle that left
        never comes back; the broker keeps a client's history up to `max_clients`)."""
        if client in self.held:
            self._release(client, t)
            self.lapsed += 1
        self.model.forget(client)

    def _release(self, client: str, t: float) -> Standby:
        standby = self.held.pop(client)
        self.host.release(standby.node_id, client + STANDBY_SUFFIX)
        self.gpu_s += (t - standby.since) * len(standby.gpus)
        return standby
