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
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

DEFAULT_WINDOW_S = 2.0
DEFAULT_LATENCY_SAMPLES = 10_000


@dataclass(frozen=True, slots=True)
class MigrationObservation:
    """What the client saw around one migration (the window in the module docstring)."""

    deployment_id: str
    migration_id: str
    longest_gap_ms: float
    failed_requests: int
    requests: int
    retried_requests: int


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

    def record(self, started: float, finished: float, ok: bool, retried: bool = False) -> None:
        """One inference request that completed at `finished` (succeeded, or raised)."""
        self._requests += 1
        self._retried += retried
        if ok:
            self._latencies.append(finished - started)
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

    def migration(self, deployment_id: str, migration_id: str, at: float) -> bool:
        """Open the window of a migration whose update arrived at `at`; False (and nothing
        changes) when that migration already has one, open or closed."""
        if migration_id in self._open or any(o.migration_id == migration_id for o in self._closed):
            return False
        # Since the last success every completed request failed: they belong to the window.
        self._open[migration_id] = _Window(
            deployment_id=deployment_id,
            migration_id=migration_id,
            update_at=at,
            last_success=self._last_success if self._last_success is not None else at,
            longest_gap=0.0,
            requests=self._failed_since_success,
            failed=self._failed_since_success,
        )
        return True

    def close(self, migration_id: str, now: float) -> MigrationObservation | None:
        """The observation of a migration if its window has closed by `now` (it is kept for
        `stats`); None while it is still open. KeyError for a migration with no open window."""
        window = self._open[migration_id]
        if window.first_success is None or now < window.update_at + self.window_s:
            return None
        del self._open[migration_id]
        observation = MigrationObservation(
            deployment_id=window.deployment_id,
            migration_id=migration_id,
            longest_gap_ms=window.longest_gap * 1000,
            failed_requests=window.failed,
            requests=window.requests,
            retried_requests=window.retried,
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
