"""Error-to-status mapping for servicers, and the runtime's own table."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from runtime.errors import (
    InferenceFailed,
    InvalidInput,
    ModelLoadError,
    ModelNotFound,
    NotReady,
    RuntimeServerError,
)

logger = logging.getLogger(__name__)

R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]
StatusTable = Sequence[tuple[type[Exception], grpc.StatusCode]]


def error_mapper(table: StatusTable) -> Callable[[Handler[R]], Handler[R]]:
    """A decorator for servicer methods: an exception of a type in `table` (first match
    wins, so list the most specific first) aborts the call with its status and message.

    Anything else propagates, and grpc reports it as UNKNOWN: a bug, not a caller's mistake.
    """
    kinds = tuple(kind for kind, _ in table)

    def decorate(method: Handler[R]) -> Handler[R]:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
            try:
                return await method(self, request, context)
            except kinds as err:
                code = next(code for kind, code in table if isinstance(err, kind))
                logger.debug("%s -> %s: %s", method.__name__, code.name, err)
                await context.abort(code, str(err))
                raise AssertionError("context.abort returned") from err  # it always raises

        return wrapper

    return decorate


STATUS_TABLE: StatusTable = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),
    (InferenceFailed, grpc.StatusCode.INTERNAL),
    (RuntimeServerError, grpc.StatusCode.INTERNAL),
)

mapped_errors = error_mapper(STATUS_TABLE)
