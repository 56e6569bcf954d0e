"""How many data calls a server runs at once: per client, and in all; and whose turn it is
to run Python.

Data calls (the data service's methods, over gRPC or a request lane) share the server's
handler threads. A client may have at most `max_client_calls` of them in flight; past that
its next call is refused (a well-behaved worker keeps a few in flight per server). All
clients together may hold at most the server's threads less `RESERVED_THREADS`, so health
checks and admin calls, which are never counted, always find a thread; past that a call is
refused as busy, and workers try it again after a backoff. A refused call changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ps.errors import InvalidArgumentError, ResourceExhaustedError, ServerBusyError

# Handler threads that data calls never take: health and admin calls answer under any load.
RESERVED_THREADS = 2
# Longest a data call waits for its turn before it runs beside the one holding it.
TURN_WAIT_S = 1.0


@dataclass(frozen=True)
class CallLimits:
    """Validated on construction."""

    max_calls: int  # data calls in flight, all clients together
    max_client_calls: int  # data calls in flight from one client

    def __post_init__(self) -> None:
        if self.max_calls < 1:
            raise InvalidArgumentError(
                f"--grpc-threads must leave at least one thread for data calls besides the "
                f"{RESERVED_THREADS} kept for health and admin calls; got {self.max_calls} left"
            )
        if self.max_client_calls < 1:
            raise InvalidArgumentError(
                f"--max-client-calls must be >= 1, got {self.max_client_calls}")

    @classmethod
    def for_threads(cls, threads: int, max_client_calls: int) -> CallLimits:
        return cls(threads - RESERVED_THREADS, max_client_calls)


def refusal(in_flight: int, own: int, limits: CallLimits, client: str
            ) -> ResourceExhaustedError | None:
    """Why one more data call from `client` (which has `own` of the server's `in_flight`
    calls) may not run now; None when it may. Pure."""
    if own >= limits.max_client_calls:
        return ResourceExhaustedError(
            f"client {client} already has {own} calls in flight, this server's limit per "
            f"client (--max-client-calls {limits.max_client_calls}); wait for their answers "
            "before sending more"
        )
    if in_flight >= limits.max_calls:
        return ServerBusyError(
            f"the server is busy: {in_flight} data calls in flight, its limit (--grpc-threads "
            f"less {RESERVED_THREADS} kept for health and admin calls); try again shortly"
        )
    return None


class CallGate:
    """Counts the data calls in flight, per client. Thread-safe; never blocks."""

    def __init__(self, limits: CallLimits) -> None:
        self.limits = limits
        # Guards _in_flight and _by_client.
        self._lock = threading.Lock()
        self._in_flight = 0
        self._by_client: dict[str, int] = {}

    def enter(self, client: str) -> None:
        """Counts one more call of `client` in flight; ResourceExhaustedError (or its
        subclass ServerBusyError), counting nothing, when a limit is reached. Every call
        that entered must `leave`."""
        with self._lock:
            own = self._by_client.get(client, 0)
            refused = refusal(self._in_flight, own, self.limits, client)
            if refused is not None:
                raise refused
            self._in_flight += 1
            self._by_client[client] = own + 1

    def leave(self, client: str) -> None:
        with self._lock:
            self._in_flight -= 1
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight


class Turn:
    """Lets one data call at a time run its work on the server's data, the others waiting.

    A server's handler threads share one interpreter lock. Two of them working at once hand
    it back and forth at every call into C (about 17 thread switches per exchange against
    1 alone, measured), so two workers' exchanges each cost more CPU than one did. In turn,
    each runs whole and the next waits once. A call gives its turn up for good before it
    blocks on other calls (a clock, a checkpoint's cut, an in-flight twin of a push:
    `give_up`), so no wait holds the others back; after `wait_s` a call runs without the
    turn. It is taken before any other lock and never taken again once given up, so it
    can be part of no deadlock. Thread-safe.
    """

    def __init__(self, wait_s: float = TURN_WAIT_S) -> None:
        self.wait_s = wait_s
        self._lock = threading.Lock()  # held by the call whose turn it is
        self._mine = threading.local()  # `held`: whether this thread holds _lock

    @contextmanager
    def taken(self) -> Iterator[None]:
        """Runs the block in this thread's turn: blocks until the turn comes, or `wait_s`.
        Inside a block that holds it already, changes nothing."""
        if getattr(self._mine, "held", False):
            yield
            return
        held = self._lock.acquire(timeout=self.wait_s)
        self._mine.held = held
        try:
            yield
        finally:
            self.give_up()

    def give_up(self) -> None:
        """Lets the next call in, if this thread holds the turn; this one goes on without
        it. Call before blocking on other calls. Never blocks."""
        if getattr(self._mine, "held", False):
            self._mine.held = False
            self._lock.release()
