"""The `ucx` transport: bulk payloads over UCX through the `ucxx` package (pstrain[ucx]).

UCX picks RDMA (verbs) when the host's UCX library has it and the hardware exists, else TCP
or shared memory; `UCX_TLS` and the other `UCX_*` variables steer it as usual. The PyPI
UCX wheels are built without verbs: RDMA needs a system UCX (1.19 or newer) built with
them, loaded with `RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`.

Each side runs one UCX worker with a progress thread. The handshake carries each side's
worker address (`TransportOffer.address`); the client makes an endpoint to the server's,
and the server one to the client's, for every session. Payloads travel as tagged messages,
each under a fresh random 64-bit tag named in its `BulkRef`:

* push: the client tag-sends the region's bytes when it names them (`send_ref`, before the
  gRPC call); the server tag-receives them into a buffer of its own when it reads the ref.
* pull: the client posts a tag-receive into the region when it names it (`recv_ref`,
  before the gRPC call); the server fills a buffer and tag-sends it when it writes the ref.

A transfer that fails or does not finish in time raises ChannelBrokenError, so the client
sends the same request again over gRPC. Buffers are never reused while UCX may still touch
them: a receive that will not be answered is completed by a zero-byte message this side
sends itself (this ucxx build cannot cancel a request explicitly), and a buffer with a
transfer still pending is set aside until the transfer ends.

Endpoints ask UCX for peer-failure detection. Shared-memory transports cannot provide it,
so when UCX_TLS leaves only those, endpoints are made without it and a dead peer shows up
as a transfer timeout instead.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib
import importlib.util
import logging
import mmap
import os
import re
import secrets
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from protos import pstrain_pb2 as pb
from protos.transport.base import (
    ChannelBrokenError,
    LaneCheck,
    TransportUnavailableError,
    host_identity,
)
from protos.transport.shm import size_class

log = logging.getLogger(__name__)

MiB = 1024 * 1024
_MIN_BUFFER = 64 * 1024  # the smallest size class
DEFAULT_CAPACITY_BYTES = 2048 * MiB
# Buffers a server keeps for reuse between requests.
SERVER_CACHE_BYTES = 512 * MiB
# How long an endpoint close, or a receive this side completes itself, may take.
_SHORT_WAIT_S = 2.0
# The progress thread wakes at least this often (milliseconds) even without UCX events.
_EPOLL_TIMEOUT_MS = 5
# Receives posted to drop late or refused messages, per worker; the oldest are cancelled.
_MAX_DISCARDS = 1024
# Where dropped messages land (truncated to one byte); shared, never read.
_SCRATCH = memoryview(bytearray(1))



class _Loaded:
    """ucxx's modules once imported, or why they could not be."""

    lock = threading.Lock()  # guards the fields below
    lib: Any = None  # ucxx._lib.libucxx
    array: Any = None  # ucxx._lib.arr.Array
    error = ""


def _lib() -> Any:
    """The `ucxx._lib.libucxx` module; TransportUnavailableError when it cannot load.
    Blocks while ucxx loads (about 0.5 s, once). Thread-safe."""
    with _Loaded.lock:
        if _Loaded.lib is None and not _Loaded.error:
            # Importing ucxx sets UCX variables in the environment, and UCX then warns about
            # the ones this build does not use (UCX_MEMTYPE_CACHE) on every context unless
            # told not to; a user's own setting wins.
            os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
            try:
                lib = importlib.import_module("ucxx._lib.libucxx")
                _Loaded.array = importlib.import_module("ucxx._lib.arr").Array
                _Loaded.lib = lib
            except Exception as exc:  # a broken install fails in many ways; report any
                _Loaded.error = f"importing ucxx failed: {type(exc).__name__}: {exc}"
        if _Loaded.lib is None:
            raise TransportUnavailableError(_Loaded.error)
        return _Loaded.lib


def probe() -> tuple[bool, str]:
    """Whether UCX can work here, and why not. Blocks while ucxx loads (about 0.5 s, once)."""
    if importlib.util.find_spec("ucxx") is None:
        return False, "the ucxx package is not installed (pip install 'pstrain[ucx]')"
    try:
        _lib()
    except TransportUnavailableError as exc:
        return False, f"{exc} (reinstall with pip install 'pstrain[ucx]')"
    return True, ""


def ucx_version() -> str:
    """The UCX library version ucxx loaded, e.g. "1.21.0"."""
    return ".".join(str(n) for n in _lib().get_ucx_version())


def _array(view: memoryview) -> Any:
    _lib()
    return _Loaded.array(view)


def _tag() -> int:
    return secrets.randbits(64) or 1


def _wait(requests: list[Any], timeout_s: float, stop: threading.Event | None = None
          ) -> bool:
    """Whether every request completed within `timeout_s` (False at once when `stop` is
    set). Polls: this ucxx build has no blocking wait without an asyncio loop; the progress
    thread does the work."""
    deadline = time.monotonic() + timeout_s
    delay = 0.0
    while True:
        if all(r.completed for r in requests):
            return True
        if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            return False
        time.sleep(delay)
        delay = min(1e-3, delay * 2 or 2e-5)


# Empty requests ucxx returned: asking one anything, or destroying it (which cancels it),
# dereferences a null pointer and crashes the process, so they are never destroyed.
_EMPTY: list[Any] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_EMPTY))


def _posted(request: Any) -> Any:
    """`request`, or ChannelBrokenError when ucxx answered with an empty one (a failed
    endpoint)."""
    if not request.ucxx_ptr:
        _EMPTY.append(request)
        raise ChannelBrokenError("ucx: the endpoint failed; the transfer was not posted")
    return request


def _close(ep: Any) -> Any:
    """Starts closing an endpoint: its close request, or None when there is nothing to wait
    for. A failed endpoint is not closed again: ucxx answers that with an empty request,
    which crashes the process when asked whether it completed."""
    if not ep.alive:
        return None
    request = ep.close()
    if not request.ucxx_ptr:
        _EMPTY.append(request)
        return None
    return request


def _check(requests: list[Any], what: str) -> None:
    """ChannelBrokenError naming the first completed request that failed."""
    for request in requests:
        try:
            request.check_error()
        except Exception as exc:  # ucxx raises its own hierarchy, rooted in Exception
            raise ChannelBrokenError(f"ucx: {what} failed: {type(exc).__name__}: {exc}") from exc


# ---- which UCX transports an endpoint uses ---------------------------------------------

_LANE = re.compile(r"lane\[\d+\]:\s+\d+:(\S+?)(?:\.\d+)?\s")


def _libucp() -> ctypes.CDLL | None:
    """The libucp this process loaded (the wheel's or the system's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libucp.so" in line}
    except OSError:
        return None
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


def endpoint_lanes(handle: int) -> list[str]:
    """The UCX transports and devices an endpoint's lanes use ("tcp/lo", "rc_mlx5/mlx5_0:1",
    "posix/memory"), read from `ucp_ep_print_info`; empty when that cannot be read."""
    try:
        lib = _libucp()
        if lib is None:
            return []
        libc = ctypes.CDLL(None)
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        lib.ucp_ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ucp_ep_print_info.restype = None
        with tempfile.NamedTemporaryFile("r", prefix="pstrain-ucx-") as out:
            stream = libc.fopen(out.name.encode(), b"w")
            if not stream:
                return []
            lib.ucp_ep_print_info(ctypes.c_void_p(handle), ctypes.c_void_p(stream))
            libc.fclose(stream)
            text = out.read()
    except (OSError, AttributeError) as exc:
        log.debug("ucx: cannot read the endpoint's lanes: %s", exc)
        return []
    return list(dict.fromkeys(_LANE.findall(text)))


# RDMA transports in UCX's names (verbs, mlx5 accelerated verbs, their DC/UD variants).
_RDMA = ("rc_", "dc_", "ud_", "gga_", "srd")


def is_rdma(lane: str) -> bool:
    """Whether a lane name from `endpoint_lanes` is an RDMA (InfiniBand/RoCE) transport."""
    return lane.split("/", 1)[0].startswith(_RDMA)


def auto_declines(lanes: list[str]) -> str:
    """Why `auto` should not use a UCX endpoint with these lanes, or "" to use it. Pure.

    UCX over TCP measured slower than gRPC here (see the README's figures), so only RDMA
    or shared-memory lanes are worth it; unknown lanes are not taken either.
    """
    if lanes and not all(lane.startswith("tcp/") for lane in lanes):
        return ""
    return (f"UCX would run over {', '.join(lanes) or 'unknown UCX transports'} only, "
            "no faster than gRPC; force --transport ucx to use it anyway")


# ---- one UCX worker and its progress thread ----------------------------------------------


class _Engine:
    """A UCX context, one worker with a progress thread, and an endpoint to itself.
    Thread-safe (the worker runs in UCX's multi-thread mode)."""

    def __init__(self, role: str) -> None:
        ucx = _lib()
        self.role = role
        try:
            self.context = ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG,
                                                             ucx.Feature.WAKEUP))
            self.worker = ucx.UCXWorker(self.context)
            self.worker.start_progress_thread(polling_mode=False,
                                              epoll_timeout=_EPOLL_TIMEOUT_MS)
        except Exception as exc:  # UCX reports a bad UCX_TLS and the like this way
            raise TransportUnavailableError(
                f"UCX could not start ({type(exc).__name__}: {exc}); check the UCX_* "
                "environment variables (UCX_TLS)"
            ) from exc
        self.address = bytes(self.worker.address)
        # Set when closing starts: transfers still waiting give up at once.
        self.stopping = threading.Event()
        # Guards _error_handling, _closed, _endpoints, _closing, _discards.
        self._lock = threading.Lock()
        # None: not known yet; False: the transports allowed cannot detect a failed peer.
        self._error_handling: bool | None = None
        self._closed = False
        self._endpoints: list[Any] = []
        self._closing: list[tuple[Any, Any]] = []  # (endpoint, its close request)
        self._discards: collections.deque[Any] = collections.deque(maxlen=_MAX_DISCARDS)
        # Stops the progress thread if this engine is dropped (or the process exits) without
        # close(): a worker destroyed while its thread runs can crash the interpreter.
        self._finalizer = weakref.finalize(self, _stop_progress, self.worker)
        self._self_ep, _ = self.endpoint(self.address)

    def endpoint(self, address: bytes) -> tuple[Any, bool]:
        """An endpoint to the worker at `address`, and whether it detects peer failure.
        TransportUnavailableError when UCX cannot reach it. Blocks briefly."""
        ucx = _lib()
        remote = ucx.UCXAddress.create_from_buffer(address)
        with self._lock:
            if self._closed:
                raise TransportUnavailableError("the ucx channel is closed")
            modes = [True, False] if self._error_handling is None else [self._error_handling]
        for error_handling in modes:
            try:
                ep = self.worker.create_endpoint_from_worker_address(remote, error_handling)
            except ucx.UCXError as exc:
                if error_handling and len(modes) > 1:
                    continue  # shared memory only: try again without peer-failure detection
                raise TransportUnavailableError(
                    f"UCX cannot reach the peer's worker: {exc} (check UCX_TLS on both sides)"
                ) from exc
            with self._lock:
                if self._error_handling is None:
                    self._error_handling = error_handling
                    if not error_handling:
                        log.info("ucx (%s): the UCX transports allowed here (UCX_TLS) "
                                 "cannot detect a failed peer; a dead peer shows up as a "
                                 "transfer timeout", self.role)
                self._endpoints.append(ep)
            return ep, error_handling
        raise TransportUnavailableError("UCX cannot reach the peer's worker")  # pragma: no cover

    def settle_receive(self, tag: int, receive: Any) -> None:
        """Ends a posted receive of `tag` this side gives up on, so its buffer can be
        reused: a zero-byte message from this worker to itself completes it (ucxx cannot
        cancel a request explicitly), then a one-byte receive stays posted for `tag` so
        that a late message from the peer is taken, and the peer's send ends, instead of
        waiting forever. Blocks until the receive completes, up to 2 s (loopback:
        microseconds)."""
        ucx = _lib()
        try:
            request = _posted(self._self_ep.tag_send(_array(memoryview(b"")),
                                                    ucx.UCXXTag(tag)))
            _wait([request, receive], _SHORT_WAIT_S)
        except Exception as exc:  # the worker is closing; the buffer stays set aside
            log.debug("ucx (%s): settling a receive: %s", self.role, exc)
        self.discard(tag)

    def discard(self, tag: int) -> None:
        """Takes the next message of `tag`, whatever its size, and drops it (a one-byte
        receive truncates it; the sender completes normally). Does not block."""
        ucx = _lib()
        try:
            request = _posted(self.worker.tag_recv(_array(_SCRATCH), ucx.UCXXTag(tag)))
        except Exception as exc:
            log.debug("ucx (%s): posting a discard: %s", self.role, exc)
            return
        with self._lock:
            # Bounded: the oldest are dropped (a dropped, unmatched receive is cancelled).
            self._discards.append(request)

    def close_endpoint(self, ep: Any) -> None:
        """Starts closing an endpoint. Does not block: the close completes in the progress
        thread."""
        with self._lock:
            if ep in self._endpoints:
                self._endpoints.remove(ep)
            # Kept until done: a request whose Python object dies is cancelled.
            self._closing = [(e, r) for e, r in self._closing
                             if r is not None and not r.completed]
        try:
            request = _close(ep)
        except Exception as exc:  # a failed peer's endpoint may refuse to close cleanly
            log.debug("ucx (%s): closing an endpoint: %s", self.role, exc)
            return
        with self._lock:
            self._closing.append((ep, request))

    def broken(self, what: str, timeout_s: float) -> ChannelBrokenError:
        """The error for a transfer that did not complete: closing, or a timeout."""
        if self.stopping.is_set():
            return ChannelBrokenError(f"ucx: {what}: the ucx channel is closing")
        return ChannelBrokenError(f"ucx: {what} did not finish within {timeout_s:.0f} s")

    def close(self, keep: object = None) -> None:
        """Closes every endpoint and stops the progress thread. Idempotent; blocks up to
        2 s.

        `keep` (transfers that never ended, with their buffers) makes the worker outlive
        this call for the rest of the process: ucxx's worker destructor waits forever for
        a send nobody receives, so such a worker is never destroyed.
        """
        self.stopping.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            endpoints, self._endpoints = self._endpoints, []
            closing, self._closing = self._closing, []
        requests = [r for _, r in closing if r is not None]
        for ep in endpoints:
            try:
                request = _close(ep)
            except Exception as exc:
                log.debug("ucx (%s): closing an endpoint: %s", self.role, exc)
                continue
            if request is not None:
                requests.append(request)
        if not _wait(requests, _SHORT_WAIT_S):
            log.debug("ucx (%s): some endpoints did not close within %s s", self.role,
                      _SHORT_WAIT_S)
        self._finalizer()
        if keep is not None:
            log.warning("ucx (%s): transfers that never ended are left; keeping this UCX "
                        "worker until the process exits", self.role)
            _KEPT.append((self, keep))


def _stop_progress(worker: Any) -> None:
    worker.stop_progress_thread()


# Workers with transfers that never ended, and those transfers. An extra reference keeps
# the list (and so them) alive through interpreter shutdown too.
_KEPT: list[tuple[_Engine, object]] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))


# ---- buffers -----------------------------------------------------------------------------


class _Buffer:
    """Anonymous page-aligned memory for transfers."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(-1, size)
        if hasattr(mmap, "MADV_POPULATE_WRITE"):
            with contextlib.suppress(OSError):
                self.map.madvise(mmap.MADV_POPULATE_WRITE)


@dataclass
class _Pool:
    """Buffers by size class, and those set aside until UCX is done with them. Thread-safe.

    `capacity_bytes` bounds the buffers out and set aside together (a lease beyond it
    returns None); `cache_bytes` bounds the free ones kept for reuse.
    """

    capacity_bytes: int
    cache_bytes: int
    # Guards every field below. Reentrant: a buffer comes back from the finalizer of the last
    # array viewing it (`give`), which the garbage collector may run in the middle of a
    # section below, in the thread holding the lock.
    lock: threading.RLock = field(default_factory=threading.RLock)
    free: dict[int, list[_Buffer]] = field(default_factory=dict)
    held: list[tuple[_Buffer, list[Any]]] = field(default_factory=list)
    used: int = 0
    cached: int = 0

    def take(self, nbytes: int, strict: bool) -> _Buffer | None:
        """A buffer of at least `nbytes`; None when `strict` and the pool is full."""
        self.sweep()
        size = size_class(max(1, nbytes))
        with self.lock:
            free = self.free.get(size)
            if free:
                self.cached -= size
                self.used += size
                return free.pop()
            if strict and self.used + size > self.capacity_bytes:
                return None
            self.used += size
        try:
            return _Buffer(size)
        except (OSError, ValueError) as exc:
            with self.lock:
                self.used -= size
            log.warning("ucx: cannot allocate a buffer of %d bytes (%s)", size, exc)
            return None

    def give(self, buffer: _Buffer, pending: list[Any]) -> None:
        """Returns a buffer; one with transfers still pending waits for them first."""
        if any(not r.completed for r in pending):
            with self.lock:
                self.held.append((buffer, pending))
            return
        with self.lock:
            self.used -= buffer.size
            if self.cached + buffer.size <= self.cache_bytes:
                self.free.setdefault(buffer.size, []).append(buffer)
                self.cached += buffer.size

    def sweep(self) -> None:
        """Frees the set-aside buffers whose transfers have ended. Does not block."""
        with self.lock:
            held, self.held = self.held, []
        for buffer, pending in held:
            self.give(buffer, pending)

    def held_bytes(self) -> int:
        self.sweep()
        with self.lock:
            return sum(b.size for b, _ in self.held)

    def stuck(self) -> list[tuple[_Buffer, list[Any]]] | None:
        """The set-aside buffers and their transfers still pending, or None."""
        self.sweep()
        with self.lock:
            return list(self.held) or None

    def clear(self) -> None:
        with self.lock:
            self.free.clear()
            self.cached = 0


# ---- client ------------------------------------------------------------------------------


@dataclass
class _Endpoint:
    """A UCX endpoint to one peer: a client's to a server session, a server's to a worker."""

    ep: Any
    error_handling: bool
    lanes: list[str]
    worker: int = -1  # the server side's peer


class _Side:
    """What a client and a server hold alike: a UCX worker, a buffer pool, and an endpoint
    per session. Thread-safe."""

    name = "ucx"

    def __init__(self, role: str, capacity_bytes: int, cache_bytes: int) -> None:
        self._engine = _Engine(role)
        self._pool = _Pool(capacity_bytes, cache_bytes)
        # Guards _endpoints and _closed (and a subclass's own counters).
        self._lock = threading.Lock()
        self._endpoints: dict[int, _Endpoint] = {}
        self._closed = False

    def offer(self) -> pb.TransportOffer:
        return pb.TransportOffer(name=self.name, available=True, address=self._engine.address,
                                 host=host_identity(), pid=os.getpid(),
                                 detail=f"UCX {ucx_version()}")

    def _open(self, session: int, address: bytes, worker: int = -1) -> _Endpoint:
        """Makes and keeps the endpoint of `session` to the peer at `address`.
        TransportUnavailableError when the channel is closed. Blocks briefly."""
        ep, error_handling = self._engine.endpoint(address)
        endpoint = _Endpoint(ep, error_handling, endpoint_lanes(ep.handle), worker)
        with self._lock:
            closed = self._closed
            if not closed:
                self._endpoints[session] = endpoint
        if closed:
            self._engine.close_endpoint(ep)
            raise TransportUnavailableError("the ucx channel is closed")
        return endpoint

    def lanes(self, session: int) -> list[str]:
        """The UCX transports the endpoint of `session` uses ("tcp/lo"). Thread-safe."""
        with self._lock:
            endpoint = self._endpoints.get(session)
        return list(endpoint.lanes) if endpoint is not None else []

    def held_bytes(self) -> int:
        """Bytes of buffers set aside until UCX finishes with them. Thread-safe."""
        return self._pool.held_bytes()

    def end(self, session: int) -> None:
        with self._lock:
            endpoint = self._endpoints.pop(session, None)
        if endpoint is not None:
            self._engine.close_endpoint(endpoint.ep)


class UcxRegion:
    """A leased buffer and the transfers one request posted on it. Not thread-safe: one
    request at a time uses it."""

    def __init__(self, client: Client, buffer: _Buffer, session: int, link: _Endpoint) -> None:
        self._client = client
        self._buffer = buffer
        self._session = session
        self._link = link
        self._view: memoryview | None = memoryview(buffer.map)
        self._sends: list[Any] = []
        self._recvs: list[tuple[int, Any]] = []

    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise ChannelBrokenError("the ucx region was released")
        return self._view

    def _ref(self, offset: int, length: int, tag: int) -> pb.BulkRef:
        return pb.BulkRef(session=self._session, segment_bytes=self._buffer.size,
                          offset=offset, length=length, tag=tag)

    def _slice(self, offset: int, length: int) -> memoryview:
        if offset < 0 or offset + length > self._buffer.size:
            raise ChannelBrokenError(
                f"bytes [{offset}, {offset + length}) are outside the ucx buffer of "
                f"{self._buffer.size}"
            )
        if not self._link.ep.alive:
            raise ChannelBrokenError(f"ucx: the endpoint of session {self._session} failed")
        return self.view[offset : offset + length]

    def send_ref(self, offset: int, length: int) -> pb.BulkRef:
        """Sends the bytes now, under a fresh tag the server receives. Does not block."""
        if not length:
            return self._ref(offset, 0, 0)
        data, tag = self._slice(offset, length), _tag()
        try:
            self._sends.append(_posted(self._link.ep.tag_send(_array(data),
                                                              _lib().UCXXTag(tag))))
        except Exception as exc:
            raise ChannelBrokenError(f"ucx: posting a send failed: {exc}") from exc
        return self._ref(offset, length, tag)

    def recv_ref(self, offset: int, length: int) -> pb.BulkRef:
        """Posts a receive into the bytes, under a fresh tag the server sends to. Does not
        block."""
        if not length:
            return self._ref(offset, 0, 0)
        data, tag = self._slice(offset, length), _tag()
        try:
            request = _posted(self._link.ep.tag_recv(_array(data), _lib().UCXXTag(tag)))
        except Exception as exc:
            raise ChannelBrokenError(f"ucx: posting a receive failed: {exc}") from exc
        self._recvs.append((tag, request))
        return self._ref(offset, length, tag)

    def _requests(self) -> list[Any]:
        return [*self._sends, *(r for _, r in self._recvs)]

    def complete(self, timeout_s: float) -> None:
        requests = self._requests()
        engine = self._client._engine
        if not _wait(requests, timeout_s, engine.stopping):
            raise engine.broken(f"a transfer of session {self._session}", timeout_s)
        _check(requests, f"a transfer of session {self._session}")

    def abort(self) -> None:
        for tag, request in self._recvs:
            if not request.completed:
                self._client._engine.settle_receive(tag, request)

    def release(self) -> None:
        # Views made from the region (a tensor handed to the caller) keep the memory alive
        # on their own; the pool takes the buffer back once no transfer touches it.
        view, self._view = self._view, None
        if view is not None:
            self._client._pool.give(self._buffer, self._requests())
            self._sends, self._recvs = [], []


class Client(_Side):
    """A client's UCX worker, its endpoints to servers, and its buffer pool. Thread-safe."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        if capacity_bytes < _MIN_BUFFER:
            raise ValueError(f"capacity_bytes must be >= {_MIN_BUFFER}, got {capacity_bytes}")
        super().__init__("client", capacity_bytes, capacity_bytes)

    def token(self) -> str:
        return ""

    def connect(self, session: int, peer: pb.TransportOffer, timeout_s: float) -> None:
        """Makes the endpoint to the server's worker. TransportUnavailableError when UCX
        cannot reach it. Blocks briefly."""
        if not peer.address:
            raise TransportUnavailableError("the server sent no UCX worker address")
        link = self._open(session, peer.address)
        log.info("ucx: session %d runs over UCX transports %s%s", session,
                 ", ".join(link.lanes) or "(unknown)",
                 "" if link.error_handling else " (peer failures detected by timeout only)")

    def describe(self, session: int) -> str:
        return ", ".join(self.lanes(session))

    def lease(self, nbytes: int, session: int) -> UcxRegion | None:
        with self._lock:
            link = None if self._closed else self._endpoints.get(session)
        if link is None:
            return None
        buffer = self._pool.take(nbytes, strict=True)
        if buffer is None:
            return None
        return UcxRegion(self, buffer, session, link)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._endpoints.clear()
        self._engine.close(keep=self._pool.stuck())
        self._pool.clear()


# ---- server ------------------------------------------------------------------------------


class Server(_Side):
    """A server's UCX worker and its endpoints to the clients it serves. Thread-safe."""

    def __init__(self, cache_bytes: int = SERVER_CACHE_BYTES) -> None:
        super().__init__("server", capacity_bytes=1 << 62, cache_bytes=cache_bytes)
        self._waiting = 0  # transfers being waited for now; guarded by _lock

    def accept(self, request: pb.HandshakeRequest, peer: pb.TransportOffer) -> int:
        if not peer.address:
            raise TransportUnavailableError("the client sent no UCX worker address")
        session = secrets.randbits(62) + 1
        state = self._open(session, peer.address, int(request.worker))
        log.info("ucx: worker %d (session %d) runs over UCX transports %s%s", request.worker,
                 session, ", ".join(state.lanes) or "(unknown)",
                 "" if state.error_handling else " (peer failures detected by timeout only)")
        return session

    def _session(self, ref: pb.BulkRef) -> _Endpoint:
        with self._lock:
            state = self._endpoints.get(ref.session)
        if state is None:
            raise ChannelBrokenError(f"unknown ucx session {ref.session}")
        if not state.ep.alive:
            raise ChannelBrokenError(
                f"ucx: the endpoint to worker {state.worker} (session {ref.session}) failed"
            )
        return state

    @contextlib.contextmanager
    def read(self, ref: pb.BulkRef, timeout_s: float) -> Iterator[memoryview]:
        """Receives the payload `ref` names. Blocks up to `timeout_s`; ChannelBrokenError
        when it does not arrive."""
        try:
            state = self._session(ref)
        except ChannelBrokenError:
            self.discard(ref)
            raise
        if not ref.length:
            yield memoryview(b"")
            return
        buffer = self._pool.take(ref.length, strict=False)
        if buffer is None:
            raise ChannelBrokenError(f"ucx: no memory for a payload of {ref.length} bytes")
        view = memoryview(buffer.map)[: ref.length]
        requests: list[Any] = []
        try:
            try:
                requests.append(_posted(state.ep.tag_recv(_array(view),
                                                          _lib().UCXXTag(ref.tag))))
            except Exception as exc:
                raise ChannelBrokenError(f"ucx: posting a receive failed: {exc}") from exc
            with self._active():
                arrived = _wait(requests, timeout_s, self._engine.stopping)
            if not arrived:
                self._engine.settle_receive(ref.tag, requests[0])
                raise self._engine.broken(f"the payload from worker {state.worker}",
                                          timeout_s)
            _check(requests, f"receiving from worker {state.worker}")
            yield view.toreadonly()
        finally:
            self._pool.give(buffer, requests)

    def write(self, ref: pb.BulkRef, nbytes: int, fill: Callable[[memoryview], None],
              timeout_s: float) -> None:
        """Fills a buffer and sends it to the client's posted receive. Blocks until the
        client has it (up to `timeout_s`)."""
        state = self._session(ref)
        if nbytes > ref.length:
            raise ChannelBrokenError(
                f"ucx: {nbytes} bytes do not fit the client's receive of {ref.length}"
            )
        if not nbytes:
            fill(memoryview(bytearray()))
            return
        buffer = self._pool.take(nbytes, strict=False)
        if buffer is None:
            raise ChannelBrokenError(f"ucx: no memory for an answer of {nbytes} bytes")
        view = memoryview(buffer.map)[:nbytes]
        requests: list[Any] = []
        try:
            fill(view)
            try:
                requests.append(_posted(state.ep.tag_send(_array(view),
                                                          _lib().UCXXTag(ref.tag))))
            except Exception as exc:
                raise ChannelBrokenError(f"ucx: posting a send failed: {exc}") from exc
            with self._active():
                taken = _wait(requests, timeout_s, self._engine.stopping)
            if not taken:
                raise self._engine.broken(f"the answer to worker {state.worker}", timeout_s)
            _check(requests, f"sending to worker {state.worker}")
        finally:
            self._pool.give(buffer, requests)

    @contextlib.contextmanager
    def _active(self) -> Iterator[None]:
        """Counts a transfer being waited for, so that close() can let it give up first."""
        with self._lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1

    def lane_check(self) -> LaneCheck | None:
        return None  # no request lane yet: exchanges go to the Exchange RPC

    def declines(self, session: int) -> str:
        return auto_declines(self.lanes(session))

    def discard(self, ref: pb.BulkRef) -> None:
        if ref.length and ref.tag:
            self._engine.discard(ref.tag)

    def sessions(self) -> int:
        """How many client sessions are open. Thread-safe."""
        with self._lock:
            return len(self._endpoints)

    def end(self, session: int) -> None:
        super().end(session)
        self._pool.sweep()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._endpoints.clear()
        # Transfers still waiting (for a dead peer) give up now, setting their buffers aside.
        self._engine.stopping.set()
        deadline = time.monotonic() + _SHORT_WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                if not self._waiting:
                    break
            time.sleep(0.01)
        self._engine.close(keep=self._pool.stuck())
        self._pool.clear()


__all__ = ["Client", "Server", "UcxRegion", "auto_declines", "endpoint_lanes", "is_rdma", "probe",
           "ucx_version"]
