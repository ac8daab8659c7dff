"""How late the broker's event loop runs what is due: the evidence the lost-node check needs
before it calls a silent node lost.

A node's heartbeats are read by the same event loop that runs everything else. While that
loop is behind (saturated, or the process paused), heartbeats wait in gRPC's buffers, unread,
and a node that sends every second looks silent to the broker for as long as the loop is
late. `LoopLag.run` wakes every `tick_s` and notes how late it woke; `worst` is the most it
was late over the last `window_s` seconds, counting a wake-up overdue right now (the check
may run before the monitor after a pause). The lost-node check allows a node that much more
silence: the broker counts only silence it could have heard.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


class LoopLag:
    """The running event loop's lateness over the last `window_s` seconds (module docstring).
    Not thread-safe: use it from that loop."""

    def __init__(self, window_s: float, tick_s: float = 0.1) -> None:
        if window_s <= 0 or tick_s <= 0:
            raise ValueError("window_s and tick_s must be > 0")
        self._window_s = window_s
        self._tick_s = tick_s
        self._late: deque[tuple[float, float]] = deque()
        """(when noted, seconds late), oldest first, within the window."""
        self._due: float | None = None
        """When the monitor should wake next (None: not running)."""

    async def run(self) -> None:
        """Note how late each wake-up is, until cancelled."""
        try:
            while True:
                self._due = time.monotonic() + self._tick_s
                await asyncio.sleep(self._tick_s)
                now = time.monotonic()
                self.note(now, now - self._due)
        finally:
            self._due = None

    def note(self, now: float, late_s: float) -> None:
        """Record that the loop ran something `late_s` late at `now` (monotonic seconds)."""
        self._late.append((now, max(0.0, late_s)))
        self._forget(now)

    def worst(self, now: float | None = None) -> float:
        """The most the loop ran late over the last `window_s` seconds, a wake-up overdue at
        `now` included (0.0 without samples)."""
        now = time.monotonic() if now is None else now
        self._forget(now)
        overdue = now - self._due if self._due is not None else 0.0
        return max(0.0, overdue, *(late for _, late in self._late))

    def _forget(self, now: float) -> None:
        while self._late and self._late[0][0] < now - self._window_s:
            self._late.popleft()
