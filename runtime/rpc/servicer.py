"""`inference.GRPCInferenceService` over one `OnnxModel`: thin methods, errors mapped once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from runtime.batching import CLASSES, Batcher, PriorityClass, client_bound, client_queue_full
from runtime.clients import Caller
from runtime.errors import (
    InvalidInput,
    ModelNotFound,
    NotReady,
    QueueFull,
    RateLimited,
    TooLate,
    quote,
)
from runtime.metrics import ModelMetrics
from runtime.model import OnnxModel
from runtime.rpc import convert
from runtime.rpc.auth import CALLER
from runtime.rpc.plans import Plan, Plans, split_request
from runtime.rpc.status import UNDECODABLE, mapped_errors
from runtime.version import __version__

logger = logging.getLogger(__name__)

SERVER_NAME = "edge-offload-runtime"
MODEL_VERSION = "1"
PLATFORM = "onnxruntime_onnx"
RAW_METHODS = frozenset({"/inference.GRPCInferenceService/ModelInfer"})
"""Methods the servicer implements on serialized messages (bytes in, bytes out)."""


class ServingState:
    """What the server may do now: serve once ready, refuse new calls once draining."""

    def __init__(self) -> None:
        self.model: OnnxModel | None = None
        self.inline = False
        """Run inferences on the event loop instead of a worker thread (decided at load, from
        the model's measured compute time; see `runtime.server.load_model`)."""
        self.compute_s = 0.0
        """The model's compute time measured at warm-up (median)."""
        self.batcher: Batcher | None = None
        """Where inferences go when the model batches; None: each runs alone, inline or in a
        worker thread."""
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def ready(self) -> bool:
        return self.model is not None and not self.draining

    def accepting(self) -> OnnxModel:
        """The model, if a new inference may start; NotReady (UNAVAILABLE) otherwise."""
        if self.draining:
            raise NotReady("the server is draining (shutting down); retry on the new endpoint")
        if self.model is None:
            raise NotReady("the model is still loading or warming up; retry shortly")
        return self.model

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one accepted inference until it finishes."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        state: ServingState,
        model_name: str,
        executor: Executor,
        metrics: ModelMetrics,
        max_queued_per_class: int,
    ) -> None:
        """`metrics`: where ModelInfer records its compute time and its waits for a worker
        thread (the call as a whole is measured around the handler: `measure_calls`);
        `max_queued_per_class`: the calls of one priority class that may wait for a worker
        thread (a batching model's queues have the same bound: `runtime.batching`)."""
        self._state = state
        self._name = model_name
        self._executor = executor
        self._metrics = metrics
        self._compute = metrics.compute
        self._queued = metrics.queued
        self._plans = Plans()
        self._max_queued = max_queued_per_class
        self._waiting = dict.fromkeys(CLASSES, 0)
        """Calls per class waiting for a worker thread: raised on the loop, lowered by the
        thread that takes the call (or on the loop for one none took), under `_lock`."""
        self._client_bound = client_bound(max_queued_per_class)
        self._waiting_by_client: dict[tuple[PriorityClass, str], int] = {}
        """Calls of each client (not the deployment's) per class waiting for a worker thread
        (those with some), kept as `_waiting` is."""
        self._lock = threading.Lock()

    def _model(self, name: str, version: str) -> OnnxModel:
        if name != self._name or version not in ("", MODEL_VERSION):
            raise ModelNotFound(
                f"model {quote(name)} version {quote(version or '(any)')} is not served here; "
                f"this server serves {self._name!r} version {MODEL_VERSION!r}"
            )
        return self._state.accepting()

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._state.ready)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        served = request.name == self._name and request.version in ("", MODEL_VERSION)
        return pb.ModelReadyResponse(ready=served and self._state.ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=[])

    @mapped_errors
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        model = self._model(request.name, request.version)
        return pb.ModelMetadataResponse(
            name=self._name,
            versions=[MODEL_VERSION],
            platform=PLATFORM,
            inputs=convert.tensor_metadata(model.inputs),
            outputs=convert.tensor_metadata(model.outputs),
        )

    @mapped_errors
    async def ModelInfer(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Registered without a (de)serializer (`RAW_METHODS`): a request whose header has a
        plan skips parsing and response building (`runtime.rpc.plans`); any other takes the
        full path, which makes the plan for the next one. A client over its rate limit
        (`runtime.clients`) waits first for its token, or is refused RateLimited when that
        is too far off."""
        caller = CALLER.get()
        limit = caller.limit
        if limit is not None:
            wait = limit.reserve()
            if wait is None:
                raise RateLimited(
                    f"client {caller.client_id} is over its rate limit of {limit.rate:g} "
                    "requests/s; retry later"
                )
            if wait:
                await asyncio.sleep(wait)
        split = split_request(raw)
        if split is not None:
            plan = self._plans.get(split[0])
            if plan is not None:
                feeds = plan.feeds(split[1])
                if feeds is not None:
                    model = self._state.accepting()
                    with self._state.track():
                        arrays = await self._run(model, feeds, plan.names, context)
                    return plan.response(arrays)
        try:
            request = pb.ModelInferRequest.FromString(raw)
        except DecodeError as err:
            raise InvalidInput(f"ModelInfer: {UNDECODABLE}") from err
        model = self._model(request.model_name, request.model_version)
        with self._state.track():
            feeds = model.prepare(convert.request_tensors(request))
            names = model.output_names([o.name for o in request.outputs])
            arrays = await self._run(model, feeds, names, context)
        if split is not None and not self._plans.full:
            self._plans.add(split[0], Plan(request, feeds, names, arrays))
        return convert.infer_response(
            request.model_name, request.id, names, arrays
        ).SerializeToString()

    async def _run(
        self,
        model: OnnxModel,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        context: grpc.aio.ServicerContext,
    ) -> list[np.ndarray]:
        """The outputs `names` of `model` on `feeds`, inline or in a worker thread. A call
        whose deadline leaves less than the model's measured compute time when it would start
        computing (at once inline; when a thread takes it otherwise) is TooLate
        (DEADLINE_EXCEEDED) and not computed: under overload the server would otherwise spend
        itself on answers nobody waits for, and the calls behind them would expire too.

        When the model batches, the call joins the queue of its caller's priority class (what
        its token says: `CALLER`) and is computed in a batch (`runtime.batching`)."""
        left = context.time_remaining()
        caller = CALLER.get()
        batcher = self._state.batcher
        if batcher is not None:
            deadline = None if left is None else time.monotonic() + left
            return await batcher.infer(
                feeds, names, caller.priority_class, deadline, caller.client_id
            )
        if not self._state.inline:
            deadline = None if left is None else time.monotonic() + left
            return await self._run_in_worker(model, feeds, names, deadline, caller)
        self._check_in_time(left)
        started = time.perf_counter()
        try:
            return model.run(feeds, names)
        finally:
            self._computed(caller.client_id, time.perf_counter() - started)

    def _computed(self, client: str, seconds: float) -> None:
        """Record an unbatched inference's compute time (any thread)."""
        self._compute.observe(seconds)
        if client:
            self._metrics.client_computed(client, seconds)

    def _check_in_time(self, left: float | None) -> None:
        """TooLate when `left` seconds (None: no deadline) are under the compute time."""
        if left is not None and left < self._state.compute_s:
            raise TooLate(
                f"ModelInfer: {max(left, 0) * 1000:.1f} ms left of the call's deadline, under "
                f"the model's compute time ({self._state.compute_s * 1000:.1f} ms); not computed"
            )

    async def _run_in_worker(
        self,
        model: OnnxModel,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        deadline: float | None,
        caller: Caller,
    ) -> list[np.ndarray]:
        """`model.run` in a worker thread, counted as queued (in all, in its caller's class
        and for a client's call in its client's) until a thread takes it; QueueFull
        (RESOURCE_EXHAUSTED) when the class has `max_queued_per_class` calls waiting
        already, or the client its share of them (`runtime.batching.client_bound`).

        The executor's queue is where calls wait for the concurrency limit (its thread
        count). A call that never reaches a thread (cancelled by its client, or by the
        executor's shutdown at a drain) is taken off the count here; one that did, by the
        thread: a concurrent future that was not cancelled has run or will run. `deadline`
        (`time.monotonic()`, None for none) is checked when the thread takes the call.
        """
        cls = caller.priority_class
        mine = (cls, caller.client_id)
        with self._lock:
            waiting = self._waiting[cls]
            held = self._waiting_by_client.get(mine, 0)
            over = bool(caller.client_id) and held >= self._client_bound
            if waiting < self._max_queued and not over:
                self._waiting[cls] = waiting + 1
                if caller.client_id:
                    self._waiting_by_client[mine] = held + 1
        if over:
            raise client_queue_full(caller.client_id, held, cls, self._max_queued)
        if waiting >= self._max_queued:
            self._metrics.refused_full(cls)
            raise QueueFull(
                f"{waiting} {cls} requests are waiting for a worker thread already, the most "
                f"this replica holds per class (--max-queued-per-class); retry with backoff"
            )
        self._queued.inc()
        try:
            future = self._executor.submit(self._run_queued, model, feeds, names, deadline, caller)
        except BaseException:
            self._taken(caller)
            raise
        try:
            return await asyncio.wrap_future(future)
        finally:
            if future.cancelled():
                self._taken(caller)

    def _taken(self, caller: Caller) -> None:
        """A call of `caller` waits no longer: a thread took it, or none will."""
        self._queued.dec()
        cls = caller.priority_class
        with self._lock:
            self._waiting[cls] -= 1
            if caller.client_id:
                mine = (cls, caller.client_id)
                left = self._waiting_by_client[mine] - 1
                if left:
                    self._waiting_by_client[mine] = left
                else:
                    del self._waiting_by_client[mine]

    def _run_queued(
        self,
        model: OnnxModel,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        deadline: float | None,
        caller: Caller,
    ) -> list[np.ndarray]:
        """In the worker thread: no longer queued; TooLate if too little of the deadline is
        left (the wait for a thread may have used it up); else run, timed."""
        self._taken(caller)
        self._check_in_time(None if deadline is None else deadline - time.monotonic())
        started = time.perf_counter()
        try:
            return model.run(feeds, names)
        finally:
            self._computed(caller.client_id, time.perf_counter() - started)
