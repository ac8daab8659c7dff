"""Who may register a node id (`Broker.register_node`, `NodeRegistry.check`, `retire`): the
rules the integration tests drive with real daemons, each case on its own, TLS takeover
included (the certificate proves the id once its holder is no longer live)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.errors import AlreadyExists, Impossible, NotFound, Unauthenticated
from broker.service import Broker
from common.inventory import Inventory
from common.node_identity import new_secret
from tests.broker_support import local_broker

NO_GPUS = Inventory(gpus=(), links={}, driver_version="", cuda_version="")


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    async with local_broker(tmp_path) as running:
        yield running


async def register(
    broker: Broker, secret: str, address: str = "127.0.0.1:1000", certified: bool = False
) -> None:
    await broker.register_node(
        "n1", address, "site-a", NO_GPUS, ["process"], [], secret=secret, certified=certified
    )


async def test_a_registration_retried_while_its_first_is_in_flight_binds_once(
    broker: Broker,
) -> None:
    """A slow broker: the node retries its registration before the first one is answered.
    Both carry the same secret; the second sees the id unbound, and its compare-and-swap
    finds it bound by the first: that proves it, so both succeed. Another daemon's secret
    in the same race does not."""
    secret = new_secret()
    await asyncio.gather(register(broker, secret), register(broker, secret))
    broker.registry.check("n1", secret)
    rival = new_secret()
    outcomes = await asyncio.gather(
        register(broker, secret, "127.0.0.1:1000"),
        broker.register_node("n2", "127.0.0.1:3000", "site-a", NO_GPUS, [], [], secret=rival),
        broker.register_node(
            "n2", "127.0.0.1:3001", "site-a", NO_GPUS, [], [], secret=new_secret()
        ),
        return_exceptions=True,
    )
    assert outcomes[0] is None and outcomes[1] is None
    assert isinstance(outcomes[2], AlreadyExists), outcomes[2]
    assert broker.nodes["n2"].record.address == "127.0.0.1:3000"


def go_silent(broker: Broker) -> None:
    broker.nodes["n1"].last_heartbeat = time.monotonic() - 3600


async def test_the_first_secret_binds_and_only_it_registers_or_heartbeats(broker: Broker) -> None:
    secret = new_secret()
    with pytest.raises(Unauthenticated, match="node secret"):
        await register(broker, "")
    await register(broker, secret)
    with pytest.raises(AlreadyExists, match=r"held by the live node at 127\.0\.0\.1:1000"):
        await register(broker, new_secret(), "127.0.0.2:1000")
    assert broker.nodes["n1"].record.address == "127.0.0.1:1000"  # never repointed
    # The rightful node, restarted elsewhere, proves itself while the old stream is live.
    await register(broker, secret, "127.0.0.1:2000")
    assert broker.nodes["n1"].record.address == "127.0.0.1:2000"
    assert broker.nodes["n1"].client.secret == secret
    broker.registry.check("n1", secret)
    with pytest.raises(NotFound, match="register again"):
        broker.registry.check("n1", new_secret())
    # Lost: without TLS still only the secret registers; the message says to retire.
    go_silent(broker)
    with pytest.raises(AlreadyExists, match=r"retire the id \(offload retire n1\)"):
        await register(broker, new_secret())


async def test_with_tls_the_certificate_takes_over_an_id_whose_holder_is_gone(
    broker: Broker,
) -> None:
    old, new = new_secret(), new_secret()
    await register(broker, old, certified=True)
    with pytest.raises(AlreadyExists, match="held by the live node"):
        await register(broker, new, "127.0.0.2:1000", certified=True)
    go_silent(broker)
    await register(broker, new, "127.0.0.2:1000", certified=True)
    broker.registry.check("n1", new)
    with pytest.raises(NotFound):  # the old daemon's stream, if it comes back
        broker.registry.check("n1", old)


async def test_a_retired_id_binds_afresh_and_a_live_one_is_not_retired(broker: Broker) -> None:
    old, new = new_secret(), new_secret()
    with pytest.raises(NotFound, match="unknown"):
        await broker.registry.retire("n1")
    await register(broker, old)
    with pytest.raises(Impossible, match="is live"):
        await broker.registry.retire("n1")
    go_silent(broker)
    await broker.registry.retire("n1")
    await broker.registry.retire("n1")  # idempotent
    with pytest.raises(NotFound):
        broker.registry.check("n1", old)
    await register(broker, new, "127.0.0.2:1000")
    broker.registry.check("n1", new)
