"""Errors of the broker's domain, mapped to gRPC status codes in `broker.rpc.status`, and the
two helpers that keep what an error says fit for a client.

Hierarchy::

    BrokerError
    ├── InvalidRequest       a field is malformed or inconsistent (INVALID_ARGUMENT)
    ├── Unauthenticated      a missing or wrong join token or API key (UNAUTHENTICATED)
    ├── PermissionDenied     a known caller asking for what it may not do; a delete of
    │                        another client's deployment (PERMISSION_DENIED)
    ├── NotFound             an unknown deployment, model or node; also another client's
    │                        deployment to any call but a delete, which must look no
    │                        different (NOT_FOUND)
    ├── AlreadyExists        a node id held by another daemon, which this one cannot prove
    │                        it is (no or another node secret): ALREADY_EXISTS, naming the
    │                        holder's address
    ├── ResourceExhausted    nothing fits now, or a quota is reached (RESOURCE_EXHAUSTED)
    ├── Impossible           nothing could ever fit: more GPUs than any node has
    │   │                    (FAILED_PRECONDITION, naming the largest possible)
    │   └── Busy             the deployment is being migrated or deleted: the same call
    │                        succeeds once that has finished (FAILED_PRECONDITION)
    └── NodeUnavailable      the chosen node failed to start the replica, or could not be
        │                    reached (UNAVAILABLE): placed again
        └── ReplicaFailed    the node ran the replica and it failed by itself (its model
            │                does not load, it exited): placing it again would fail alike
            └── Unfit        the replica cannot run as asked: a GPU memory share below its
                             model's need (refused before placement, or its arena ran out
                             at load), a memory_mib its node cannot enforce
                             (FAILED_PRECONDITION: the same spec fails alike; the message
                             names what was asked and what it needs)

An error's message is meant for the caller: it names the field and quotes at most a short
prefix of an offending value (`quote`). Text that comes from a node (its status details, a
replica's log tail) passes through `client_text` before it is put in a message.
"""

from __future__ import annotations

# One copy of the helpers for every package: runtime.errors imports nothing.
from runtime.errors import MESSAGE_CHARS, QUOTE_CHARS, client_text, quote

__all__ = ["MESSAGE_CHARS", "QUOTE_CHARS", "client_text", "quote"]


class BrokerError(Exception):
    """Base class of the broker's errors; the message is meant for the caller."""


class InvalidRequest(BrokerError):
    pass


class Unauthenticated(BrokerError):
    pass


class PermissionDenied(BrokerError):
    pass


class NotFound(BrokerError):
    pass


class AlreadyExists(BrokerError):
    pass


class ResourceExhausted(BrokerError):
    pass


class Impossible(BrokerError):
    pass


class Busy(Impossible):
    """The deployment is taken by a migration or a delete under way (FAILED_PRECONDITION:
    the same call succeeds once that has finished)."""


class StateUnavailable(BrokerError):
    """The broker's state store failed (a PostgreSQL connection lost, a disk error): nothing
    was changed by the call; retry. The detail goes to the broker's log, not to the caller."""


class NodeUnavailable(BrokerError):
    pass


class ReplicaFailed(NodeUnavailable):
    pass


class Unfit(ReplicaFailed):
    """A ReplicaFailed for every caller that places and moves replicas, but answered
    FAILED_PRECONDITION: the client must change its request, not wait."""
