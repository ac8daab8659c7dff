"""The one table that maps the runtime's errors to gRPC status codes."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
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

# Most specific first; the first match wins.
STATUS_TABLE: tuple[tuple[type[RuntimeServerError], grpc.StatusCode], ...] = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),
    (InferenceFailed, grpc.StatusCode.INTERNAL),
    (RuntimeServerError, grpc.StatusCode.INTERNAL),
)


def status_for(error: RuntimeServerError) -> grpc.StatusCode:
    return next(code for kind, code in STATUS_TABLE if isinstance(error, kind))


R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def mapped_errors(method: Handler[R]) -> Handler[R]:
    """Decorate a servicer method so our errors abort the call with their mapped status.

    Anything else propagates, and grpc reports it as UNKNOWN: a bug, not a caller's mistake.
    """

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except RuntimeServerError as err:
            code = status_for(err)
            logger.debug("%s -> %s: %s", method.__name__, code.name, err)
            await context.abort(code, str(err))
            raise AssertionError("context.abort returned") from err  # abort always raises

    return wrapper
