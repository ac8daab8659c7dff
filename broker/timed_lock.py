"""An asyncio lock that reports how long each holder waited for it and held it.

The broker takes its placement decisions one at a time under one lock, and each holds it
through the state store's commit. When that lock is busy most of the time, it, not the CPU,
is what bounds how many deploys the broker commits per second; the time holders waited says
how long the queue in front of it was. `on_release(waited_s, held_s)` is called after each
release (perf_counter seconds); a holder cancelled while waiting reports nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import TracebackType


class TimedLock:
    """`async with lock:` as an `asyncio.Lock`, reporting each use (module docstring). Not
    thread-safe: use it from one event loop."""

    def __init__(self, on_release: Callable[[float, float], None]) -> None:
        self._lock = asyncio.Lock()
        self._on_release = on_release
        self._waited_s = 0.0
        self._acquired_at = 0.0
        """Of the current holder: only the holder writes them, after acquiring."""

    async def __aenter__(self) -> None:
        asked = time.perf_counter()
        await self._lock.acquire()
        self._acquired_at = time.perf_counter()
        self._waited_s = self._acquired_at - asked

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        held_s = time.perf_counter() - self._acquired_at
        waited_s = self._waited_s
        self._lock.release()
        self._on_release(waited_s, held_s)
