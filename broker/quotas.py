"""Per-client limits: how much of the broker one client may take.

- deployments (not deleted) a client has: `--max-deployments-per-client`;
- bytes of the models a client uploaded (each model counted once per client that uploaded it,
  whoever else did too): `--max-model-bytes-per-client`;
- uploads a client runs at once: `--max-uploads-per-client`;
- bytes of uploads being received (staged on disk, not yet stored), counted as they arrive:
  per client (`--max-staged-upload-bytes-per-client`) and broker-wide
  (`--max-staged-upload-bytes`), held by `StagedBytes` and given back when an upload ends
  however it ends; the model bytes quota above is checked against the same count, so an upload
  stops at the first chunk that would take its client past it;
- WatchDeployment streams a client holds open at once: `--max-watch-streams-per-client`;
- and an upload that sends nothing for `--upload-idle-timeout` seconds is cut off
  (`within_idle_timeout`), so a stalled stream cannot hold memory and a staging file forever.

Past a limit the call is refused with `ResourceExhausted` (RESOURCE_EXHAUSTED) naming the limit
and the flag that sets it. Plain Python: the counts come from the caller (the broker reads them
from its state under the decision that uses them); `Slots` counts what is held in memory.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from broker.errors import ResourceExhausted

T = TypeVar("T")

GIB = 1024**3
DEFAULT_MAX_STAGED_BYTES = 4 * GIB
"""Broker-wide bytes of uploads staged at once (`--max-staged-upload-bytes`): two uploads of
the largest model the broker takes by default (2 GiB)."""


@dataclass(frozen=True, slots=True)
class Quotas:
    """The limits every client has; each one a flag of `offload broker`."""

    deployments: int = 20
    """Deployments a client may have, not deleted (failed ones count until deleted)."""
    model_bytes: int = 10 * GIB
    """Total bytes of the models a client uploaded."""
    uploads: int = 2
    """Uploads a client may run at once."""
    watch_streams: int = 32
    """WatchDeployment streams a client may hold open at once."""
    upload_idle_timeout_s: float = 30.0
    """An upload stream that sends no chunk for this long is cut off."""
    staged_bytes: int = 2 * GIB
    """Bytes of a client's uploads under way (received, not yet stored), all together."""

    def __post_init__(self) -> None:
        for name in ("deployments", "model_bytes", "uploads", "watch_streams", "staged_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"the {name} quota must be at least 1")
        if not 0 < self.upload_idle_timeout_s < float("inf"):
            raise ValueError("the upload idle timeout must be a positive number of seconds")


def check_deployments(quotas: Quotas, client_id: str, current: int) -> None:
    """ResourceExhausted unless `client_id`, having `current` deployments, may add one."""
    if current >= quotas.deployments:
        raise ResourceExhausted(
            f"client {client_id} has {current} deployments, its limit "
            f"(--max-deployments-per-client {quotas.deployments}); delete one first"
        )


def check_model_bytes(quotas: Quotas, client_id: str, stored: int, adding: int) -> None:
    """ResourceExhausted unless `client_id`, whose models take `stored` bytes, may add a model
    of `adding` bytes."""
    if stored + adding > quotas.model_bytes:
        raise ResourceExhausted(
            f"a model of {adding} bytes would take client {client_id}'s models to "
            f"{stored + adding} bytes, over its limit (--max-model-bytes-per-client "
            f"{quotas.model_bytes}); nothing was stored"
        )


def check_model_bytes_while_staging(
    quotas: Quotas, client_id: str, stored: int, staged: int, adding: int
) -> None:
    """ResourceExhausted unless `client_id`, whose models take `stored` bytes and whose
    uploads under way hold `staged`, may take `adding` bytes more into staging."""
    if stored + staged + adding > quotas.model_bytes:
        raise ResourceExhausted(
            f"client {client_id}'s models ({stored} bytes) and uploads under way would pass "
            f"its limit (--max-model-bytes-per-client {quotas.model_bytes}) with this chunk; "
            "the upload was cut off and nothing was stored"
        )


class StagedBytes:
    """Bytes of uploads staged at once, broker-wide (`total_cap`) and per client (the
    quota's `staged_bytes`), counted as chunks arrive. Used from one event loop (not
    thread-safe)."""

    def __init__(self, total_cap: int, per_client_cap: int) -> None:
        if total_cap < 1 or per_client_cap < 1:
            raise ValueError("the staged upload bytes caps must be at least 1")
        self.total_cap = total_cap
        self.per_client_cap = per_client_cap
        self.total = 0
        """Bytes staged now, all clients together."""
        self._by_client: Counter[str] = Counter()

    def of(self, client_id: str) -> int:
        """Bytes `client_id`'s uploads under way hold now."""
        return self._by_client[client_id]

    def take(self, client_id: str, nbytes: int) -> None:
        """Count `nbytes` more for `client_id`; ResourceExhausted naming the cap (nothing
        counted) when that passes its cap or the broker's."""
        if self._by_client[client_id] + nbytes > self.per_client_cap:
            raise ResourceExhausted(
                f"client {client_id}'s uploads under way would stage more than its limit "
                f"(--max-staged-upload-bytes-per-client {self.per_client_cap}); the upload "
                "was cut off and nothing was stored; retry when its other uploads finished"
            )
        if self.total + nbytes > self.total_cap:
            raise ResourceExhausted(
                "the broker's uploads under way would stage more than its limit "
                f"(--max-staged-upload-bytes {self.total_cap}); the upload was cut off and "
                "nothing was stored; retry soon"
            )
        self._by_client[client_id] += nbytes
        self.total += nbytes

    def give_back(self, client_id: str, nbytes: int) -> None:
        """Uncount `nbytes` that `take` counted for `client_id`."""
        left = self._by_client[client_id] - nbytes
        if left < 0:
            raise ValueError(f"client {client_id} gives back more staged bytes than it holds")
        if left:
            self._by_client[client_id] = left
        else:
            del self._by_client[client_id]
        self.total -= nbytes


class Slots:
    """At most `limit` held at once per client: concurrent uploads, open streams. Used from one
    event loop (not thread-safe)."""

    def __init__(self, limit: int, what: str, flag: str) -> None:
        self._limit = limit
        self._what = what
        self._flag = flag
        self._held: Counter[str] = Counter()

    @contextmanager
    def hold(self, client_id: str) -> Iterator[None]:
        """Take one of `client_id`'s slots for the block; ResourceExhausted when all are
        taken. Released whatever ends the block."""
        if self._held[client_id] >= self._limit:
            raise ResourceExhausted(
                f"client {client_id} has {self._limit} {self._what} open, its limit "
                f"({self._flag} {self._limit}); retry when one has finished"
            )
        self._held[client_id] += 1
        try:
            yield
        finally:
            self._held[client_id] -= 1
            if not self._held[client_id]:
                del self._held[client_id]


@dataclass(slots=True)
class ClientLimits:
    """The quotas and the slots that enforce the in-memory ones, for the broker to own."""

    quotas: Quotas = field(default_factory=Quotas)
    max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES
    """Broker-wide cap on bytes of uploads staged at once."""
    uploads: Slots = field(init=False)
    watch_streams: Slots = field(init=False)
    staged: StagedBytes = field(init=False)

    def __post_init__(self) -> None:
        self.staged = StagedBytes(self.max_staged_bytes, self.quotas.staged_bytes)
        self.uploads = Slots(self.quotas.uploads, "uploads", "--max-uploads-per-client")
        self.watch_streams = Slots(
            self.quotas.watch_streams, "watch streams", "--max-watch-streams-per-client"
        )


async def within_idle_timeout(items: AsyncIterator[T], idle_s: float) -> AsyncIterator[T]:
    """`items`, cut off with ResourceExhausted when the next one takes longer than `idle_s`
    seconds to come (a stalled upload stream)."""
    iterator = aiter(items)
    while True:
        try:
            item = await asyncio.wait_for(anext(iterator), idle_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise ResourceExhausted(
                f"the upload stalled: no chunk for {idle_s:g} s (--upload-idle-timeout); "
                "it was cut off and nothing was stored"
            ) from None
        yield item
