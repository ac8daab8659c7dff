"""The one table that maps the node daemon's errors to gRPC status codes (applied by
`runtime.rpc.status.error_mapper`, which also answers unexpected errors)."""

from __future__ import annotations

import grpc

from common.content import InvalidDigest
from node_daemon.errors import (
    AlreadyExists,
    ClientsNotConfirmed,
    GpuShareTooSmall,
    InvalidRequest,
    NotFound,
    ResourceExhausted,
    StartFailed,
    StopFailed,
    Unsupported,
)
from runtime.rpc.status import StatusTable, error_mapper

STATUS_TABLE: StatusTable = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidDigest, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (GpuShareTooSmall, grpc.StatusCode.FAILED_PRECONDITION),
    (StartFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (Unsupported, grpc.StatusCode.FAILED_PRECONDITION),
    (StopFailed, grpc.StatusCode.UNAVAILABLE),
    (ClientsNotConfirmed, grpc.StatusCode.UNAVAILABLE),
)
"""Each error's status, most specific first. A `NodeError` not listed here (a new subclass
someone forgot to map) answers INTERNAL and is logged as the bug it is."""

# A node's messages may carry a replica's log tail: where it listened stays here.
mapped_errors = error_mapper(STATUS_TABLE, hide_addresses=True)
