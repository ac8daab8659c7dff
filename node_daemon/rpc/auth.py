"""The NodeAgent's token check: every call needs `authorization: Bearer <agent token>`.

The comparison is the runtime's (`runtime.rpc.auth.BearerToken`, constant time); the refusal
is the node's own, so a caller is never told of a deployment: the agent token is the node's,
shared with the broker only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from runtime.rpc.auth import BearerToken

MISSING = "missing authorization metadata: send 'authorization: Bearer <this node's agent token>'"
WRONG = "invalid agent token for this node"


class AgentTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED, before the request is parsed, for a call without the agent token;
    methods the server does not implement stay UNIMPLEMENTED."""

    def __init__(self, token: str) -> None:
        self._token = BearerToken(token)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        if handler is None or self._token.refusal(metadata) is None:
            return handler
        given = any(key == "authorization" for key, _value in metadata or ())
        return _deny(handler, WRONG if given else MISSING)


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call without reading its
    request (a client stream, PutModel's chunks, is never read)."""

    async def abort(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)
