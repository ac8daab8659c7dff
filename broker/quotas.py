"""Per-client limits: how much of the broker one client may take.

- deployments (not deleted) a client has: `--max-deployments-per-client`;
- bytes of the models a client uploaded (each model counted once per client that uploaded it,
  whoever else did too): `--max-model-bytes-per-client`;
- uploads a client runs at once: `--max-uploads-per-client`;
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

    def __post_init__(self) -> None:
        for name in ("deployments", "model_bytes", "uploads", "watch_streams"):
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
    uploads: Slots = field(init=False)
    watch_streams: Slots = field(init=False)

    def __post_init__(self) -> None:
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
