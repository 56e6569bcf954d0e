"""The gRPC face of a shard: decode frames, call the shard, encode answers, map errors.

Each method converts wire messages to domain values, calls one Shard method and turns
domain errors into status codes. Status codes appear nowhere else in the server.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from prometheus_client import Histogram

from protos import codec, marks, modes, rpc
from protos import pstrain_pb2 as pb
from protos.codec import Frame, WireError
from protos.parts import cut
from protos.parts import join as joined
from protos.security import peer_rank
from protos.transport import TransportError
from protos.transport.lane import LaneContext
from ps import wire
from ps.bulk import BulkEndpoint
from ps.checkpoint import CheckpointError, ShardState
from ps.concurrency import CallGate
from ps.errors import (
    CallEndedError,
    ClockWaitTimeoutError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    PSError,
    ResourceExhaustedError,
    RolledBackError,
    ServerBusyError,
    StreamEndedError,
    out_of_memory,
)
from ps.shard import Shard

log = logging.getLogger(__name__)

_STATUS: dict[type[PSError], grpc.StatusCode] = {
    # The server's own disk holds no usable checkpoint for the request: not the caller's
    # input, not a server bug.
    CheckpointError: grpc.StatusCode.FAILED_PRECONDITION,
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    StreamEndedError: grpc.StatusCode.CANCELLED,
    CallEndedError: grpc.StatusCode.CANCELLED,
}

R = TypeVar("R")


@dataclass(frozen=True)
class WireLimits:
    chunk_bytes: int
    max_message_bytes: int
    max_request_bytes: int
    # A streamed request that sends no part for this long is cancelled: a stalled client
    # must not hold a handler thread.
    stream_idle_s: float = 60.0


class _StreamWatch:
    """Cancels streamed calls that have gone quiet. One daemon thread, running while some
    stream is open; thread-safe."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        # Guards _due and _thread: call id -> (deadline, the call's cancel).
        self._lock = threading.Lock()
        self._due: dict[int, tuple[float, Callable[[], None]]] = {}
        self._thread: threading.Thread | None = None

    def progress(self, key: int, cancel: Callable[[], None]) -> None:
        """The call `key` made progress: its deadline moves on."""
        with self._lock:
            self._due[key] = (time.monotonic() + self.idle_s, cancel)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ps-stream-watch",
                                                daemon=True)
                self._thread.start()

    def done(self, key: int) -> None:
        with self._lock:
            self._due.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.idle_s / 4))
            now = time.monotonic()
            with self._lock:
                late = [(k, cancel) for k, (due, cancel) in self._due.items() if due <= now]
                for key, _ in late:
                    del self._due[key]
                if not self._due and not late:
                    self._thread = None  # the next stream starts another
                    return
            for _, cancel in late:
                log.warning("a streamed exchange sent nothing for %.0f s; cancelling it",
                            self.idle_s)
                cancel()


# Longest a bulk transfer of one request may take once the server starts it.
BULK_TIMEOUT_S = 30.0


def _abort(context: grpc.ServicerContext | LaneContext, exc: Exception) -> NoReturn:
    if isinstance(exc, ClockWaitTimeoutError):
        context.set_trailing_metadata(((marks.CLOCK_WAIT, "1"),))
    if isinstance(exc, RolledBackError):
        context.set_trailing_metadata(((marks.ROLLED_BACK, "1"),))
    if isinstance(exc, CheckpointError):
        context.set_trailing_metadata(((marks.CHECKPOINT_UNREADABLE, "1"),))
    if isinstance(exc, ServerBusyError):
        context.set_trailing_metadata(((marks.BUSY, "1"),))
    if isinstance(exc, TransportError):
        context.set_trailing_metadata(((marks.BULK_FAILED, "1"),))
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, WireError):
        code = grpc.StatusCode.INVALID_ARGUMENT
    else:
        code = next(
            (c for cls, c in _STATUS.items() if isinstance(exc, cls)), grpc.StatusCode.INTERNAL
        )
    context.abort(code, str(exc))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def _guard(call: Callable[[], R], context: grpc.ServicerContext) -> R:
    try:
        return call()
    except (PSError, WireError, TransportError) as exc:
        _abort(context, exc)
    except (MemoryError, OSError, RuntimeError) as exc:
        if not out_of_memory(exc):
            raise
        _abort(context, ResourceExhaustedError(
            f"this server could not allocate memory for the request ({exc}); give it a "
            "--memory-budget (requests over it are then refused before anything is "
            "allocated), free memory on its host, or add servers"))


class _ByteCounter:
    def __init__(self) -> None:
        # Guards received and sent.
        self._lock = threading.Lock()
        self.received = 0
        self.sent = 0

    def add(self, received: int = 0, sent: int = 0) -> None:
        with self._lock:
            self.received += received
            self.sent += sent


class ParameterServerServicer:
    """Serves one Shard over gRPC. Thread-safe: gRPC calls it from its thread pool."""

    def __init__(self, shard: Shard, limits: WireLimits, version: str,
                 load: Callable[[str, str], ShardState],
                 bulk: BulkEndpoint | None = None, gate: CallGate | None = None,
                 tls: bool = False) -> None:
        self.shard = shard
        # Whether callers present certificates (which may bind them to a rank).
        self.tls = tls
        # Data calls in flight, per client and in all (None: unlimited).
        self.gate = gate
        # This shard's state in checkpoint (id, sha256), from the server's own directory.
        self.load = load
        # Bulk transports other than inline gRPC; None serves everything inline.
        self.bulk = bulk
        self.limits = limits
        self.version = version
        self.bytes = _ByteCounter()
        self._watch = _StreamWatch(limits.stream_idle_s)
        # Request latency by method, when the server exports metrics.
        self.latency: Histogram | None = None

    def _acting_as(self, context: Any, worker: int) -> None:
        """Refuses a caller whose certificate binds it to another rank than `worker` (the
        certificates `pstrain certs --workers` makes; others may act as any rank). Without
        TLS there are no certificates, and the call costs nothing."""
        if not self.tls:
            return
        auth = getattr(context, "auth_context", None)
        rank = peer_rank(auth()) if auth is not None else None
        if rank is not None and rank != worker:
            raise PermissionDeniedError(
                f"this client's certificate is worker rank {rank}'s; it may not act as worker "
                f"{worker}")

    # ---- control ---------------------------------------------------------------------------

    def info(self) -> pb.ServerInfo:
        cfg = self.shard.config
        return pb.ServerInfo(
            shard=cfg.shard, num_shards=cfg.num_shards, incarnation=cfg.incarnation,
            job=cfg.job, version=self.version, max_message_bytes=self.limits.max_message_bytes,
            chunk_bytes=self.limits.chunk_bytes, consistency=modes.to_proto(cfg.mode)[0],
            workers=cfg.quorum.workers, backups=cfg.quorum.backups, staleness=cfg.staleness,
            open_clock=self.shard.clock_state().open_clock,
        )

    def GetServerInfo(self, request: Frame[pb.ServerInfoRequest], context: Any) -> bytes:
        return self.info().SerializeToString()

    def DeclareTables(self, request: Frame[pb.DeclareTablesRequest], context: Any) -> bytes:
        def declare() -> bytes:
            specs = [wire.spec_from_proto(t) for t in request.msg.tables]
            placements = self.shard.declare(specs)
            return pb.DeclareTablesResponse(
                tables=[
                    pb.TablePlacement(name=s.name, row_start=p.start, row_end=p.end)
                    for s, p in zip(specs, placements, strict=True)
                ]
            ).SerializeToString()

        return _guard(declare, context)

    def GetStats(self, request: Frame[pb.StatsRequest], context: Any) -> bytes:
        state = self.shard.clock_state(history=request.msg.history)
        response = pb.StatsResponse(
            info=self.info(),
            tables=[wire.stats_to_proto(s, mode) for s, mode in self.shard.stats()],
            bytes_received=self.bytes.received,
            bytes_sent=self.bytes.sent,
            open_clock=state.open_clock,
            clocks_closed=state.clocks_closed,
            clocks=wire.clocks_to_proto(state),
        )
        if request.msg.history:
            response.history.extend(
                pb.ClockRecord(clock=c, workers=used, dropped=dropped)
                for c, used, dropped in state.history
            )
        if request.msg.pull_log:
            response.pull_log.extend(
                pb.PullRecord(table=r.table, worker=r.worker, clock=r.clock,
                              min_live_clock=r.min_live_clock)
                for r in self.shard.pull_log()
            )
        return response.SerializeToString()

    def Join(self, request: Frame[pb.JoinRequest], context: Any) -> bytes:
        msg = request.msg

        def join() -> tuple[int, int, bool, bytes]:
            self._acting_as(context, msg.worker)
            return self.shard.join(msg.worker, msg.incarnation, msg.generation)

        clock, open_clock, live, position = _guard(join, context)
        return pb.JoinResponse(clock=clock, open_clock=open_clock, live=live,
                               position=position.decode()).SerializeToString()

    def Restore(self, request: Frame[pb.RestoreRequest], context: Any) -> bytes:
        msg = request.msg

        def restore() -> int:
            checkpoint_id, sha256 = wire.restore_from_proto(msg)
            state = self.load(checkpoint_id, sha256) if checkpoint_id else None
            self.shard.restore(state, msg.generation)
            return self.shard.clock_state().open_clock

        return pb.RestoreResponse(clock=_guard(restore, context)).SerializeToString()

    def SetMembership(self, request: Frame[pb.MembershipRequest], context: Any) -> bytes:
        state = _guard(lambda: self.shard.set_live(request.msg.live_workers,
                                                   dict(request.msg.fenced)), context)
        return pb.MembershipResponse(
            open_clock=state.open_clock, clocks=wire.clocks_to_proto(state)
        ).SerializeToString()

    def Handshake(self, request: Frame[pb.HandshakeRequest], context: Any) -> bytes:
        bulk = self.bulk
        _guard(lambda: self._acting_as(context, request.msg.worker), context)
        if bulk is None:
            return pb.HandshakeResponse(transport="grpc").SerializeToString()
        return _guard(lambda: bulk.handshake(request.msg), context).SerializeToString()

    def _bulk(self) -> BulkEndpoint:
        if self.bulk is None:
            raise InvalidArgumentError("this server serves no bulk transport; send data inline")
        return self.bulk

    # ---- a whole step ----------------------------------------------------------------------

    def Exchange(self, request: Frame[pb.ExchangeRequest], context: Any) -> bytes:
        """A whole step in one message, over gRPC or a request lane. It runs in the shard's
        turn (see ps.concurrency.Turn), which its waits give up."""
        payload = request.payload("payload")

        def run() -> bytes:
            self._acting_as(context, request.msg.worker)
            if request.msg.HasField("bulk"):
                return self._exchange_bulk(request.msg, context.is_active)
            self._check_request_size(payload.nbytes)
            response, out = self._exchange(request.msg, codec.Received([payload]),
                                           context.is_active)
            return codec.encode(response, {"payload": out.parts})

        with self.shard.turn.taken():
            return _guard(run, context)

    def ExchangeStream(self, parts: Iterator[Frame[pb.ExchangePart]],
                       context: Any) -> Iterator[bytes]:
        """An exchange too large for one message. Nothing of it applies until every part
        has arrived: a stream cut short (cancelled, past its deadline, its client gone) is
        refused whole, so its retry applies everything once."""

        key = id(context)

        def watched() -> Iterator[Frame[pb.ExchangePart]]:
            self._watch.progress(key, context.cancel)
            for part in parts:
                self._watch.progress(key, context.cancel)
                yield part

        def run() -> tuple[pb.ExchangeResponse, codec.Payload]:
            try:
                msg, payload = joined(
                    watched(), lambda head, nbytes: self._check_stream_head(head, nbytes,
                                                                            context),
                    "ExchangeStream")
            except grpc.RpcError as exc:  # the call ended mid-stream (the client, or the watch)
                raise StreamEndedError("the stream ended before its last part (cancelled by "
                                       "its client, or idle too long); nothing of it was "
                                       "applied") from exc
            finally:
                self._watch.done(key)
            if not isinstance(msg, pb.ExchangeRequest) or msg.HasField("bulk") or msg.payload:
                raise InvalidArgumentError(
                    "a streamed exchange carries its payload in its parts, not in the request"
                )
            with self.shard.turn.taken():  # once every part has arrived
                return self._exchange(msg, payload, context.is_active)

        response, out = _guard(run, context)
        yield from cut(pb.ExchangeAnswerPart, response, out.parts, out.nbytes,
                       self.limits.chunk_bytes)

    def _exchange(self, msg: pb.ExchangeRequest, payload: codec.Received,
                  alive: Callable[[], bool]) -> tuple[pb.ExchangeResponse, codec.Payload]:
        self.bytes.add(received=payload.nbytes)
        exchange = wire.exchange_from_proto(msg, payload)
        result = self.shard.exchange(exchange, alive)
        response, out = wire.exchange_to_proto(exchange, result)
        self.bytes.add(sent=out.nbytes)
        return response, out

    def _exchange_bulk(self, msg: pb.ExchangeRequest, alive: Callable[[], bool]) -> bytes:
        """An exchange whose payload, and answer, lie in the client's bulk region."""
        bulk = self._bulk()
        with self._refused(msg.bulk):
            self._check_request_size(msg.bulk.length)
        with bulk.read(msg.bulk, BULK_TIMEOUT_S) as payload:
            self.bytes.add(received=payload.nbytes)
            exchange = wire.exchange_from_proto(msg, codec.Received([payload]))
            result = self.shard.exchange(exchange, alive)
        response, out = wire.exchange_to_proto(exchange, result)
        if out.nbytes != msg.answer.length:
            raise InvalidArgumentError(
                f"the exchange's answer region holds {msg.answer.length} bytes; the answer "
                f"needs {out.nbytes}"
            )

        bulk.write(msg.answer, out.nbytes, out.copy_into, BULK_TIMEOUT_S)
        self.bytes.add(sent=out.nbytes)
        response.in_bulk = True
        return response.SerializeToString()

    def lane_handler(self) -> Callable[[bytes, LaneContext], bytes]:
        """The Exchange RPC for the request lanes: the same handler, timed the same way,
        with its refusals carried as the RPC's status would be."""
        exchange = self._gated(self._timed("Exchange", self.Exchange))

        def handle(data: bytes, context: LaneContext) -> bytes:
            try:
                request = codec.decode(pb.ExchangeRequest, data)
            except WireError as exc:
                _abort(context, WireError(f"Exchange: the request is not a valid "
                                          f"ExchangeRequest ({exc})"))
            owner = self.bulk.owner(context.session) if self.bulk is not None else None
            if owner is not None and request.msg.worker != owner:
                # The session's handshake was checked against the caller's certificate.
                _abort(context, PermissionDeniedError(
                    f"this lane's session belongs to worker {owner}; it may not carry worker "
                    f"{request.msg.worker}'s exchanges"))
            answer: bytes = exchange(request, context)
            return answer

        return handle

    def _gated(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        """`handler` as a data call counted by the gate (a whole stream, for streamed
        answers); refused with its status when its client or the server is at its limit."""
        gate = self.gate
        if gate is None:
            return handler

        def enter(context: Any) -> str:
            client = str(context.peer())
            try:
                gate.enter(client)
            except ResourceExhaustedError as exc:
                _abort(context, exc)
            return client

        if inspect.isgeneratorfunction(handler):
            def streamed(request: Any, context: Any) -> Iterator[bytes]:
                client = enter(context)
                try:
                    yield from handler(request, context)
                finally:
                    gate.leave(client)

            return streamed

        def unary(request: Any, context: Any) -> Any:
            client = enter(context)
            try:
                return handler(request, context)
            finally:
                gate.leave(client)

        return unary

    def _timed(self, method: str, handler: Callable[..., Any]) -> Callable[..., Any]:
        """`handler`, observing its duration (a whole stream's, for streamed answers)."""
        if self.latency is None:
            return handler
        observe = self.latency.labels(method).observe

        if inspect.isgeneratorfunction(handler):
            def streamed(request: Any, context: Any) -> Iterator[bytes]:
                start = time.perf_counter()
                try:
                    yield from handler(request, context)
                finally:
                    observe(time.perf_counter() - start)

            return streamed

        def unary(request: Any, context: Any) -> Any:
            start = time.perf_counter()
            try:
                return handler(request, context)
            finally:
                observe(time.perf_counter() - start)

        return unary

    @contextlib.contextmanager
    def _refused(self, *refs: pb.BulkRef) -> Iterator[None]:
        """Drops the payloads `refs` name, unread, when the block raises: a request refused
        before its payload was read would otherwise leave the client's transfer waiting
        (a transport's send may end only when the server takes it)."""
        try:
            yield
        except BaseException:
            if refs and self.bulk is not None:
                self.bulk.discard(*refs)
            raise

    def _check_stream_head(self, head: object, nbytes: int, context: Any) -> None:
        """A streamed exchange's first part: its caller, its size and the tables it names
        are checked before any more of it is received or held."""
        self._check_request_size(nbytes)
        if isinstance(head, pb.ExchangeRequest):
            self._acting_as(context, head.worker)
            self.shard.check_tables(wire.tables_named(head))

    def _check_request_size(self, nbytes: int) -> None:
        if nbytes > self.limits.max_request_bytes:
            raise ResourceExhaustedError(
                f"request of {nbytes} bytes is over this server's limit of "
                f"{self.limits.max_request_bytes} bytes (--max-request-bytes); split the push"
            )

    # ---- registration ----------------------------------------------------------------------

    def _served(self, method: rpc.Rpc[Any, Any]) -> Callable[..., Any]:
        """The behaviour of `method`: timed, and counted by the gate if it is a data call
        (admin calls are not: they must answer under any load of data calls)."""
        handler = self._timed(method.name, getattr(self, method.name))
        return self._gated(handler) if method.service == rpc.SERVICE else handler

    def handlers(self) -> tuple[grpc.GenericRpcHandler, ...]:
        """One generic handler per service of the contract (protos/rpc.py: the data service
        and the admin service), serving every method with the zero-copy codec."""
        return tuple(
            grpc.method_handlers_generic_handler(service, {
                method.name: method.handler(self._served(method), _abort)
                for method in rpc.METHODS if method.service == service
            })
            for service in rpc.SERVICES
        )
