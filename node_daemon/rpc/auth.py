"""Who may call NodeAgent: the broker only.

- `AgentTokenInterceptor`: every call needs `authorization: Bearer <agent token>`. A node
  that joins a broker takes its node secret as the token (`common.node_identity`): the broker
  learns it when the node registers and no other node has it; a standalone node takes its
  `--agent-token-file`. The comparison is the runtime's (`runtime.rpc.auth.BearerToken`,
  constant time); the refusal is the node's own, so a caller is never told of a deployment.
- `BrokerCertificateInterceptor` (mutual TLS): the caller's certificate, which the listener
  verified against the CA, must carry the broker role (`offload certs issue --role broker`,
  `common.certs.certificate_roles`): another node's certificate is PERMISSION_DENIED.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from common.certs import certificate_roles
from runtime.rpc.auth import BearerToken

MISSING = "missing authorization metadata: send 'authorization: Bearer <this node's agent token>'"
WRONG = "invalid agent token for this node"
NO_CERTIFICATE = "NodeAgent takes calls from the broker only: present its certificate"
NOT_BROKER = (
    "NodeAgent takes calls from the broker only: this certificate is not a broker's "
    "(offload certs issue NAME --role broker)"
)


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


def _deny(
    handler: grpc.RpcMethodHandler,
    message: str,
    code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call without reading its
    request (a client stream, PutModel's chunks, is never read)."""

    async def abort(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class BrokerCertificateInterceptor(grpc.aio.ServerInterceptor):
    """PERMISSION_DENIED, before the request is read, for a call whose certificate does not
    carry the broker role (UNAUTHENTICATED for one without a certificate: a listener that
    requires client certificates never lets such a call through). The role check needs the
    call's TLS context, which only the handler sees: the handler is wrapped."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.response_streaming:  # NodeAgent has none: refuse rather than guess
            return _deny(handler, NOT_BROKER, grpc.StatusCode.PERMISSION_DENIED)
        if handler.request_streaming:
            behavior, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
        else:
            behavior, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            certificates = context.auth_context().get("x509_pem_cert") or []
            if not certificates:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, NO_CERTIFICATE)
            if "broker" not in _roles(bytes(certificates[0])):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, NOT_BROKER)
            return await behavior(request, context)

        return make(
            checked,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


@functools.lru_cache(maxsize=64)
def _roles(certificate_pem: bytes) -> frozenset[str]:
    """A certificate's roles, parsed once per certificate (the broker presents the same one
    on every call)."""
    return certificate_roles(certificate_pem)
