"""Counting and timing inference calls, as a handler wrapper applied once at registration.

`measure_calls` wraps ModelInfer's handler (for `runtime.rpc.registration.add_servicer`):
between the token check, which runs before it, and the request's parsing, which runs inside
it, so a request that does not parse is counted and one without the token is not. What it
records, and why at these points, is in `runtime.metrics`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Any

import grpc

from runtime.metrics import ModelMetrics
from runtime.rpc.auth import CALLER
from runtime.rpc.registration import HandlerWrapper

MEASURED_METHODS = frozenset({"/inference.GRPCInferenceService/ModelInfer"})
_OK = grpc.StatusCode.OK.name
_UNKNOWN = grpc.StatusCode.UNKNOWN.name


def measure_calls(
    metrics: ModelMetrics, methods: Collection[str] = MEASURED_METHODS
) -> HandlerWrapper:
    """A handler wrapper that counts each call of `methods` (unary-unary) in `metrics`: in
    flight while it runs; then answered, how long it took and, when it failed, its status;
    and per client for a client's call (`CALLER`, set by the token check before it).

    The figures move before the answer leaves: a client that scrapes after its call sees it.
    """

    def wrap(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if method not in methods:
            return handler
        inner = handler.unary_unary
        if inner is None:
            raise TypeError(f"{method}: measure_calls wraps unary-unary methods only")
        # Bound once: the call below does no attribute lookups it can avoid.
        clock = time.perf_counter
        requests_inc = metrics.requests.inc
        observe = metrics.duration.observe
        in_flight_inc = metrics.in_flight.inc
        in_flight_dec = metrics.in_flight.dec
        failed = metrics.failed
        client_answered = metrics.client_answered

        async def measured(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = clock()
            in_flight_inc()
            code = _OK
            try:
                return await inner(request, context)
            except grpc.aio.AbortError:
                aborted = context.code()
                code = aborted.name if aborted is not None else _UNKNOWN
                failed(code)
                raise
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED.name
                failed(code)
                raise
            except BaseException:  # grpc answers UNKNOWN; mapped_errors leaves none such
                code = _UNKNOWN
                failed(code)
                raise
            finally:
                in_flight_dec()
                seconds = clock() - started
                observe(seconds)
                requests_inc()
                client = CALLER.get().client_id
                if client:
                    client_answered(client, code, seconds)

        return grpc.unary_unary_rpc_method_handler(
            measured,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    return wrap
