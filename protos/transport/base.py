"""The transport interface: what a client and a server need from a bulk transport.

A request that moves a bulk payload works on a `Region`, a buffer the client leases for the
request. For a push the client fills the region and names it in the request (`send_ref`);
the server reads it (`ServerChannel.read`). For a pull the client names the region as the
destination (`recv_ref`); the server writes the answer into it (`ServerChannel.write`) and
the client reads it from `Region.view`, without a copy where the caller allows it.

A transport may also declare a request lane (`ServerChannel.lane_check`): a socket beside
it that carries whole Exchange requests and answers without gRPC (protos.transport.lane).
The server opens one for every transport that declares it and names it in the handshake;
the client sends there the exchanges of the sessions that took that transport.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from protos import pstrain_pb2 as pb

# A request lane's check of a connecting client: (session, token, peer pid) -> "" when that
# process may use the session, else why not.
LaneCheck = Callable[[int, str, int], str]


class TransportError(Exception):
    """Base of every error a bulk transport raises."""


class TransportUnavailableError(TransportError):
    """A transport cannot work in this process or with this peer; the message says why."""


class HandshakeError(TransportError):
    """Client and server could not agree on a transport (a forced one the peer lacks)."""


class ChannelBrokenError(TransportError):
    """A bulk transfer failed mid-request; the request may be retried over gRPC."""


class Region(Protocol):
    """A client-side buffer for one request's bulk payload. Not thread-safe: one request."""

    @property
    def view(self) -> memoryview:
        """The writable bytes of the region (at least the size leased)."""
        ...

    def send_ref(self, offset: int, length: int) -> pb.BulkRef:
        """Names bytes [offset, offset+length) for the server to read (a push's payload).

        The bytes must be filled before this call. Does not block.
        """
        ...

    def recv_ref(self, offset: int, length: int) -> pb.BulkRef:
        """Names bytes [offset, offset+length) for the server to write (a pull's answer)."""
        ...

    def complete(self, timeout_s: float) -> None:
        """Waits until every transfer named by the refs is done. Blocks up to `timeout_s`.

        Call it after the server answered the request successfully; ChannelBrokenError if a
        transfer failed or did not finish in time.
        """
        ...

    def abort(self) -> None:
        """The request failed: settles the transfers still posted. Does not block for long."""
        ...

    def release(self) -> None:
        """Returns the region to its pool. Idempotent; the view must not be used after it."""
        ...


class ClientChannel(Protocol):
    """A client's side of one transport, shared by all its servers. Thread-safe."""

    name: str

    def offer(self) -> pb.TransportOffer:
        """What this side can do, for the handshake (with its `token`)."""
        ...

    def token(self) -> str:
        """Names this client's resources for the server; may be empty. A request lane's
        hello carries it too."""
        ...

    def connect(self, session: int, peer: pb.TransportOffer, timeout_s: float) -> None:
        """Prepares to talk to a server that accepted session `session`. Blocks briefly."""
        ...

    def lease(self, nbytes: int, session: int) -> Region | None:
        """A region of at least `nbytes` for a request to that session's server, or None when
        the payload should travel inline (over the pool's capacity). Does not block."""
        ...

    def describe(self, session: int) -> str:
        """What the session runs over, for logs (the UCX transports in use); may be empty.
        Does not block."""
        ...

    def end(self, session: int) -> None:
        """Forgets a session and frees what it held (an endpoint). Idempotent; blocks
        briefly."""
        ...

    def close(self) -> None:
        """Frees every resource. Idempotent."""
        ...


class ServerChannel(Protocol):
    """A server's side of one transport, serving every client. Thread-safe."""

    name: str

    def offer(self) -> pb.TransportOffer:
        ...

    def accept(self, request: pb.HandshakeRequest, peer: pb.TransportOffer) -> int:
        """Opens a session for a client; returns its id. TransportUnavailableError if this
        client cannot be served by this transport (the caller then tries the next one)."""
        ...

    def read(self, ref: pb.BulkRef, timeout_s: float) -> AbstractContextManager[memoryview]:
        """The payload named by `ref`, valid inside the `with` block only. Blocks up to
        `timeout_s`; ChannelBrokenError when the payload cannot be had."""
        ...

    def write(self, ref: pb.BulkRef, nbytes: int, fill: Callable[[memoryview], None],
              timeout_s: float) -> None:
        """Calls `fill` with a writable buffer of `nbytes` that reaches the client at `ref`.
        Blocks until the bytes are delivered (up to `timeout_s`)."""
        ...

    def lane_check(self) -> LaneCheck | None:
        """Who may use a request lane beside this transport, or None: it declares no lane.
        Does not block."""
        ...

    def declines(self, session: int) -> str:
        """Why `auto` should not use this accepted session (it would be no faster than
        gRPC), or "" to use it. A forced transport is used regardless. Does not block."""
        ...

    def discard(self, ref: pb.BulkRef) -> None:
        """Drops the payload `ref` names without reading it (a refused request, an unknown
        session), so the client's transfer can end. Does not block."""
        ...

    def end(self, session: int) -> None:
        """Forgets a session and frees what it held. Idempotent."""
        ...

    def close(self) -> None:
        """Frees every resource. Idempotent."""
        ...


def host_identity() -> str:
    """Which host (and pid namespace) this process runs in: equal for processes that can
    share memory through /proc. Does not block."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}/{pidns}"


def check_length(ref: pb.BulkRef, nbytes: int, what: str) -> None:
    """ChannelBrokenError unless `ref` names exactly `nbytes` bytes."""
    if ref.length != nbytes:
        raise ChannelBrokenError(
            f"{what}: the bulk reference names {ref.length} bytes but {nbytes} are needed"
        )

