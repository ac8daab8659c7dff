"""The words of adaptive offload that the edge client reports and the broker accepts.

An edge client with a local model decides per request where it runs (`edge_client.adaptive`)
and reports how many requests ran where, and why (`ObservationReport.offload`). The broker
refuses a report with a word outside these sets (INVALID_ARGUMENT), so both sides must agree:
`tests/unit/test_broker_validate.py` pins the client's enums to them. Plain strings, as they
travel in the protocol.
"""

from __future__ import annotations

POLICIES = frozenset({"remote", "local", "fastest", "remote-then-local"})
"""How a client chooses: always its replica, always its own model, the faster of the two, or
its replica with the local model as a fallback."""

TARGETS = frozenset({"remote", "local"})
"""Where a request ran: the deployment's replica, or the device's own model."""

REASONS = frozenset({"policy", "faster", "measuring", "probe", "remote-down", "fallback"})
"""Why it ran there (`edge_client.adaptive.Reason` says what each one means)."""
