"""The one table that maps the broker's errors to gRPC status codes."""

from __future__ import annotations

import grpc

from broker.errors import (
    BrokerError,
    Impossible,
    InvalidRequest,
    NodeUnavailable,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from runtime.rpc.status import StatusTable, error_mapper

STATUS_TABLE: StatusTable = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Impossible, grpc.StatusCode.FAILED_PRECONDITION),
    (NodeUnavailable, grpc.StatusCode.UNAVAILABLE),
    (BrokerError, grpc.StatusCode.INTERNAL),
)

mapped_errors = error_mapper(STATUS_TABLE)
