"""Offload decisions from explicit figures and times (`edge_client.adaptive`)."""

from __future__ import annotations

import itertools

import pytest

from edge_client.adaptive import (
    RECHECK_AFTER,
    AdaptiveSettings,
    Decision,
    DecisionCount,
    OffloadChooser,
    Policy,
    Reason,
    Target,
    parse_policy,
)
from edge_client.errors import InvalidInput

REMOTE, LOCAL = Target.REMOTE, Target.LOCAL
RACED = Decision(REMOTE, Reason.PROBE, local_reason=Reason.FASTER)
"""A probe of the losing replica, raced against the local model."""
TIPPING = AdaptiveSettings().window // 2 + 1
"""Slow figures in a row that turn a side's median."""


def test_policy_names_defaults_and_the_ones_that_need_a_local_model() -> None:
    assert parse_policy(None, has_local=False) == Policy.REMOTE
    assert parse_policy(None, has_local=True) == Policy.FASTEST
    assert parse_policy("remote-then-local", has_local=True) == Policy.REMOTE_THEN_LOCAL
    assert parse_policy("remote", has_local=False) == Policy.REMOTE
    with pytest.raises(InvalidInput, match="unknown offload policy 'quickest'; use one of remote"):
        parse_policy("quickest", has_local=True)
    for name in ("local", "fastest", "remote-then-local"):
        with pytest.raises(InvalidInput, match="needs a local model"):
            parse_policy(name, has_local=False)


def test_settings_out_of_range_are_refused() -> None:
    for bad in (
        {"window": 0},
        {"min_figures": AdaptiveSettings().window + 1},
        {"probe_every": 0},
        {"margin": 1.0},
        {"retry_min_s": 5.0, "retry_max_s": 1.0},
        {"probe_timeout_s": 0.0},
        {"probe_cost_budget": 0.0},
    ):
        with pytest.raises(InvalidInput):
            AdaptiveSettings(**bad)  # type: ignore[arg-type]


class Run:
    """Drives a chooser as the client does: choose, then report the side's figure."""

    def __init__(self, policy: Policy, **settings: float) -> None:
        self.chooser = OffloadChooser(policy, AdaptiveSettings(**settings))  # type: ignore[arg-type]
        self.now = 0.0

    def request(self, remote_s: float | None, local_s: float) -> Decision:
        """One request; `remote_s` None: the replica fails it (and it falls back when the
        policy allows)."""
        decision = self.chooser.choose(self.now)
        if decision.local_reason is not None:
            return self.race(decision, decision.local_reason, remote_s, local_s)
        if decision.target == REMOTE:
            if remote_s is not None:
                self.chooser.remote_succeeded(decision, remote_s)
                self.now += remote_s
                return decision
            self.chooser.remote_failed(self.now)
            if not self.chooser.can_fall_back:
                return decision
        self.chooser.local_succeeded(decision, local_s)
        self.now += local_s
        return decision

    def race(
        self, decision: Decision, local_reason: Reason, remote_s: float | None, local_s: float
    ) -> Decision:
        """A raced probe: both sides run; the first answer is the application's."""
        remote_first = remote_s is not None and remote_s < local_s
        if remote_s is None:
            self.chooser.remote_failed(self.now)
        else:
            self.chooser.remote_succeeded(decision, remote_s, counted=remote_first)
        self.chooser.local_succeeded(Decision(LOCAL, local_reason), local_s, not remote_first)
        self.chooser.race_over()
        self.now += remote_s if remote_s is not None and remote_first else local_s
        return decision

    def requests(self, n: int, remote_s: float | None, local_s: float) -> list[Decision]:
        return [self.request(remote_s, local_s) for _ in range(n)]


def test_remote_and_local_policies_never_choose_the_other_side() -> None:
    remote = Run(Policy.REMOTE)
    assert {d for d in remote.requests(30, 0.5, 0.001)} == {Decision(REMOTE, Reason.POLICY)}
    local = Run(Policy.LOCAL)
    assert {d for d in local.requests(30, 0.001, 0.5)} == {Decision(LOCAL, Reason.POLICY)}
    assert local.chooser.summary().decisions == (DecisionCount(LOCAL, Reason.POLICY, 30),)


def test_fastest_measures_both_sides_then_takes_the_faster_and_probes_the_other_rarely() -> None:
    run = Run(Policy.FASTEST, probe_every=10, probe_interval_s=1000)
    first = run.requests(4, 0.030, 0.045)
    assert [(d.target, d.reason) for d in first] == [
        (REMOTE, Reason.MEASURING),
        (REMOTE, Reason.MEASURING),
        (LOCAL, Reason.MEASURING),
        (LOCAL, Reason.MEASURING),
    ]
    steady = run.requests(55, 0.030, 0.045)
    probes = [i for i, d in enumerate(steady) if d.reason == Reason.PROBE]
    assert probes == [10, 21, 32, 43, 54]
    assert all(steady[i].target == LOCAL for i in probes)
    assert all(
        d == Decision(REMOTE, Reason.FASTER) for i, d in enumerate(steady) if i not in probes
    )
    stats = run.chooser.summary()
    assert stats.preferred == REMOTE
    assert (stats.remote_estimate_ms, stats.local_estimate_ms) == (
        pytest.approx(30),
        pytest.approx(45),
    )


def test_only_the_first_figures_of_a_side_are_measuring() -> None:
    """The first round trips are slow (a channel being connected), so the local side wins; a
    probe far below them drops them, and the request that refills the replica's figures
    confirms that probe: it is a probe, not a second measurement."""
    run = Run(Policy.FASTEST, probe_every=5, probe_interval_s=1000)
    assert [d.reason for d in run.requests(2, 0.500, 0.100)] == [Reason.MEASURING] * 2
    assert [d.reason for d in run.requests(2, 0.030, 0.100)] == [Reason.MEASURING] * 2
    decisions = run.requests(10, 0.030, 0.100)
    assert decisions[0] == Decision(LOCAL, Reason.FASTER)
    remote = [d for d in decisions if d.target == REMOTE]
    # The replica's stale figures are 5x the local model's: the probe races it; its fast
    # answer replaces them, so the confirming probe goes alone.
    assert remote[:3] == [RACED] + [Decision(REMOTE, Reason.PROBE)] * 2
    assert Decision(REMOTE, Reason.FASTER) in remote
    counts = {(c.target, c.reason): c.requests for c in run.chooser.summary().decisions}
    assert counts[REMOTE, Reason.MEASURING] == counts[LOCAL, Reason.MEASURING] == 2


def test_fastest_probes_after_an_interval_even_when_requests_are_few() -> None:
    run = Run(Policy.FASTEST, probe_every=1000, probe_interval_s=1.0)
    run.requests(4, 0.030, 0.045)
    steady = run.requests(40, 0.030, 0.045)
    # 1 s at 30 ms a request, counted from the first comparison: one probe, after 34.
    probes = [i for i, d in enumerate(steady) if d.reason == Reason.PROBE]
    assert probes == [34]


def sparse_probes(local_s: float, n: int = 42) -> list[int]:
    """A device that sends a request every 10 s (the interval has always passed), the replica
    answering in 30 ms and the local model in `local_s`: which requests probe the local side."""
    run = Run(Policy.FASTEST, probe_every=20, probe_interval_s=3.0, probe_min_requests=5)
    run.requests(4, 0.030, local_s)
    decisions = []
    for _ in range(n):
        run.now += 10.0
        decisions.append(run.request(0.030, local_s))
    assert all(d.target == LOCAL for d in decisions if d.reason == Reason.PROBE)
    return [i for i, d in enumerate(decisions) if d.reason == Reason.PROBE]


def test_time_alone_never_sends_a_request_to_the_losing_side() -> None:
    """A loser only a little slower (36 ms against 30): cheap to probe, yet only one request
    in `probe_min_requests` + 1 goes to it."""
    assert sparse_probes(0.036) == [5, 11, 17, 23, 29, 35, 41]


def test_an_expensive_loser_is_probed_only_as_often_as_the_budget_pays_for() -> None:
    """A loser 6.7x slower (200 ms against 30): a probe costs 170 ms more than the winner,
    which a tenth of 57 requests at 30 ms pays for; neither `probe_every` (20) nor a pause
    sends one sooner."""
    assert sparse_probes(0.200, n=120) == [56, 113]


def test_probes_of_a_loser_many_times_slower_cost_at_most_the_budget() -> None:
    """Over a long run, the local probes' extra time beside a LAN replica stays within
    `probe_cost_budget` of the time the application spent at the winner."""
    run = Run(Policy.FASTEST)
    run.requests(4, 0.030, 0.200)
    steady = run.requests(1000, 0.030, 0.200)
    probes = sum(d.target == LOCAL for d in steady)
    assert probes >= 10  # still probed
    extra = probes * (0.200 - 0.030)
    assert extra <= run.chooser.settings.probe_cost_budget * (1000 - probes) * 0.030


def test_a_raced_probe_of_a_slow_link_is_not_held_back_by_the_budget() -> None:
    """The link is 7x slower than the local model: its probes race the local model, cost
    the application nothing, and go out every `probe_every` requests."""
    run = Run(Policy.FASTEST, probe_every=10, probe_interval_s=1000)
    run.requests(4, 0.700, 0.100)
    steady = run.requests(60, 0.700, 0.100)
    probes = [i for i, d in enumerate(steady) if d.target == REMOTE]
    assert all(steady[i] == RACED for i in probes)
    # The local model took over at the first comparison: the recheck, then every 11th.
    assert probes == list(range(RECHECK_AFTER, 60, 11))


def raced_probes(run: Run, n: int, remote_s: float, local_s: float = 0.125) -> list[int]:
    """`n` requests, one every 0.5 s (the local model's 125 ms and a pause; times exact in
    binary): which were probes of the replica raced against the local model."""
    decisions = []
    for _ in range(n):
        run.now += 0.5 - local_s
        decisions.append(run.request(remote_s, local_s))
    return [i for i, d in enumerate(decisions) if d == RACED]


def test_raced_probes_of_a_link_that_stays_slow_space_out() -> None:
    """A raced probe slows the local run beside it (both on the device's CPU), so while the
    link stays 7x slower the time rule's interval doubles at each raced probe (3, 6, 12 s,
    ...) until `probe_every` is the sooner; a link that recovers and slows again is probed
    as the first time."""
    run = Run(Policy.FASTEST, probe_every=20, probe_interval_s=3.0, probe_min_requests=5)
    run.requests(20, 0.030, 0.125)
    first = raced_probes(run, 90, 0.875)
    assert run.chooser.summary().preferred == LOCAL
    # The recheck after the switch, then 6 s later (12 requests), then every 21st by count,
    # where a fixed 3 s interval sent one every 6th.
    gaps = [b - a for a, b in itertools.pairwise(first)]
    assert gaps[:2] == [12, 21] and set(gaps[2:]) == {21}
    # Recovered: one raced probe sees it, the probes alone after it confirm it.
    assert len(raced_probes(run, 60, 0.030)) == 1
    assert run.chooser.summary().preferred == REMOTE
    again = raced_probes(run, 90, 0.875)
    assert [b - a for a, b in itertools.pairwise(again)] == gaps


def local_probes(run: Run, n: int, local_s: float, remote_s: float = 0.125) -> list[int]:
    """`n` requests, one every 0.5 s: which probed the local model."""
    decisions = []
    for _ in range(n):
        run.now += 0.5 - remote_s
        decisions.append(run.request(remote_s, local_s))
    return [i for i, d in enumerate(decisions) if d == Decision(LOCAL, Reason.PROBE)]


def test_probes_of_a_local_model_that_stays_slower_space_out() -> None:
    """Under a CPU quota a local probe also slows the replica's requests after it (their
    client-side work), so while the local model stays 20 % slower than a winning replica the
    time rule's interval doubles at each probe; a local model that turns faster (an idle
    device) is probed at the first interval again and wins."""
    run = Run(Policy.FASTEST, probe_every=20, probe_interval_s=3.0, probe_min_requests=5)
    run.requests(4, 0.125, 0.150)
    assert run.chooser.summary().preferred == REMOTE
    probes = local_probes(run, 120, 0.150)
    # 3, 6, 12 s at a request every 0.5 s, then every 21st by count, where a fixed 3 s
    # interval sent every 7th to the slower side.
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[:2] == [12, 21] and set(gaps[2:]) == {21}, gaps
    # The device idles: the next probe finds the local model faster, the following ones go
    # out on the first interval again, and once their figures are a majority it wins.
    faster = local_probes(run, 60, 0.080)
    assert [b - a for a, b in itertools.pairwise(faster)][:3] == [7, 7, 7]
    assert run.chooser.summary().preferred == LOCAL


def test_fastest_switches_to_local_when_the_link_slows_and_back_when_it_recovers() -> None:
    run = Run(Policy.FASTEST, probe_every=10, probe_interval_s=1000)
    run.requests(20, 0.030, 0.200)
    # The link slows down: the remote round trip is now 400 ms.
    slow = run.requests(10, 0.400, 0.200)
    switched = next(i for i, d in enumerate(slow) if d == Decision(LOCAL, Reason.FASTER))
    assert switched <= TIPPING  # the median turns after a majority of slow figures
    assert run.chooser.summary().preferred == LOCAL
    more = run.requests(40, 0.400, 0.200)
    assert sum(d.target == REMOTE for d in more) <= 4  # probes only
    # The link recovers: one probe beats the local estimate, more probes follow at once
    # until the median agrees, then the remote wins again.
    recovered = run.requests(30, 0.030, 0.200)
    first_probe = next(i for i, d in enumerate(recovered) if d.reason == Reason.PROBE)
    back = next(i for i, d in enumerate(recovered) if d == Decision(REMOTE, Reason.FASTER))
    assert first_probe <= 10
    # The probe's figure replaces the stale 400 ms ones: one more to confirm, then back.
    assert back - first_probe == 2
    assert [d.target for d in recovered[first_probe : first_probe + 3]] == [REMOTE] * 3
    assert all(d.reason == Reason.PROBE for d in recovered[first_probe:] if d.target == LOCAL)
    assert run.chooser.summary().preferred == REMOTE


def test_a_recovered_link_is_seen_even_when_its_first_probe_is_slow() -> None:
    """The link recovers, but the first probe lands on a slow round trip that does not beat
    the local side: it is still far below the stale 400 ms figures, so they are dropped
    and the replica is tried again at once rather than a probe period later."""
    run = Run(Policy.FASTEST, probe_every=10, probe_interval_s=1000)
    run.requests(10, 0.030, 0.200)
    run.requests(20, 0.400, 0.200)
    assert run.chooser.summary().preferred == LOCAL
    decisions = []
    for remote_s in [0.195] + [0.030] * 19:  # the first answer after recovery is slow
        while (decision := run.request(remote_s, 0.200)).target != REMOTE:
            decisions.append(decision)
        decisions.append(decision)
        if decision.reason == Reason.FASTER:
            break
    remote = [i for i, d in enumerate(decisions) if d.target == REMOTE]
    assert decisions[-1] == Decision(REMOTE, Reason.FASTER)
    assert remote[1] - remote[0] == 1  # the slow probe was followed at once
    assert len(remote) == 3  # probe, confirm, then the replica wins


def test_a_short_run_of_slow_figures_costs_a_few_requests_not_a_probe_period() -> None:
    run = Run(Policy.FASTEST, probe_every=20, probe_interval_s=1000)
    run.requests(10, 0.030, 0.200)
    run.requests(TIPPING, 0.300, 0.200)  # a majority of slow round trips tips the median
    after = run.requests(10, 0.030, 0.200)  # the link was fine all along
    assert after[0] == Decision(LOCAL, Reason.FASTER)
    back = next(i for i, d in enumerate(after) if d == Decision(REMOTE, Reason.FASTER))
    assert back <= RECHECK_AFTER + 3
    assert run.chooser.summary().preferred == REMOTE


def test_fastest_keeps_the_winner_when_the_other_side_is_only_marginally_better() -> None:
    run = Run(Policy.FASTEST, probe_every=5, probe_interval_s=1000, margin=0.1)
    run.requests(10, 0.100, 0.200)
    steady = run.requests(30, 0.100, 0.095)  # local 5 % better: inside the margin
    assert all(d.target == REMOTE for d in steady if d.reason == Reason.FASTER)
    assert run.chooser.summary().preferred == REMOTE


def test_a_fast_local_probe_alone_does_not_pull_requests_local() -> None:
    """A device under a CPU quota: a local request after a run of remote ones finds the
    quota refilled and takes 25 ms; back to back, 100 ms. The fast probe neither drops the
    local figures nor calls for another probe at once; the next local request is the next
    periodic probe."""
    run = Run(Policy.FASTEST, probe_every=10, probe_interval_s=1000)
    run.requests(20, 0.030, 0.100)
    decisions = run.requests(25, 0.030, 0.025)
    local = [i for i, d in enumerate(decisions) if d.target == LOCAL]
    assert [decisions[i].reason for i in local] == [Reason.PROBE] * len(local)
    assert all(b - a > 10 for a, b in itertools.pairwise(local))
    assert run.chooser.summary().preferred == REMOTE
    assert run.chooser.summary().local_estimate_ms == pytest.approx(100)


@pytest.mark.parametrize("policy", [Policy.FASTEST, Policy.REMOTE_THEN_LOCAL])
def test_an_unreachable_replica_sends_requests_local_until_a_probe_succeeds(
    policy: Policy,
) -> None:
    run = Run(policy, retry_min_s=1.0, retry_max_s=4.0, probe_every=1000, probe_interval_s=1000)
    run.requests(6, 0.030, 0.200)
    failed = run.request(None, 0.200)  # the replica fails this one: it falls back
    assert failed.target == REMOTE
    stats = run.chooser.summary()
    assert (stats.remote_reachable, stats.preferred, stats.fallbacks) == (False, LOCAL, 1)
    # Local for the backoff (1 s, at 300 ms a request), then one probe, which fails too.
    down = run.requests(4, None, 0.300)
    assert [d.reason for d in down] == [Reason.REMOTE_DOWN] * 3 + [Reason.PROBE]
    assert down[3].target == REMOTE
    # The backoff doubled: 2 s of local requests before the next probe, which succeeds.
    again = run.requests(12, 0.030, 0.300)
    probe = next(i for i, d in enumerate(again) if d.reason == Reason.PROBE)
    assert probe == 6
    after = again[probe + 1 :]
    assert after and all(d.target == REMOTE for d in after)
    assert run.chooser.summary().remote_reachable
    counts = {(c.target, c.reason): c.requests for c in run.chooser.summary().decisions}
    # The first failure fell back; the probes raced the local model, which answered the
    # failed one (the application never waited for it) and lost to the one that succeeded.
    assert counts[LOCAL, Reason.FALLBACK] == 1
    assert counts[LOCAL, Reason.REMOTE_DOWN] == 3 + 1 + 6
    assert counts[REMOTE, Reason.PROBE] == 1


def test_one_probe_at_a_time_while_the_replica_is_down() -> None:
    chooser = OffloadChooser(Policy.REMOTE_THEN_LOCAL, AdaptiveSettings(retry_min_s=1.0))
    chooser.remote_failed(0.0)
    probe = Decision(REMOTE, Reason.PROBE, local_reason=Reason.REMOTE_DOWN)
    assert chooser.choose(0.5) == Decision(LOCAL, Reason.REMOTE_DOWN)
    assert chooser.choose(1.0) == probe
    assert chooser.probing_down_remote
    # Concurrent requests stay local while the probe is out.
    assert chooser.choose(1.1) == Decision(LOCAL, Reason.REMOTE_DOWN)
    # A probe that ends with no verdict (cancelled) lets the next request probe, once the
    # race it was in is over.
    chooser.remote_abandoned()
    assert chooser.choose(1.2) == Decision(LOCAL, Reason.REMOTE_DOWN)
    chooser.race_over()
    assert chooser.choose(1.3) == probe
    chooser.remote_succeeded(probe, 0.05)
    chooser.race_over()
    assert chooser.choose(1.4) == Decision(REMOTE, Reason.POLICY)


def test_a_replica_about_as_fast_as_the_local_model_is_probed_alone() -> None:
    """A near tie (110 ms against 100): racing would run both on the device's CPU at once
    and skew the comparison, so the replica's probes go alone; at 3x they race."""
    run = Run(Policy.FASTEST, probe_every=5, probe_interval_s=1000)
    near = [d for d in run.requests(40, 0.110, 0.100) if d.target == REMOTE]
    assert near[2:] and all(d == Decision(REMOTE, Reason.PROBE) for d in near[2:])
    far = [d for d in run.requests(40, 0.300, 0.100) if d.reason == Reason.PROBE]
    assert far[-1] == RACED and run.chooser.summary().raced > 0


def test_a_raced_probe_that_finds_the_link_recovered_is_not_kept_as_a_figure() -> None:
    """A 1-CPU device (local 38 ms) after a slow link (700 ms): the raced probe's round trip
    is 50 ms, slowed by the local run beside it on the device's CPU, against 24 ms alone.
    It drops the stale figures without replacing them: two probes alone follow, and the
    replica wins on their figures, which a kept 50 ms would have held back (median 37)."""
    run = Run(Policy.FASTEST, probe_every=5, probe_interval_s=1000)
    decisions = run.requests(10, 0.700, 0.038)
    assert RACED in decisions
    chooser = run.chooser
    assert chooser.summary().preferred == LOCAL
    decision = chooser.choose(run.now)
    while decision != RACED:
        chooser.local_succeeded(decision, 0.038)
        decision = chooser.choose(run.now)
    chooser.remote_succeeded(decision, 0.050)  # the link recovered; this round trip raced
    chooser.local_succeeded(Decision(LOCAL, Reason.FASTER), 0.045, counted=False)
    chooser.race_over()
    assert chooser.summary().remote_estimate_ms is None
    for _ in range(2):
        decision = chooser.choose(run.now)
        assert decision == Decision(REMOTE, Reason.PROBE)
        chooser.remote_succeeded(decision, 0.024)
    assert chooser.choose(run.now) == Decision(REMOTE, Reason.FASTER)
    assert chooser.summary().remote_estimate_ms == pytest.approx(24)


def test_a_probe_of_a_losing_replica_waits_while_a_raced_one_is_out() -> None:
    """A slow link: the replica's raced probe is still out when the next probe falls due;
    the winner serves until it ends, then the due probe goes out."""
    chooser = OffloadChooser(Policy.FASTEST, AdaptiveSettings(probe_every=3, probe_min_requests=1))
    now = 0.0
    for _ in range(2):
        decision = chooser.choose(now)
        chooser.remote_succeeded(decision, 0.700)
    for _ in range(2):
        decision = chooser.choose(now)
        chooser.local_succeeded(decision, 0.070)
    decisions = []
    for _ in range(12):
        now += 0.07
        decision = chooser.choose(now)
        decisions.append(decision)
        if decision.target == LOCAL:
            chooser.local_succeeded(decision, 0.070)
    assert decisions[:3] == [Decision(LOCAL, Reason.FASTER)] * 3
    assert decisions[3] == RACED
    assert decisions[4:] == [Decision(LOCAL, Reason.FASTER)] * 8  # the race is still out
    chooser.remote_succeeded(RACED, 0.700, counted=False)
    chooser.race_over()
    assert chooser.choose(now) == RACED  # overdue: at once
    stats = chooser.summary()
    assert (stats.remote_requests, stats.preferred) == (2, LOCAL)


def test_remote_policy_never_falls_back_but_knows_the_replica_is_down() -> None:
    run = Run(Policy.REMOTE)
    assert run.request(None, 0.2) == Decision(REMOTE, Reason.POLICY)
    stats = run.chooser.summary()
    assert not run.chooser.can_fall_back
    assert (stats.remote_reachable, stats.local_requests, stats.remote_requests) == (False, 0, 0)
    assert run.chooser.choose(run.now) == Decision(REMOTE, Reason.POLICY)
