"""How the broker's RPCs answer failures: the one table from its errors to gRPC status codes,
the decorator that applies it, and the interceptor that refuses requests that do not parse.

No input makes an RPC answer UNKNOWN or INTERNAL:

- a request that is not a valid message (corrupt protobuf, invalid UTF-8 in a string field)
  is INVALID_ARGUMENT (`MalformedRequests`, shared with the runtime and the node daemon;
  grpc would answer UNKNOWN);
- a `BrokerError` gets its code from `STATUS_TABLE` and its message through `client_text`
  (bounded, no escape codes, paths or class names), by the runtime's `error_mapper`;
- anything else is a bug: it is logged with its traceback and a reference, and the caller
  gets INTERNAL with only that reference. The fuzz tests (tests/integration/
  test_broker_fuzz.py) send random fields and random bytes to every RPC and fail on any
  INTERNAL, so a bug that input can reach is found there, not in production.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from broker.errors import (
    AlreadyExists,
    BrokerError,
    Impossible,
    InvalidRequest,
    NodeUnavailable,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StateUnavailable,
    Unauthenticated,
    Unfit,
)
from runtime.rpc.status import MalformedRequests, error_mapper

__all__ = ["STATUS_TABLE", "MalformedRequests", "mapped_errors", "status_of"]

STATUS_TABLE: Sequence[tuple[type[BrokerError], grpc.StatusCode]] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Impossible, grpc.StatusCode.FAILED_PRECONDITION),
    (Unfit, grpc.StatusCode.FAILED_PRECONDITION),
    (NodeUnavailable, grpc.StatusCode.UNAVAILABLE),
    (StateUnavailable, grpc.StatusCode.UNAVAILABLE),
)
"""Each error's status, most specific first."""

mapped_errors = error_mapper(STATUS_TABLE)
"""The decorator every broker servicer method wears."""


def status_of(err: BrokerError) -> grpc.StatusCode:
    """The status a domain error answers with; INTERNAL for a `BrokerError` the table lacks
    (a new subclass someone forgot to map: a bug, logged as one)."""
    return next(
        (code for kind, code in STATUS_TABLE if isinstance(err, kind)), grpc.StatusCode.INTERNAL
    )
