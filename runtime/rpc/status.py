"""How a servicer answers failures: the decorator that maps errors to gRPC status codes by a
table (the runtime's table is here; the node daemon has its own), and the interceptor that
refuses requests that do not parse. The node daemon uses both.

No input makes an RPC answer UNKNOWN:

- a request that is not a valid message (corrupt protobuf, invalid UTF-8 in a string field)
  is INVALID_ARGUMENT (`parse_in_handler`, or the `MalformedRequests` interceptor that
  applies it per call; grpc alone would answer UNKNOWN);
- an error in the table gets its code, and its message through `client_text` (bounded, no
  escape codes, host paths or exception class names);
- anything else is a bug: it is logged with its traceback and a reference, and the caller
  gets INTERNAL with only that reference. The fuzz tests (tests/integration/
  test_node_fuzz.py) send random fields and random bytes to every RPC and fail on any
  UNKNOWN or INTERNAL answer.
"""

from __future__ import annotations

import functools
import inspect
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError

from runtime.errors import (
    InferenceFailed,
    InvalidInput,
    ModelLoadError,
    ModelNotFound,
    NotReady,
    QueueFull,
    RateLimited,
    TooLate,
    client_text,
)

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
StatusTable = Sequence[tuple[type[Exception], grpc.StatusCode]]


def error_mapper(table: StatusTable, hide_addresses: bool = False) -> Callable[[F], F]:
    """A decorator for servicer methods (coroutines and server-streaming async generators):
    an exception of a type in `table` (first match wins, so list the most specific first)
    aborts the call with its status and its message made fit for a caller (`client_text`;
    `hide_addresses` for a server whose messages may carry a replica's log tail, the node's).

    Any other exception but grpc's own abort is a bug: logged with its traceback under a
    reference, answered INTERNAL with only that reference. Cancellation passes through.
    """

    async def abort(method: str, err: Exception, context: grpc.aio.ServicerContext) -> NoReturn:
        code = next((code for kind, code in table if isinstance(err, kind)), None)
        if code is None:
            reference = secrets.token_hex(4)
            logger.error("%s failed (ref %s)", method, reference, exc_info=err)
            code = grpc.StatusCode.INTERNAL
            message = f"the server failed on this request (ref {reference}; its log has more)"
        else:
            logger.debug("%s -> %s: %s", method, code.name, err)
            message = client_text(str(err), hide_addresses=hide_addresses)
        await context.abort(code, message)
        raise AssertionError("context.abort returned") from err  # it always raises

    def decorate(method: F) -> F:
        name = method.__name__
        if inspect.isasyncgenfunction(method):  # a server-streaming method

            @functools.wraps(method)
            async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async for item in method(self, request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as err:
                    await abort(name, err, context)

            return cast(F, stream)

        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await method(self, request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as err:
                await abort(name, err, context)

        return cast(F, wrapper)

    return decorate


Parse = Callable[[bytes], Any]
UNDECODABLE = (
    "the request is not a valid message (corrupt protobuf, or invalid UTF-8 in a string field)"
)


async def _parsed(parse: Parse, raw: bytes, method: str, context: grpc.aio.ServicerContext) -> Any:
    try:
        return parse(raw)
    except DecodeError:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: {UNDECODABLE}",
        )


async def _each_parsed(
    parse: Parse, raw: AsyncIterator[bytes], method: str, context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    async for message in raw:
        yield await _parsed(parse, message, method, context)


def parse_in_handler(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with no deserializer (grpc then hands it the raw bytes), parsing them itself
    so that a `DecodeError` is answered INVALID_ARGUMENT.

    Unary requests are parsed before the servicer method starts, each message of a client
    stream as the servicer reads it. Handlers without a deserializer are returned unchanged.
    """
    if handler.request_deserializer is None:
        return handler
    parse: Parse = handler.request_deserializer
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        unary_unary = handler.unary_unary

        async def parsed_unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await unary_unary(await _parsed(parse, raw, method, context), context)

        return grpc.unary_unary_rpc_method_handler(
            parsed_unary_unary, response_serializer=serialize
        )
    if handler.unary_stream is not None:
        unary_stream = handler.unary_stream

        async def parsed_unary_stream(
            raw: bytes, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            request = await _parsed(parse, raw, method, context)
            async for response in unary_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            parsed_unary_stream, response_serializer=serialize
        )
    if handler.stream_unary is not None:
        stream_unary = handler.stream_unary

        async def parsed_stream_unary(
            raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> Any:
            return await stream_unary(_each_parsed(parse, raw, method, context), context)

        return grpc.stream_unary_rpc_method_handler(
            parsed_stream_unary, response_serializer=serialize
        )
    if handler.stream_stream is not None:
        stream_stream = handler.stream_stream

        async def parsed_stream_stream(
            raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            async for response in stream_stream(
                _each_parsed(parse, raw, method, context), context
            ):
                yield response

        return grpc.stream_stream_rpc_method_handler(
            parsed_stream_stream, response_serializer=serialize
        )
    return handler


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Refuses requests that do not parse with INVALID_ARGUMENT (`parse_in_handler` on each
    call's handler).

    grpc.aio parses a request before the servicer runs and answers UNKNOWN when its
    deserializer raises. Put it first among the interceptors, so that a call the token check
    refuses is refused before its request is parsed. The runtime, whose calls are on the
    latency path, applies `parse_in_handler` once at registration instead (see
    `runtime.rpc.registration`): an interceptor costs every call its own await chain.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return parse_in_handler(handler_call_details.method, handler)


STATUS_TABLE: StatusTable = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (TooLate, grpc.StatusCode.DEADLINE_EXCEEDED),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RateLimited, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),
    (InferenceFailed, grpc.StatusCode.INTERNAL),
)

mapped_errors = error_mapper(STATUS_TABLE)
