"""Error-to-status mapping for servicers, and the runtime's own table."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

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
F = TypeVar("F", bound=Callable[..., Any])
StatusTable = Sequence[tuple[type[Exception], grpc.StatusCode]]


def error_mapper(table: StatusTable) -> Callable[[F], F]:
    """A decorator for servicer methods: an exception of a type in `table` (first match
    wins, so list the most specific first) aborts the call with its status and message.

    Anything else propagates, and grpc reports it as UNKNOWN: a bug, not a caller's mistake.
    """
    kinds = tuple(kind for kind, _ in table)

    async def abort(method: Any, err: Exception, context: grpc.aio.ServicerContext) -> None:
        code = next(code for kind, code in table if isinstance(err, kind))
        logger.debug("%s -> %s: %s", method.__name__, code.name, err)
        await context.abort(code, str(err))
        raise AssertionError("context.abort returned") from err  # it always raises

    def decorate(method: F) -> F:
        if inspect.isasyncgenfunction(method):  # a server-streaming method

            @functools.wraps(method)
            async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async for item in method(self, request, context):
                        yield item
                except kinds as err:
                    await abort(method, err, context)

            return cast(F, stream)

        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
            try:
                return await method(self, request, context)
            except kinds as err:
                await abort(method, err, context)
                raise  # not reached: abort raises

        return cast(F, wrapper)

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
