"""When to move a deployment: a client's new site against where its replica runs.

Pure functions. A move must gain at least `min_gain_ms` AND `min_gain_ratio` of the current
latency (hysteresis: a client on the border between two sites must not flap), and not come
within `cooldown_s` of the deployment's last migration.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Hysteresis:
    min_gain_ms: float = 2.0
    """A move must cut the client's network latency by at least this much (ms)..."""
    min_gain_ratio: float = 0.2
    """...and by at least this fraction of the current latency."""
    cooldown_s: float = 30.0
    """No mobility migration sooner than this after the deployment's last one."""

    def __post_init__(self) -> None:
        if self.min_gain_ms < 0 or not 0 <= self.min_gain_ratio < 1 or self.cooldown_s < 0:
            raise ValueError(
                "hysteresis: min_gain_ms >= 0, 0 <= min_gain_ratio < 1, cooldown_s >= 0"
            )


@dataclass(frozen=True, slots=True)
class Verdict:
    move: bool
    reason: str
    """Why (or why not), for the log and the migration record."""


def mobility_verdict(
    current_ms: float,
    best_ms: float,
    since_last_migration_s: float | None,
    hysteresis: Hysteresis,
) -> Verdict:
    """Whether a client now `current_ms` from its replica should move to a node `best_ms`
    away. `since_last_migration_s` is None when the deployment never migrated."""
    gain = current_ms - best_ms
    needed = max(hysteresis.min_gain_ms, hysteresis.min_gain_ratio * current_ms)
    if gain < needed:
        return Verdict(
            False,
            f"gain {gain:.2f} ms is under the hysteresis ({needed:.2f} ms: at least "
            f"{hysteresis.min_gain_ms:g} ms and {hysteresis.min_gain_ratio:.0%} of "
            f"{current_ms:.2f} ms)",
        )
    if since_last_migration_s is not None and since_last_migration_s < hysteresis.cooldown_s:
        return Verdict(
            False,
            f"cooling down: last migration {since_last_migration_s:.1f}s ago "
            f"(cooldown {hysteresis.cooldown_s:g}s)",
        )
    return Verdict(True, f"latency {current_ms:.2f} -> {best_ms:.2f} ms (gain {gain:.2f} ms)")


@dataclass(frozen=True, slots=True)
class PrewarmSettings:
    """Predictive pre-warm (`broker.prewarm`): standby replicas at a client's predicted next
    site."""

    budget: int = 0
    """Standby replicas held at once, cluster-wide; 0 turns pre-warm off."""
    min_probability: float = 0.3
    """A prediction less likely than this warms nothing."""
    ttl_s: float = 120.0
    """A standby the client has not reached after this long is retired."""

    def __post_init__(self) -> None:
        if self.budget < 0 or not 0 < self.min_probability <= 1 or not self.ttl_s > 0:
            raise ValueError("pre-warm: budget >= 0, 0 < min_probability <= 1, ttl_s > 0")

    @property
    def enabled(self) -> bool:
        return self.budget > 0


def prewarm_verdict(
    probability: float,
    current_ms: float,
    standby_ms: float,
    hysteresis: Hysteresis,
    settings: PrewarmSettings,
) -> Verdict:
    """Whether to warm a standby for a client predicted, with `probability`, to go to a site
    where its replica would be `current_ms` away and the standby's node `standby_ms`.

    Only a move the policy would make is worth warming (the gain passes the hysteresis; the
    cooldown is not asked: a pre-warmed move costs no start), and only when the expected gain,
    probability x gain, is at least the hysteresis' `min_gain_ms`."""
    if probability < settings.min_probability:
        return Verdict(
            False,
            f"next site {probability:.0%} likely, under the {settings.min_probability:.0%} "
            "pre-warm threshold",
        )
    move = mobility_verdict(current_ms, standby_ms, None, hysteresis)
    if not move.move:
        return Verdict(False, f"a move there would not be made: {move.reason}")
    expected = probability * (current_ms - standby_ms)
    if expected < hysteresis.min_gain_ms:
        return Verdict(
            False,
            f"expected gain {expected:.2f} ms ({probability:.0%} x "
            f"{current_ms - standby_ms:.2f} ms) under {hysteresis.min_gain_ms:g} ms",
        )
    return Verdict(
        True,
        f"next site {probability:.0%} likely; a move there gains {current_ms - standby_ms:.2f} ms",
    )
