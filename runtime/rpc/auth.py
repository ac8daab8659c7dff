"""The bearer-token check on every call but the health check: the deployment's token, and
those of the clients sharing the replica (`runtime.clients`)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Collection, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import grpc

from runtime.batching import DEPLOYMENT, PriorityClass
from runtime.clients import Caller, ClientTable

OPEN_METHODS = frozenset({"/inference.GRPCInferenceService/ServerLive"})

Metadata = Sequence[tuple[str, str | bytes]]

_UNCHECKED = Caller(DEPLOYMENT, PriorityClass.STANDARD)
CALLER: ContextVar[Caller] = ContextVar("caller", default=_UNCHECKED)
"""Who the call being handled comes from, as its token says (`CallerTokens`): its client
id and priority class; set by `require_token` before the handler runs, in the handler's own
context."""


def _supplied(metadata: Metadata | None) -> bytes | None:
    supplied = None
    for key, value in metadata or ():
        if key == "authorization":
            supplied = value.encode() if isinstance(value, str) else value
    return supplied


MISSING_TOKEN = "missing authorization metadata: send 'authorization: Bearer <token>'"
INVALID_TOKEN = "invalid token for this deployment"


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
            return INVALID_TOKEN
        return None


class CallerTokens:
    """The bearer tokens a replica takes, each with what it says of its caller: the
    deployment's token and those of `--class-tokens` (fixed at start, caller id ""), and the
    clients of the clients file (`runtime.clients`, swapped whole by `use_clients`).

    A supplied token is looked up by its SHA-256 digest, so the time a look-up takes tells
    nothing of how much of a valid token a guess got right. A fixed token wins over a
    client's of the same digest."""

    def __init__(self, tokens: Mapping[str, PriorityClass]) -> None:
        if not tokens or any(not token for token in tokens):
            raise ValueError("a replica's tokens must not be empty")
        self._fixed = {
            hashlib.sha256(t.encode()).digest(): Caller(DEPLOYMENT, c) for t, c in tokens.items()
        }
        self._clients: Mapping[bytes, Caller] = {}

    def use_clients(self, table: ClientTable) -> None:
        """Take the clients of `table` from the next call on, instead of those before."""
        self._clients = table.callers

    def caller(self, metadata: Metadata | None) -> tuple[Caller | None, str | None]:
        """(Who the call's token says its caller is, None) for a known token, else
        (None, why the call is refused)."""
        supplied = _supplied(metadata)
        if supplied is None:
            return None, MISSING_TOKEN
        if not supplied.startswith(b"Bearer "):
            return None, INVALID_TOKEN
        digest = hashlib.sha256(supplied[len(b"Bearer ") :]).digest()
        found = self._fixed.get(digest) or self._clients.get(digest)
        if found is None:
            return None, INVALID_TOKEN
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
            if caller is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal or INVALID_TOKEN)
                raise AssertionError("context.abort returned")  # it always raises
            CALLER.set(caller)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            checked,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    return wrap
