"""An asyncio lock that reports how long each holder waited for it and held it, by use.

The broker takes its placement decisions one at a time under one lock, and each holds it
through the state store's commit. When that lock is busy most of the time, it, not the CPU,
is what bounds how many deploys the broker commits per second; the time holders waited says
how long the queue in front of it was, and the use each holder names ("decide", "delete",
"switch", ...) says which of them fill it. `on_release(use, waited_s, held_s)` is called
after each release (perf_counter seconds); a holder cancelled while waiting reports nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import TracebackType


class TimedLock:
    """`async with lock.use("decide"):` as an `asyncio.Lock`, reporting each use (module
    docstring). Not thread-safe: use it from one event loop."""

    def __init__(self, on_release: Callable[[str, float, float], None]) -> None:
        self._lock = asyncio.Lock()
        self._on_release = on_release

    def use(self, name: str) -> _Use:
        """The lock for one holder that reports itself as `name`."""
        return _Use(self._lock, self._on_release, name)


class _Use:
    def __init__(
        self, lock: asyncio.Lock, on_release: Callable[[str, float, float], None], name: str
    ) -> None:
        self._lock = lock
        self._on_release = on_release
        self._name = name
        self._waited_s = 0.0
        self._acquired_at = 0.0

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
        self._lock.release()
        self._on_release(self._name, self._waited_s, held_s)
