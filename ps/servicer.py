"""The gRPC face of a shard: decode frames, call the shard, encode answers, map errors.

Each method converts wire messages to domain values, calls one Shard method and turns
domain errors into status codes. Status codes appear nowhere else in the server.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
import torch
from prometheus_client import Histogram

from protos import codec, marks, modes, rpc
from protos import pstrain_pb2 as pb
from protos.codec import Frame, WireError
from protos.parts import cut
from protos.parts import join as joined
from protos.transport import TransportError
from protos.transport.lane import LaneContext
from ps.bulk import BulkEndpoint
from ps.checkpoint import read_shard
from ps.errors import (
    ClockWaitTimeoutError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PSError,
    ResourceExhaustedError,
    RolledBackError,
    StreamEndedError,
)
from ps.initializers import InitSpec
from ps.shard import (
    ClockState,
    DensePush,
    Exchange,
    ExchangeResult,
    Pull,
    PushMeta,
    PushOutcome,
    Shard,
    SparsePush,
)
from ps.tables import OptimizerConfig, TableSpec, TableStats

log = logging.getLogger(__name__)

_STATUS: dict[type[PSError], grpc.StatusCode] = {
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    StreamEndedError: grpc.StatusCode.CANCELLED,
}

R = TypeVar("R")


@dataclass(frozen=True)
class WireLimits:
    chunk_bytes: int
    max_message_bytes: int
    max_request_bytes: int


# Longest a bulk transfer of one request may take once the server starts it.
BULK_TIMEOUT_S = 30.0


def _abort(context: grpc.ServicerContext | LaneContext, exc: Exception) -> NoReturn:
    if isinstance(exc, ClockWaitTimeoutError):
        context.set_trailing_metadata(((marks.CLOCK_WAIT, "1"),))
    if isinstance(exc, RolledBackError):
        context.set_trailing_metadata(((marks.ROLLED_BACK, "1"),))
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


# ---- proto -> domain ---------------------------------------------------------------------


def spec_from_proto(msg: pb.TableSpec) -> TableSpec:
    """A domain TableSpec from its wire form; InvalidArgumentError when it is malformed."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidArgumentError(f"table {msg.name!r}: set either dense or sparse")
    body = msg.dense if kind == "dense" else msg.sparse
    try:
        dtype = codec.dtype_from_wire(body.dtype)
    except WireError as exc:
        raise InvalidArgumentError(f"table {msg.name!r}: {exc}") from exc
    init = InitSpec(body.init.kind or "uniform", body.init.a, body.init.b) if body.HasField(
        "init"
    ) else InitSpec()
    optimizer = OptimizerConfig(
        msg.optimizer.name or "sgd", tuple(sorted(msg.optimizer.params.items()))
    )
    try:
        mode = modes.from_proto(
            msg.consistency, msg.staleness if msg.HasField("staleness") else None
        )
    except modes.ModeError as exc:
        raise InvalidArgumentError(f"table {msg.name!r}: {exc}") from exc
    return TableSpec(
        name=msg.name,
        kind=kind,
        dtype=dtype,
        shape=tuple(msg.dense.shape) if kind == "dense" else (),
        dim=msg.sparse.dim if kind == "sparse" else 0,
        init=init,
        seed=body.seed,
        optimizer=optimizer,
        allow_non_finite=msg.allow_non_finite,
        mode=mode,
    )


def _push_result(outcome: PushOutcome, elements: int) -> pb.PushResponse:
    return pb.PushResponse(
        duplicate=outcome is PushOutcome.DUPLICATE, dropped=outcome is PushOutcome.DROPPED,
        kept=outcome is PushOutcome.KEPT, elements=elements,
    )


def exchange_from_proto(msg: pb.ExchangeRequest, payload: memoryview) -> Exchange:
    """A domain Exchange from its wire form; WireError or InvalidArgumentError if malformed."""
    wait_s = msg.wait_ms / 1000
    pushes: list[SparsePush | DensePush] = []
    for p in msg.pushes:
        what = f"push to {p.table!r}"
        meta = PushMeta(worker=msg.worker, incarnation=msg.incarnation, seq=p.seq,
                        clock=msg.push_clock, assign=p.assign, wait_s=wait_s,
                        generation=msg.generation, if_absent=p.if_absent)
        dtype = codec.dtype_from_wire(p.dtype)
        values = codec.span_of(payload, p.values, what)
        if not p.dense:
            keys = codec.keys_from_bytes(codec.span_of(payload, p.keys, what))
            pushes.append(SparsePush(p.table, meta, dtype, p.dim, keys, values))
            continue
        shape = tuple(p.shape)
        itemsize = dtype.itemsize
        expected = math.prod(shape) * itemsize
        if values.nbytes != expected:
            raise InvalidArgumentError(
                f"dense push to {p.table!r} carries {values.nbytes} bytes but shape "
                f"{list(shape)} of {codec.dtype_name(p.dtype)} needs {expected}"
            )
        flat = codec.tensor_from_bytes(values, dtype, (expected // itemsize,))
        pushes.append(DensePush(p.table, meta, dtype, shape, flat))
    pulls = [
        Pull(q.table) if q.dense else Pull(
            q.table, codec.keys_from_bytes(codec.span_of(payload, q.keys, f"pull of {q.table!r}"))
        )
        for q in msg.pulls
    ]
    return Exchange(
        worker=msg.worker, incarnation=msg.incarnation, generation=msg.generation,
        push_clock=msg.push_clock, pushes=pushes, end_iteration=msg.end_iteration,
        pull_clock=msg.pull_clock, pulls=pulls, wait_s=wait_s,
    )


def exchange_to_proto(
    exchange: Exchange, result: ExchangeResult
) -> tuple[pb.ExchangeResponse, codec.Payload]:
    """The wire answer to `exchange`, and the bulk bytes it names."""
    response = pb.ExchangeResponse(
        pushes=[
            _push_result(outcome, _elements(push))
            for push, outcome in zip(exchange.pushes, result.outcomes, strict=True)
        ],
        open_clock=result.open_clock or 0,
    )
    payload = codec.Payload()
    for pulled in result.pulled:
        values = pulled if isinstance(pulled, torch.Tensor) else pulled.gather(0, len(pulled))
        response.pulled.append(pb.ExchangePulled(
            dtype=codec.dtype_to_wire(values.dtype), shape=list(values.shape),
            values=payload.add(codec.tensor_bytes(values)),
        ))
    return response, payload


def _elements(push: SparsePush | DensePush) -> int:
    return len(push.keys) * push.dim if isinstance(push, SparsePush) else push.values.numel()


def _stats_to_proto(s: TableStats, mode: modes.Mode) -> pb.TableStats:
    c = s.counters
    consistency, staleness = modes.to_proto(mode)
    return pb.TableStats(
        name=s.name, kind=s.kind, optimizer=s.optimizer, rows=s.rows,
        value_bytes=s.value_bytes, state_bytes=s.state_bytes, index_bytes=s.index_bytes,
        pushes_applied=c.pushes_applied, pushes_duplicate=c.pushes_duplicate,
        pushes_rejected=c.pushes_rejected, pulls=c.pulls, rows_pulled=c.rows_pulled,
        rows_pushed=c.rows_pushed, row_start=s.row_start, row_end=s.row_end,
        consistency=consistency, staleness=staleness or 0,
        pushes_dropped=c.pushes_dropped, gradients_aggregated=c.gradients_aggregated,
        pushes_kept=c.pushes_kept,
    )


def _clocks_to_proto(state: ClockState) -> list[pb.WorkerClock]:
    return [
        pb.WorkerClock(worker=w, clock=c, live=w in state.live)
        for w, c in sorted(state.clocks.items())
    ]


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
                 bulk: BulkEndpoint | None = None) -> None:
        self.shard = shard
        # Bulk transports other than inline gRPC; None serves everything inline.
        self.bulk = bulk
        self.limits = limits
        self.version = version
        self.bytes = _ByteCounter()
        # Request latency by method, when the server exports metrics.
        self.latency: Histogram | None = None

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
            specs = [spec_from_proto(t) for t in request.msg.tables]
            placements = self.shard.declare(specs)
            return pb.DeclareTablesResponse(
                tables=[
                    pb.TablePlacement(name=s.name, row_start=p.start, row_end=p.end)
                    for s, p in zip(specs, placements, strict=True)
                ]
            ).SerializeToString()

        return _guard(declare, context)

    def GetStats(self, request: Frame[pb.StatsRequest], context: Any) -> bytes:
        state = self.shard.clock_state()
        response = pb.StatsResponse(
            info=self.info(),
            tables=[_stats_to_proto(s, mode) for s, mode in self.shard.stats()],
            bytes_received=self.bytes.received,
            bytes_sent=self.bytes.sent,
            open_clock=state.open_clock,
            clocks_closed=state.clocks_closed,
            clocks=_clocks_to_proto(state),
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
        clock, open_clock, live = _guard(
            lambda: self.shard.join(msg.worker, msg.incarnation, msg.generation), context
        )
        return pb.JoinResponse(clock=clock, open_clock=open_clock, live=live).SerializeToString()

    def Restore(self, request: Frame[pb.RestoreRequest], context: Any) -> bytes:
        msg = request.msg

        def restore() -> int:
            state = read_shard(msg.path, msg.sha256 or None) if msg.checkpoint_id else None
            self.shard.restore(state, msg.generation)
            return self.shard.clock_state().open_clock

        return pb.RestoreResponse(clock=_guard(restore, context)).SerializeToString()

    def SetMembership(self, request: Frame[pb.MembershipRequest], context: Any) -> bytes:
        state = _guard(lambda: self.shard.set_live(request.msg.live_workers), context)
        return pb.MembershipResponse(
            open_clock=state.open_clock, clocks=_clocks_to_proto(state)
        ).SerializeToString()

    def Handshake(self, request: Frame[pb.HandshakeRequest], context: Any) -> bytes:
        bulk = self.bulk
        if bulk is None:
            return pb.HandshakeResponse(transport="grpc").SerializeToString()
        return _guard(lambda: bulk.handshake(request.msg), context).SerializeToString()

    def _bulk(self) -> BulkEndpoint:
        if self.bulk is None:
            raise InvalidArgumentError("this server serves no bulk transport; send data inline")
        return self.bulk

    # ---- a whole step ----------------------------------------------------------------------

    def Exchange(self, request: Frame[pb.ExchangeRequest], context: Any) -> bytes:
        payload = request.payload("payload")

        def run() -> bytes:
            if request.msg.HasField("bulk"):
                return self._exchange_bulk(request.msg)
            self._check_request_size(payload.nbytes)
            response, out = self._exchange(request.msg, payload)
            return codec.encode(response, {"payload": out.parts})

        return _guard(run, context)

    def ExchangeStream(self, parts: Iterator[Frame[pb.ExchangePart]],
                       context: Any) -> Iterator[bytes]:
        """An exchange too large for one message. Nothing of it applies until every part
        has arrived: a stream cut short (cancelled, past its deadline, its client gone) is
        refused whole, so its retry applies everything once."""

        def run() -> tuple[pb.ExchangeResponse, codec.Payload]:
            try:
                msg, payload = joined(parts, self._check_request_size, "ExchangeStream")
            except grpc.RpcError as exc:  # the client ended the call mid-stream
                raise StreamEndedError("the client ended the stream before its last part; "
                                       "nothing of it was applied") from exc
            if not isinstance(msg, pb.ExchangeRequest) or msg.HasField("bulk") or msg.payload:
                raise InvalidArgumentError(
                    "a streamed exchange carries its payload in its parts, not in the request"
                )
            return self._exchange(msg, payload)

        response, out = _guard(run, context)
        yield from cut(pb.ExchangeAnswerPart, response, out.parts, out.nbytes,
                       self.limits.chunk_bytes)

    def _exchange(self, msg: pb.ExchangeRequest,
                  payload: memoryview) -> tuple[pb.ExchangeResponse, codec.Payload]:
        self.bytes.add(received=payload.nbytes)
        exchange = exchange_from_proto(msg, payload)
        response, out = exchange_to_proto(exchange, self.shard.exchange(exchange))
        self.bytes.add(sent=out.nbytes)
        return response, out

    def _exchange_bulk(self, msg: pb.ExchangeRequest) -> bytes:
        """An exchange whose payload, and answer, lie in the client's bulk region."""
        bulk = self._bulk()
        with self._refused(msg.bulk):
            self._check_request_size(msg.bulk.length)
        with bulk.read(msg.bulk, BULK_TIMEOUT_S) as payload:
            self.bytes.add(received=payload.nbytes)
            exchange = exchange_from_proto(msg, payload)
            result = self.shard.exchange(exchange)
        response, out = exchange_to_proto(exchange, result)
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
        exchange = self._timed("Exchange", self.Exchange)

        def handle(data: bytes, context: LaneContext) -> bytes:
            try:
                request = codec.decode(pb.ExchangeRequest, data)
            except WireError as exc:
                _abort(context, exc)
            answer: bytes = exchange(request, context)
            return answer

        return handle

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

    def _check_request_size(self, nbytes: int) -> None:
        if nbytes > self.limits.max_request_bytes:
            raise ResourceExhaustedError(
                f"request of {nbytes} bytes is over this server's limit of "
                f"{self.limits.max_request_bytes} bytes (--max-request-bytes); split the push"
            )

    # ---- registration ----------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler serving every method of the contract (protos/rpc.py) with the
        zero-copy codec."""
        methods = {
            method.name: method.handler(self._timed(method.name, getattr(self, method.name)))
            for method in rpc.METHODS
        }
        return grpc.method_handlers_generic_handler(rpc.SERVICE, methods)
