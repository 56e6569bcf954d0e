"""A worker's link to one parameter server.

A `Link` owns what talking to one server takes: the gRPC channel and its typed stubs, the
bulk transport agreed with the server (`Peer`), retries with backoff, following a server
that restarted at another address, and the fallback from a broken bulk channel to gRPC.
Every data call goes through `Link.exchange`, which picks the way for one request: the
bulk transport (through its request lane where it has one), one gRPC message, or, for a
request or answer larger than a message, the streamed form (ExchangeStream).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np

from protos import codec, marks, rpc
from protos import pstrain_pb2 as pb
from protos.codec import Frame
from protos.marks import marks_of
from protos.parts import cut
from protos.parts import join as joined
from protos.rpc import Resp, Rpc, Stubs
from protos.security import Security
from protos.transport import ChannelBrokenError
from worker import bulk as bulk_io
from worker.bulk import BulkClient, Peer
from worker.errors import ClusterMismatchError, PSClientError, RemoteError, RolledBackError

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1024 * 1024
# Status codes after which a call is tried again: the request may not have been applied.
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# After its bulk transport failed, a link asks its server whether it is a new process this
# long after the failure, then twice as long after each answer that it is not, up to the
# last figure: a server restarted at the same address gets a new session.
RECHECK_S = (1.0, 60.0)


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


@dataclass
class Reach:
    """What every link of one client shares: who calls, limits, and the client's hooks."""

    worker: int
    num_shards: int
    timeout_s: float
    connect_timeout_s: float
    retry: RetryPolicy
    options: Sequence[tuple[str, int]]
    bulk: BulkClient
    # Finds a shard's current address (a restarted server may have moved), e.g. in Redis.
    resolve: Callable[[int], str | None] | None = None
    # The tables to declare again on a server that came back without them.
    specs: Callable[[], list[pb.TableSpec]] = list
    # Called when a server refuses this process because the job rolled back since it joined.
    on_rolled_back: Callable[[], None] | None = None
    # TLS and the job token for every channel.
    security: Security = field(default_factory=Security)
    # The job every server must belong to (None: any; a worker inside a job checks it, since
    # the addresses come from Redis).
    job: str | None = None

    def stubs(self, address: str) -> tuple[grpc.Channel, Stubs]:
        """A new channel to `address` and its stubs, with this process's credentials."""
        channel = self.security.channel(address, self.options)
        return channel, Stubs(channel, self.security.call_metadata())


class Link:
    """One server, as this worker reaches it. Thread-safe: calls may overlap, and a
    reconnection swaps the connection under a lock."""

    def __init__(self, index: int, reach: Reach) -> None:
        self.index = index
        self.reach = reach
        self.address = ""
        self.channel: grpc.Channel | None = None
        self.stubs: Stubs | None = None
        self.chunk_bytes = 2 * MiB
        self.incarnation = 0
        self.peer = Peer()  # the transport agreed with this server
        # When to ask whether the server restarted (0: the transport has not failed), and
        # the wait after that.
        self._recheck_at = 0.0
        self._recheck_s = RECHECK_S[0]
        # Guards swapping the connection (follow, a new session).
        self._lock = threading.Lock()

    @classmethod
    def open(cls, index: int, address: str, reach: Reach) -> Link:
        """A link connected to the server at `address` (or where the resolver says it moved),
        within reach.connect_timeout_s. PSClientError when it cannot be reached,
        ClusterMismatchError when it is another shard."""
        link = cls(index, reach)
        link._connect(address, reach.connect_timeout_s)
        return link

    def _connect(self, address: str, timeout_s: float) -> None:
        reach = self.reach
        deadline = time.monotonic() + timeout_s
        channel, stubs = reach.stubs(address)
        while True:
            try:
                info = self._server_info(stubs, address, deadline)
            except BaseException:
                channel.close()
                raise
            if info is not None:
                break
            moved = reach.resolve(self.index) if reach.resolve is not None else None
            if moved and moved != address:
                channel.close()
                address = moved
                channel, stubs = reach.stubs(address)
        if reach.job is not None and info.job != reach.job:
            channel.close()
            raise ClusterMismatchError(
                f"server {address} serves job {info.job!r}, not {reach.job!r}: the address "
                "this worker was given (by Redis, or --servers) belongs to another job"
            )
        if info.shard != self.index or info.num_shards != reach.num_shards:
            channel.close()
            raise ClusterMismatchError(
                f"server {address} is shard {info.shard} of {info.num_shards}, but the client "
                f"lists it as shard {self.index} of {reach.num_shards}; list every server, in "
                "shard order"
            )
        try:
            peer = reach.bulk.meet(self.index, address, stubs, timeout_s)
        except grpc.RpcError as exc:  # refused (the certificate binds another rank, say)
            channel.close()
            raise RemoteError(exc.code(), exc.details() or "", self.index, address) from exc
        except BaseException:
            channel.close()
            raise
        self.address, self.channel, self.stubs, self.peer = address, channel, stubs, peer
        self.chunk_bytes = int(info.chunk_bytes) or 2 * MiB
        self.incarnation = int(info.incarnation)
        self._recheck_at, self._recheck_s = 0.0, RECHECK_S[0]

    def _server_info(self, stubs: Stubs, address: str, deadline: float) -> pb.ServerInfo | None:
        """The server's info; None after a short failed try (the caller may re-resolve);
        PSClientError past the deadline."""
        # Short tries: between them a resolver may point at a restarted server.
        attempt_s = max(0.1, min(2.0, deadline - time.monotonic()))
        try:
            return stubs.unary(rpc.GET_SERVER_INFO, pb.ServerInfoRequest().SerializeToString(),
                               attempt_s, wait_for_ready=True).msg
        except grpc.RpcError as exc:
            if time.monotonic() + 0.1 >= deadline:
                raise PSClientError(
                    f"cannot reach shard {self.index} at {address} within "
                    f"{self.reach.connect_timeout_s:g} s: {exc.code().name} {exc.details()}"
                ) from exc
            return None

    def close(self) -> None:
        """Ends the bulk session (best effort) and closes the channel. Idempotent."""
        if self.channel is None or self.stubs is None:
            return
        self.reach.bulk.end(self.peer, self.stubs)
        self.channel.close()
        self.channel = None

    # ---- calls with retries ----------------------------------------------------------------

    def call(self, what: str, attempt: Callable[[], T]) -> T:
        """Runs `attempt`, retrying on UNAVAILABLE and DEADLINE_EXCEEDED with backoff.

        Between tries a server that moved (restarted elsewhere) is followed, and tables are
        declared again on a server that came back without them. RemoteError carries a
        refusal's status and reason; RolledBackError says this process must restart.
        """
        reach = self.reach
        tries = 0
        redeclared = False
        while True:
            try:
                return attempt()
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.NOT_FOUND and not redeclared:
                    redeclared = True
                    if self._redeclare():
                        continue
                if code in _RETRYABLE and tries > 0:
                    self.follow()
                marked = marks_of(exc.trailing_metadata())
                if marks.ROLLED_BACK in marked:
                    if reach.on_rolled_back is not None:
                        reach.on_rolled_back()
                    raise RolledBackError(code, exc.details() or "", self.index,
                                          self.address) from exc
                # A server that waited out its clock limit marks the answer; asking again
                # would only wait again.
                waited = marks.CLOCK_WAIT in marked
                # A busy server did nothing with the call; it is asked again after a backoff.
                busy = marks.BUSY in marked
                if ((code in _RETRYABLE and not waited) or busy) and (
                        tries + 1 < reach.retry.attempts):
                    delay = reach.retry.delay_s(tries)
                    log.warning(
                        "worker %d: %s on shard %d (%s) failed with %s; retry %d in %.2f s",
                        reach.worker, what, self.index, self.address, code.name, tries + 1,
                        delay,
                    )
                    time.sleep(delay)
                    tries += 1
                    continue
                raise RemoteError(code, exc.details() or "", self.index, self.address) from exc

    def unary(self, method: Rpc[Any, Resp], request: bytes,
              timeout_s: float | None = None) -> Frame[Resp]:
        """One try of a unary call (within `timeout_s`; default: the link's)."""
        return self._stubs().unary(method, request,
                                   self.reach.timeout_s if timeout_s is None else timeout_s)

    def _stubs(self) -> Stubs:
        stubs = self.stubs
        if stubs is None:
            raise PSClientError(f"the link to shard {self.index} is closed")
        return stubs

    def follow(self) -> None:
        """Reconnects if the resolver now gives another address for this shard."""
        reach = self.reach
        if reach.resolve is None:
            return
        try:
            address = reach.resolve(self.index)
        except Exception as exc:  # a resolver outage must not end the retries
            log.debug("worker %d: resolving shard %d failed: %s", reach.worker, self.index, exc)
            return
        if not address or address == self.address:
            return
        with self._lock:
            if address == self.address:
                return
            old, old_peer, old_stubs = self.channel, self.peer, self.stubs
            try:
                self._connect(address, min(5.0, reach.connect_timeout_s))
            except PSClientError as exc:
                log.info("worker %d: shard %d not ready at %s yet: %s", reach.worker,
                         self.index, address, exc)
                return
            if old is not None and old_stubs is not None:
                reach.bulk.end(old_peer, old_stubs)
                old.close()
        log.warning("worker %d: shard %d moved to %s (incarnation %d)", reach.worker,
                    self.index, address, self.incarnation)

    def _redeclare(self) -> bool:
        """Declares every known table on this server again; True if that worked."""
        specs = self.reach.specs()
        if not specs:
            return False
        request = pb.DeclareTablesRequest(tables=specs).SerializeToString()
        try:
            self.unary(rpc.DECLARE_TABLES, request)
        except grpc.RpcError:
            return False
        log.warning("worker %d: declared %d tables again on shard %d", self.reach.worker,
                    len(specs), self.index)
        return True

    # ---- the data call -------------------------------------------------------------------

    def exchange(self, msg: pb.ExchangeRequest, payload: codec.Payload,
                 answer_bytes: int) -> tuple[pb.ExchangeResponse, codec.Received]:
        """One try of an exchange: the answer and its payload (`answer_bytes` long).

        Through the bulk transport where one is agreed and takes the request; a transport
        that fails is marked broken for this link and the same request (the same push ids,
        so nothing applies twice) goes over gRPC, as do all later ones.
        """
        peer = self.peer
        if self._recheck_at and time.monotonic() >= self._recheck_at:
            peer = self._meet_restarted()
        if peer.channel is not None:
            try:
                sent = bulk_io.exchange(peer, self._stubs(), msg, payload, answer_bytes,
                                        self.reach.timeout_s)
            except ChannelBrokenError as exc:
                self.reach.bulk.broken(peer, self.index, str(exc))
                with self._lock:
                    self._recheck_at = time.monotonic() + self._recheck_s
            else:
                if sent is not None:
                    frame, region = sent
                    # The answer views the region, which goes back to its pool once every
                    # tensor made from it is gone.
                    answer = np.frombuffer(region.view, dtype=np.uint8, count=answer_bytes,
                                           offset=payload.nbytes)
                    weakref.finalize(answer, region.release)
                    return frame.msg, codec.Received([answer.data])
        limit = 2 * self.chunk_bytes
        if payload.nbytes <= limit and answer_bytes <= limit:
            data = codec.encode(msg, {"payload": payload.parts})
            frame = self.unary(rpc.EXCHANGE, data)
            return frame.msg, codec.Received([frame.payload("payload")])
        return self._stream(msg, payload, answer_bytes)

    def _meet_restarted(self) -> Peer:
        """The peer to use after the bulk transport failed: a new session if the server is
        a new process since (restarted at the same address), else the failed one (gRPC)
        and a later check."""
        with self._lock:
            now = time.monotonic()
            if not self._recheck_at or now < self._recheck_at:
                return self.peer
            stubs = self._stubs()
            old = self.peer
            try:
                info = stubs.unary(rpc.GET_SERVER_INFO,
                                   pb.ServerInfoRequest().SerializeToString(),
                                   min(2.0, self.reach.timeout_s)).msg
                incarnation = int(info.incarnation)
                peer = (self.reach.bulk.meet(self.index, self.address, stubs,
                                             min(5.0, self.reach.connect_timeout_s))
                        if incarnation != self.incarnation else old)
            except (grpc.RpcError, PSClientError) as exc:
                log.debug("worker %d: asking shard %d whether it restarted failed: %s",
                          self.reach.worker, self.index, exc)
                peer = old
            if peer is old:
                self._recheck_at = now + self._recheck_s
                self._recheck_s = min(2 * self._recheck_s, RECHECK_S[1])
                return old
            self.reach.bulk.end(old, stubs)
            self.peer, self.incarnation = peer, incarnation
            self._recheck_at, self._recheck_s = 0.0, RECHECK_S[0]
        log.warning("worker %d: shard %d restarted at %s (incarnation %d); exchanging over %s",
                    self.reach.worker, self.index, self.address, incarnation, peer.transport)
        return peer

    def _stream(self, msg: pb.ExchangeRequest, payload: codec.Payload,
                answer_bytes: int) -> tuple[pb.ExchangeResponse, codec.Received]:
        parts = cut(pb.ExchangePart, msg, payload.parts, payload.nbytes, self.chunk_bytes)
        call = self._stubs().stream(rpc.EXCHANGE_STREAM, parts, self.reach.timeout_s)

        def expected(head: object, nbytes: int) -> None:
            if nbytes != answer_bytes:
                raise codec.WireError(f"an answer of {nbytes} bytes where {answer_bytes} "
                                      "were due")

        try:
            response, data = joined(call, expected, f"shard {self.index}'s answer",
                                    assemble=True)
        except codec.WireError as exc:
            call.cancel()
            raise PSClientError(str(exc)) from exc
        if not isinstance(response, pb.ExchangeResponse):  # pragma: no cover - by construction
            raise PSClientError(f"shard {self.index} answered {type(response).__name__}")
        return response, data  # one writable buffer, filled as the parts arrived

    # ---- what the link uses ----------------------------------------------------------------

    @property
    def transport(self) -> str:
        return self.peer.transport

    @property
    def transport_detail(self) -> str:
        peer = self.peer
        return f"{peer.transport} ({peer.over})" if peer.over else peer.transport

    @property
    def has_lane(self) -> bool:
        return self.peer.lane is not None
