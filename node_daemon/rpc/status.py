"""The one table that maps the node daemon's errors to gRPC status codes."""

from __future__ import annotations

import grpc

from node_daemon.errors import (
    AlreadyExists,
    InvalidRequest,
    NodeError,
    NotFound,
    ResourceExhausted,
    StartFailed,
    Unsupported,
)
from runtime.rpc.status import StatusTable, error_mapper

STATUS_TABLE: StatusTable = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (StartFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (Unsupported, grpc.StatusCode.FAILED_PRECONDITION),
    (NodeError, grpc.StatusCode.INTERNAL),
)

mapped_errors = error_mapper(STATUS_TABLE)
