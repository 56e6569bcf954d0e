"""The worker's side of bulk transports: meeting each server, and moving payloads.

`BulkClient.meet` runs the handshake with one server and records which transport that
server and this worker share (`Peer`). `exchange` carries one request's payload and its
answer through that transport; it returns None when the payload should travel inline
instead, and raises ChannelBrokenError when the transport failed, after which the caller
(worker/link.py) marks the peer and sends the same request (the same push ids) over gRPC.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from protos import codec, marks, rpc
from protos import pstrain_pb2 as pb
from protos.codec import Frame
from protos.marks import marks_of
from protos.rpc import Stubs
from protos.transport import ENV_VAR as ENV_TRANSPORT
from protos.transport import (
    PREFERENCE,
    ChannelBrokenError,
    Choice,
    ClientChannel,
    Region,
    TransportError,
    available,
    client_channel,
)
from protos.transport.lane import LaneClient
from protos.transport.registry import unavailable_offer
from worker.errors import PSClientError

log = logging.getLogger(__name__)

T = TypeVar("T")

class TransportChoiceError(PSClientError):
    """A forced transport cannot be used (here, or with a server); the message says why."""


ENV_LANES = "PSTRAIN_LANE"
_ENV_LANES_BEFORE = "PSTRAIN_SHM_LANE"  # its name until lanes became a transport capability


@dataclass(frozen=True)
class TransportSettings:
    """A worker's bulk-transport settings: which transports (`PSClient(transport=...)`) and
    whether exchanges take a server's request lane (`PSClient(lanes=...)`)."""

    transport: str = "auto"
    lanes: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TransportSettings:
        """From PSTRAIN_TRANSPORT (default auto) and PSTRAIN_LANE (1, the default, or 0);
        for entry points (`worker.init()`, `training.connect()`) only. TransportChoiceError
        names a bad value, or the variable's old name."""
        if _ENV_LANES_BEFORE in env:
            raise TransportChoiceError(
                f"{_ENV_LANES_BEFORE} is now called {ENV_LANES} (any transport may offer a "
                f"request lane); set {ENV_LANES}={env[_ENV_LANES_BEFORE]} instead"
            )
        lanes = env.get(ENV_LANES, "1").strip()
        if lanes not in ("0", "1"):
            raise TransportChoiceError(f"{ENV_LANES} must be 0 or 1, got {lanes!r}")
        return cls(env.get(ENV_TRANSPORT, "auto").strip() or "auto", lanes == "1")


@dataclass
class Peer:
    """How this worker moves bulk payloads to and from one server."""

    transport: str = "grpc"
    session: int = 0
    channel: ClientChannel | None = None
    note: str = ""
    over: str = ""  # what the transport runs over, when it says (e.g. "tcp/eth0")
    lane: LaneClient | None = None  # the transport's request lane, when the server has one


class BulkClient:
    """Every bulk transport of one worker process. Thread-safe."""

    def __init__(self, choice: Choice, worker: int, incarnation: int, lanes: bool) -> None:
        self.choice = choice
        self.worker = worker
        self.incarnation = incarnation
        self.lanes = lanes  # send exchanges over a server's request lane where it has one
        self._channels: dict[str, ClientChannel] = {}
        self._offers: list[pb.TransportOffer] = []
        for name in PREFERENCE:
            if choice.forced and name != choice.forced:
                self._offers.append(unavailable_offer(name, f"the worker forces {choice.forced}"))
                continue
            ok, reason = available(name)
            if ok:
                try:
                    self._channels[name] = client_channel(name)
                    self._offers.append(self._channels[name].offer())
                    continue
                except TransportError as exc:
                    reason = str(exc)
            if choice.forced:
                self.close()
                raise TransportChoiceError(
                    f"transport {name!r} is forced (--transport / PSTRAIN_TRANSPORT) but not "
                    f"available in this worker: {reason}"
                )
            self._offers.append(unavailable_offer(name, reason))
        # Guards the Peer objects' fields when a transport breaks.
        self._lock = threading.Lock()

    def meet(self, index: int, address: str, stubs: Stubs, timeout_s: float) -> Peer:
        """Agrees on a transport with one server. Blocks up to `timeout_s`.

        TransportChoiceError when a transport forced on either side cannot be used.
        """
        request = pb.HandshakeRequest(
            worker=self.worker, incarnation=self.incarnation, offers=self._offers,
            forced=self.choice.forced,
        )
        try:
            frame = stubs.unary(rpc.HANDSHAKE, request.SerializeToString(), timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED and self.choice.forced in ("", "grpc"):
                return Peer(note="the server predates bulk transports")
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise TransportChoiceError(
                    f"shard {index} ({address}): {exc.details()}"
                ) from exc
            raise
        answer = frame.msg
        name = answer.transport or "grpc"
        if self.choice.forced and name != self.choice.forced:
            raise TransportChoiceError(
                f"shard {index} ({address}) chose transport {name!r}, but {self.choice.forced!r} "
                "is forced here; the server may be older than this worker"
            )
        channel = self._channels.get(name)
        if name == "grpc" or channel is None:
            if answer.note:
                log.info("worker %d: shard %d (%s) uses transport grpc (%s)", self.worker, index,
                         address, answer.note)
            return Peer(note=answer.note)
        server_offer = next((o for o in answer.offers if o.name == name), pb.TransportOffer())
        try:
            channel.connect(answer.session, server_offer, timeout_s)
        except TransportError as exc:
            if self.choice.forced:
                raise TransportChoiceError(
                    f"shard {index} ({address}): transport {name!r} is forced but connecting "
                    f"failed: {exc}"
                ) from exc
            log.warning("worker %d: shard %d (%s): %s connection failed (%s); using grpc",
                        self.worker, index, address, name, exc)
            self.end(Peer(name, answer.session, channel), stubs)
            return Peer(note=f"{name}: {exc}")
        over = channel.describe(answer.session)
        lane = self._open_lane(index, address, answer, channel, timeout_s)
        detail = "".join(f", {d}" for d in (server_offer.detail, over) if d)
        log.info("worker %d: shard %d (%s) uses transport %s%s%s%s", self.worker, index,
                 address, name, detail, " with its exchange lane" if lane else "",
                 f" ({answer.note})" if answer.note else "")
        return Peer(name, answer.session, channel, answer.note, over, lane)

    def _open_lane(self, index: int, address: str, answer: pb.HandshakeResponse,
                   channel: ClientChannel, timeout_s: float) -> LaneClient | None:
        """The request lane the server named for this session, connected once to be sure;
        None when it named none, this worker does not want it, or it does not answer
        (exchanges then use gRPC)."""
        if not answer.lane or not self.lanes:
            return None
        lane = LaneClient(answer.lane, answer.session, channel.token())
        try:
            lane.check(timeout_s)
        except ChannelBrokenError as exc:
            lane.close()
            log.warning("worker %d: shard %d (%s): %s; exchanging over gRPC", self.worker,
                        index, address, exc)
            return None
        return lane

    def broken(self, peer: Peer, index: int, reason: str) -> None:
        """Marks a peer's transport as failed: its requests go inline from now on."""
        with self._lock:
            if peer.channel is None:
                return
            was = peer.transport
            peer.transport, peer.channel, peer.over = "grpc", None, ""
            peer.note = f"{was} failed: {reason}"
            lane, peer.lane = peer.lane, None
        if lane is not None:
            lane.close()
        log.warning("worker %d: transport %s to shard %d failed (%s); retrying the request and "
                    "sending everything after it over grpc", self.worker, was, index, reason)

    def end(self, peer: Peer, stubs: Stubs) -> None:
        """Tells the server the session is over (best effort, short timeout) and frees what
        this side held for it."""
        if peer.lane is not None:
            peer.lane.close()
        if not peer.session:
            return
        for channel in self._channels.values():
            channel.end(peer.session)
        request = pb.HandshakeRequest(worker=self.worker, end_session=peer.session)
        try:
            stubs.unary(rpc.HANDSHAKE, request.SerializeToString(), 2.0)
        except grpc.RpcError as exc:
            log.debug("worker %d: ending bulk session failed: %s", self.worker, exc)

    def channel(self, name: str) -> ClientChannel | None:
        return self._channels.get(name)

    def close(self) -> None:
        """Closes every channel. Idempotent."""
        for channel in self._channels.values():
            channel.close()


def _lease(peer: Peer, nbytes: int) -> Region | None:
    with_channel = peer.channel
    if with_channel is None:
        return None
    return with_channel.lease(nbytes, peer.session)


def _failed(exc: grpc.RpcError) -> bool:
    return marks.BULK_FAILED in marks_of(exc.trailing_metadata())


def _run(region: Region, call: Callable[[], Any], timeout_s: float) -> Any:
    """Runs one request over a region; ChannelBrokenError when the transport failed."""
    try:
        result = call()
        region.complete(timeout_s)
        return result
    except BaseException as exc:
        region.abort()
        region.release()
        if isinstance(exc, grpc.RpcError) and _failed(exc):
            raise ChannelBrokenError(exc.details() or "the server's bulk transfer failed") from exc
        if isinstance(exc, TransportError):
            raise ChannelBrokenError(str(exc)) from exc
        raise


def _named(region: Region, build: Callable[[], T]) -> T:
    """`build()`, which fills the region and names it in a request; on any failure the
    transfers already posted are settled and the region goes back to its pool."""
    try:
        return build()
    except BaseException:
        region.abort()
        region.release()
        raise


def exchange(peer: Peer, stubs: Stubs, msg: pb.ExchangeRequest,
             payload: codec.Payload, answer_bytes: int, timeout_s: float
             ) -> tuple[Frame[pb.ExchangeResponse], Region] | None:
    """Sends an exchange whose payload goes through a region and whose answer's payload
    comes back into it, from byte `payload.nbytes` on; the caller releases the region.
    None: go inline."""
    nbytes = payload.nbytes
    if not nbytes and not answer_bytes:
        return None  # nothing bulk: a plain message is cheaper
    region = _lease(peer, nbytes + answer_bytes)
    if region is None:
        return None

    def build() -> pb.ExchangeRequest:
        payload.copy_into(region.view)
        request = pb.ExchangeRequest()
        request.CopyFrom(msg)
        request.bulk.CopyFrom(region.send_ref(0, nbytes))
        request.answer.CopyFrom(region.recv_ref(nbytes, answer_bytes))
        return request

    request = _named(region, build)

    lane = peer.lane

    def call() -> Frame[pb.ExchangeResponse]:
        data = request.SerializeToString()
        frame: Frame[pb.ExchangeResponse]
        if lane is None:
            frame = stubs.unary(rpc.EXCHANGE, data, timeout_s)
        else:
            try:
                frame = codec.decode(pb.ExchangeResponse, lane.call(data, timeout_s))
            except codec.WireError as exc:
                raise ChannelBrokenError(f"an unreadable answer on the exchange lane: {exc}") \
                    from exc
        if not frame.msg.in_bulk:
            raise ChannelBrokenError("the server answered a bulk exchange inline")
        return frame

    frame: Frame[pb.ExchangeResponse] = _run(region, call, timeout_s)
    return frame, region
