"""Errors of the broker's domain, mapped to gRPC status codes in `broker.rpc.status`.

Hierarchy::

    BrokerError
    ├── InvalidRequest       a field is malformed or inconsistent (INVALID_ARGUMENT)
    ├── Unauthenticated      a missing or wrong join token or API key (UNAUTHENTICATED)
    ├── NotFound             an unknown deployment, model or node; also another client's
    │                        deployment, which must look no different (NOT_FOUND)
    ├── ResourceExhausted    nothing fits now (RESOURCE_EXHAUSTED)
    ├── Impossible           nothing could ever fit: more GPUs than any node has
    │                        (FAILED_PRECONDITION, naming the largest possible)
    └── NodeUnavailable      the chosen node failed to start the replica (UNAVAILABLE)
"""


class BrokerError(Exception):
    """Base class of the broker's errors; the message is meant for the caller."""


class InvalidRequest(BrokerError):
    pass


class Unauthenticated(BrokerError):
    pass


class NotFound(BrokerError):
    pass


class ResourceExhausted(BrokerError):
    pass


class Impossible(BrokerError):
    pass


class NodeUnavailable(BrokerError):
    pass
