"""What the client saw: request latency, and the gap between successful responses around
each migration. Pure bookkeeping over timestamps the caller passes in (monotonic seconds);
no clock, no I/O, so it is tested with explicit times.

The window of one migration, with every time a completion time as the client measured it:

- ``u``: when the PlacementUpdate carrying the migration id arrived (the client switches
  to the new endpoint at that moment);
- ``s0``: the last successful response completed before ``u`` (``u`` itself when there was
  none);
- ``f``: the first successful response completed after ``u``;
- ``end = max(f, u + window_s)``.

``longest_gap`` is the largest difference between consecutive successful completions in
``[s0, end]``; the first difference is from ``s0`` to the next success, so a stop-start
outage that began before the update arrived is counted whole. ``requests`` and
``failed_requests`` count the requests that completed in ``(s0, end]``, and those that
raised; a request that failed once and succeeded on its retry is a success (it is counted
in ``retried_requests``). The window closes at ``end``: once ``f`` exists and the time
passed ``u + window_s``; without a success after ``u`` it stays open.

That window is the switch. The migration began earlier: the target replica started (model
load, warm-up) while the old one served, on CPUs they may share. The span is the whole of it:

- ``p``: the update's ``prepared_ms``, how long the broker had prepared the migration
  (from its decision to sending the update); ``d = u - p`` is its decision on the client's
  clock (later than the true one by the update's transit time, a few ms at most);
- ``span_gap`` is the largest difference between consecutive successful completions from
  the last one at or before ``d`` to ``end``: every gap that ends after ``d``, counted whole,
  so ``span_gap >= longest_gap``.

The span ends where the switch window does: the broker stops the old replica 0.2 s after the
client's ack (plus its drain), well inside the default 2 s window. Why a duration carried by
the switch, not a notice when the preparation starts: the client cannot miss it. A notice
could be lost to a watch stream that broke and reopened while the target started (the
reopened stream begins with the current placement, not the history), and could arrive after
a reordering on the client's side; the duration arrives in the same message as the switch,
and needs no clock shared with the broker. The cost is that the client keeps the gaps of the
last `HISTORY_S` (only those that could still be a span's worst: a suffix-maximum stack, a
handful of entries), since it learns where the span began only once it is over but for the
switch.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

DEFAULT_WINDOW_S = 2.0
DEFAULT_LATENCY_SAMPLES = 10_000
REPORTS_KEPT = 64
"""Location reports remembered until their migration's window closes."""
HISTORY_S = 600.0
"""How far back a span may begin: longer than any preparation (a replica's start is given
120 s); a longer `prepared_ms` is clamped to it."""


@dataclass(frozen=True, slots=True)
class MigrationObservation:
    """What the client saw around one migration (the window in the module docstring)."""

    deployment_id: str
    migration_id: str
    longest_gap_ms: float
    """Across the switch (the window in the module docstring)."""
    failed_requests: int
    requests: int
    retried_requests: int
    span_gap_ms: float | None = None
    """Over the whole migration, decision to the window's end; None when the update
    carried no preparation time (an older broker)."""
    moved_to_served_ms: float | None = None
    """From this client's location report that started the migration (the call's start)
    to its first answer from the new replica: the time from the mobility event to serving
    at the new site. None for a migration this client's report did not start, or with no
    answer from the new replica inside the window."""


@dataclass(frozen=True, slots=True)
class ClientStats:
    """The client's counters since it started."""

    requests: int
    """Inference requests completed, successful or not (a retried request counts once)."""
    failures: int
    """Requests that raised."""
    retried: int
    """Requests that failed once with UNAVAILABLE or CANCELLED and were sent again."""
    latency_p50_ms: float | None
    """Over the last `latency_samples` successful requests (retries included); None
    before the first success."""
    latency_p99_ms: float | None
    migrations: tuple[MigrationObservation, ...]
    """Closed migration windows, in the order they closed."""


@dataclass(slots=True)
class _Window:
    deployment_id: str
    migration_id: str
    update_at: float
    last_success: float
    longest_gap: float
    requests: int
    failed: int
    retried: int = 0
    first_success: float | None = None
    span_before: float | None = None
    """The longest gap that ended between the decision and the update; None: no span."""
    served_at: float | None = None
    """When the first answer from the migration's new replica completed."""


class _GapHistory:
    """The gaps between consecutive successes that ended within the last `horizon_s`,
    reduced to those that are the longest of some suffix (each longer than every later
    one): `worst_since(t)` is then the first whose end is after `t`. Appending pops the
    shorter gaps before it, so a steady load keeps a handful of entries."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._ends: list[float] = []
        self._gaps: list[float] = []

    def add(self, end: float, gap: float) -> None:
        while self._gaps and self._gaps[-1] <= gap:
            self._gaps.pop()
            self._ends.pop()
        self._ends.append(end)
        self._gaps.append(gap)
        old = bisect.bisect_left(self._ends, end - self.horizon_s)
        if old:
            del self._ends[:old], self._gaps[:old]

    def worst_since(self, t: float) -> float:
        """The longest gap that ended after `t` (0.0 when none did)."""
        i = bisect.bisect_right(self._ends, t)
        return self._gaps[i] if i < len(self._gaps) else 0.0


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted, non-empty list."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class GapObserver:
    """Counters, latency samples and the open migration windows of one client.

    `record` must be called in completion order (each `finished` no earlier than the one
    before), as a client does when it records each request the moment it completes.
    """

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        latency_samples: int = DEFAULT_LATENCY_SAMPLES,
    ) -> None:
        self.window_s = window_s
        self._latencies: deque[float] = deque(maxlen=latency_samples)
        self._requests = 0
        self._failures = 0
        self._retried = 0
        self._last_success: float | None = None
        self._failed_since_success = 0
        self._open: dict[str, _Window] = {}
        self._closed: list[MigrationObservation] = []
        self._history = _GapHistory(HISTORY_S)
        self._reported: dict[str, float] = {}
        """migration id -> when this client's location report that started it began."""

    def record(self, started: float, finished: float, ok: bool, retried: bool = False) -> None:
        """One inference request that completed at `finished` (succeeded, or raised)."""
        self._requests += 1
        self._retried += retried
        if ok:
            self._latencies.append(finished - started)
            if self._last_success is not None:
                self._history.add(finished, finished - self._last_success)
            self._last_success = finished
            self._failed_since_success = 0
        else:
            self._failures += 1
            self._failed_since_success += 1
        for window in self._open.values():
            if window.first_success is not None and finished > max(
                window.first_success, window.update_at + self.window_s
            ):
                continue  # past the window's end
            window.requests += 1
            window.failed += not ok
            window.retried += retried
            if ok:
                window.longest_gap = max(window.longest_gap, finished - window.last_success)
                window.last_success = finished
                if window.first_success is None:
                    window.first_success = finished

    def migration(
        self, deployment_id: str, migration_id: str, at: float, prepared_s: float | None = None
    ) -> bool:
        """Open the window of a migration whose update arrived at `at`, `prepared_s` after
        the broker decided it (None: unknown, no span is measured; a value that is not a
        finite non-negative number is treated as unknown, one over `HISTORY_S` clamped to
        it). False (and nothing changes) when that migration already has one, open or
        closed."""
        if migration_id in self._open or any(o.migration_id == migration_id for o in self._closed):
            return False
        span_before = None
        if prepared_s is not None and math.isfinite(prepared_s) and prepared_s >= 0:
            span_before = self._history.worst_since(at - min(prepared_s, HISTORY_S))
        # Since the last success every completed request failed: they belong to the window.
        self._open[migration_id] = _Window(
            deployment_id=deployment_id,
            migration_id=migration_id,
            update_at=at,
            last_success=self._last_success if self._last_success is not None else at,
            longest_gap=0.0,
            requests=self._failed_since_success,
            failed=self._failed_since_success,
            span_before=span_before,
        )
        return True

    def reported(self, migration_id: str, at: float) -> None:
        """This client's location report that began at `at` started `migration_id` (before
        or after its window opened: the reply and the update race). The last
        `REPORTS_KEPT` are kept until their window closes."""
        self._reported[migration_id] = at
        while len(self._reported) > REPORTS_KEPT:
            del self._reported[next(iter(self._reported))]

    def served(self, migration_id: str, at: float) -> None:
        """The migration's new replica answered for the first time at `at` (nothing when
        its window is closed, or has that already)."""
        window = self._open.get(migration_id)
        if window is not None and window.served_at is None:
            window.served_at = at

    def close(self, migration_id: str, now: float) -> MigrationObservation | None:
        """The observation of a migration if its window has closed by `now` (it is kept for
        `stats`); None while it is still open. KeyError for a migration with no open window."""
        window = self._open[migration_id]
        if window.first_success is None or now < window.update_at + self.window_s:
            return None
        del self._open[migration_id]
        reported = self._reported.pop(migration_id, None)
        observation = MigrationObservation(
            deployment_id=window.deployment_id,
            migration_id=migration_id,
            longest_gap_ms=window.longest_gap * 1000,
            failed_requests=window.failed,
            requests=window.requests,
            retried_requests=window.retried,
            span_gap_ms=(
                None
                if window.span_before is None
                else max(window.span_before, window.longest_gap) * 1000
            ),
            moved_to_served_ms=(
                None
                if reported is None or window.served_at is None
                else (window.served_at - reported) * 1000
            ),
        )
        self._closed.append(observation)
        return observation

    def stats(self) -> ClientStats:
        ordered = sorted(self._latencies)
        return ClientStats(
            requests=self._requests,
            failures=self._failures,
            retried=self._retried,
            latency_p50_ms=percentile(ordered, 0.50) * 1000 if ordered else None,
            latency_p99_ms=percentile(ordered, 0.99) * 1000 if ordered else None,
            migrations=tuple(self._closed),
        )
