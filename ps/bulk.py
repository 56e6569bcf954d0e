"""The server's side of bulk transports: the handshake, and the sessions' channels.

The servicer calls `handshake` for the Handshake RPC and `read`/`write` when a request names
a bulk reference. Which transports a server offers is decided once, at start: all that work
here (auto), or only the forced one (an error at start if it cannot work).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from contextlib import AbstractContextManager

from protos import pstrain_pb2 as pb
from protos.transport import (
    PREFERENCE,
    Choice,
    HandshakeError,
    ServerChannel,
    TransportError,
    TransportUnavailableError,
    select,
    server_channel,
)
from protos.transport.base import ChannelBrokenError
from protos.transport.lane import Handler, LaneServer
from protos.transport.registry import available, unavailable_offer
from ps.errors import FailedPreconditionError, InvalidArgumentError

log = logging.getLogger(__name__)


class BulkEndpoint:
    """Every bulk transport of one server. Thread-safe."""

    def __init__(self, choice: Choice, shard: int) -> None:
        self.choice = choice
        self.shard = shard
        self._lanes: dict[str, LaneServer] = {}  # by transport
        self._channels: dict[str, ServerChannel] = {}
        self._offers: list[pb.TransportOffer] = []
        for name in PREFERENCE:
            if choice.forced and name != choice.forced:
                self._offers.append(unavailable_offer(name, f"the server forces {choice.forced}"))
                continue
            ok, reason = available(name)
            if ok:
                try:
                    channel = server_channel(name)
                except TransportError as exc:
                    ok, reason = False, str(exc)
                else:
                    self._channels[name] = channel
                    self._offers.append(channel.offer())
                    continue
            if choice.forced:
                self.close()
                raise InvalidArgumentError(
                    f"--transport {name} is forced but not available on this server: {reason}"
                )
            self._offers.append(unavailable_offer(name, reason))
            log.info("shard %d: transport %s not available: %s", shard, name, reason)
        # Guards _sessions.
        self._lock = threading.Lock()
        self._sessions: dict[int, str] = {}
        # Guarded by _lock too: the worker whose handshake opened each session.
        self._owners: dict[int, int] = {}
        log.info("shard %d: bulk transports offered: %s", shard,
                 ", ".join(self._channels) or "none")

    @property
    def offers(self) -> list[pb.TransportOffer]:
        return list(self._offers)

    def serve_lanes(self, handle: Handler, max_frame_bytes: int, run: Executor,
                    threads: int) -> None:
        """Opens a request lane (protos.transport.lane) beside every transport offered here
        that declares one; `handle` answers its requests on `run`, an executor of `threads`
        threads. A lane that cannot open is logged, and that transport's clients exchange
        over gRPC."""
        for name, channel in self._channels.items():
            check = channel.lane_check()
            if check is None or name in self._lanes:
                continue
            try:
                self._lanes[name] = LaneServer(handle, check, max_frame_bytes, run, threads,
                                               name=f"lane{self.shard}-{name}")
            except OSError as exc:
                log.warning("shard %d: no request lane beside %s (%s); its clients exchange "
                            "over gRPC", self.shard, name, exc)

    def owner(self, session: int) -> int | None:
        """The worker whose handshake opened `session`; None for no open session."""
        with self._lock:
            return self._owners.get(session)

    def handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeResponse:
        """Picks a transport for a client and opens its session. Blocks briefly."""
        if request.end_session:
            self.end(request.end_session)
            return pb.HandshakeResponse(transport="grpc")
        offers = list(self._offers)
        notes: list[str] = []
        while True:
            try:
                name, note = select(request.offers, offers, request.forced, self.choice.forced)
            except HandshakeError as exc:
                raise FailedPreconditionError(str(exc)) from exc
            if note:
                notes.append(note)
            channel = self._channels.get(name)
            if channel is None:
                raise FailedPreconditionError(f"transport {name!r} has no channel here")
            peer = next((o for o in request.offers if o.name == name), pb.TransportOffer())
            try:
                session = channel.accept(request, peer)
            except TransportUnavailableError as exc:
                # This client cannot use it after all: offer the next transport instead.
                offers = [o if o.name != name else unavailable_offer(name, str(exc))
                          for o in offers]
                continue
            declined = "" if request.forced or self.choice.forced else channel.declines(session)
            if declined:
                # Usable but no faster than gRPC here: auto takes the next transport.
                channel.end(session)
                offers = [o if o.name != name else unavailable_offer(name, declined)
                          for o in offers]
                continue
            break
        if name != "grpc":
            with self._lock:
                self._sessions[session] = name
                self._owners[session] = request.worker
        log.info("shard %d: worker %d uses transport %s%s", self.shard, request.worker, name,
                 f" ({'; '.join(notes)})" if notes else "")
        lane = self._lanes[name].address if name in self._lanes else ""
        return pb.HandshakeResponse(transport=name, session=session, offers=self._offers,
                                    note="; ".join(notes), lane=lane)

    def _channel(self, ref: pb.BulkRef) -> ServerChannel:
        with self._lock:
            name = self._sessions.get(ref.session)
        if name is None:
            raise ChannelBrokenError(
                f"bulk session {ref.session} is unknown to this server (restarted?); "
                "the client must meet it again"
            )
        return self._channels[name]

    def read(self, ref: pb.BulkRef, timeout_s: float) -> AbstractContextManager[memoryview]:
        """The payload `ref` names, valid inside the `with` block. ChannelBrokenError when
        it cannot be had."""
        try:
            channel = self._channel(ref)
        except ChannelBrokenError:
            self.discard(ref)
            raise
        return channel.read(ref, timeout_s)

    def discard(self, *refs: pb.BulkRef) -> None:
        """Drops payloads a refused request names, unread, so the client's transfers end
        (a transport's send may wait for its receiver). Does not block."""
        for ref in refs:
            if not ref.length:
                continue
            with self._lock:
                name = self._sessions.get(ref.session)
            # A session this server no longer knows: any channel may hold its bytes.
            channels = [self._channels[name]] if name else list(self._channels.values())
            for channel in channels:
                try:
                    channel.discard(ref)
                except TransportError as exc:
                    log.debug("shard %d: dropping a bulk payload: %s", self.shard, exc)

    def write(self, ref: pb.BulkRef, nbytes: int, fill: Callable[[memoryview], None],
              timeout_s: float) -> None:
        """Fills and delivers `nbytes` to where `ref` says. Blocks until delivered."""
        self._channel(ref).write(ref, nbytes, fill, timeout_s)

    def end(self, session: int) -> None:
        with self._lock:
            name = self._sessions.pop(session, None)
            self._owners.pop(session, None)
        if name is not None:
            self._channels[name].end(session)

    def channel(self, name: str) -> ServerChannel | None:
        return self._channels.get(name)

    def close_lanes(self, grace_s: float = 0.0) -> None:
        """Stops the request lanes, giving their calls in progress up to `grace_s` to be
        answered (as a stopping gRPC server does). Blocks that long at most. Idempotent."""
        for lane in self._lanes.values():
            lane.close(grace_s)

    def close(self) -> None:
        """Closes the lanes and every channel. Idempotent."""
        self.close_lanes()
        for channel in self._channels.values():
            channel.close()
