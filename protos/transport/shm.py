"""The `shm` transport: bulk payloads through shared memory between processes on one host.

The client owns every segment: an anonymous memory file (memfd_create), mode 0600, sealed
against shrinking and growing, mapped once and reused across requests. Segments never have a
name in /dev/shm, so a process that dies (even by SIGKILL) leaves nothing behind: the kernel
frees a segment when the last descriptor and mapping of it are gone.

A server maps a client's segment the first time a request names it, by opening
/proc/<client pid>/fd/<fd> (the handshake has shown both run on one host, in one pid
namespace, as the same user). It checks the file's name (which carries the client's random
session token), its seals and its size before mapping, and closes the descriptor at once.
It drops a session's mappings when the client ends the session or its process is gone.

Regions are whole segments taken from a pool by size class: each request takes its own, so
requests from several threads run in parallel. A payload larger than the pool's free
capacity travels inline over gRPC instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from protos import pstrain_pb2 as pb
from protos.transport.base import (
    ChannelBrokenError,
    LaneCheck,
    TransportUnavailableError,
    host_identity,
)

log = logging.getLogger(__name__)

MiB = 1024 * 1024
_MIN_SEGMENT = 64 * 1024
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
DEFAULT_CAPACITY_BYTES = 2048 * MiB


def probe() -> tuple[bool, str]:
    """Whether memfd segments work here."""
    if not hasattr(os, "memfd_create"):
        return False, "this platform has no memfd_create (Linux only)"
    if not host_identity():
        return False, "/proc does not show a boot id and pid namespace"
    try:
        fd = os.memfd_create("pstrain-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        return False, f"memfd_create failed: {exc}"
    os.close(fd)
    return True, ""


def size_class(nbytes: int) -> int:
    """The segment size for a payload: powers of two up to 1 MiB, then quarter steps."""
    if nbytes <= _MIN_SEGMENT:
        return _MIN_SEGMENT
    if nbytes <= MiB:
        return 1 << (nbytes - 1).bit_length()
    step = 1 << max(0, (nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


def _name(token: str, segment: int) -> str:
    return f"pstrain-{token}-{segment}"


class _Segment:
    """One memfd mapped in the client. Its descriptor stays open so servers can map it."""

    def __init__(self, token: str, ident: int, size: int) -> None:
        self.ident = ident
        self.size = size
        self.fd = os.memfd_create(_name(token, ident), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(self.fd, 0o600)
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        # Fault every page in now, once, instead of inside the first few transfers.
        if hasattr(mmap, "MADV_POPULATE_WRITE"):
            with contextlib.suppress(OSError):
                self.map.madvise(mmap.MADV_POPULATE_WRITE)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a caller still holds a view: the GC frees it
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class ShmRegion:
    """A leased segment. Not thread-safe: one request at a time uses it."""

    def __init__(self, pool: Client, segment: _Segment, session: int) -> None:
        self._pool = pool
        self._segment = segment
        self._session = session
        self._view: memoryview | None = memoryview(segment.map)

    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise ChannelBrokenError("the shared-memory region was released")
        return self._view

    def _ref(self, offset: int, length: int) -> pb.BulkRef:
        if offset < 0 or offset + length > self._segment.size:
            raise ChannelBrokenError(
                f"bytes [{offset}, {offset + length}) are outside the segment of "
                f"{self._segment.size}"
            )
        return pb.BulkRef(session=self._session, segment=self._segment.ident,
                          fd=self._segment.fd, segment_bytes=self._segment.size,
                          offset=offset, length=length)

    def send_ref(self, offset: int, length: int) -> pb.BulkRef:
        return self._ref(offset, length)

    def recv_ref(self, offset: int, length: int) -> pb.BulkRef:
        return self._ref(offset, length)

    def complete(self, timeout_s: float) -> None:
        return None  # the server wrote or read the bytes before it answered

    def abort(self) -> None:
        return None

    def release(self) -> None:
        # Views made from the region (a tensor handed to the caller) die on their own; the
        # segment is taken again only through the pool.
        view, self._view = self._view, None
        if view is not None:
            self._pool._give_back(self._segment)


class Client:
    """A client's pool of shared-memory segments, shared by all its servers. Thread-safe."""

    name = "shm"

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        if capacity_bytes < _MIN_SEGMENT:
            raise ValueError(f"capacity_bytes must be >= {_MIN_SEGMENT}, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._token = secrets.token_hex(12)
        # Guards _free, _all, _total, _next and _closed. Reentrant: a region goes back to the
        # pool from the finalizer of the last array viewing it (`_give_back`), and the garbage
        # collector may run that in the middle of a section below, in the thread holding it.
        self._lock = threading.RLock()
        self._free: dict[int, list[_Segment]] = {}
        self._all: dict[int, _Segment] = {}
        self._total = 0
        self._next = 1
        self._closed = False

    def offer(self) -> pb.TransportOffer:
        return pb.TransportOffer(name=self.name, available=True, host=host_identity(),
                                 pid=os.getpid(), token=self._token)

    def token(self) -> str:
        return self._token

    def connect(self, session: int, peer: pb.TransportOffer, timeout_s: float) -> None:
        return None  # the server maps segments when a request first names them

    def lease(self, nbytes: int, session: int) -> ShmRegion | None:
        """A segment of at least `nbytes`, or None when the pool is full. Does not block
        (a new segment costs one memfd and its page faults)."""
        size = size_class(max(1, nbytes))
        with self._lock:
            if self._closed:
                return None
            free = self._free.get(size)
            reused = free.pop() if free else None
            if reused is None:
                if self._total + size > self.capacity_bytes:
                    return None
                ident = self._next
                self._next += 1
                self._total += size
        if reused is not None:  # made outside the lock, as every object here
            return ShmRegion(self, reused, session)
        try:
            segment = _Segment(self._token, ident, size)
        except OSError as exc:
            with self._lock:
                self._total -= size
            log.warning("shm: cannot make a segment of %d bytes (%s); sending inline", size, exc)
            return None
        with self._lock:
            self._all[ident] = segment
        return ShmRegion(self, segment, session)

    def _give_back(self, segment: _Segment) -> None:
        with self._lock:
            if not self._closed:
                self._free.setdefault(segment.size, []).append(segment)
                return
        segment.close()

    def describe(self, session: int) -> str:
        return ""

    def end(self, session: int) -> None:
        return None  # segments belong to the pool, not to a session

    def segments(self) -> list[tuple[int, int]]:
        """(fd, size) of every segment, for inspection. Thread-safe."""
        with self._lock:
            return [(s.fd, s.size) for s in self._all.values()]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free = [s for group in self._free.values() for s in group]
            self._free.clear()
            self._all.clear()
        for segment in free:
            segment.close()


def _start_time(pid: int) -> str:
    """The kernel's start time of process `pid` ("" when it is gone): pid reuse changes it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]


@dataclass
class _Session:
    pid: int
    started: str
    token: str
    maps: dict[int, mmap.mmap] = field(default_factory=dict)


class Server:
    """Maps the segments of the clients it serves. Thread-safe.

    A background thread checks every `sweep_interval_s` whether each client process still
    exists and unmaps the segments of those that are gone.
    """

    name = "shm"

    def __init__(self, sweep_interval_s: float = 2.0) -> None:
        self._host = host_identity()
        # Guards _sessions, _retired and _closed.
        self._lock = threading.Lock()
        self._sessions: dict[int, _Session] = {}
        self._retired: list[mmap.mmap] = []
        self._closed = False
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, args=(sweep_interval_s,),
                                         name="shm-sweeper", daemon=True)
        self._sweeper.start()

    def offer(self) -> pb.TransportOffer:
        return pb.TransportOffer(name=self.name, available=True, host=self._host,
                                 pid=os.getpid())

    def accept(self, request: pb.HandshakeRequest, peer: pb.TransportOffer) -> int:
        if peer.host != self._host:
            raise TransportUnavailableError("the client is on another host")
        token = peer.token
        if not token.isalnum():
            raise TransportUnavailableError("the client sent no usable segment token")
        started = _start_time(int(peer.pid))
        if not started:
            raise TransportUnavailableError(f"client process {peer.pid} is not visible here")
        session = secrets.randbits(62) + 1
        with self._lock:
            self._sessions[session] = _Session(int(peer.pid), started, token)
        return session

    def lane_check(self) -> LaneCheck:
        """shm declares a request lane: its clients share this host."""
        return self.owns

    def owns(self, session: int, token: str, pid: int) -> str:
        """"" when process `pid`, holding `token`, is the client of `session`; else why not."""
        with self._lock:
            known = self._sessions.get(session)
        if known is None:
            return f"session {session} is not an open shm session of this server"
        if not secrets.compare_digest(known.token, token):
            return f"the token does not match shared-memory session {session}"
        if known.pid != pid:
            return f"session {session} belongs to process {known.pid}, not {pid}"
        return ""

    def _map(self, ref: pb.BulkRef) -> mmap.mmap:
        with self._lock:
            session = self._sessions.get(ref.session)
            mapped = session.maps.get(ref.segment) if session is not None else None
        if session is None:
            raise ChannelBrokenError(f"unknown shared-memory session {ref.session}")
        if mapped is not None:
            return mapped
        path = f"/proc/{session.pid}/fd/{ref.fd}"
        expected = f"/memfd:{_name(session.token, ref.segment)} (deleted)"
        try:
            if os.readlink(path) != expected:
                raise ChannelBrokenError(f"{path} is not segment {ref.segment} of this client")
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ChannelBrokenError(f"cannot open the client's segment {path}: {exc}") from exc
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            size = os.fstat(fd).st_size
            if seals & _SEALS != _SEALS or size != ref.segment_bytes:
                raise ChannelBrokenError(
                    f"segment {ref.segment} is not sealed at {ref.segment_bytes} bytes "
                    f"(size {size}, seals {seals:#x})"
                )
            mapped = mmap.mmap(fd, size)
        except OSError as exc:
            raise ChannelBrokenError(f"cannot map the client's segment: {exc}") from exc
        finally:
            os.close(fd)
        with self._lock:
            current = self._sessions.get(ref.session)
            if current is None:
                self._retired.append(mapped)
                raise ChannelBrokenError(f"shared-memory session {ref.session} ended")
            current.maps.setdefault(ref.segment, mapped)
            winner = current.maps[ref.segment]
        if winner is not mapped:
            mapped.close()
        return winner

    def _view(self, ref: pb.BulkRef, nbytes: int) -> memoryview:
        mapped = self._map(ref)
        if ref.offset + nbytes > len(mapped) or nbytes > ref.length:
            raise ChannelBrokenError(
                f"bytes [{ref.offset}, {ref.offset + nbytes}) are outside the client's "
                f"segment of {len(mapped)} bytes (or its reference of {ref.length})"
            )
        return memoryview(mapped)[ref.offset : ref.offset + nbytes]

    @contextlib.contextmanager
    def read(self, ref: pb.BulkRef, timeout_s: float) -> Iterator[memoryview]:
        # Not released here: tensors made from the view may outlive the block by a moment;
        # a mapping with views left is unmapped by a later sweep.
        yield self._view(ref, ref.length).toreadonly()

    def write(self, ref: pb.BulkRef, nbytes: int, fill: Callable[[memoryview], None],
              timeout_s: float) -> None:
        fill(self._view(ref, nbytes))

    def declines(self, session: int) -> str:
        return ""

    def discard(self, ref: pb.BulkRef) -> None:
        return None  # the bytes stay in the client's segment; nothing is in flight

    def sessions(self) -> int:
        """How many client sessions are open. Thread-safe."""
        with self._lock:
            return len(self._sessions)

    def mapped_bytes(self) -> int:
        """Bytes of client segments mapped now. Thread-safe."""
        with self._lock:
            return sum(len(m) for s in self._sessions.values() for m in s.maps.values())

    def end(self, session: int) -> None:
        with self._lock:
            gone = self._sessions.pop(session, None)
            if gone is not None:
                self._retired.extend(gone.maps.values())
        self._unmap_retired()

    def _unmap_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        still: list[mmap.mmap] = []
        for mapped in retired:
            try:
                mapped.close()
            except BufferError:  # a request still reads it; the next sweep tries again
                still.append(mapped)
        if still:
            with self._lock:
                self._retired.extend(still)

    def sweep(self) -> int:
        """Ends the sessions of client processes that are gone; returns how many."""
        with self._lock:
            items = list(self._sessions.items())
        dead = [sid for sid, s in items if _start_time(s.pid) != s.started]
        for sid in dead:
            log.info("shm: client process of session %d is gone; unmapping its segments", sid)
            self.end(sid)
        if not dead:
            self._unmap_retired()
        return len(dead)

    def _sweep_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.sweep()
            except Exception:  # the sweeper must outlive any one bad pass
                log.exception("shm: sweeping sessions failed")
                time.sleep(interval_s)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            ids = list(self._sessions)
        for sid in ids:
            self.end(sid)
        self._sweeper.join(timeout=5.0)
