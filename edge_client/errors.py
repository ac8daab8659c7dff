"""The edge client's errors: every failure the client reports is one of these.

`edge_client.client` maps each gRPC status to one of them in one table (`STATUS_ERRORS`
there) and raises it `from` the `grpc.RpcError`, which never leaves the client.

Hierarchy::

    OffloadError
    ├── InvalidInput         a request field or tensor was refused (INVALID_ARGUMENT), or the
    │                        client cannot encode the inputs or decode the outputs
    ├── Unauthenticated      a missing or wrong API key or replica token (UNAUTHENTICATED)
    ├── PermissionDenied     the key may not do this (PERMISSION_DENIED)
    ├── NotFound             an unknown deployment or model, or another client's (NOT_FOUND)
    ├── AlreadyExists        a name taken already, e.g. a service's (ALREADY_EXISTS)
    ├── ResourceExhausted    nothing fits now (RESOURCE_EXHAUSTED)
    ├── FailedPrecondition   nothing could ever fit, or the operation does not apply now
    │                        (FAILED_PRECONDITION)
    ├── Unavailable          the broker or the replica cannot be reached, or refused the call
    │                        for now (UNAVAILABLE; for inference also CANCELLED by the other
    │                        side), after the client's own retries
    ├── DeadlineExceeded     the call's deadline passed (DEADLINE_EXCEEDED); never retried
    ├── ServerError          any other status (INTERNAL, UNKNOWN, UNIMPLEMENTED ...): a bug
    │                        or a version mismatch on the other side
    ├── NotConnected         the client is not connected: connect() was not called, or
    │                        close() was
    └── NotDeployed          no deployment to infer on: call deploy() or attach() first
"""


class OffloadError(Exception):
    """Base class of the edge client's errors; the message names the action and the cause."""


class InvalidInput(OffloadError):
    pass


class Unauthenticated(OffloadError):
    pass


class PermissionDenied(OffloadError):
    pass


class NotFound(OffloadError):
    pass


class AlreadyExists(OffloadError):
    pass


class ResourceExhausted(OffloadError):
    pass


class FailedPrecondition(OffloadError):
    pass


class Unavailable(OffloadError):
    pass


class DeadlineExceeded(OffloadError):
    pass


class ServerError(OffloadError):
    pass


class NotConnected(OffloadError):
    pass


class NotDeployed(OffloadError):
    pass
