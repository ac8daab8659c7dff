"""The node's link to the broker: register, heartbeat, and fetch models by sha256.

`BrokerLink.run` registers (retrying with backoff while the broker is unreachable), then
heartbeats as messages on one `Heartbeats` stream (a unary `Heartbeat` call each, from a
broker that has no stream: UNIMPLEMENTED); when the broker answers NOT_FOUND (it lost its
state, or marked the node lost and dropped it) the node registers again. Heartbeats on the
stream do not wait for the answers to those before them; one unanswered for too long
(`_answer_deadline`: 2 s with several brokers, ten heartbeat intervals with one) ends the
stream, and the next heartbeat opens a new one.

What a heartbeat carries (`Cadence`): to a broker that takes leases (its RegisterResponse
has `lease_renew_ms`), the node's usage sample and replicas only when they changed
(`node_daemon.telemetry.usage_digest`, the replicas' states) or every `--sample-interval`
seconds, and in between a lease renewal (node id alone) every `lease_renew_ms`; the stream
itself is the node's liveness, so a stream that broke is replaced at once. To an older
broker, a full heartbeat every interval it asked for, as before leases.

Liveness beacons (`common.beacons`): the node asks for them at registration and on each
stream's first message; a broker that takes them answers that message with a key
(`HeartbeatResponse.beacon`), and from then on, while the stream lasts, the node's event loop
sends a 33-byte UDP datagram each interval to the broker's host (`BeaconSender`). Those are
its liveness there: its stream then carries a lease renewal only every `lease_renew_ms`
(24 s by default), when no sample went since.

Every call has a deadline; only UNAVAILABLE, DEADLINE_EXCEEDED and CANCELLED are retried,
except a failed TLS handshake (the broker's certificate does not chain to the
node's CA), which no retry mends: it stops the daemon. Over TLS the node presents its
certificate (mutual TLS); the broker checks that it is for this node id.

Every call shows the node's secret (`common.node_identity`, metadata `offload-node-secret`):
the broker binds the node id to it at the first registration and takes the id's heartbeats
and registrations from that secret only. A registration refused ALREADY_EXISTS (another
daemon holds this node id: a cloned host, or the id of a node whose state dir was lost) is
not retried: it stops the daemon, with the broker's message naming the holder.

Several brokers (one PostgreSQL state, one leader): the node is given every address and
calls one at a time; a call refused UNAVAILABLE moves it to the leader a standby named, or to
the next address (`common.brokers.BrokerAddresses`), and the new leader has it register
again when it does not know it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from common.beacons import ID_BYTES, KEY_BYTES, beacon
from common.brokers import BrokerAddresses, leader_hint, parse_broker_addresses
from common.certs import TlsIdentity
from common.node_identity import NODE_SECRET_HEADER
from node_daemon.agent import NodeAgent
from node_daemon.errors import ModelNotCached
from node_daemon.rpc import convert
from node_daemon.telemetry import NodeSample, usage_digest
from protos.offload.v1 import broker_pb2 as bpb
from protos.offload.v1 import broker_pb2_grpc as bpb_grpc
from protos.offload.v1 import node_pb2 as npb
from runtime.tls import is_handshake_failure, open_channel

logger = logging.getLogger(__name__)

RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    # What an overloaded broker's gRPC core answers a call it sheds before the broker sees
    # it (more calls waiting for its event loop than `grpc.server.max_pending_requests`).
    grpc.StatusCode.CANCELLED,
)
CALL_TIMEOUT_S = 10.0
MAX_BACKOFF_S = 5.0
FETCH_TIMEOUT_S = 300.0
"""A model fetch's deadline; a paced one has the largest model's time at its rate on top."""
HEARTBEAT_TIMEOUT_MIN_S = 2.0
STALL_HEARTBEATS = 10
"""With one broker, heartbeat intervals a heartbeat may go unanswered before the stream is
given up (`_answer_deadline`)."""
SAMPLE_INTERVAL_S = 20.0
"""`--sample-interval`'s default: a usage sample that did not change goes to a broker with
leases this often (docs/OPERATIONS.md, "Liveness", says why 20 s: under the node port's
renewal interval, 24 s, so that a quiet node sends one message every 20 s)."""


@dataclass(frozen=True, slots=True)
class Cadence:
    """What the broker asked for at registration."""

    interval_s: float
    """How often the node looks at its replicas and sample (a full heartbeat each time to a
    broker without leases)."""
    renew_s: float = 0.0
    """How often a lease renewal goes when nothing else does; 0: the broker takes no leases."""


class BrokerLink:
    def __init__(
        self,
        brokers: str | Sequence[str],
        join_token: str,
        agent: NodeAgent,
        agent_address: str,
        tls: TlsIdentity | None = None,
        *,
        channel_options: Sequence[tuple[str, object]] = (),
        on_heartbeat: Callable[[float | None], None] | None = None,
        background_fetch_bytes_per_s: float = 0.0,
        node_secret: str = "",
        sample_interval_s: float = SAMPLE_INTERVAL_S,
    ) -> None:
        """`brokers`: the NodeRegistry address of every broker, as a sequence or "A,B,..."
        (ValueError when one is not host:port); `tls`: the node's certificate (presented) and
        the CA the broker's must chain to; None: plaintext. `channel_options` go to every
        channel the link opens (hollow nodes: a connection of their own); `on_heartbeat` is
        told each heartbeat's round trip in ms, or None for one that failed;
        `background_fetch_bytes_per_s`: the average rate a background start's model is
        fetched at (`fetch_model`), 0 for as fast as it comes; `node_secret`: the node's
        secret (`common.node_identity.load_or_create_secret`), which a broker requires;
        `sample_interval_s`: how often an unchanged usage sample goes to a broker with leases
        (> 0; ValueError otherwise)."""
        if background_fetch_bytes_per_s < 0:
            raise ValueError(f"a negative fetch rate: {background_fetch_bytes_per_s}")
        if not sample_interval_s > 0:
            raise ValueError(f"a sample interval must be positive: {sample_interval_s}")
        self._sample_interval_s = sample_interval_s
        self._background_rate = background_fetch_bytes_per_s
        self._channel_options = [
            ("grpc.max_receive_message_length", 8 * 1024 * 1024),
            *channel_options,
        ]
        self._on_heartbeat = on_heartbeat
        self._brokers = BrokerAddresses(parse_broker_addresses(brokers))
        self._metadata = (
            ("authorization", f"Bearer {join_token}"),
            (NODE_SECRET_HEADER, node_secret),
        )
        self._agent = agent
        self._agent_address = agent_address
        self._tls_identity = tls
        self._tls = tls is not None
        self._channel = self._open(self._brokers.current)
        self._stub = bpb_grpc.NodeRegistryStub(self._channel)
        self.registered = asyncio.Event()
        self._usage: NodeSample | None = None
        """The latest sample (`_sample_usage`)."""

    @property
    def broker(self) -> str:
        """The broker called now."""
        return self._brokers.current

    def _open(self, address: str) -> grpc.aio.Channel:
        return open_channel(address, self._tls_identity, self._channel_options)

    async def _move_on(self, err: grpc.aio.AioRpcError) -> None:
        """After a retryable failure: call the leader the broker named, or the next broker
        (a new channel; with one broker, the same one)."""
        before = self._brokers.current
        after = self._brokers.failed(leader_hint(err.trailing_metadata()))
        if after == before:
            return
        logger.info("broker %s: %s; calling broker %s", before, err.details(), after)
        await self._channel.close()
        self._channel = self._open(after)
        self._stub = bpb_grpc.NodeRegistryStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def _register(self) -> Cadence:
        """Register until it succeeds; returns what the broker asked for."""
        backoff = 0.2
        while True:
            replicas = await self._agent.list_replicas()
            request = bpb.RegisterRequest(
                node_id=self._agent.node_id,
                address=self._agent_address,
                site=self._agent.site,
                inventory=convert.inventory(self._agent.inventory),
                runtimes=[self._agent.runtime.name],
                replicas=[convert.replica(v) for v in replicas],
                beacons=True,
            )
            try:
                reply = await self._stub.Register(
                    request, metadata=self._metadata, timeout=CALL_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as err:
                if err.code() not in RETRYABLE or is_handshake_failure(err.details()):
                    raise
                logger.warning(
                    "broker %s unreachable (%s: %s); retrying in %.1fs%s",
                    self.broker,
                    err.code().name,
                    err.details(),
                    backoff,
                    _closed_hint(err.details(), self._tls),
                )
                await self._move_on(err)
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
                continue
            logger.info(
                "node=%s registered with broker %s (%d replica(s))",
                self._agent.node_id,
                self.broker,
                len(replicas),
            )
            self.registered.set()
            interval = max(0.05, reply.heartbeat_interval_ms / 1000)
            renew = max(interval, reply.lease_renew_ms / 1000) if reply.lease_renew_ms else 0.0
            return Cadence(interval, renew)

    async def run(self) -> None:
        """Register, then heartbeat until cancelled. Raises on a non-retryable refusal
        (a wrong join token: UNAUTHENTICATED), which stops the daemon."""
        cadence = await self._register()
        sampler = asyncio.create_task(self._sample_usage(cadence.interval_s), name="usage-sampler")
        try:
            await self._heartbeat(cadence)
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)

    async def _sample_usage(self, interval: float) -> None:
        """Keep `_usage` fresh, and hand each sample to the node's resource manager
        (`NodeAgent.resizer`): the heartbeat interval is the sampling interval. Reading a
        replica may be slow (Docker's stats call, where its cgroup is not visible, takes
        about half a second a replica): heartbeats carry the latest sample instead of
        waiting for one, so a slow engine never makes a live node look lost."""
        while True:
            sampling = time.monotonic()
            try:
                self._usage = await self._agent.usage()
                if self._agent.resizer is not None:
                    await self._agent.resizer.step(self._usage)
            except Exception:  # the next sample may do better; heartbeats go on regardless
                logger.exception("sampling the replicas' usage, or resizing them, failed")
            if (took := time.monotonic() - sampling) > 2 * interval:
                logger.warning("reading the replicas' usage took %.1fs", took)
            await asyncio.sleep(interval)

    async def _heartbeat(self, cadence: Cadence) -> None:
        stream: HeartbeatStream | None = None
        streaming = True
        report = _Reported()
        now_again = False  # the stream broke under a heartbeat: replace it at once
        failing = False  # the last heartbeat failed: try again every interval until one works
        try:
            while True:
                if now_again:
                    force, now_again = True, False
                elif stream is not None:  # woken early when the stream ends
                    await stream.ended_within(cadence.interval_s)
                    # Between renewals too, a stream that ended or whose broker stopped
                    # answering is dropped now (the heartbeat forced raises why).
                    force = stream.ended or stream.overdue(
                        self._answer_deadline(cadence.interval_s)
                    )
                else:
                    await asyncio.sleep(cadence.interval_s)
                    # A broker that was down (restarted, moved) hears from the node within
                    # an interval of its return, not at the next renewal (24 s apart on a
                    # node port): it counts the node lost after --lost-after without it.
                    force = failing
                request = await self._next_heartbeat(cadence, report, streaming, force)
                if request is None:
                    continue
                try:
                    worked = False
                    if streaming:
                        if stream is None:
                            call = self._stub.Heartbeats(metadata=self._metadata)
                            host = self.broker.rpartition(":")[0].strip("[]")
                            stream = HeartbeatStream(call, self._on_heartbeat, host)
                            request.beacons = True
                        worked = stream.answered > 0
                        await stream.beat(request, self._answer_deadline(cadence.interval_s))
                    else:
                        started = time.perf_counter()
                        await self._stub.Heartbeat(
                            request,
                            metadata=self._metadata,
                            timeout=_heartbeat_timeout(cadence.interval_s),
                        )
                        if self._on_heartbeat is not None:
                            self._on_heartbeat((time.perf_counter() - started) * 1000)
                    report.sent(request, time.monotonic())
                    failing = False
                except grpc.aio.AioRpcError as err:
                    failing = True
                    if stream is not None:
                        stream.cancel()
                        stream = None
                        # A stream that worked and broke (the broker restarted, a connection
                        # reset): the broker counts the node lost unless it hears from it
                        # soon (`NodeRegistry.stream_grace_s`), so the next one opens now.
                        now_again = worked and err.code() == grpc.StatusCode.UNAVAILABLE
                    if self._on_heartbeat is not None:
                        self._on_heartbeat(None)
                    if streaming and err.code() == grpc.StatusCode.UNIMPLEMENTED:
                        logger.info(
                            "broker %s has no heartbeat stream: a call per heartbeat", self.broker
                        )
                        streaming = False
                    elif err.code() == grpc.StatusCode.NOT_FOUND:
                        self.registered.clear()
                        cadence = await self._register()
                        report = _Reported()  # a full heartbeat first, to the new record
                    elif err.code() in RETRYABLE:
                        logger.warning(
                            "heartbeat to %s failed: %s (%s)",
                            self.broker,
                            err.code().name,
                            err.details(),
                        )
                        await self._move_on(err)
                    else:
                        raise
        finally:
            if stream is not None:
                stream.cancel()

    async def _next_heartbeat(
        self, cadence: Cadence, report: _Reported, streaming: bool, force: bool
    ) -> bpb.HeartbeatRequest | None:
        """The heartbeat due now: a full one to a broker without leases, or when the replicas
        or the sample changed since the last full one or `sample_interval_s` has passed;
        else a lease renewal when `cadence.renew_s` has passed since the last heartbeat, or
        `force` (the stream ended, or a new one must tell the broker at once); else none."""
        replicas = await self._replicas(cadence.interval_s)
        digest = self._digest()
        now = time.monotonic()
        if (
            not cadence.renew_s
            or not streaming
            or report.changed(replicas, digest)
            or now - report.full_at >= self._sample_interval_s
        ):
            report.full(replicas, digest)
            return bpb.HeartbeatRequest(
                node_id=self._agent.node_id, usage=self._usage_message(), replicas=replicas
            )
        if force or now - report.sent_at >= cadence.renew_s - cadence.interval_s / 2:
            return bpb.HeartbeatRequest(node_id=self._agent.node_id, lease_only=True)
        return None

    def _digest(self) -> tuple[object, ...]:
        """The sample's digest and the resizes the heartbeat would carry: a new resize is a
        change too."""
        resizer = self._agent.resizer
        return (
            None if self._usage is None else usage_digest(self._usage),
            tuple(e.event_id for e in resizer.events()) if resizer is not None else (),
        )

    def _answer_deadline(self, interval: float) -> float:
        """How late the oldest unanswered heartbeat on the stream may be before the stream is
        dropped. With several brokers, soon (`_heartbeat_timeout`): a paused leader is left
        for the next broker before the one that leads counts this node lost. With one, ten
        heartbeats: there is no other broker to go to, and a broker slow to answer still
        counts each heartbeat as it reads it, so dropping the stream would only cost it a
        new call, and the heartbeats not yet read, when it can least afford them."""
        if len(self._brokers.all) > 1:
            return _heartbeat_timeout(interval)
        return max(HEARTBEAT_TIMEOUT_MIN_S, STALL_HEARTBEATS * interval)

    async def _replicas(self, interval: float) -> list[npb.Replica]:
        checking = time.monotonic()
        replicas = await self._agent.list_replicas()
        if (took := time.monotonic() - checking) > interval:
            logger.warning(
                "checking the replicas took %.1fs (heartbeat interval %.1fs): the runtime "
                "is slow to answer",
                took,
                interval,
            )
        return [convert.replica(v) for v in replicas]

    def _usage_message(self) -> npb.UsageResponse:
        if self._usage is None:  # no sample yet: the GPUs as at startup
            return npb.UsageResponse(gpus=[convert.gpu(g) for g in self._agent.inventory.gpus])
        return convert.usage(self._usage, self._agent.resizer)

    async def fetch_model(self, sha256: str, background: bool = False) -> None:
        """Copy a model from the broker into the node's cache. ModelNotCached when the
        broker does not have it either. `background` (the model of a replica started at
        background priority, beside replicas that serve): at the link's background rate,
        so the copy's work (the broker's reads and sends, this daemon's receive, hash and
        write) is spread out instead of taking a core from the replicas that serve."""
        upload = self._agent.cache.upload(sha256)
        pace = None
        timeout = FETCH_TIMEOUT_S
        if background and self._background_rate:
            pace = Pace(self._background_rate, time.monotonic())
            timeout += self._agent.cache.max_bytes / self._background_rate  # the largest, paced
        try:
            stream = self._stub.FetchModel(
                bpb.FetchModelRequest(sha256=sha256), metadata=self._metadata, timeout=timeout
            )
            async for chunk in stream:
                await asyncio.to_thread(upload.write, chunk.data)
                if pace is not None:
                    await asyncio.sleep(pace.wait_s(len(chunk.data), time.monotonic()))
            await asyncio.to_thread(upload.commit)
        except grpc.aio.AioRpcError as err:
            upload.abort()
            if err.code() == grpc.StatusCode.NOT_FOUND:
                raise ModelNotCached(f"model {sha256} is neither here nor at the broker") from err
            raise ModelNotCached(
                f"model {sha256} is not here and fetching it from the broker failed: "
                f"{err.code().name} {err.details()}"
            ) from err
        except grpc.aio.UsageError as err:  # the link was closed: the daemon is stopping
            upload.abort()
            raise ModelNotCached(
                f"model {sha256} is not here and this node is leaving the broker"
            ) from err
        except BaseException:
            upload.abort()
            raise
        logger.info(
            "model %s fetched from broker %s%s",
            sha256[:12],
            self.broker,
            f" at {self._background_rate / 1e6:g} MB/s (background)" if pace else "",
        )


class Pace:
    """Holds a stream of bytes to `bytes_per_s` (> 0) on average from `start`: `wait_s` says
    how long to wait once `count` more bytes have come in at `now`."""

    def __init__(self, bytes_per_s: float, start: float) -> None:
        self._rate = bytes_per_s
        self._start = start
        self._bytes = 0

    def wait_s(self, count: int, now: float) -> float:
        self._bytes += count
        return max(0.0, self._start + self._bytes / self._rate - now)


class HeartbeatStream:
    """Heartbeats on one `Heartbeats` call, each written without waiting for the answers to
    those before it: a broker slow to answer still counts each one when it reads it. A
    reader task matches the answers, which come in order, to the times they were sent."""

    def __init__(
        self,
        call: grpc.aio.StreamStreamCall,
        on_answer: Callable[[float | None], None] | None,
        beacon_host: str = "",
    ) -> None:
        """`beacon_host`: where beacons go, when the broker gives this stream a key (the host
        the node dialled)."""
        self._call = call
        self._on_answer = on_answer
        self._beacon_host = beacon_host
        self.beacons: BeaconSender | None = None
        """This stream's beacons, once the broker gave it a key."""
        self._sent: deque[float] = deque()
        self.answered = 0
        """Heartbeats the broker answered on this stream."""
        self._reader = asyncio.create_task(self._read(), name="heartbeat-answers")

    async def _read(self) -> None:
        try:
            with contextlib.suppress(grpc.aio.AioRpcError):  # the call's status says why
                while (answer := await self._call.read()) is not grpc.aio.EOF:
                    self.answered += 1
                    started = self._sent.popleft() if self._sent else None
                    if self._on_answer is not None and started is not None:
                        self._on_answer((time.perf_counter() - started) * 1000)
                    if answer.HasField("beacon") and self.beacons is None:
                        self.beacons = BeaconSender.start(self._beacon_host, answer.beacon)
        finally:
            if self.beacons is not None:  # the key was this stream's
                self.beacons.stop()

    @property
    def ended(self) -> bool:
        """Whether the broker's side of the stream has ended (`beat` raises why)."""
        return self._reader.done()

    def overdue(self, deadline_s: float) -> bool:
        """Whether the oldest heartbeat unanswered is older than `deadline_s`."""
        return bool(self._sent) and time.perf_counter() - self._sent[0] > deadline_s

    async def ended_within(self, timeout_s: float) -> None:
        """Wait `timeout_s`, or less when the stream ends meanwhile."""
        await asyncio.wait([self._reader], timeout=timeout_s)

    async def beat(self, request: bpb.HeartbeatRequest, deadline_s: float) -> None:
        """Write one heartbeat. AioRpcError when the stream has ended (the broker's status:
        NOT_FOUND, UNAVAILABLE, ...) or the oldest heartbeat unanswered is older than
        `deadline_s`, or the write itself takes that long (DEADLINE_EXCEEDED: the caller
        drops the stream)."""
        if self._reader.done():
            raise await self._ended()
        if self.overdue(deadline_s):
            raise _deadline(f"no answer to a heartbeat within {deadline_s:.1f}s")
        # Noted before the write: its answer may be read before the write returns here.
        self._sent.append(time.perf_counter())
        try:
            async with asyncio.timeout(deadline_s):
                await self._call.write(request)
        except TimeoutError:
            raise _deadline(f"a heartbeat not written within {deadline_s:.1f}s") from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError):
            raise await self._ended() from None  # written after the stream ended
        except grpc.aio.AioRpcError as err:
            raise _broken(err) from None

    async def _ended(self) -> grpc.aio.AioRpcError:
        """The error the ended stream stands for: the broker's status (UNAVAILABLE for one
        that ended OK: the broker went away cleanly)."""
        await asyncio.wait([self._reader])
        code = await self._call.code()
        return _broken(
            grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK else code,
                await self._call.initial_metadata(),
                await self._call.trailing_metadata(),
                await self._call.details() or "the broker ended the heartbeat stream",
            )
        )

    def cancel(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        if self.beacons is not None:
            self.beacons.stop()


class BeaconSender:
    """A stream's beacons (`common.beacons`): one each interval to the broker's UDP port,
    from this event loop (so that a loop that hangs goes silent), until `stop`."""

    def __init__(self, host: str, key: bpb.Beacon) -> None:
        self._address = (host, key.port)
        self._id, self._key = key.id, key.key
        self._interval_s = key.interval_ms / 1000
        self.sent = 0
        """Beacons sent."""
        self._task = asyncio.create_task(self._run(), name="beacons")

    @classmethod
    def start(cls, host: str, key: bpb.Beacon) -> BeaconSender | None:
        """Beacons under `key` to `host`; None (logged: the lease alone counts) for a key
        that is not one (a broker's bug)."""
        if (
            len(key.id) != ID_BYTES
            or len(key.key) != KEY_BYTES
            or not 0 < key.port < 65536
            or not 0 < key.interval_ms <= 60_000
        ):
            logger.warning(
                "the broker's beacon key is malformed (id %d bytes, key %d, port %d, every "
                "%d ms): no beacons, the lease alone counts",
                len(key.id),
                len(key.key),
                key.port,
                key.interval_ms,
            )
            return None
        return cls(host, key)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                asyncio.DatagramProtocol, remote_addr=self._address
            )
        except OSError as err:
            logger.warning(
                "beacons to %s:%d impossible (%s): the lease alone counts", *self._address, err
            )
            return
        try:
            while True:
                self.sent += 1
                transport.sendto(beacon(self._id, self._key, self.sent))
                await asyncio.sleep(self._interval_s)
        finally:
            transport.close()

    def stop(self) -> None:
        self._task.cancel()


def _broken(err: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """`err`, or UNAVAILABLE for an INTERNAL one: a stream whose connection dies under it
    (the broker killed) ends INTERNAL ("Internal error from Core"), which is the transport's
    failure, not the broker's refusal, and must not stop the daemon."""
    if err.code() != grpc.StatusCode.INTERNAL:
        return err
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        err.initial_metadata(),
        err.trailing_metadata(),
        f"the heartbeat stream broke: {err.details()}",
    )


class _Reported:
    """What the node last told the broker on its heartbeats (`BrokerLink._next_heartbeat`)."""

    def __init__(self) -> None:
        self.full_at = -math.inf
        """time.monotonic() of the last full heartbeat (-inf: none yet)."""
        self.sent_at = -math.inf
        """time.monotonic() of the last heartbeat of any kind the broker took."""
        self._replicas: list[npb.Replica] | None = None
        self._digest: tuple[object, ...] | None = None
        self._pending: tuple[list[npb.Replica], tuple[object, ...]] | None = None

    def changed(self, replicas: list[npb.Replica], digest: tuple[object, ...]) -> bool:
        """Whether the replicas or the sample's digest differ from the last full heartbeat's."""
        return self._replicas != replicas or self._digest != digest

    def full(self, replicas: list[npb.Replica], digest: tuple[object, ...]) -> None:
        """A full heartbeat with these is about to go (`sent` once it went)."""
        self._pending = (replicas, digest)

    def sent(self, request: bpb.HeartbeatRequest, now: float) -> None:
        self.sent_at = now
        if not request.lease_only and self._pending is not None:
            self._replicas, self._digest = self._pending
            self.full_at = now
        self._pending = None


def _deadline(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )


def _heartbeat_timeout(interval: float) -> float:
    """A heartbeat's deadline: the broker answers one at once, so one that hangs (a broker
    paused, a host gone without a reset) is given up soon and the next broker tried before
    the one that leads counts this node lost."""
    return min(CALL_TIMEOUT_S, max(HEARTBEAT_TIMEOUT_MIN_S, 2 * interval))


def _closed_hint(details: str | None, tls: bool) -> str:
    """What a connection the broker closed at once may mean: TLS on one side only, or a
    node certificate the broker refused."""
    if "socket closed" not in (details or "").lower():
        return ""
    if tls:
        return " (the broker may refuse this node's certificate, or serve plaintext)"
    return " (the broker may serve TLS: give --tls-cert, --tls-key and --tls-ca)"
