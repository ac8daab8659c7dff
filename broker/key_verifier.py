"""`KeyVerifier`: which client an API key belongs to, without letting key checks crowd out
anything else.

A key check is a ~35 ms scrypt hash (`broker.state.api_keys`). It runs in a small pool of its
own, never on the broker's state thread, so node heartbeats, placement and the store's other
work never queue behind it (the hash releases the GIL). Three bounds keep it cheap:

- a verified key is cached (by its sha256): only a client's first call costs a hash;
- one check per distinct key is in flight: concurrent calls with the same key await it;
- at most `max_pending` distinct checks wait for the pool, and every address (the host part
  of gRPC's `context.peer()`) has a budget of failed checks that refills at
  `failure_refill_per_s`; past either, a check is refused with `ResourceExhausted` at once,
  without hashing, so a flood of bogus keys costs the broker almost nothing.

A call spends its address's budget when it starts waiting for a check, not when the check
fails, and gets it back when the key proves valid: a check under way counts as failed until
it is known. Charged afterwards, 60 callers from one address each passed a budget of 20 while
none of their checks had finished yet, and the last of them waited 10 s in the pool's queue
behind the others (the chaos suite's deploy storm, whose bogus keys must be refused, not time
out). A call cancelled while it waits (its client's deadline) keeps its budget spent.

With a keys file (`use_keys`, at start and on every reload), the file decides at once: a key
is valid exactly when it is the file's key of the client it names, compared by sha256 (the
cache's own measure), so no check waits for a hash and no reload re-verifies anything. A key
the new file removes or replaces is dropped from the cache and refused from the moment
`use_keys` returns, and whatever was opened with it (`on_revoke`: WatchDeployment streams) is
told so. The store's scrypt hashes stay the record at rest; without a file (a broker driven
through its store alone) every key not cached is checked against them.

Plain asyncio over a blocking `check(api_key) -> client id | None` function (the store's).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from broker.errors import ResourceExhausted

logger = logging.getLogger(__name__)

KeyCheck = Callable[[str], str | None]
"""Blocking: the client id `api_key` authenticates, or None."""


@dataclass(frozen=True, slots=True)
class KeyLimits:
    workers: int = 2
    """Threads that hash keys."""
    max_pending: int = 64
    """Distinct keys waiting for (or in) the pool; more are refused at once."""
    failure_burst: int = 20
    """Failed checks an address may make back to back..."""
    failure_refill_per_s: float = 2.0
    """...and how fast its budget comes back."""
    max_addresses: int = 10_000
    """Addresses whose failure budget is remembered (the least recently failed go first)."""


@dataclass(slots=True)
class _Budget:
    tokens: float
    at: float


def _sha256(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer (`ipv4:1.2.3.4:5678` -> `ipv4:1.2.3.4`,
    `ipv6:[::1]:5678` -> `ipv6:[::1]`); anything else as given."""
    head, colon, port = peer.rpartition(":")
    return head if colon and port.isdigit() and ":" in head else peer


class KeyVerifier:
    def __init__(
        self,
        check: KeyCheck,
        limits: KeyLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self._limits = limits or KeyLimits()
        self._clock = clock
        self._pool = ThreadPoolExecutor(self._limits.workers, thread_name_prefix="key-check")
        self._verified: dict[str, str] = {}
        """sha256 of a key -> its client id."""
        self._in_flight: dict[str, asyncio.Future[str | None]] = {}
        self._generation = 0
        """Bumped by `forget`: a check started before it neither answers later calls nor
        enters the cache."""
        self._budgets: OrderedDict[str, _Budget] = OrderedDict()
        self._allowed: dict[str, str] | None = None
        """client id -> the sha256 of its key in the keys file (`use_keys`); None: no file,
        keys are checked against the store."""
        self._revoke_callbacks: dict[str, set[Callable[[], None]]] = {}
        """sha256 of a key -> what to call when it stops working (`on_revoke`)."""

    async def client_for(self, api_key: str, peer: str) -> str | None:
        """The client id of `api_key`, or None when it authenticates no one.
        ResourceExhausted when `peer`'s address failed too often lately or too many keys
        wait for a check."""
        digest = _sha256(api_key)
        if (client_id := self._verified.get(digest)) is not None:
            return client_id
        host = peer_host(peer)
        budget = self._budget(host)
        if budget.tokens < 1:
            wait_s = (1 - budget.tokens) / self._limits.failure_refill_per_s
            raise ResourceExhausted(
                "too many failed or unfinished API key checks from this address; "
                f"retry in {wait_s:.1f}s"
            )
        if self._allowed is not None:
            client_id = api_key.partition(".")[0]
            if hmac.compare_digest(self._allowed.get(client_id, ""), digest):
                self._verified[digest] = client_id
                return client_id
            self._spend(host, budget)
            return None
        generation = self._generation
        future = self._in_flight.get(digest)
        if future is None:
            if len(self._in_flight) >= self._limits.max_pending:
                raise ResourceExhausted("too many API keys waiting to be checked; retry soon")
            future = asyncio.get_running_loop().run_in_executor(self._pool, self._check, api_key)
            self._in_flight[digest] = future
            future.add_done_callback(lambda done: self._done(digest, done))
        self._spend(host, budget)
        client_id = await asyncio.shield(future)
        if client_id is not None:
            budget.tokens = min(self._limits.failure_burst, budget.tokens + 1)
            if generation == self._generation:
                self._verified[digest] = client_id
        return client_id

    def _done(self, digest: str, future: asyncio.Future[str | None]) -> None:
        if self._in_flight.get(digest) is future:
            del self._in_flight[digest]

    def forget(self) -> None:
        """Drop the cached keys (after the set of valid keys changed); checks under way
        answer the calls waiting for them but are neither cached nor shared any more."""
        self._generation += 1
        self._verified.clear()
        self._in_flight.clear()

    def use_keys(self, keys: Iterable[str]) -> tuple[str, ...]:
        """Make `keys` (well-formed `<client id>.<secret>`, one per client: a parsed keys
        file) exactly the valid ones, at once and without hashing: every other key, cached
        or not, is refused from now on, checks under way are no longer shared, and the
        `on_revoke` callbacks of keys that are not valid any more are called. The ids of the
        clients whose key stopped working (removed, or replaced by another), sorted."""
        allowed = {key.partition(".")[0]: _sha256(key) for key in keys}
        stopped = {
            client_id
            for client_id, digest in (self._allowed or {}).items()
            if allowed.get(client_id) != digest
        }
        self._allowed = allowed
        self._generation += 1
        self._in_flight.clear()
        valid = set(allowed.values())
        for digest, client_id in list(self._verified.items()):
            if digest not in valid:
                del self._verified[digest]
                stopped.add(client_id)
        for digest in [d for d in self._revoke_callbacks if d not in valid]:
            for callback in self._revoke_callbacks.pop(digest):
                callback()
        return tuple(sorted(stopped))

    @contextlib.contextmanager
    def on_revoke(self, api_key: str, callback: Callable[[], None]) -> Iterator[None]:
        """Call `callback` (on the event loop, once) if `api_key` stops working while the
        block runs (`use_keys`); for what a call opened with the key and holds open."""
        digest = _sha256(api_key)
        self._revoke_callbacks.setdefault(digest, set()).add(callback)
        try:
            yield
        finally:
            callbacks = self._revoke_callbacks.get(digest)
            if callbacks is not None:
                callbacks.discard(callback)
                if not callbacks:
                    del self._revoke_callbacks[digest]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _budget(self, host: str) -> _Budget:
        """`host`'s failure budget, refilled to now (full for an address not seen lately)."""
        now = self._clock()
        budget = self._budgets.get(host)
        if budget is None:
            return _Budget(self._limits.failure_burst, now)
        budget.tokens = min(
            self._limits.failure_burst,
            budget.tokens + (now - budget.at) * self._limits.failure_refill_per_s,
        )
        budget.at = now
        return budget

    def _spend(self, host: str, budget: _Budget) -> None:
        """Take one check out of `host`'s budget; it stays remembered (the least recently
        charged addresses are forgotten past `max_addresses`)."""
        budget.tokens -= 1
        self._budgets[host] = budget
        self._budgets.move_to_end(host)
        while len(self._budgets) > self._limits.max_addresses:
            self._budgets.popitem(last=False)
        if budget.tokens < 1:
            logger.warning(
                "peer=%s: failed or unfinished API key checks past its budget; throttled", host
            )
