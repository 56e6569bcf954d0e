"""A request lane: whole exchanges over a local socket, without gRPC's per-call cost.

A transport declares a lane by returning a check from `ServerChannel.lane_check` (shm does:
its clients share the server's host, pid namespace and user). The server then also listens
on a Unix stream socket in the abstract namespace and names it in the handshake of every
session that took that transport. The worker sends those sessions' bulk exchanges there:
the Exchange RPC's request, whose payload and answer already lie in the transport's memory,
in one frame, and the answer in another. One blocking send and one blocking receive per
call on the client's thread; on the server, the frame is handled on the same executor, under
the same thread limit and message size limit, as a gRPC call, and a stopping server drains
the lane's calls in progress as it drains gRPC's. A Python gRPC unary call costs both
processes together about half a millisecond of CPU (thread hand-offs, HTTP/2, completion
queues); a training step makes one exchange per server, so on a small machine that cost is
a large part of a step.

Nothing else changes: the server runs the Exchange RPC's own handler, and a refusal carries
the status code, message and trailing-metadata marks the RPC would have ended with, so the
client handles it the same way (`LaneError` is a `grpc.RpcError`). A lane that fails (the
server went away, a malformed frame) raises ChannelBrokenError, and the caller sends the
same request, with the same push ids, over gRPC.

The framing is described beside `LaneHello` in pstrain.proto. Who may connect: the first
frame names the session and carries the client's token for the transport; the transport's
check says whether the peer process (SO_PEERCRED) holds that session, and the lane checks it
runs as the same user. Abstract sockets have no file: a process that dies leaves nothing
behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from protos import pstrain_pb2 as pb
from protos.transport.base import ChannelBrokenError, LaneCheck

log = logging.getLogger(__name__)

HELLO, REQUEST, ANSWER, REFUSAL = 1, 2, 3, 4
_HEAD = struct.Struct("<IB")
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
# How long one frame's bytes may take to arrive or leave (a hello, a request, an answer).
IO_TIMEOUT_S = 5.0
MAX_ANSWER_BYTES = 256 * 1024 * 1024  # answers carry headers only; their rows are in shm
_READ_AHEAD = 64 * 1024  # a frame's first receive; requests and answers fit
# A task that answered a call keeps reading its connection for the next one (it lingers)
# before handing it back to the watcher: a training loop sends its next request a step
# later, and serving it on the same thread saves the hand-offs through the watcher and the
# executor's queue (a third of a small exchange's server CPU). How long: see linger_s.
LINGER_MIN_S = 0.005
LINGER_MAX_S = 0.05
_GAP_WEIGHT = 0.25  # of the newest gap in a connection's running estimate
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def linger_s(gap_s: float | None) -> float:
    """How long to read a connection for its next request after an answer, given its usual
    gap from an answer to the next request (None: none seen yet): twice the gap, so a
    steady loop's next step arrives while the thread waits, and LINGER_MIN_S where that is
    shorter, or longer than LINGER_MAX_S (a gap that long costs more in the waiting thread
    than the hand-off it saves)."""
    if gap_s is None:
        return LINGER_MIN_S
    wait = 2.0 * gap_s
    return wait if LINGER_MIN_S <= wait <= LINGER_MAX_S else LINGER_MIN_S


def next_gap(estimate: float | None, gap_s: float) -> float:
    """A connection's gap estimate after one more observed gap (a running mean)."""
    return gap_s if estimate is None else estimate + _GAP_WEIGHT * (gap_s - estimate)


class LaneProtocolError(Exception):
    """A frame broke the lane's framing; the connection is closed."""


def _fill(sock: socket.socket, view: memoryview, got: int, total: int) -> None:
    """Receives into all of `view`: the last bytes of a `total`-byte frame, `got` in."""
    pos = 0
    while pos < view.nbytes:
        k = sock.recv_into(view[pos:])
        if not k:
            raise LaneProtocolError(
                f"the connection closed inside a frame ({got + pos} of {total})")
        pos += k


def read_frame(sock: socket.socket, max_bytes: int) -> tuple[int, bytes] | None:
    """(kind, body) of the next frame; None when the peer closed the connection.

    A peer sends nothing past a frame until it is answered, so the first receive may take
    the whole of it: a frame of up to _READ_AHEAD bytes costs one call, and bytes past its
    end are a protocol error.
    """
    data = sock.recv(_READ_AHEAD)
    if not data:
        return None
    if len(data) < _HEAD.size:
        head = bytearray(_HEAD.size)
        head[: len(data)] = data
        _fill(sock, memoryview(head)[len(data) :], len(data), _HEAD.size)
        data = bytes(head)
    length, kind = _HEAD.unpack_from(data)
    if kind not in (HELLO, REQUEST, ANSWER, REFUSAL):
        raise LaneProtocolError(f"unknown frame kind {kind}")
    if length > max_bytes:
        raise LaneProtocolError(f"a frame of {length} bytes is over the limit of {max_bytes}")
    have = len(data) - _HEAD.size
    if have > length:
        raise LaneProtocolError(f"{have - length} bytes arrived past the end of a frame")
    if have == length:
        return kind, data[_HEAD.size :]
    body = bytearray(length)
    body[:have] = memoryview(data)[_HEAD.size :]
    _fill(sock, memoryview(body)[have:], _HEAD.size + have, _HEAD.size + length)
    return kind, bytes(body)


def write_frame(sock: socket.socket, kind: int, body: bytes) -> None:
    sock.sendall(_HEAD.pack(len(body), kind) + body)


def _status(code: grpc.StatusCode, details: str, marks: Iterable[str] = ()) -> bytes:
    return pb.LaneStatus(code=code.value[0], details=details, marks=list(marks)).SerializeToString()


# ---- the server's side ------------------------------------------------------------------------


class LaneAbort(Exception):
    """A handler ended its call with a status (LaneContext.abort)."""

    def __init__(self, code: grpc.StatusCode, details: str, marks: tuple[str, ...]) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.marks = marks


class LaneContext:
    """What a handler sees of a lane call: the part of grpc.ServicerContext that the Exchange
    handler uses (trailing metadata, abort)."""

    def __init__(self, peer: str = "lane", session: int = 0,
                 conn: socket.socket | None = None) -> None:
        self._marks: tuple[str, ...] = ()
        self._peer = peer
        self.session = session  # the session whose hello opened the connection
        self._conn = conn

    def peer(self) -> str:
        """Who called, as gRPC's context names a peer: the client process ("lane:pid N")."""
        return self._peer

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, Any]]) -> None:
        self._marks = tuple(key for key, _ in metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise LaneAbort(code, details, self._marks)

    def is_active(self) -> bool:
        """Whether the client still waits for the answer: a lane call has no deadline of its
        own, so it ends when the client hangs up (its process ended, or it gave the lane
        up). A client sends nothing more while it waits, so the connection reads as hung up
        or as nothing. Costs one poll of the socket; never blocks."""
        if self._conn is None:
            return True
        poller = select.poll()
        poller.register(self._conn, _HUNG_UP)
        return not poller.poll(0)


Handler = Callable[[bytes, LaneContext], bytes]
_HUNG_UP = select.POLLHUP | select.POLLERR | select.POLLRDHUP
_ACCEPT, _WAKE = object(), object()  # the watcher's own sockets


class LaneServer:
    """Listens on an abstract Unix socket and runs each request through `handle` on `run`:
    the executor that runs the server's gRPC calls (`threads` of them), so lane and gRPC
    calls share its threads and its limit. One thread watches the connections for frames; a
    connection has at most one request at a time (its client waits for each answer), and
    the task that answered it serves the next one that comes within `linger_s` of the
    connection's gap, while fewer than half the threads linger (none on one thread), so
    lingering never takes a thread another call needs. Thread-safe."""

    def __init__(self, handle: Handler, verify: LaneCheck, max_frame_bytes: int,
                 run: Executor, threads: int, name: str = "lane") -> None:
        self._handle = handle
        self._max_lingering = threads // 2
        self._verify = verify
        self._max = max_frame_bytes
        self._run = run
        self._name = name
        self.address = f"pstrain-lane-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind("\0" + self.address)
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, _ACCEPT)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        # Guards the fields below; `_idle` is notified when a task ends.
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._conns: set[socket.socket] = set()  # every open connection
        # Each welcomed connection's client ("lane:pid N") and session.
        self._peers: dict[socket.socket, tuple[str, int]] = {}
        self._running: set[socket.socket] = set()  # those with a task in `run`
        self._parked: list[socket.socket] = []  # to be watched again by the watcher
        self._lingering = 0  # tasks reading their connection for its next request
        # Not guarded: per connection, when its last answer left and its gap estimate
        # (next_gap), read and written only by the one task serving that connection.
        self._pace: dict[socket.socket, tuple[float, float | None]] = {}
        self._closed = False
        self._watcher = threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)
        self._watcher.start()

    def connections(self) -> int:
        """Connections open now. Thread-safe."""
        with self._lock:
            return len(self._conns)

    def _watch(self) -> None:
        """The watcher: accepts connections and hands each frame's connection to `run`."""
        while True:
            events = self._selector.select()
            # Wake-ups are read before the parked list is taken: a connection parked after
            # this read sends a wake-up of its own, so none is left parked unwatched.
            if any(key.data is _WAKE for key, _ in events):
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
            with self._lock:
                if self._closed:
                    return
                parked, self._parked = self._parked, []
            for conn in parked:
                self._selector.register(conn, selectors.EVENT_READ, conn)
            for key, _ in events:
                if key.data is _ACCEPT:
                    self._accept()
                elif key.data is not _WAKE:
                    self._selector.unregister(key.fileobj)
                    self._start(self._serve_one, key.data)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(True)
        conn.settimeout(IO_TIMEOUT_S)
        with self._lock:
            self._conns.add(conn)
        self._start(self._welcome, conn)

    def _start(self, step: Callable[[socket.socket], bool], conn: socket.socket) -> None:
        """Runs `step` on `conn` in `run`; the connection is watched again if it says True."""
        with self._lock:
            self._running.add(conn)
        try:
            self._run.submit(self._task, step, conn)
        except RuntimeError:  # the executor is shut down: the server is stopping
            self._end_task(conn, keep=False)

    def _task(self, step: Callable[[socket.socket], bool], conn: socket.socket) -> None:
        keep = False
        try:
            keep = step(conn)
            while keep and self._next_soon(conn):
                keep = self._serve_one(conn)
        except LaneProtocolError as exc:
            log.warning("%s: closing a connection: %s", self._name, exc)
            with contextlib.suppress(OSError):
                write_frame(conn, REFUSAL, _status(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
        except OSError as exc:
            log.debug("%s: connection ended: %s", self._name, exc)
        except Exception:
            log.exception("%s: a lane task failed", self._name)
        finally:
            self._end_task(conn, keep)

    def _next_soon(self, conn: socket.socket) -> bool:
        """Whether `conn` has bytes to read within its linger (while the lane is open and a
        thread may linger)."""
        with self._lock:
            if self._closed or self._lingering >= self._max_lingering:
                return False
            self._lingering += 1
            wait = linger_s(self._pace.get(conn, (0.0, None))[1])
        try:
            poll = select.poll()
            poll.register(conn, select.POLLIN)
            return bool(poll.poll(wait * 1000))
        finally:
            with self._lock:
                self._lingering -= 1

    def _end_task(self, conn: socket.socket, keep: bool) -> None:
        with self._lock:
            self._running.discard(conn)
            keep = keep and not self._closed
            if keep:
                self._parked.append(conn)
            else:
                self._conns.discard(conn)
                self._peers.pop(conn, None)
                self._pace.pop(conn, None)
            self._idle.notify_all()
        if keep:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"w")
        else:
            conn.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        """Reads one request (its bytes arrive together: a client stalled inside a frame is
        dropped after IO_TIMEOUT_S) and answers it; False to close the connection."""
        frame = read_frame(conn, self._max)
        if frame is None:
            return False
        arrived = time.monotonic()
        kind, body = frame
        if kind != REQUEST:
            write_frame(conn, REFUSAL, _status(
                grpc.StatusCode.INVALID_ARGUMENT, f"expected a request frame, got {kind}"))
            return False
        with self._lock:
            peer, session = self._peers[conn]
        last, gap = self._pace.get(conn, (None, None))
        if last is not None:
            gap = next_gap(gap, arrived - last)
        write_frame(conn, *self._answer(body, peer, session, conn))
        self._pace[conn] = (time.monotonic(), gap)
        return True

    def _welcome(self, conn: socket.socket) -> bool:
        """Checks the hello; answers it with an empty answer frame, or a refusal."""
        pid, uid, _ = _CREDS.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
        try:
            frame = read_frame(conn, 4096)
        except TimeoutError:
            return False
        if frame is None:
            return False
        kind, body = frame
        reason = ""
        if kind != HELLO:
            reason = f"the first frame must be a hello, got kind {kind}"
        elif uid != os.getuid():
            reason = f"the peer runs as uid {uid}, this server as uid {os.getuid()}"
        else:
            try:
                hello = pb.LaneHello.FromString(body)
            except DecodeError as exc:
                reason = f"cannot parse the hello: {exc}"
            else:
                reason = self._verify(hello.session, hello.token, pid)
        if reason:
            log.warning("%s: refused a connection from pid %d: %s", self._name, pid, reason)
            write_frame(conn, REFUSAL, _status(grpc.StatusCode.PERMISSION_DENIED, reason))
            return False
        with self._lock:
            self._peers[conn] = (f"lane:pid {pid}", hello.session)
        write_frame(conn, ANSWER, b"")
        return True

    def _answer(self, body: bytes, peer: str, session: int,
                conn: socket.socket) -> tuple[int, bytes]:
        context = LaneContext(peer, session, conn)
        try:
            return ANSWER, self._handle(body, context)
        except LaneAbort as exc:
            return REFUSAL, _status(exc.code, exc.details, exc.marks)
        except Exception as exc:  # a bug in the handler: the caller still gets an answer
            log.exception("%s: the handler failed", self._name)
            return REFUSAL, _status(grpc.StatusCode.UNKNOWN, f"the server failed: {exc!r}")

    def close(self, grace_s: float = 0.0) -> None:
        """Stops taking requests, gives those in progress up to `grace_s` to be answered,
        then ends every connection (a call still in progress gets no answer, as when the
        process stops). Blocks up to `grace_s` and a little. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"w")
        self._watcher.join(timeout=2.0)
        self._selector.close()
        self._listener.close()
        deadline = time.monotonic() + grace_s
        with self._lock:
            while self._running and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            idle = [c for c in self._conns if c not in self._running]
            busy = [c for c in self._conns if c in self._running]
            self._conns.difference_update(idle)
        for conn in idle:
            conn.close()
        for conn in busy:  # their tasks close them when they end
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._wake_r.close()
        self._wake_w.close()


# ---- the client's side ------------------------------------------------------------------------


class LaneError(grpc.RpcError):  # type: ignore[misc]  # grpc ships no stubs
    """The server refused a lane call: the status the Exchange RPC would have ended with."""

    def __init__(self, code: grpc.StatusCode, details: str, marks: Iterable[str] = ()) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self._marks = tuple(marks)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((mark, "1") for mark in self._marks)

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"


def _round_trip(sock: socket.socket, kind: int, body: bytes) -> tuple[int, bytes]:
    """Sends one frame and reads the server's; LaneProtocolError when it closed instead."""
    write_frame(sock, kind, body)
    frame = read_frame(sock, MAX_ANSWER_BYTES)
    if frame is None:
        raise LaneProtocolError("the server closed the connection")
    return frame


def _refusal(body: bytes) -> LaneError:
    try:
        status = pb.LaneStatus.FromString(body)
    except DecodeError as exc:
        raise ChannelBrokenError(f"exchange lane: unreadable refusal ({exc})") from exc
    return LaneError(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.details,
                     status.marks)


class LaneClient:
    """A client's connections to one server's lane: one per call in flight, kept for the
    next call. Thread-safe."""

    def __init__(self, address: str, session: int, token: str) -> None:
        self.address = address
        self._hello = pb.LaneHello(session=session, token=token).SerializeToString()
        # Guards _idle, _closed and calls.
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._closed = False
        self.calls = 0  # requests sent, answered or refused

    def _connect(self, timeout_s: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(min(timeout_s, IO_TIMEOUT_S))
            sock.connect("\0" + self.address)
            kind, body = _round_trip(sock, HELLO, self._hello)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, OSError | LaneProtocolError):
                raise ChannelBrokenError(f"cannot open the exchange lane: {exc}") from exc
            raise
        if kind != ANSWER:
            sock.close()
            raise ChannelBrokenError(f"the server refused the exchange lane: {_refusal(body)}"
                                     if kind == REFUSAL else
                                     f"unexpected frame kind {kind} after the hello")
        return sock

    def check(self, timeout_s: float) -> None:
        """Opens one connection now (kept for the first call). ChannelBrokenError if the
        server does not take it."""
        self._give_back(self._connect(timeout_s))

    def _take(self, timeout_s: float) -> socket.socket:
        with self._lock:
            if self._closed:
                raise ChannelBrokenError("the exchange lane is closed")
            if self._idle:
                return self._idle.pop()
        return self._connect(timeout_s)

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def call(self, request: bytes, timeout_s: float) -> bytes:
        """Sends one request and returns the answer's bytes. Blocks up to `timeout_s`.

        LaneError (a grpc.RpcError) when the server refused it, DEADLINE_EXCEEDED when no
        answer came in time; ChannelBrokenError when the lane itself failed.
        """
        sock = self._take(timeout_s)
        try:
            if sock.gettimeout() != timeout_s:  # setting it is a system call
                sock.settimeout(timeout_s)
            kind, body = _round_trip(sock, REQUEST, request)
        except BaseException as exc:
            sock.close()  # a late answer must not reach the next call
            if isinstance(exc, TimeoutError):
                raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no answer on the exchange lane within {timeout_s:g} s") from exc
            if isinstance(exc, OSError | LaneProtocolError):
                raise ChannelBrokenError(f"the exchange lane failed: {exc}") from exc
            raise
        if kind not in (ANSWER, REFUSAL):
            sock.close()
            raise ChannelBrokenError(f"unexpected frame kind {kind} on the exchange lane")
        with self._lock:
            self.calls += 1
        self._give_back(sock)
        if kind == REFUSAL:
            raise _refusal(body)
        return body

    def close(self) -> None:
        """Closes idle connections; those in use close when their call ends. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
