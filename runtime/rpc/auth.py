"""Per-deployment bearer-token check on every call but the health check."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection

import grpc

OPEN_METHODS = frozenset({"/inference.GRPCInferenceService/ServerLive"})


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata; UNAUTHENTICATED otherwise.

    The comparison takes constant time. Methods in `open_methods` (the liveness check) pass
    without a token; methods the server does not implement stay UNIMPLEMENTED.
    """

    def __init__(self, token: str, open_methods: Collection[str] = OPEN_METHODS) -> None:
        if not token:
            raise ValueError("the deployment token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._open = frozenset(open_methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in self._open:
            return handler
        supplied = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                supplied = value.encode() if isinstance(value, str) else value
        if supplied is None:
            return _deny("missing authorization metadata: send 'authorization: Bearer <token>'")
        if not hmac.compare_digest(supplied, self._expected):
            return _deny("invalid token for this deployment")
        return handler


def _deny(message: str) -> grpc.RpcMethodHandler:
    async def abort(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # Every method this server authenticates is unary-unary; the request is not parsed.
    return grpc.unary_unary_rpc_method_handler(abort)
