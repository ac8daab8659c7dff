"""Per-deployment bearer-token check on every call but the health check."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Collection, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import grpc

OPEN_METHODS = frozenset({"/inference.GRPCInferenceService/ServerLive"})

Metadata = Sequence[tuple[str, str | bytes]]

CALLER: ContextVar[str] = ContextVar("caller", default="")
"""What the token of the call being handled says its caller is (`CallerTokens`); set by
`require_token` before the handler runs, in the handler's own context."""


def _supplied(metadata: Metadata | None) -> bytes | None:
    supplied = None
    for key, value in metadata or ():
        if key == "authorization":
            supplied = value.encode() if isinstance(value, str) else value
    return supplied


MISSING_TOKEN = "missing authorization metadata: send 'authorization: Bearer <token>'"


class BearerToken:
    """What a call must carry: `authorization: Bearer <token>`. The comparison takes constant
    time."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the deployment token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def refusal(self, metadata: Metadata | None) -> str | None:
        """Why a call with this metadata is refused; None when its token is right."""
        supplied = _supplied(metadata)
        if supplied is None:
            return MISSING_TOKEN
        if not hmac.compare_digest(supplied, self._expected):
            return "invalid token for this deployment"
        return None


class CallerTokens:
    """The bearer tokens a replica takes, each with what it says of its caller (its priority
    class): the deployment's token, and those of the clients sharing the replica.

    A supplied token is looked up by its SHA-256 digest, so the time a look-up takes tells
    nothing of how much of a valid token a guess got right."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        if not tokens or any(not token for token in tokens):
            raise ValueError("a replica's tokens must not be empty")
        self._callers = {self._digest(f"Bearer {t}".encode()): c for t, c in tokens.items()}

    @staticmethod
    def _digest(value: bytes) -> bytes:
        return hashlib.sha256(value).digest()

    def caller(self, metadata: Metadata | None) -> tuple[str, str | None]:
        """(What the call's token says of its caller, None) for a known token, else
        ("", why the call is refused)."""
        supplied = _supplied(metadata)
        if supplied is None:
            return "", MISSING_TOKEN
        found = self._callers.get(self._digest(supplied))
        if found is None:
            return "", "invalid token for this deployment"
        return found, None


def require_token(
    tokens: CallerTokens, open_methods: Collection[str] = OPEN_METHODS
) -> Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]:
    """A handler wrapper (for `runtime.rpc.registration.add_servicer`) that checks the token
    before anything else runs, the request's parsing included, and sets `CALLER` to what
    the token says of its caller. Unary-unary methods only."""

    def wrap(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if method in open_methods:
            return handler
        inner = handler.unary_unary
        if inner is None:
            raise TypeError(f"{method}: require_token wraps unary-unary methods only")

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            caller, refusal = tokens.caller(context.invocation_metadata())
            if refusal is not None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
            CALLER.set(caller)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            checked,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    return wrap
