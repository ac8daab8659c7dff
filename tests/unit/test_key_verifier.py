"""`KeyVerifier`: one check per distinct key, verified keys cached, failures throttled per
address, a bound on keys waiting; checks run in its own threads."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from broker.errors import ResourceExhausted
from broker.key_verifier import KeyLimits, KeyVerifier, peer_host

GOOD = "alice.secret-of-alice-0123456789"


class Checks:
    """A key check that counts its calls and blocks until released."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.threads: set[str] = set()
        self.release = threading.Event()

    def __call__(self, api_key: str) -> str | None:
        self.calls[api_key] += 1
        self.threads.add(threading.current_thread().name)
        self.release.wait(10)
        return "alice" if api_key == GOOD else None


@pytest.fixture
def checks() -> Iterator[Checks]:
    checks = Checks()
    yield checks
    checks.release.set()


def test_peer_host_drops_the_port() -> None:
    assert peer_host("ipv4:127.0.0.1:54321") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:[::1]:5678") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/socket") == "unix:/tmp/socket"


async def test_concurrent_calls_with_one_key_share_one_check_in_its_own_pool(
    checks: Checks,
) -> None:
    verifier = KeyVerifier(checks)
    try:
        calls = [
            asyncio.create_task(verifier.client_for(GOOD, f"ipv4:10.0.0.1:{port}"))
            for port in range(1000, 1020)
        ]
        await asyncio.sleep(0)  # each call is waiting for the one check now
        checks.release.set()
        assert await asyncio.gather(*calls) == ["alice"] * 20
        assert checks.calls == {GOOD: 1}
        assert all(name.startswith("key-check") for name in checks.threads)
        # Verified once, cached after.
        assert await verifier.client_for(GOOD, "ipv4:10.0.0.2:1") == "alice"
        assert checks.calls == {GOOD: 1}
        verifier.forget()
        assert await verifier.client_for(GOOD, "ipv4:10.0.0.2:1") == "alice"
        assert checks.calls == {GOOD: 2}
    finally:
        verifier.close()


async def test_an_address_that_fails_too_often_is_refused_without_a_check(
    checks: Checks,
) -> None:
    checks.release.set()
    now = [0.0]
    verifier = KeyVerifier(
        checks, KeyLimits(failure_burst=3, failure_refill_per_s=1.0), clock=lambda: now[0]
    )
    try:
        assert await verifier.client_for(GOOD, "ipv4:10.0.0.9:1") == "alice"
        for n in range(3):
            assert await verifier.client_for(f"alice.wrong-{n:016}", "ipv4:10.0.0.1:1") is None
        with pytest.raises(ResourceExhausted, match="API key checks from this address"):
            await verifier.client_for("alice.wrong-again-000000", "ipv4:10.0.0.1:2")
        assert checks.calls["alice.wrong-again-000000"] == 0
        # Other addresses, and keys verified before, are not held back.
        assert await verifier.client_for("bob.wrong-0000000000000", "ipv4:10.0.0.2:1") is None
        assert await verifier.client_for(GOOD, "ipv4:10.0.0.1:3") == "alice"
        # The budget comes back with time.
        now[0] += 1.0
        assert await verifier.client_for("alice.wrong-again-000000", "ipv4:10.0.0.1:2") is None
    finally:
        verifier.close()


async def test_an_address_never_has_more_checks_unfinished_than_its_budget(
    checks: Checks,
) -> None:
    """Charged only when a check failed, 10 concurrent bogus keys from one address all
    queued for the pool before any failed; the budget must bound them while they wait."""
    now = [0.0]
    verifier = KeyVerifier(
        checks, KeyLimits(failure_burst=3, failure_refill_per_s=1.0), clock=lambda: now[0]
    )
    try:
        calls = [
            asyncio.create_task(verifier.client_for(f"alice.wrong-{n:016}", f"ipv4:10.0.0.1:{n}"))
            for n in range(10)
        ]
        done, waiting = await asyncio.wait(calls, timeout=0.5)
        assert len(waiting) == 3
        for call in done:
            with pytest.raises(ResourceExhausted, match="unfinished API key checks"):
                call.result()
        # Another address is not held back by this one's queue.
        other = asyncio.create_task(verifier.client_for(GOOD, "ipv4:10.0.0.2:1"))
        await asyncio.sleep(0)
        checks.release.set()
        assert await asyncio.gather(*waiting) == [None, None, None]
        assert await other == "alice"
        assert sum(checks.calls.values()) == 4
        # A valid key gives back what its check took: the budget is not spent by it.
        now[0] += 3.0
        verifier.forget()  # GOOD is checked again, not served from the cache
        assert await verifier.client_for(GOOD, "ipv4:10.0.0.1:20") == "alice"
        assert checks.calls[GOOD] == 2
        for n in range(3):
            assert await verifier.client_for(f"bob.wrong-{n:018}", "ipv4:10.0.0.1:21") is None
    finally:
        verifier.close()


async def test_too_many_distinct_keys_waiting_are_refused(checks: Checks) -> None:
    verifier = KeyVerifier(checks, KeyLimits(workers=1, max_pending=2))
    try:
        waiting = [
            asyncio.create_task(verifier.client_for(f"alice.key-{n:016}", f"ipv4:10.0.0.{n}:1"))
            for n in range(2)
        ]
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="too many API keys waiting"):
            await verifier.client_for("alice.key-0000000000000009", "ipv4:10.0.0.9:1")
        checks.release.set()
        assert await asyncio.gather(*waiting) == [None, None]
    finally:
        verifier.close()


async def test_a_check_under_way_when_keys_are_forgotten_is_not_cached(checks: Checks) -> None:
    verifier = KeyVerifier(checks)
    try:
        before = asyncio.create_task(verifier.client_for(GOOD, "ipv4:10.0.0.1:1"))
        await asyncio.sleep(0)  # its check is under way
        verifier.forget()  # e.g. the keys file was reloaded meanwhile
        checks.release.set()
        assert await before == "alice"
        assert await verifier.client_for(GOOD, "ipv4:10.0.0.1:1") == "alice"
        assert checks.calls == {GOOD: 2}
    finally:
        verifier.close()


async def test_keys_of_a_file_decide_at_once_and_a_reload_revokes_without_a_check(
    checks: Checks,
) -> None:
    """With a keys file, no key waits for a hash: the file's keys are valid, any other is
    refused; a reload drops a removed or replaced key from the cache before any check."""
    bob, bob_rotated = "bob.secret-of-bob-00000000000", "bob.secret-of-bob-11111111111"
    carol = "carol.secret-of-carol-000000000"
    verifier = KeyVerifier(checks)
    revoked: list[str] = []
    try:
        assert verifier.use_keys([GOOD, bob, carol]) == ()
        for key, client in ((GOOD, "alice"), (bob, "bob"), (carol, "carol")):
            assert await verifier.client_for(key, "ipv4:10.0.0.1:1") == client
        assert await verifier.client_for(bob_rotated, "ipv4:10.0.0.1:1") is None
        with (
            verifier.on_revoke(bob, lambda: revoked.append("bob")),
            verifier.on_revoke(GOOD, lambda: revoked.append("alice")),
        ):
            # carol removed, bob's key replaced: both refused from the next call on.
            assert verifier.use_keys([GOOD, bob_rotated]) == ("bob", "carol")
            assert revoked == ["bob"]
            assert await verifier.client_for(carol, "ipv4:10.0.0.1:1") is None
            assert await verifier.client_for(bob, "ipv4:10.0.0.1:1") is None
            assert await verifier.client_for(bob_rotated, "ipv4:10.0.0.1:1") == "bob"
            assert await verifier.client_for(GOOD, "ipv4:10.0.0.1:1") == "alice"
        assert checks.calls == {}  # not one key went to the store's check
        # A refusal by the file is a failed check for the address's budget all the same.
        for n in range(20):
            assert await verifier.client_for(f"dave.wrong-{n:016}", "ipv4:10.0.0.7:1") is None
        with pytest.raises(ResourceExhausted, match="API key checks from this address"):
            await verifier.client_for("dave.wrong-again-000000", "ipv4:10.0.0.7:1")
    finally:
        verifier.close()
