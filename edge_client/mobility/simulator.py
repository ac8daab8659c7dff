"""Replay a mobility trace of many clients through the real placement and migration policy.

No containers and no broker process: a discrete-event simulation whose decisions are made by
the broker's own code. Each vehicle of the trace is a client with one deployment (1 GPU whole,
or a memory share of one for `share_fraction` of them; best-effort, so it preempts nothing and
nothing preempts it).

- It arrives at its first site: `broker.placement.place` on the cluster snapshot, committed
  (`ClusterSnapshot.commit`); nothing fits: a capacity refusal, and it stays unserved (its
  deployment pending) until a later handover finds room.
- At each handover, `today`'s policy decides as `broker.migrations.Migrations.
  _mobility_choice` does: the best node other than the current one (`place` on the snapshot
  without it), then `migration.policy.mobility_verdict` (hysteresis, cooldown since the end of
  the deployment's last migration). No other node fits: a capacity refusal (it stays). A
  deployment being moved skips the report (the broker's `if_idle`).
- A move holds the target's GPUs from the decision; the client is served by the old node until
  the target is ready (`CostModel.start_s`) and has switched (`switch_s`); the old replica
  keeps its GPUs while it drains (`drain_s`), and the migration ends (cooldown from then).
- It leaves at the end of its trace: everything it holds is released.

`never` does the same with no migration at all; the `oracle` is always at the nearest node
(the best latency any node could give its site, capacity and start time ignored): a bound, not
a policy. Latency, time-weighted over served time: the cell's access latency + the network
latency from the client's site to its replica's node (`EdgeNetwork.latency_ms`: shortest path
between the sites + the node's access). A migration is *wasted* when, from its switch until the
client's next switch or departure, the old node would have served it at least as well
(time-integrated latency), or when the client left before it switched.

Speed: `place` costs ~0.3 ms on 10,000 nodes, and a migration decision also needs the snapshot
without the current node. `_Rankings` keeps each (site, request shape)'s top candidates from one
real `place` and drops them exactly when a change could alter them: a change of a node among
them, or of a node whose latency alone does not exceed the worst of them (every score term is
>= 0, so such a node cannot enter the top). The best node other than the current one is then
the first of the top that is not it (`place` returns the same top as the brute force). With
`check_every` N, every Nth decision is also taken by `place` itself on the snapshot without the
current node, as the broker does, and must agree (AssertionError otherwise).

With pre-warm (issue 14, item 3), a third run is today's policy with standby replicas at
each client's predicted next site (`edge_client.mobility.prewarm`, with the settings'
budget, probability threshold and TTL), placed as the broker places them: class STANDBY, on
the whole cluster (deployments and other standbys), evicting nothing. A real placement
(arrival, pending retry, migration target) is decided as if no standby existed, and the
standbys on the chosen node holding any of the chosen GPUs are then evicted (the broker's
`_standbys_under`), so a standby never sends a deployment to a worse node. Hence two caches:
one over the snapshot without standbys for real requests, one over the whole snapshot for
standbys; a real allocation's commit and release go to both (to the second after the
evictions), a standby's to the whole one only. With `check_every`, both caches are checked against
`place`, and each real commit checks that the first's node is the second's without its
standbys. A client that reports the site of its standby moves to the standby's node when
the hysteresis allows it (cooldown not asked): a hit, serving after `switch_s` alone instead
of `start_s + switch_s`.

The independent runs (never-migrate, today's policy, with pre-warm) can go to worker
processes (`jobs`): each is deterministic from the same cluster and demand, so the figures
are those of a serial run.
"""

from __future__ import annotations

import enum
import heapq
import math
import multiprocessing
import random
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from broker.network import EdgeNetwork
from broker.placement import (
    Allocation,
    Candidate,
    ClusterSnapshot,
    NodeSnapshot,
    PlacementRequest,
    PriorityClass,
    Strategy,
    place,
)
from broker.placement.search import TOP_CANDIDATES
from edge_client.mobility.prewarm import MarkovPrewarmer
from edge_client.mobility.traces import MobilityTrace
from migration.policy import Hysteresis, PrewarmSettings, mobility_verdict

SHARE_MIB = 8192
"""The memory share of a shared-GPU client, MiB."""


@dataclass(frozen=True, slots=True)
class CostModel:
    """How long a make-before-break migration's steps take (docs/benchmarks-history.md, "Migration
    under load", make-before-break p50 server timeline)."""

    start_s: float = 0.95
    """Target started to ready: measured 0.89-0.97 s."""
    switch_s: float = 0.005
    """Placement update to the client's ack: measured 3-7 ms."""
    drain_s: float = 0.6
    """The old replica's 0.2 s straggler grace, then its drain (measured 0.34-0.46 s)."""

    def __post_init__(self) -> None:
        for name in ("start_s", "switch_s", "drain_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0 s, not {value}")


class Policy(enum.StrEnum):
    NEVER = "never-migrate"
    TODAY = "today's policy"


ORACLE = "nearest node (oracle)"


@dataclass(frozen=True, slots=True)
class SimOptions:
    hysteresis: Hysteresis = field(default_factory=Hysteresis)
    costs: CostModel = field(default_factory=CostModel)
    share_fraction: float = 0.25
    """Clients asking for a memory share of one GPU (`SHARE_MIB`) instead of a whole GPU."""
    fill: float = 0.0
    """GPUs held by other tenants before the clients arrive (0..0.99), placed by `place`."""
    seed: int = 1
    check_every: int = 0
    """Also take every Nth decision with `place` itself and compare (0: never)."""


# --- figures ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Figures:
    """One policy's results over the trace."""

    policy: str
    clients: int
    client_hours: float
    migrations: int
    wasted: int
    """Of `migrations` (see the module docstring)."""
    refused_deploy: int
    """Arrivals (and pending retries at handovers) nothing could take."""
    refused_move: int
    """Handovers at which no other node fits."""
    unserved_client_hours: float
    latency_mean_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    move_to_serving_s: float | None = None
    """Mean time from a move's decision (the client's handover) to its switch, when the client
    is served at the new node; None without moves."""
    prewarm_hit_rate: float | None = None
    """Of `migrations`, the share made to a standby (ready at once). None: no pre-warm."""
    prewarm_hits: int | None = None
    move_to_serving_hit_s: float | None = None
    move_to_serving_miss_s: float | None = None
    standby_gpu_s: float | None = None
    standbys_started: int | None = None
    standbys_preempted: int | None = None
    """Released because a deployment (arrival, pending retry or move) took GPUs it held."""
    standbys_lapsed: int | None = None
    """Released because the client reported another site, or left."""
    standbys_expired: int | None = None
    """Released at their TTL, the client not there yet."""
    standbys_declined: int | None = None
    """Reached, but the move to them failed the hysteresis."""
    standby_refused_budget: int | None = None
    standby_refused_capacity: int | None = None
    standbys_max_held: int | None = None
    decisions: int = 0
    """Placement answers asked for (arrivals and migration choices)."""
    place_calls: int = 0
    """Of which `place` actually ran (the rest came from `_Rankings`)."""
    wall_s: float = 0.0

    @property
    def migrations_per_client_hour(self) -> float:
        return self.migrations / self.client_hours if self.client_hours else 0.0


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The `q`-th percentile (0..100) of `values` weighted by `weights` (time): the smallest
    value with at least q % of the weight at or below it. NaN without weight."""
    total = float(weights.sum())
    if total <= 0:
        return math.nan
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    at = int(np.searchsorted(cumulative, q / 100 * total, side="left"))
    return float(values[order][min(at, len(values) - 1)])


# --- the exact placement cache ---------------------------------------------------------------


Shape = int
"""A request shape: 0 for one whole GPU, else the share in MiB of one GPU."""


@dataclass(slots=True)
class _Entry:
    top: tuple[Candidate, ...]
    """`place`'s top: the nodes that fit as they are (nothing below best-effort is in the
    snapshot of a best-effort cache, and a standby evicts nothing)."""
    ids: frozenset[str]
    worst: float
    """The worst top penalty; inf when the top is not full (any change may add to it)."""
    watched: tuple[str, ...]


class _Rankings:
    """The cluster snapshot with each (site, shape)'s top candidates for requests of class
    `priority` kept while they are exact (see the module docstring). Every change of the
    snapshot goes through `commit`/`release`."""

    def __init__(
        self,
        snapshot: ClusterSnapshot,
        network: EdgeNetwork,
        check_every: int,
        priority: PriorityClass = PriorityClass.BEST_EFFORT,
    ):
        self.snapshot = snapshot
        self.network = network
        self.check_every = check_every
        self.priority = priority
        self._entries: dict[tuple[str, Shape], _Entry] = {}
        self._watch: dict[str, set[tuple[str, Shape]]] = {}
        self._floor = network.min_access_ms
        self._site_of = {node.node_id: node.site for node in snapshot}
        self.decisions = 0
        self.place_calls = 0

    def request(self, deployment_id: str, site: str, shape: Shape) -> PlacementRequest:
        return PlacementRequest(
            deployment_id=deployment_id,
            site=site,
            gpus=1,
            gpu_memory_mib=shape,
            priority=self.priority,
            # Standbys spread, where packing deployments go last (as the broker's).
            strategy=Strategy.SPREAD if self.priority is PriorityClass.STANDBY else Strategy.PACK,
        )

    def top(self, site: str, shape: Shape) -> tuple[Candidate, ...]:
        key = (site, shape)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._compute(key)
        return entry.top

    def best(self, site: str, shape: Shape) -> Candidate | None:
        """`place`'s choice for a new deployment (or a standby) at `site`."""
        self.decisions += 1
        top = self.top(site, shape)
        chosen = top[0] if top else None
        if self.check_every and self.decisions % self.check_every == 0:
            decision = place(self.snapshot, self.request("check", site, shape), self.network)
            self._agree(decision.explanation.chosen, chosen, site, None)
        return chosen

    def best_other(self, site: str, shape: Shape, current: str) -> Candidate | None:
        """`place`'s choice on the snapshot without `current` (what a migration would take):
        the top holds every node that fits when it is not full, so none other fits when it
        holds only `current`."""
        self.decisions += 1
        top = self.top(site, shape)
        chosen = next((c for c in top if c.node_id != current), None)
        if self.check_every and self.decisions % self.check_every == 0:
            decision = place(
                self.snapshot.without_node(current),
                self.request("check", site, shape),
                self.network,
            )
            self._agree(decision.explanation.chosen, chosen, site, current)
        return chosen

    def commit(
        self,
        node_id: str,
        deployment_id: str,
        gpus: tuple[int, ...],
        shape: Shape,
        priority: PriorityClass = PriorityClass.BEST_EFFORT,
    ) -> None:
        node = self.snapshot.node(node_id)
        allocation = Allocation(deployment_id, priority, gpus, shape)
        self.snapshot = self.snapshot.with_node(node.with_allocation(allocation))
        self._changed(node_id)

    def release(self, node_id: str, deployment_id: str) -> None:
        self.snapshot = self.snapshot.release(node_id, deployment_id)
        self._changed(node_id)

    def _compute(self, key: tuple[str, Shape]) -> _Entry:
        site, shape = key
        self.place_calls += 1
        decision = place(self.snapshot, self.request("rank", site, shape), self.network)
        top = decision.explanation.top
        assert not decision.preempt, "nothing in a cache's snapshot is below its requests"
        worst = top[-1].score.total if len(top) == TOP_CANDIDATES else math.inf
        watched = tuple(
            other for d, other in self.network.nearest(site) if d + self._floor <= worst
        )
        entry = _Entry(top, frozenset(c.node_id for c in top), worst, watched)
        self._entries[key] = entry
        for other in watched:
            self._watch.setdefault(other, set()).add(key)
        return entry

    def _changed(self, node_id: str) -> None:
        site = self._site_of[node_id]
        watchers = self._watch.get(site)
        if not watchers:
            return
        access = self.network.access_ms(node_id)
        stale = []
        for key in watchers:
            entry = self._entries[key]
            if (
                node_id in entry.ids
                or self.network.distance_ms(key[0], site) + access <= entry.worst
            ):
                stale.append(key)
        for key in stale:
            entry = self._entries.pop(key)
            for other in entry.watched:
                self._watch[other].discard(key)

    @staticmethod
    def _agree(
        reference: Candidate | None, ours: Candidate | None, site: str, current: str | None
    ) -> None:
        def view(c: Candidate | None) -> object:
            return None if c is None else (c.node_id, c.gpus, c.latency_ms, c.preempt)

        if view(reference) != view(ours):
            raise AssertionError(
                f"cached ranking chose {view(ours)}, place chose {view(reference)} "
                f"for a client at {site} (current node {current})"
            )


# --- the simulation --------------------------------------------------------------------------


class _Client:
    __slots__ = (
        "alloc",
        "epoch",
        "eval_src",
        "eval_sum",
        "gone",
        "id",
        "index",
        "last_end",
        "moved_at",
        "node",
        "old",
        "seg_t",
        "shape",
        "site",
        "target",
        "target_alloc",
        "warm",
    )

    def __init__(self, index: int, client_id: str, shape: Shape) -> None:
        self.index = index
        self.id = client_id
        self.shape = shape
        self.site = ""
        self.node: str | None = None
        self.alloc = ""
        self.epoch = 0
        self.target: str | None = None
        self.target_alloc = ""
        self.moved_at = 0.0
        self.warm = False
        """The move in flight goes to a standby."""
        self.old: tuple[str, str] | None = None
        self.last_end: float | None = None
        self.seg_t = 0.0
        self.eval_src: str | None = None
        self.eval_sum = 0.0
        self.gone = False


_ARRIVE, _HANDOVER, _DEPART = 0, 1, 2
_READY, _DRAINED, _EXPIRE = 0, 1, 2


class _Run:
    """One policy over the whole trace; the `PrewarmHost` of its pre-warmer, if any."""

    def __init__(
        self,
        trace: MobilityTrace,
        network: EdgeNetwork,
        snapshot: ClusterSnapshot,
        shapes: Sequence[Shape],
        policy: Policy,
        options: SimOptions,
        prewarm: PrewarmSettings | None = None,
    ) -> None:
        self.trace = trace
        self.network = network
        self.rankings = _Rankings(snapshot, network, options.check_every)
        """Real requests' cache: the snapshot without standbys."""
        self.policy = policy
        self.options = options
        self.access = {site.name: site.access_ms for site in trace.sites}
        self.node_site = {node.node_id: node.site for node in snapshot}
        self.clients = [
            _Client(i, v.id, shape)
            for i, (v, shape) in enumerate(zip(trace.vehicles, shapes, strict=True))
        ]
        self.by_id = {c.id: c for c in self.clients}
        self.internal: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.lat: list[float] = []
        self.dur: list[float] = []
        self.unserved_s = 0.0
        self.migrations = self.wasted = self.refused_deploy = self.refused_move = 0
        self.move_s = [0.0, 0.0]
        """Decision to switch, summed over switched moves: [cold, warm]."""
        self.moves = [0, 0]
        self.prewarmer: MarkovPrewarmer | None = None
        self.standbys: _Rankings | None = None
        """Standbys' cache (with pre-warm): the whole snapshot, standbys included."""
        if prewarm is not None:
            self.prewarmer = MarkovPrewarmer(prewarm, options.hysteresis, self)
            self.standbys = _Rankings(
                snapshot, network, options.check_every, PriorityClass.STANDBY
            )

    # --- latency ------------------------------------------------------------------------

    def latency(self, site: str, node_id: str) -> float:
        return self.access[site] + self.network.latency_ms(site, self.node_site[node_id], node_id)

    def account(self, c: _Client, t: float) -> None:
        """Close the client's current segment at `t`."""
        dt = t - c.seg_t
        c.seg_t = t
        if dt <= 0:
            return
        if c.node is None:
            self.unserved_s += dt
            return
        latency = self.latency(c.site, c.node)
        self.lat.append(latency)
        self.dur.append(dt)
        if c.eval_src is not None:
            c.eval_sum += dt * (latency - self.latency(c.site, c.eval_src))

    def settle(self, c: _Client) -> None:
        """The last switched migration's tenure ends: was it wasted?"""
        if c.eval_src is not None and c.eval_sum >= 0:
            self.wasted += 1
        c.eval_src = None
        c.eval_sum = 0.0

    # --- events -------------------------------------------------------------------------

    def schedule(self, t: float, kind: int, c: int, token: int) -> None:
        self.seq += 1
        heapq.heappush(self.internal, (t, self.seq, kind, c, token))

    def run(self) -> Figures:
        started = time.perf_counter()
        events: list[tuple[float, int, int, str]] = []
        for i, vehicle in enumerate(self.trace.vehicles):
            events.append((vehicle.sites[0][0], i, _ARRIVE, vehicle.sites[0][1]))
            events.extend((t, i, _HANDOVER, site) for t, site in vehicle.sites[1:])
            events.append((vehicle.end_s, i, _DEPART, ""))
        events.sort(key=lambda e: (e[0], e[1], e[2]))
        internal = self.internal
        for t, i, kind, site in events:
            while internal and internal[0][0] <= t:
                it, _, ikind, ic, token = heapq.heappop(internal)
                self.on_internal(it, ikind, self.clients[ic], token)
            c = self.clients[i]
            if kind == _ARRIVE:
                self.arrive(c, t, site)
            elif kind == _HANDOVER:
                self.handover(c, i, t, site)
            else:
                self.depart(c, t)
        while internal:
            it, _, ikind, ic, token = heapq.heappop(internal)
            self.on_internal(it, ikind, self.clients[ic], token)
        return self.figures(time.perf_counter() - started)

    def take(
        self, node_id: str, allocation: str, gpus: tuple[int, ...], shape: Shape, t: float
    ) -> None:
        """Commit a real allocation. Its placement did not see the standbys: those on its
        GPUs are evicted first (a deployment never goes to a worse node for a standby)."""
        self.rankings.commit(node_id, allocation, gpus, shape)
        if self.standbys is None:
            return
        assert self.prewarmer is not None
        taken = set(gpus)
        self.prewarmer.preempt(
            [
                a.deployment_id
                for a in self.standbys.snapshot.node(node_id).allocations
                if a.priority is PriorityClass.STANDBY and not taken.isdisjoint(a.gpus)
            ],
            t,
        )
        self.standbys.commit(node_id, allocation, gpus, shape)
        if self.options.check_every:
            self._check_without_standbys(node_id)

    def free(self, node_id: str, allocation: str) -> None:
        """Release a real allocation."""
        self.rankings.release(node_id, allocation)
        if self.standbys is not None:
            self.standbys.release(node_id, allocation)

    def _check_without_standbys(self, node_id: str) -> None:
        """The real requests' snapshot holds the node as the whole one does without its
        standbys (AssertionError otherwise)."""
        assert self.standbys is not None
        whole = self.standbys.snapshot.node(node_id)
        expected = whole.without(
            a.deployment_id for a in whole.allocations if a.priority is PriorityClass.STANDBY
        )
        real = self.rankings.snapshot.node(node_id)
        if (real.free, real.shared_mib, set(real.allocations)) != (
            expected.free,
            expected.shared_mib,
            set(expected.allocations),
        ):
            raise AssertionError(f"node {node_id}: the real requests' snapshot drifted")

    def deploy(self, c: _Client, t: float) -> None:
        chosen = self.rankings.best(c.site, c.shape)
        if chosen is None:
            self.refused_deploy += 1
            return
        c.epoch += 1
        c.alloc = f"{c.id}@{c.epoch}"
        self.take(chosen.node_id, c.alloc, chosen.gpus, c.shape, t)
        c.node = chosen.node_id

    def arrive(self, c: _Client, t: float, site: str) -> None:
        c.site, c.seg_t = site, t
        if self.prewarmer is not None:
            self.prewarmer.report(c.id, t, site)
        self.deploy(c, t)
        self.settled(c, t)

    def handover(self, c: _Client, i: int, t: float, site: str) -> None:
        self.account(c, t)
        c.site = site
        if self.prewarmer is not None:
            self.prewarmer.report(c.id, t, site)
        if c.node is None:
            self.deploy(c, t)  # the broker's pending retry
        elif self.policy is Policy.NEVER or c.target is not None:
            return  # being moved: the broker skips the report (if_idle)
        else:
            self.mobility(c, i, t, site, c.node)
        self.settled(c, t)

    def mobility(self, c: _Client, i: int, t: float, site: str, current: str) -> None:
        """Today's decision for a served, idle client at `site`; its standby there first."""
        current_ms = self.latency_ms(site, current)
        hysteresis = self.options.hysteresis
        prewarmer = self.prewarmer
        if prewarmer is not None and (standby := prewarmer.standby_for(c.id, site)) is not None:
            standby_ms = self.latency_ms(site, standby.node_id)
            if mobility_verdict(current_ms, standby_ms, None, hysteresis).move:
                prewarmer.claim(c.id, t)
                self.move(c, i, t, standby.node_id, standby.gpus, warm=True)
                return
            prewarmer.decline(c.id, t)
        chosen = self.rankings.best_other(site, c.shape, current)
        if chosen is None:
            self.refused_move += 1
            return
        since = None if c.last_end is None else t - c.last_end
        if not mobility_verdict(current_ms, chosen.latency_ms, since, hysteresis).move:
            return
        self.move(c, i, t, chosen.node_id, chosen.gpus, warm=False)

    def move(
        self, c: _Client, i: int, t: float, target: str, gpus: tuple[int, ...], warm: bool
    ) -> None:
        """Start a make-before-break move to `target` (to a standby: no start)."""
        self.migrations += 1
        c.target = target
        c.target_alloc = f"{c.id}@{c.epoch + 1}"
        c.moved_at, c.warm = t, warm
        self.take(target, c.target_alloc, gpus, c.shape, t)
        costs = self.options.costs
        ready = t + (0.0 if warm else costs.start_s) + costs.switch_s
        self.schedule(ready, _READY, i, c.epoch + 1)

    def settled(self, c: _Client, t: float) -> None:
        """After an arrival, a handover or a switch: a served client with no move in flight
        may have a standby warmed for its next site."""
        if self.prewarmer is not None and c.node is not None and c.target is None:
            self.prewarmer.settled(c.id, t, c.site, c.node)

    def on_internal(self, t: float, kind: int, c: _Client, token: int) -> None:
        if kind == _EXPIRE:
            assert self.prewarmer is not None
            self.prewarmer.expire(c.id, t, token)
            return
        if kind == _DRAINED:
            if c.old is not None and not c.gone:
                self.free(*c.old)
                c.old = None
                c.last_end = t
            return
        if c.gone or c.target is None or token != c.epoch + 1:
            return
        self.account(c, t)
        self.settle(c)
        assert c.node is not None
        c.eval_src = c.node
        c.old = (c.node, c.alloc)
        c.node, c.alloc, c.epoch = c.target, c.target_alloc, c.epoch + 1
        c.target = None
        self.move_s[c.warm] += t - c.moved_at
        self.moves[c.warm] += 1
        self.schedule(t + self.options.costs.drain_s, _DRAINED, c.index, 0)
        self.settled(c, t)

    def depart(self, c: _Client, t: float) -> None:
        self.account(c, t)
        self.settle(c)
        c.gone = True
        if c.target is not None:
            self.wasted += 1  # it left before the move switched
            self.free(c.target, c.target_alloc)
            c.target = None
        if c.old is not None:
            self.free(*c.old)
            c.old = None
        if c.node is not None:
            self.free(c.node, c.alloc)
            c.node = None
        if self.prewarmer is not None:
            self.prewarmer.depart(c.id, t)

    # --- PrewarmHost --------------------------------------------------------------------

    def latency_ms(self, site: str, node_id: str) -> float:
        return self.network.latency_ms(site, self.node_site[node_id], node_id)

    def best_standby(self, client: str, site: str) -> Candidate | None:
        assert self.standbys is not None
        return self.standbys.best(site, self.by_id[client].shape)

    def hold(self, client: str, candidate: Candidate, allocation: str) -> None:
        assert self.standbys is not None
        shape = self.by_id[client].shape
        self.standbys.commit(
            candidate.node_id, allocation, candidate.gpus, shape, PriorityClass.STANDBY
        )

    def release(self, node_id: str, allocation: str) -> None:
        assert self.standbys is not None
        self.standbys.release(node_id, allocation)

    def alarm(self, client: str, t: float, token: int) -> None:
        self.schedule(t, _EXPIRE, self.by_id[client].index, token)

    # --- results ------------------------------------------------------------------------

    @property
    def caches(self) -> tuple[_Rankings, ...]:
        return (self.rankings,) if self.standbys is None else (self.rankings, self.standbys)

    def figures(self, wall_s: float) -> Figures:
        lat = np.array(self.lat)
        dur = np.array(self.dur)
        served_s = float(dur.sum())
        client_s = served_s + self.unserved_s

        def mean(total: float, n: int) -> float | None:
            return total / n if n else None

        figures = Figures(
            policy=str(self.policy),
            clients=len(self.clients),
            client_hours=client_s / 3600,
            migrations=self.migrations,
            wasted=self.wasted,
            refused_deploy=self.refused_deploy,
            refused_move=self.refused_move,
            unserved_client_hours=self.unserved_s / 3600,
            latency_mean_ms=float((lat * dur).sum() / served_s) if served_s else math.nan,
            latency_p50_ms=weighted_percentile(lat, dur, 50),
            latency_p99_ms=weighted_percentile(lat, dur, 99),
            move_to_serving_s=mean(sum(self.move_s), sum(self.moves)),
            decisions=sum(r.decisions for r in self.caches),
            place_calls=sum(r.place_calls for r in self.caches),
            wall_s=wall_s,
        )
        p = self.prewarmer
        if p is None:
            return figures
        return replace(
            figures,
            policy=f"{figures.policy} + pre-warm",
            prewarm_hit_rate=p.hits / self.migrations if self.migrations else 0.0,
            prewarm_hits=p.hits,
            move_to_serving_hit_s=mean(self.move_s[True], self.moves[True]),
            move_to_serving_miss_s=mean(self.move_s[False], self.moves[False]),
            standby_gpu_s=p.gpu_s,
            standbys_started=p.started,
            standbys_preempted=p.preempted,
            standbys_lapsed=p.lapsed,
            standbys_expired=p.expired,
            standbys_declined=p.declined,
            standby_refused_budget=p.refused_budget,
            standby_refused_capacity=p.refused_capacity,
            standbys_max_held=p.max_held,
        )


def oracle(trace: MobilityTrace, network: EdgeNetwork, nodes: Iterable[NodeSnapshot]) -> Figures:
    """Always at the best node for the site (see the module docstring)."""
    started = time.perf_counter()
    access: dict[str, float] = {}
    for node in nodes:
        a = network.access_ms(node.node_id)
        access[node.site] = min(a, access.get(node.site, math.inf))
    best = {
        site.name: site.access_ms
        + min(network.distance_ms(site.name, other) + a for other, a in access.items())
        for site in trace.sites
    }
    lat: list[float] = []
    dur: list[float] = []
    for vehicle in trace.vehicles:
        ends = [t for t, _ in vehicle.sites[1:]] + [vehicle.end_s]
        for (t, site), end in zip(vehicle.sites, ends, strict=True):
            lat.append(best[site])
            dur.append(end - t)
    lat_a, dur_a = np.array(lat), np.array(dur)
    served = float(dur_a.sum())
    return Figures(
        policy=ORACLE,
        clients=len(trace.vehicles),
        client_hours=served / 3600,
        migrations=0,
        wasted=0,
        refused_deploy=0,
        refused_move=0,
        unserved_client_hours=0.0,
        latency_mean_ms=float((lat_a * dur_a).sum() / served) if served else math.nan,
        latency_p50_ms=weighted_percentile(lat_a, dur_a, 50),
        latency_p99_ms=weighted_percentile(lat_a, dur_a, 99),
        wall_s=time.perf_counter() - started,
    )


def fill_cluster(
    snapshot: ClusterSnapshot, network: EdgeNetwork, fill: float, seed: int
) -> ClusterSnapshot:
    """`snapshot` with other tenants holding about `fill` of its GPUs: requests of 1, 2, 4 or
    8 GPUs (weights 4:3:2:1) at random sites, placed by `place` until that much is held or
    nothing more fits."""
    if not 0 <= fill < 1:
        raise ValueError(f"fill must be in [0, 1), not {fill}")
    total = sum(node.gpu_count for node in snapshot)
    rng = random.Random(seed)
    sites = network.sites
    held = 0
    n = 0
    failures = 0
    while held < fill * total and failures < 50:
        n += 1
        gpus = rng.choices([1, 2, 4, 8], [4, 3, 2, 1])[0]
        request = PlacementRequest(
            f"tenant-{n}", rng.choice(sites), gpus, priority=PriorityClass.BEST_EFFORT
        )
        decision = place(snapshot, request, network)
        if decision.node_id is None:
            failures += 1
            continue
        snapshot = snapshot.commit(request, decision)
        held += gpus
    return snapshot


def shapes_for(trace: MobilityTrace, share_fraction: float, seed: int) -> list[Shape]:
    """Each client's request shape, seeded."""
    rng = random.Random(seed)
    return [SHARE_MIB if rng.random() < share_fraction else 0 for _ in trace.vehicles]


@dataclass(frozen=True, slots=True)
class _Start:
    """What every policy run starts from: the same filled cluster and the same demand. Worker
    processes are forked with it (its snapshot and network hold mappings that do not pickle,
    and a fork copies nothing up front)."""

    trace: MobilityTrace
    network: EdgeNetwork
    snapshot: ClusterSnapshot
    shapes: tuple[Shape, ...]
    options: SimOptions

    def run(self, policy: Policy, prewarm: PrewarmSettings | None) -> Figures:
        return _Run(
            self.trace, self.network, self.snapshot, self.shapes, policy, self.options, prewarm
        ).run()


_worker_start: _Start | None = None
"""A worker process's `_Start`, set once by `_init_worker` rather than sent with each run."""


def _init_worker(start: _Start) -> None:
    global _worker_start
    _worker_start = start


def _run_in_worker(policy: Policy, prewarm: PrewarmSettings | None) -> Figures:
    assert _worker_start is not None, "_init_worker runs first"
    return _worker_start.run(policy, prewarm)


def simulate(
    trace: MobilityTrace,
    network: EdgeNetwork,
    nodes: Sequence[NodeSnapshot],
    options: SimOptions,
    prewarm: PrewarmSettings | None = None,
    jobs: int = 1,
) -> list[Figures]:
    """Never-migrate, today's policy, today's policy with pre-warm (when `prewarm` is given
    with a budget) and the oracle, each over the whole trace from the same cluster.
    Deterministic for the options' seed; with `jobs` > 1, the policy runs go to that many
    worker processes (at most one per run) and give the same figures."""
    if not 0 <= options.share_fraction <= 1:
        raise ValueError("share_fraction must be in [0, 1]")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")
    snapshot = fill_cluster(ClusterSnapshot.of(nodes), network, options.fill, options.seed)
    shapes = tuple(shapes_for(trace, options.share_fraction, options.seed))
    start = _Start(trace, network, snapshot, shapes, options)
    runs: list[tuple[Policy, PrewarmSettings | None]] = [
        (Policy.NEVER, None),
        (Policy.TODAY, None),
    ]
    if prewarm is not None and prewarm.enabled:
        runs.append((Policy.TODAY, prewarm))
    if jobs == 1:
        results = [start.run(*r) for r in runs]
    else:
        with ProcessPoolExecutor(
            min(jobs, len(runs)),
            mp_context=multiprocessing.get_context("fork"),
            initializer=_init_worker,
            initargs=(start,),
        ) as pool:
            # The longest runs first (pre-warm, today's), so the short one fills in after.
            futures = [pool.submit(_run_in_worker, *r) for r in reversed(runs)]
            results = [f.result() for f in reversed(futures)]
    results.append(oracle(trace, network, nodes))
    return results


def render(results: Sequence[Figures]) -> str:
    """The table: one column per policy."""
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cells: Iterable[str]) -> None:
        rows.append((label, list(cells)))

    def fmt(value: float | None, spec: str) -> str:
        return (
            "-"
            if value is None or (isinstance(value, float) and math.isnan(value))
            else format(value, spec)
        )

    row("clients", (f"{r.clients:,}" for r in results))
    row("client-hours", (f"{r.client_hours:,.1f}" for r in results))
    row("migrations", (f"{r.migrations:,}" for r in results))
    row("migrations per client-hour", (f"{r.migrations_per_client_hour:.2f}" for r in results))
    row("wasted migrations", (f"{r.wasted:,}" for r in results))
    row("latency mean, ms", (fmt(r.latency_mean_ms, ".2f") for r in results))
    row("latency p50, ms", (fmt(r.latency_p50_ms, ".2f") for r in results))
    row("latency p99, ms", (fmt(r.latency_p99_ms, ".2f") for r in results))
    named = {r.policy: r for r in results}
    never, oracle_ = named.get(Policy.NEVER), named.get(ORACLE)
    if never is not None:
        saved = (never.latency_mean_ms - r.latency_mean_ms for r in results)
        row("latency saved vs never-migrate, ms", (fmt(v, ".2f") for v in saved))
    if oracle_ is not None:
        over = (r.latency_mean_ms - oracle_.latency_mean_ms for r in results)
        row("latency over the oracle, ms", (fmt(v, ".2f") for v in over))
    row("move: handover to serving, mean s", (fmt(r.move_to_serving_s, ".3f") for r in results))
    row("capacity refusals: deploy", (f"{r.refused_deploy:,}" for r in results))
    row("capacity refusals: move", (f"{r.refused_move:,}" for r in results))
    row("unserved client-hours", (f"{r.unserved_client_hours:,.2f}" for r in results))
    row("pre-warm hit rate", (fmt(r.prewarm_hit_rate, ".1%") for r in results))
    row("pre-warm hits", (fmt(r.prewarm_hits, ",") for r in results))
    row("standbys started", (fmt(r.standbys_started, ",") for r in results))
    row("standbys preempted", (fmt(r.standbys_preempted, ",") for r in results))
    row("standbys lapsed (client elsewhere)", (fmt(r.standbys_lapsed, ",") for r in results))
    row("standbys expired (TTL)", (fmt(r.standbys_expired, ",") for r in results))
    row("standbys declined (hysteresis)", (fmt(r.standbys_declined, ",") for r in results))
    row("standby refusals: budget", (fmt(r.standby_refused_budget, ",") for r in results))
    row("standby refusals: capacity", (fmt(r.standby_refused_capacity, ",") for r in results))
    row("standbys held at most", (fmt(r.standbys_max_held, ",") for r in results))
    row("standby GPU-seconds", (fmt(r.standby_gpu_s, ",.0f") for r in results))
    row("placement answers (place run)", (f"{r.decisions:,} ({r.place_calls:,})" for r in results))
    row("wall time, s", (f"{r.wall_s:.1f}" for r in results))
    width = max(16, *(len(r.policy) for r in results)) + 2
    label_w = max(len(label) for label, _ in rows) + 2
    lines = [" " * label_w + "".join(r.policy.rjust(width) for r in results)]
    lines += [
        label.ljust(label_w) + "".join(c.rjust(width) for c in cells) for label, cells in rows
    ]
    return "\n".join(lines)
