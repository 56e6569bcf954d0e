"""PSClient: a worker's connection to every shard of the parameter server.

It routes dense row blocks and sparse keys to their shards, de-duplicates keys, talks to
all shards in parallel, streams large arrays in chunks, retries failed calls with backoff
(pushes are numbered, so a retry is never applied twice) and returns rows in the caller's
order.

Typical use::

    client = PSClient(["10.0.0.1:7000", "10.0.0.2:7000"], worker=rank)
    client.declare_sparse("user_emb", dim=64, optimizer="adagrad", lr=0.05)
    rows = client.pull_sparse("user_emb", ids)          # [len(ids), 64]
    client.push_sparse("user_emb", ids, grad_rows)      # server runs Adagrad
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from protos import codec, marks, modes, rpc
from protos import pstrain_pb2 as pb
from protos.codec import Frame
from protos.marks import marks_of
from protos.partition import RowRange, dense_placement, shard_of_keys
from protos.rpc import Resp, Rpc, Stubs
from protos.runtime import tune_malloc
from protos.transport import ChannelBrokenError, TransportError, parse_choice
from worker import bulk as bulk_io
from worker.bulk import BulkClient, Peer
from worker.errors import (
    ClusterMismatchError,
    PSClientError,
    RemoteError,
    RolledBackError,
    UnknownTableError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1024 * 1024
# Status codes after which a call is tried again: the request may not have been applied.
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
KeysLike = np.ndarray | torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class RetryPolicy:
    """How calls are retried: exponential backoff with jitter, bounded in attempts."""

    attempts: int = 6
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")

    def delay_s(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * 2**attempt)
        return float(base * (0.5 + random.random() / 2))


@dataclass(frozen=True)
class _Table:
    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim: int
    placement: tuple[RowRange, ...]  # dense only


@dataclass
class _Shard:
    index: int
    address: str
    channel: grpc.Channel
    stubs: Stubs
    chunk_bytes: int
    incarnation: int = 0
    bulk: Peer = field(default_factory=Peer)  # the transport agreed with this server


@dataclass(frozen=True)
class Push:
    """A gradient for `PSClient.exchange`: of a dense table (`keys` None) or of sparse rows."""

    table: str
    grad: torch.Tensor
    keys: KeysLike | None = None
    assume_unique: bool = False


@dataclass(frozen=True)
class Pull:
    """What `PSClient.exchange` pulls: a dense table whole (`keys` None) or sparse rows."""

    table: str
    keys: KeysLike | None = None
    assume_unique: bool = False


@dataclass
class _PullOut:
    """Where the shards' answers to one pull land."""

    values: torch.Tensor  # dense: the whole tensor; sparse: the unique keys' rows
    inverse: np.ndarray | None = None  # sparse: each asked key's row in `values`
    dense_width: int = 0


class _ExchangePlan:
    """One exchange's per-shard requests, and how their answers are put back together."""

    def __init__(self, client: PSClient, push_clock: int, end_iteration: bool,
                 pull_clock: int) -> None:
        self.client = client
        self.header = pb.ExchangeRequest(
            worker=client.worker, incarnation=client.incarnation,
            generation=client.generation, wait_ms=client._wait_ms(), push_clock=push_clock,
            end_iteration=end_iteration, pull_clock=pull_clock,
        )
        self.shards: dict[int, tuple[pb.ExchangeRequest, codec.Payload]] = {}
        # Per shard, per pull sent there: (pull index, where its rows go; None: all of them).
        self.routes: dict[int, list[tuple[int, np.ndarray | RowRange | None]]] = {}
        self.outputs: list[_PullOut] = []
        self.answer_bytes: dict[int, int] = {}
        if end_iteration:
            for shard in client._shards:
                self._request(shard.index)

    def _request(self, index: int) -> tuple[pb.ExchangeRequest, codec.Payload]:
        found = self.shards.get(index)
        if found is None:
            msg = pb.ExchangeRequest()
            msg.CopyFrom(self.header)
            found = self.shards[index] = (msg, codec.Payload())
            self.routes[index] = []
        return found

    def push(self, push: Push) -> None:
        client = self.client
        if push.keys is None:
            table = client._table(push.table, "dense")
            dtype = client._wire_dtype(push.grad.dtype)
            for r, shape, block in client._dense_blocks(table, push.grad):
                msg, payload = self._request(r.shard)
                msg.pushes.append(pb.ExchangePush(
                    table=push.table, seq=next(client._seq), dtype=dtype, dense=True,
                    shape=shape, values=payload.add(codec.tensor_bytes(block)),
                ))
            return
        table = client._table(push.table, "sparse")
        unique, grads = client._coalesce(table, push.keys, push.grad, push.assume_unique)
        dtype = client._wire_dtype(grads.dtype)
        for shard, positions in client._route(unique):
            keys = unique if positions is None else unique[positions]
            rows = grads if positions is None else grads[torch.from_numpy(positions)]
            msg, payload = self._request(shard.index)
            msg.pushes.append(pb.ExchangePush(
                table=push.table, seq=next(client._seq), dtype=dtype, dim=table.dim,
                keys=payload.add(codec.keys_bytes(keys)),
                values=payload.add(codec.tensor_bytes(rows)),
            ))

    def pull(self, pull: Pull) -> _PullOut:
        client = self.client
        index = len(self.outputs)
        if pull.keys is None:
            table = client._table(pull.table, "dense")
            out = _PullOut(torch.empty(table.shape, dtype=table.dtype),
                           dense_width=math.prod(table.shape[1:]) if table.shape else 1)
            for r in table.placement:
                if r.rows or not table.shape:
                    msg, _ = self._request(r.shard)
                    msg.pulls.append(pb.ExchangePull(table=pull.table, dense=True))
                    self.routes[r.shard].append((index, r))
                    self._expect(r.shard, r.rows * out.dense_width * out.values.element_size())
        else:
            table = client._table(pull.table, "sparse")
            unique, inverse = client._unique(_as_keys(pull.keys), pull.assume_unique)
            out = _PullOut(torch.empty((len(unique), table.dim), dtype=table.dtype), inverse)
            row_bytes = table.dim * out.values.element_size()
            for shard, positions in client._route(unique):
                keys = unique if positions is None else unique[positions]
                msg, payload = self._request(shard.index)
                msg.pulls.append(pb.ExchangePull(
                    table=pull.table, keys=payload.add(codec.keys_bytes(keys))
                ))
                self.routes[shard.index].append((index, positions))
                self._expect(shard.index, len(keys) * row_bytes)
        self.outputs.append(out)
        return out

    def _expect(self, index: int, nbytes: int) -> None:
        self.answer_bytes[index] = self.answer_bytes.get(index, 0) + nbytes

    def too_large(self) -> bool:
        """Whether a request or an answer would pass one shard's comfortable message size."""
        shards = self.client._shards
        return any(
            max(payload.nbytes, self.answer_bytes.get(i, 0)) > 2 * shards[i].chunk_bytes
            for i, (_, payload) in self.shards.items()
        )

    def requests(self) -> list[tuple[_Shard, pb.ExchangeRequest, codec.Payload, int]]:
        """(shard, request, its payload, the answer's payload bytes) per shard involved."""
        return [
            (self.client._shards[i], msg, payload, self.answer_bytes.get(i, 0))
            for i, (msg, payload) in sorted(self.shards.items())
        ]

    def unpack(self, shard: _Shard, msg: pb.ExchangeResponse, payload: memoryview) -> None:
        """Puts one shard's answer (its pulled parts in `payload`) where the pulls want it."""
        routes = self.routes[shard.index]
        if len(msg.pulled) != len(routes):
            raise PSClientError(
                f"shard {shard.index} answered {len(msg.pulled)} pulls of {len(routes)}"
            )
        for (index, where), part in zip(routes, msg.pulled, strict=True):
            out = self.outputs[index]
            data = codec.span_of(payload, part.values, f"shard {shard.index}'s answer")
            values = codec.tensor_from_bytes(data, out.values.dtype, tuple(part.shape))
            if isinstance(where, RowRange):
                flat = out.values.view(-1)
                start = where.start * out.dense_width
                flat[start : start + values.numel()].copy_(values.reshape(-1))
            elif where is None:
                out.values.copy_(values)
            else:
                out.values.index_copy_(0, torch.from_numpy(where), values)

    def finish(self, index: int, out: _PullOut) -> torch.Tensor:
        if out.inverse is None:
            return out.values
        return out.values[torch.from_numpy(out.inverse)]


def _as_keys(keys: KeysLike) -> np.ndarray:
    if isinstance(keys, torch.Tensor):
        if keys.dtype != torch.int64:
            raise PSClientError(f"keys must be int64, got a tensor of {keys.dtype}")
        return keys.detach().cpu().contiguous().numpy().reshape(-1)
    array = np.asarray(keys)
    if array.size and array.dtype != np.int64:
        if not np.issubdtype(array.dtype, np.integer):
            raise PSClientError(f"keys must be integers, got an array of {array.dtype}")
        array = array.astype(np.int64)
    return np.ascontiguousarray(array, dtype=np.int64).reshape(-1)


def _optimizer(name: str, params: dict[str, float]) -> pb.OptimizerSpec:
    return pb.OptimizerSpec(name=name, params=params)


def _consistency(mode: str | modes.Mode | None) -> dict[str, Any]:
    """A TableSpec's mode fields for a declared mode; "" or None keeps the server's."""
    try:
        parsed = modes.parse_optional(mode) if isinstance(mode, str) else mode
    except modes.ModeError as exc:
        raise PSClientError(str(exc)) from exc
    consistency, staleness = modes.to_proto(parsed)
    return {"consistency": consistency, "staleness": staleness}


class PSClient:
    """A connection to all shards. Thread-safe: calls may overlap from several threads.

    Every call blocks until each shard involved has answered or the retries are spent, and
    raises RemoteError carrying the server's status code and reason when a shard refuses.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        worker: int = 0,
        incarnation: int | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = 64 * MiB,
        resolve: Callable[[int], str | None] | None = None,
        observe: Callable[[str, float], None] | None = None,
        transport: str = "auto",
        lanes: bool = True,
    ) -> None:
        if not addresses:
            raise PSClientError("PSClient needs at least one server address")
        self.worker = worker
        # A new process is a new incarnation: the start time in microseconds grows with every
        # start, so a rerun's pushes are never taken for duplicates of an earlier run's.
        self.incarnation = time.time_ns() // 1000 if incarnation is None else incarnation
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        tune_malloc()
        # This worker's iteration count: pulls and pushes carry it, end_iteration advances it.
        self.clock = 0
        # The job's rollback count this process joined under (worker.init sets it).
        self.generation = 0
        # Called (from whichever thread made the call) when a server refuses this process
        # because the job rolled back since it joined, before RolledBackError is raised.
        # worker.init sets it to exit the script for its supervisor to start it again.
        self.on_rolled_back: Callable[[], None] | None = None
        # Guards dropped_pushes, and the clock where exchanges may end iterations in parallel.
        self._count_lock = threading.Lock()
        self.dropped_pushes = 0
        # Finds a shard's current address (a restarted server may have moved), e.g. in Redis.
        self._resolve = resolve
        # Told (what, seconds) of every call: the worker's latency metrics.
        self.observe = observe
        # Guards reconnecting a shard and _specs.
        self._reconnect_lock = threading.Lock()
        self._specs: dict[str, pb.TableSpec] = {}
        self._connect_timeout_s = connect_timeout_s
        self._seq = itertools.count(1)
        # Guards _tables.
        self._lock = threading.Lock()
        self._tables: dict[str, _Table] = {}
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._options = options
        # Bulk transports: `transport` picks them ("auto": every one that works with a server);
        # `lanes`: send exchanges over a server's request lane where it offers one.
        try:
            choice = parse_choice(transport)
        except TransportError as exc:
            raise PSClientError(f"transport: {exc}") from exc
        self._bulk = BulkClient(choice, worker, self.incarnation, lanes)
        self._shards: list[_Shard] = []
        try:
            for i, address in enumerate(addresses):
                self._shards.append(
                    self._connect(i, address, len(addresses), options, connect_timeout_s)
                )
        except BaseException:
            # Nothing half-made outlives a failed constructor (sessions, UCX workers).
            self._disconnect()
            raise
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, 2 * len(self._shards)), thread_name_prefix="psclient"
        )

    # ---- connection ------------------------------------------------------------------------

    def _connect(
        self, index: int, address: str, expected: int, options: list[tuple[str, int]],
        timeout_s: float,
    ) -> _Shard:
        channel = grpc.insecure_channel(address, options=options)
        stubs = Stubs(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            # Short tries: between them a resolver may point at a restarted server.
            attempt_s = max(0.1, min(2.0, deadline - time.monotonic()))
            try:
                info = stubs.unary(rpc.GET_SERVER_INFO,
                                   pb.ServerInfoRequest().SerializeToString(), attempt_s,
                                   wait_for_ready=True)
                break
            except grpc.RpcError as exc:
                if time.monotonic() + 0.1 >= deadline:
                    channel.close()
                    raise PSClientError(
                        f"cannot reach shard {index} at {address} within {timeout_s:g} s: "
                        f"{exc.code().name} {exc.details()}"
                    ) from exc
                moved = self._resolve(index) if self._resolve is not None else None
                if moved and moved != address:
                    channel.close()
                    return self._connect(index, moved, expected, options,
                                         deadline - time.monotonic())
        if info.msg.shard != index or info.msg.num_shards != expected:
            channel.close()
            raise ClusterMismatchError(
                f"server {address} is shard {info.msg.shard} of {info.msg.num_shards}, but the "
                f"client lists it as shard {index} of {expected}; list every server, in shard order"
            )
        try:
            peer = self._bulk.meet(index, address, stubs, timeout_s)
        except BaseException:
            channel.close()
            raise
        return _Shard(index, address, channel, stubs, int(info.msg.chunk_bytes) or 2 * MiB,
                      int(info.msg.incarnation), peer)

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def close(self) -> None:
        """Closes every channel. Idempotent."""
        self._pool.shutdown(wait=True)
        self._disconnect()

    def _disconnect(self) -> None:
        """Ends every shard's bulk session and closes its channel, then the transports."""
        for shard in self._shards:
            self._bulk.end(shard.bulk, shard.stubs)
            shard.channel.close()
        self._bulk.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls with retries ----------------------------------------------------------------

    def _call(self, shard: _Shard, what: str, call: Callable[[], T]) -> T:
        """Runs `call`, retrying on UNAVAILABLE and DEADLINE_EXCEEDED with backoff.

        Between attempts a shard whose address changed (a restarted server) is reconnected,
        and tables are declared again on a server that came back without them.
        """
        attempt = 0
        redeclared = False
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.NOT_FOUND and not redeclared and self._specs:
                    redeclared = True
                    if self._redeclare(shard):
                        continue
                if code in _RETRYABLE and attempt > 0:
                    self._follow(shard)
                # A server that waited out its clock limit marks the answer; asking again
                # would only wait again.
                marked = marks_of(exc.trailing_metadata())
                if marks.ROLLED_BACK in marked:
                    if self.on_rolled_back is not None:
                        self.on_rolled_back()
                    raise RolledBackError(code, exc.details() or "", shard.index,
                                          shard.address) from exc
                waited = marks.CLOCK_WAIT in marked
                if code in _RETRYABLE and not waited and attempt + 1 < self.retry.attempts:
                    delay = self.retry.delay_s(attempt)
                    log.warning(
                        "worker %d: %s on shard %d (%s) failed with %s; retry %d in %.2f s",
                        self.worker, what, shard.index, shard.address, code.name, attempt + 1,
                        delay,
                    )
                    time.sleep(delay)
                    attempt += 1
                    continue
                raise RemoteError(code, exc.details() or "", shard.index, shard.address) from exc

    def _follow(self, shard: _Shard) -> None:
        """Reconnects `shard` if the resolver now gives another address."""
        if self._resolve is None:
            return
        try:
            address = self._resolve(shard.index)
        except Exception as exc:  # a resolver outage must not end the retries
            log.debug("worker %d: resolving shard %d failed: %s", self.worker, shard.index, exc)
            return
        if not address or address == shard.address:
            return
        with self._reconnect_lock:
            if address == shard.address:
                return
            try:
                fresh = self._connect(shard.index, address, self.num_shards, self._options,
                                      min(5.0, self._connect_timeout_s))
            except PSClientError as exc:
                log.info("worker %d: shard %d not ready at %s yet: %s", self.worker,
                         shard.index, address, exc)
                return
            old = shard.channel
            shard.bulk = fresh.bulk
            shard.address, shard.channel = fresh.address, fresh.channel
            shard.stubs, shard.chunk_bytes = fresh.stubs, fresh.chunk_bytes
            shard.incarnation = fresh.incarnation
            old.close()
            log.warning("worker %d: shard %d moved to %s (incarnation %d)", self.worker,
                        shard.index, address, shard.incarnation)

    def _redeclare(self, shard: _Shard) -> bool:
        """Declares every known table on `shard` again; True if that worked."""
        with self._reconnect_lock:
            specs = list(self._specs.values())
        request = pb.DeclareTablesRequest(tables=specs).SerializeToString()
        try:
            shard.stubs.unary(rpc.DECLARE_TABLES, request, self.timeout_s)
        except grpc.RpcError:
            return False
        log.warning("worker %d: declared %d tables again on shard %d", self.worker, len(specs),
                    shard.index)
        return True

    def _each(self, jobs: Sequence[tuple[_Shard, Callable[[], T]]], what: str) -> list[T]:
        """Runs one call per shard, in parallel when there are several."""
        start = time.perf_counter()
        if len(jobs) == 1:
            shard, call = jobs[0]
            results = [self._call(shard, what, call)]
        else:
            futures = [self._pool.submit(self._call, shard, what, call) for shard, call in jobs]
            results = [f.result() for f in futures]
        if self.observe is not None:
            self.observe(what, time.perf_counter() - start)
        return results

    def _push_id(self) -> pb.PushId:
        return pb.PushId(worker=self.worker, incarnation=self.incarnation, seq=next(self._seq))

    def _wait_ms(self) -> int:
        # The server gives up a little before the call's own deadline, so the caller gets the
        # server's account of what it waited for rather than a bare timeout.
        return max(1, int(self.timeout_s * 900))

    def _bulk_or_inline(
        self, shard: _Shard, bulk: Callable[[Peer], T | None], inline: Callable[[], T]
    ) -> T:
        """`bulk` through the shard's transport; inline when it declines or has failed.

        A failed transport is marked for the shard and the same request (for a push, the same
        push id, so it is applied at most once) is sent inline over gRPC.
        """
        peer = shard.bulk
        if peer.channel is not None:
            try:
                result = bulk(peer)
            except ChannelBrokenError as exc:
                self._bulk.broken(peer, shard.index, str(exc))
            else:
                if result is not None:
                    return result
        return inline()

    def transports(self) -> list[str]:
        """The bulk transport each shard uses now, in shard order. Thread-safe."""
        return [s.bulk.transport for s in self._shards]

    def transport_details(self) -> list[str]:
        """Each shard's transport and, where it says, what it runs over ("ucx (tcp/eth0)",
        "ucx (rc_mlx5/mlx5_0:1)" for RDMA), in shard order. Thread-safe."""
        return [f"{s.bulk.transport} ({s.bulk.over})" if s.bulk.over else s.bulk.transport
                for s in self._shards]

    def exchange_lanes(self) -> list[bool]:
        """Whether each shard's exchanges take the shm exchange lane now (a round trip of a
        fraction of a millisecond on one host), in shard order. Thread-safe."""
        return [s.bulk.lane is not None for s in self._shards]

    # ---- clocks ----------------------------------------------------------------------------

    def end_iteration(self) -> int:
        """Ends iteration `self.clock` on every shard, then advances the clock. Blocks.

        Call it once per iteration after that iteration's pushes: sync clocks close and
        ssp pulls of other workers move on when every worker has done so. A worker that fell
        behind closed sync clocks (a backup, a straggler) jumps to the oldest open one, so it
        carries on from the newest parameters instead of pushing gradients bound to be dropped.
        """
        return self._end(self.clock, follow_open_clock=True)

    def _end(self, clock: int, follow_open_clock: bool) -> int:
        request = pb.TickRequest(
            worker=self.worker, incarnation=self.incarnation, clock=clock,
            generation=self.generation,
        ).SerializeToString()
        frames = self._each(
            [(s, partial(self._unary, s, rpc.TICK, request)) for s in self._shards],
            f"end iteration {clock}",
        )
        open_clocks = [f.msg.open_clock for f in frames] if follow_open_clock else []
        return self._ended(clock, open_clocks)

    def _ended(self, clock: int, open_clocks: Sequence[int]) -> int:
        """Moves the clock past iteration `clock`, and on to the oldest of the shards' open
        sync clocks (none given: no jump). Only forward; thread-safe."""
        ended = clock + 1
        if open_clocks:
            ended = max(ended, min(open_clocks))
        with self._count_lock:
            self.clock = max(self.clock, ended)
            return self.clock

    def join(self) -> int:
        """Announces this process (its incarnation) to every shard; sets and returns its clock.

        A restarted worker calls this first: it resumes at the newest clock any shard has for
        its rank, and shards behind that are ticked up to it. Pushes from older incarnations
        are refused from then on.
        """
        frames = self._join_all()
        clock = int(max(f.msg.clock for f in frames))
        for shard, frame in zip(self._shards, frames, strict=True):
            for behind in range(frame.msg.clock, clock):
                tick = pb.TickRequest(worker=self.worker, incarnation=self.incarnation,
                                      clock=behind, generation=self.generation)
                self._call(shard, "catch up",
                           partial(self._unary, shard, rpc.TICK, tick.SerializeToString()))
        self.clock = clock
        return clock

    def live_everywhere(self) -> bool:
        """Whether every shard lists this worker as live (sync pushes need it)."""
        return all(f.msg.live for f in self._join_all())

    def _join_all(self) -> list[Frame[pb.JoinResponse]]:
        """Join on every shard; repeating it for the same incarnation changes nothing."""
        data = pb.JoinRequest(worker=self.worker, incarnation=self.incarnation,
                              generation=self.generation).SerializeToString()
        return self._each(
            [(s, partial(self._unary, s, rpc.JOIN, data)) for s in self._shards], "join"
        )

    def set_membership(self, live_workers: Sequence[int]) -> dict[int, int]:
        """Admin: tells every shard which workers are live; returns worker -> clock.

        Removed workers stop counting for sync quorums and ssp bounds at once; added ones
        enter at the current clock. Normally the scheduler calls this.
        """
        request = pb.MembershipRequest(live_workers=list(live_workers)).SerializeToString()
        frames = self._each(
            [(s, partial(self._unary, s, rpc.SET_MEMBERSHIP, request)) for s in self._shards],
            "set membership",
        )
        return {c.worker: c.clock for c in frames[0].msg.clocks}

    def _count_push(self, msg: pb.PushResponse) -> None:
        if msg.dropped:
            with self._count_lock:
                self.dropped_pushes += 1

    # ---- tables ----------------------------------------------------------------------------

    def declare_dense(
        self, name: str, shape: Sequence[int], *, dtype: torch.dtype = torch.float32,
        optimizer: str = "sgd", init: tuple[str, float, float] = ("zeros", 0.0, 0.0),
        seed: int = 0, allow_non_finite: bool = False, mode: str | modes.Mode | None = "",
        **hyper: float,
    ) -> None:
        """Declares a dense tensor (split by rows across shards). Idempotent for the same spec.

        `hyper` are the optimizer's hyperparameters (lr, eps, beta1, ...). `mode` is the
        table's consistency mode ("sync", "ssp", "ssp:S", "async", or a protos.modes.Mode);
        "" keeps the servers' default. PSClientError for a mode outside that grammar.
        """
        spec = pb.TableSpec(
            name=name,
            dense=pb.DenseSpec(
                shape=list(shape), dtype=self._wire_dtype(dtype),
                init=pb.Initializer(kind=init[0], a=init[1], b=init[2]), seed=seed,
            ),
            optimizer=_optimizer(optimizer, hyper), allow_non_finite=allow_non_finite,
            **_consistency(mode),
        )
        self._declare(spec)
        itemsize = dtype.itemsize
        placement = tuple(dense_placement(name, tuple(shape), itemsize, self.num_shards))
        with self._lock:
            self._tables[name] = _Table(name, "dense", dtype, tuple(shape), 0, placement)

    def declare_sparse(
        self, name: str, dim: int, *, dtype: torch.dtype = torch.float32,
        optimizer: str = "sgd", init: tuple[str, float, float] = ("uniform", -0.05, 0.05),
        seed: int = 0, allow_non_finite: bool = False, mode: str | modes.Mode | None = "",
        **hyper: float,
    ) -> None:
        """Declares a sparse table of rows of width `dim`, created on first touch. Idempotent.

        `mode` and `hyper` as in declare_dense.
        """
        spec = pb.TableSpec(
            name=name,
            sparse=pb.SparseSpec(
                dim=dim, dtype=self._wire_dtype(dtype),
                init=pb.Initializer(kind=init[0], a=init[1], b=init[2]), seed=seed,
            ),
            optimizer=_optimizer(optimizer, hyper), allow_non_finite=allow_non_finite,
            **_consistency(mode),
        )
        self._declare(spec)
        with self._lock:
            self._tables[name] = _Table(name, "sparse", dtype, (), dim, ())

    def _declare(self, spec: pb.TableSpec) -> None:
        request = pb.DeclareTablesRequest(tables=[spec]).SerializeToString()
        with self._reconnect_lock:
            self._specs[spec.name] = spec
        self._each(
            [(s, partial(self._unary, s, rpc.DECLARE_TABLES, request)) for s in self._shards],
            f"declare {spec.name!r}",
        )

    def _unary(self, shard: _Shard, method: Rpc[Any, Resp], request: bytes) -> Frame[Resp]:
        return shard.stubs.unary(method, request, self.timeout_s)

    @staticmethod
    def _wire_dtype(dtype: torch.dtype) -> pb.DType:
        try:
            return codec.dtype_to_wire(dtype)
        except codec.WireError as exc:
            raise PSClientError(str(exc)) from exc

    def _table(self, name: str, kind: str) -> _Table:
        with self._lock:
            table = self._tables.get(name)
        if table is None:
            raise UnknownTableError(
                f"table {name!r} is not declared by this client; call declare_{kind} first "
                "(declaring an existing table with the same spec is harmless)"
            )
        if table.kind != kind:
            raise PSClientError(f"table {name!r} is {table.kind}, not {kind}")
        return table

    # ---- dense -----------------------------------------------------------------------------

    def pull_dense(self, name: str, *, clock: int | None = None) -> torch.Tensor:
        """The whole dense tensor `name`, assembled from every shard's rows. Blocks.

        `clock` defaults to this worker's clock; the table's mode may make the pull wait.
        """
        table = self._table(name, "dense")
        clock = self.clock if clock is None else clock
        out = torch.empty(table.shape, dtype=table.dtype)
        flat = out.view(-1) if out.dim() else out.view(1)
        width = math.prod(table.shape[1:]) if table.shape else 1
        request = pb.PullDenseRequest(
            table=name, worker=self.worker, clock=clock, wait_ms=self._wait_ms(),
            generation=self.generation,
        )
        data = request.SerializeToString()
        itemsize = out.element_size()
        used = [r for r in table.placement if r.rows or not table.shape]
        if len(used) == 1 and self._shards[used[0].shard].bulk.channel is not None:
            # One server: the answer is written where the returned tensor lives (no copy).
            whole = self._pull_dense_whole(table, request, self._shards[used[0].shard], name)
            if whole is not None:
                return whole

        def inline(shard: _Shard, base: int) -> None:
            for frame in shard.stubs.stream_out(rpc.PULL_DENSE, data, self.timeout_s):
                chunk = frame.payload("data")
                n = chunk.nbytes // out.element_size()
                start = base + frame.msg.offset
                flat[start : start + n].copy_(codec.tensor_from_bytes(chunk, table.dtype, (n,)))

        def bulk(shard: _Shard, base: int, n: int, peer: Peer) -> bool | None:
            region = bulk_io.pull_dense(peer, shard.stubs, request, n * itemsize,
                                        self.timeout_s)
            if region is None:
                return None
            try:
                flat[base : base + n].copy_(
                    codec.tensor_from_bytes(region.view[: n * itemsize], table.dtype, (n,)))
            finally:
                region.release()
            return True

        def pull(shard: _Shard, rows: RowRange) -> None:
            base, n = rows.start * width, (rows.rows * width if table.shape else 1)
            self._bulk_or_inline(shard, partial(bulk, shard, base, n),
                                 partial(inline, shard, base))

        jobs = [
            (self._shards[r.shard], lambda r=r: pull(self._shards[r.shard], r))
            for r in table.placement
            if r.rows
        ]
        self._each(jobs, f"pull {name!r}")
        return out

    def _pull_dense_whole(
        self, table: _Table, request: pb.PullDenseRequest, shard: _Shard, name: str
    ) -> torch.Tensor | None:
        nbytes = math.prod(table.shape) * table.dtype.itemsize

        def bulk(peer: Peer) -> torch.Tensor | None:
            region = bulk_io.pull_dense(peer, shard.stubs, request, nbytes,
                                        self.timeout_s)
            if region is None:
                return None
            return bulk_io.region_tensor(region, 0, nbytes, table.dtype, table.shape)

        def whole() -> torch.Tensor | None:
            peer = shard.bulk
            if peer.channel is None:
                return None
            try:
                return bulk(peer)
            except ChannelBrokenError as exc:
                self._bulk.broken(peer, shard.index, str(exc))
                return None

        return self._each([(shard, whole)], f"pull {name!r}")[0]

    def push_dense(self, name: str, grad: torch.Tensor, *, clock: int | None = None) -> None:
        """Sends the gradient of dense tensor `name`; the servers apply their optimizer once.

        `clock` defaults to this worker's clock.
        """
        self._push_dense(name, grad, self.clock if clock is None else clock, pb.GRADIENT)

    def assign_dense(self, name: str, values: torch.Tensor) -> None:
        """Overwrites dense tensor `name` (initialising it from a module, for example)."""
        self._push_dense(name, values, 0, pb.ASSIGN)

    def _push_dense(
        self, name: str, values: torch.Tensor, clock: int, kind: pb.PushKind
    ) -> None:
        table = self._table(name, "dense")
        wire_dtype = self._wire_dtype(values.dtype)
        itemsize = values.element_size()
        jobs = []
        for r, shape, block in self._dense_blocks(table, values):
            shard = self._shards[r.shard]
            header = pb.PushDenseHeader(
                table=name, id=self._push_id(), clock=clock, kind=kind, dtype=wire_dtype,
                shape=shape, wait_ms=self._wait_ms(), generation=self.generation,
            )
            payload = codec.tensor_bytes(block)
            frames = partial(self._dense_frames, header, payload, itemsize, shard.chunk_bytes)
            bulk = partial(self._push_dense_bulk, shard, header, payload)
            inline = partial(self._send, shard, rpc.PUSH_DENSE, frames)
            jobs.append((shard, partial(self._bulk_or_inline, shard, bulk, inline)))
        self._each(jobs, f"push {name!r}")

    @staticmethod
    def _dense_blocks(
        table: _Table, values: torch.Tensor
    ) -> list[tuple[RowRange, list[int], torch.Tensor]]:
        """(placement, block shape, flat block) of each shard's rows of dense `values`;
        PSClientError when the shape is not the table's."""
        if tuple(values.shape) != table.shape:
            raise PSClientError(
                f"table {table.name!r} has shape {list(table.shape)}; got {list(values.shape)}"
            )
        values = values.detach().to("cpu").contiguous()
        flat = values.view(-1) if values.dim() else values.view(1)
        width = math.prod(table.shape[1:]) if table.shape else 1
        return [
            (r, [r.rows, *table.shape[1:]] if table.shape else [],
             flat[r.start * width : r.end * width])
            for r in table.placement
            if r.rows or not table.shape
        ]

    def _push_dense_bulk(
        self, shard: _Shard, header: pb.PushDenseHeader, data: memoryview, peer: Peer
    ) -> bool | None:
        frame = bulk_io.push_dense(peer, shard.stubs, header, data,
                                   self.timeout_s)
        if frame is None:
            return None
        self._count_push(frame.msg)
        return True

    @staticmethod
    def _dense_frames(
        header: pb.PushDenseHeader, data: memoryview, itemsize: int, chunk_bytes: int
    ) -> Iterator[bytes]:
        step = max(itemsize, chunk_bytes // itemsize * itemsize)
        for start in range(0, max(data.nbytes, 1), step):
            msg = pb.PushDenseChunk(offset=start // itemsize)
            if start == 0:
                msg.header.CopyFrom(header)
            yield codec.encode(msg, {"data": data[start : start + step]})

    def _send(self, shard: _Shard, method: Rpc[Any, pb.PushResponse],
              frames: Callable[[], Iterator[bytes]]) -> None:
        # gRPC encodes lazily on its own thread while earlier chunks are on the wire; each
        # attempt (the first and every retry) starts a fresh iterator.
        self._count_push(shard.stubs.stream_in(method, frames(), self.timeout_s).msg)

    # ---- sparse ----------------------------------------------------------------------------

    def pull_sparse(
        self, name: str, keys: KeysLike, *, clock: int | None = None,
        assume_unique: bool = False,
    ) -> torch.Tensor:
        """Rows of `keys` as a [len(keys), dim] tensor in the caller's order. Blocks.

        Rows that do not exist yet are created on the servers. Repeated keys are fetched
        once; pass assume_unique=True when the caller has already removed repeats.
        """
        table = self._table(name, "sparse")
        clock = self.clock if clock is None else clock
        all_keys = _as_keys(keys)
        unique, inverse = self._unique(all_keys, assume_unique)
        if self.num_shards == 1 and self._shards[0].bulk.channel is not None and len(unique):
            whole = self._pull_sparse_whole(table, name, clock, unique)
            if whole is not None:
                return whole if inverse is None else whole[torch.from_numpy(inverse)]
        rows = torch.empty((len(unique), table.dim), dtype=table.dtype)
        jobs = []
        for shard, positions in self._route(unique):
            request = codec.encode(
                pb.PullSparseRequest(
                    table=name, worker=self.worker, clock=clock, wait_ms=self._wait_ms(),
                    generation=self.generation,
                ),
                {"keys": codec.keys_bytes(unique if positions is None else unique[positions])},
            )
            shard_keys = unique if positions is None else unique[positions]
            bulk = partial(self._pull_rows_bulk, shard, table, name, clock, shard_keys, positions,
                           rows)
            inline = partial(self._pull_rows, shard, request, positions, rows)
            jobs.append((shard, partial(self._bulk_or_inline, shard, bulk, inline)))
        self._each(jobs, f"pull {name!r}")
        return rows if inverse is None else rows[torch.from_numpy(inverse)]

    def _pull_sparse_request(self, name: str, clock: int) -> pb.PullSparseRequest:
        return pb.PullSparseRequest(table=name, worker=self.worker, clock=clock,
                                    wait_ms=self._wait_ms(), generation=self.generation)

    def _pull_sparse_whole(
        self, table: _Table, name: str, clock: int, keys: np.ndarray
    ) -> torch.Tensor | None:
        """One server: its rows are written where the returned tensor lives (no copy)."""
        shard = self._shards[0]
        row_bytes = table.dim * table.dtype.itemsize

        def whole() -> torch.Tensor | None:
            peer = shard.bulk
            if peer.channel is None:
                return None
            try:
                region = bulk_io.pull_sparse(peer, shard.stubs,
                                             self._pull_sparse_request(name, clock), keys,
                                             row_bytes, self.timeout_s)
            except ChannelBrokenError as exc:
                self._bulk.broken(peer, shard.index, str(exc))
                return None
            if region is None:
                return None
            return bulk_io.region_tensor(region, keys.nbytes, len(keys) * row_bytes,
                                         table.dtype, (len(keys), table.dim))

        return self._each([(shard, whole)], f"pull {name!r}")[0]

    def _pull_rows_bulk(
        self, shard: _Shard, table: _Table, name: str, clock: int, keys: np.ndarray,
        positions: np.ndarray | None, out: torch.Tensor, peer: Peer,
    ) -> bool | None:
        row_bytes = table.dim * out.element_size()
        region = bulk_io.pull_sparse(peer, shard.stubs,
                                     self._pull_sparse_request(name, clock), keys, row_bytes,
                                     self.timeout_s)
        if region is None:
            return None
        try:
            got = codec.tensor_from_bytes(
                region.view[keys.nbytes : keys.nbytes + len(keys) * row_bytes], out.dtype,
                (len(keys), table.dim))
            if positions is None:
                out.copy_(got)
            else:
                out.index_copy_(0, torch.from_numpy(positions), got)
        finally:
            region.release()
        return True

    def _pull_rows(
        self, shard: _Shard, request: bytes, positions: np.ndarray | None, out: torch.Tensor
    ) -> None:
        index = None if positions is None else torch.from_numpy(positions)
        for frame in shard.stubs.stream_out(rpc.PULL_SPARSE, request, self.timeout_s):
            head = frame.msg
            chunk = codec.tensor_from_bytes(
                frame.payload("values"), out.dtype, (head.rows, head.dim)
            )
            start, end = head.row_offset, head.row_offset + head.rows
            if index is None:
                out[start:end].copy_(chunk)
            else:
                out.index_copy_(0, index[start:end], chunk)

    def push_sparse(
        self, name: str, keys: KeysLike, grads: torch.Tensor, *, clock: int | None = None,
        assume_unique: bool = False,
    ) -> None:
        """Sends gradient rows for `keys`; the servers run the table's optimizer on them.

        Gradients of repeated keys are summed first, as for a coalesced sparse gradient.
        `clock` defaults to this worker's clock.
        """
        clock = self.clock if clock is None else clock
        self._push_sparse(name, keys, grads, clock, pb.GRADIENT, assume_unique)

    def assign_sparse(self, name: str, keys: KeysLike, values: torch.Tensor) -> None:
        """Overwrites the rows of `keys` (unique keys) with `values`."""
        self._push_sparse(name, keys, values, 0, pb.ASSIGN, True)

    def _push_sparse(
        self, name: str, keys: KeysLike, grads: torch.Tensor, clock: int, kind: pb.PushKind,
        assume_unique: bool,
    ) -> None:
        table = self._table(name, "sparse")
        unique, grads = self._coalesce(table, keys, grads, assume_unique)
        wire_dtype = self._wire_dtype(grads.dtype)
        jobs = []
        for shard, positions in self._route(unique):
            shard_keys = unique if positions is None else unique[positions]
            shard_grads = grads if positions is None else grads[torch.from_numpy(positions)]
            header = pb.PushSparseHeader(
                table=name, id=self._push_id(), clock=clock, kind=kind, dtype=wire_dtype,
                dim=table.dim, wait_ms=self._wait_ms(), generation=self.generation,
            )
            frames = partial(self._sparse_frames, header, shard_keys, shard_grads,
                             shard.chunk_bytes)
            bulk = partial(self._push_sparse_bulk, shard, header, shard_keys, shard_grads)
            inline = partial(self._send, shard, rpc.PUSH_SPARSE, frames)
            jobs.append((shard, partial(self._bulk_or_inline, shard, bulk, inline)))
        self._each(jobs, f"push {name!r}")

    def _push_sparse_bulk(
        self, shard: _Shard, header: pb.PushSparseHeader, keys: np.ndarray,
        grads: torch.Tensor, peer: Peer,
    ) -> bool | None:
        frame = bulk_io.push_sparse(peer, shard.stubs, header, keys,
                                    codec.tensor_bytes(grads), self.timeout_s)
        if frame is None:
            return None
        self._count_push(frame.msg)
        return True

    def _coalesce(
        self, table: _Table, keys: KeysLike, grads: torch.Tensor, assume_unique: bool
    ) -> tuple[np.ndarray, torch.Tensor]:
        """(unique keys, their gradient rows): gradients of repeated keys summed."""
        all_keys = _as_keys(keys)
        grads = grads.detach().to("cpu")
        if grads.dim() != 2 or grads.shape[0] != len(all_keys) or grads.shape[1] != table.dim:
            raise PSClientError(
                f"push to {table.name!r} needs a [{len(all_keys)}, {table.dim}] gradient, got "
                f"{list(grads.shape)}"
            )
        unique, inverse = self._unique(all_keys, assume_unique)
        if inverse is not None:
            summed = torch.zeros((len(unique), table.dim), dtype=grads.dtype)
            grads = summed.index_add_(0, torch.from_numpy(inverse), grads)
        return unique, grads.contiguous()

    @staticmethod
    def _sparse_frames(
        header: pb.PushSparseHeader, keys: np.ndarray, grads: torch.Tensor, chunk_bytes: int
    ) -> Iterator[bytes]:
        row_bytes = max(1, grads.shape[1] * grads.element_size()) + 8
        per_chunk = max(1, chunk_bytes // row_bytes)
        values = codec.tensor_bytes(grads)
        value_row = grads.shape[1] * grads.element_size()
        for start in range(0, max(len(keys), 1), per_chunk):
            end = min(len(keys), start + per_chunk)
            msg = pb.PushSparseChunk()
            if start == 0:
                msg.header.CopyFrom(header)
            yield codec.encode(
                msg,
                {
                    "keys": codec.keys_bytes(keys[start:end]),
                    "values": values[start * value_row : end * value_row],
                },
            )

    @staticmethod
    def _unique(keys: np.ndarray, assume_unique: bool) -> tuple[np.ndarray, np.ndarray | None]:
        if assume_unique or len(keys) < 2:
            return keys, None
        unique, inverse = torch.unique(torch.from_numpy(keys), return_inverse=True)
        if len(unique) == len(keys):
            # Already unique: keep the caller's order so no reordering is needed.
            return keys, None
        return unique.numpy(), inverse.numpy()

    def _route(self, keys: np.ndarray) -> Iterator[tuple[_Shard, np.ndarray | None]]:
        """(shard, positions of its keys) for each shard with keys; None means all of them."""
        if self.num_shards == 1:
            yield self._shards[0], None
            return
        owners = shard_of_keys(keys, self.num_shards)
        order = np.argsort(owners, kind="stable")
        bounds = np.searchsorted(owners[order], np.arange(self.num_shards + 1))
        for s in range(self.num_shards):
            positions = order[bounds[s] : bounds[s + 1]]
            if len(positions):
                yield self._shards[s], positions

    # ---- a whole step in one request per shard -----------------------------------------------

    def exchange(
        self, pushes: Sequence[Push] = (), *, end_iteration: bool = False,
        pulls: Sequence[Pull] = (), push_clock: int | None = None,
        pull_clock: int | None = None, follow_open_clock: bool = True,
    ) -> list[torch.Tensor]:
        """Pushes gradients, ends the iteration and pulls, in one request per shard. Blocks.

        Each shard applies its part of `pushes` (gradients, at `push_clock`, default this
        worker's clock), then ends iteration `push_clock` if `end_iteration` (advancing the
        clock as `end_iteration()` does), then answers its part of `pulls` at `pull_clock`
        (default: the clock after the iteration, or the current one), waiting as the tables'
        modes say. Returns one tensor per pull, in order: a dense table whole, or a sparse
        pull's `[len(keys), dim]` rows in the caller's order.

        The same as the separate calls in that order, at the cost of one round trip per
        shard; pushes keep their exactly-once numbering, so a retried exchange applies
        nothing twice. Requests too large for one message are sent as those separate calls.
        `follow_open_clock=False` keeps the clock from jumping to the oldest open sync
        clock: for callers with several exchanges of their own in flight, whose later ticks
        may have closed clocks already.
        Thread-safe; the clock only moves forward.
        """
        push_clock = self.clock if push_clock is None else push_clock
        if pull_clock is None:
            pull_clock = push_clock + 1 if end_iteration else self.clock
        plan = _ExchangePlan(self, push_clock, end_iteration, pull_clock)
        for push in pushes:
            plan.push(push)
        outputs = [plan.pull(pull) for pull in pulls]
        if plan.too_large():
            return self._exchange_apart(pushes, end_iteration, pulls, push_clock, pull_clock,
                                        follow_open_clock)
        jobs = [
            (shard, partial(self._bulk_or_inline, shard,
                            partial(self._exchange_bulk, plan, shard, msg, payload, answer),
                            partial(self._exchange_inline, plan, shard, msg, payload)))
            for shard, msg, payload, answer in plan.requests()
        ]
        answers = self._each(jobs, f"exchange {push_clock}")
        for answer in answers:
            for result in answer.pushes:
                self._count_push(result)
        if end_iteration:
            self._ended(push_clock, [a.open_clock for a in answers] if follow_open_clock else [])
        return [plan.finish(i, out) for i, out in enumerate(outputs)]

    def _exchange_inline(
        self, plan: _ExchangePlan, shard: _Shard, msg: pb.ExchangeRequest,
        payload: codec.Payload,
    ) -> pb.ExchangeResponse:
        data = codec.encode(msg, {"payload": payload.parts})
        frame: Frame[pb.ExchangeResponse] = self._unary(shard, rpc.EXCHANGE, data)
        plan.unpack(shard, frame.msg, frame.payload("payload"))
        return frame.msg

    def _exchange_bulk(
        self, plan: _ExchangePlan, shard: _Shard, msg: pb.ExchangeRequest,
        payload: codec.Payload, answer_bytes: int, peer: Peer,
    ) -> pb.ExchangeResponse | None:
        sent = bulk_io.exchange(peer, shard.stubs, msg, payload, answer_bytes,
                                self.timeout_s)
        if sent is None:
            return None
        frame, region = sent
        try:
            view = region.view[payload.nbytes : payload.nbytes + answer_bytes]
            plan.unpack(shard, frame.msg, view)
        finally:
            region.release()
        return frame.msg

    def _exchange_apart(
        self, pushes: Sequence[Push], end_iteration: bool, pulls: Sequence[Pull],
        push_clock: int, pull_clock: int, follow_open_clock: bool,
    ) -> list[torch.Tensor]:
        for push in pushes:
            if push.keys is None:
                self.push_dense(push.table, push.grad, clock=push_clock)
            else:
                self.push_sparse(push.table, push.keys, push.grad, clock=push_clock,
                                 assume_unique=push.assume_unique)
        if end_iteration:
            self._end(push_clock, follow_open_clock)
        return [
            self.pull_dense(pull.table, clock=pull_clock)
            if pull.keys is None
            else self.pull_sparse(pull.table, pull.keys, clock=pull_clock,
                                  assume_unique=pull.assume_unique)
            for pull in pulls
        ]

    # ---- introspection ---------------------------------------------------------------------

    def stats(self, *, pull_log: bool = False, history: bool = False) -> list[pb.StatsResponse]:
        """Every shard's counters, clocks and table sizes, in shard order.

        `pull_log` adds the record of served ssp pulls, `history` that of recent sync clocks.
        """
        request = pb.StatsRequest(pull_log=pull_log, history=history).SerializeToString()
        frames = self._each(
            [(s, partial(self._unary, s, rpc.GET_STATS, request)) for s in self._shards], "stats"
        )
        return [f.msg for f in frames]
