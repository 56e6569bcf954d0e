"""Exactly-once pushes: which (worker, incarnation, seq) a shard has applied.

A client numbers its pushes and reuses the number when it retries. The shard admits a push
only if its number is new, so a retry after a lost acknowledgement is acknowledged again
without being applied twice. Numbers need not arrive in order (a client overlaps pushes), so
the ledger keeps, per worker, the set of recent numbers it has seen; numbers older than that
window cannot be checked and are refused rather than risk a double application.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ps.errors import DeadlineExceededError, FailedPreconditionError

# Pushes remembered per worker. A client's retries of one push span far fewer pushes.
DEFAULT_WINDOW = 4096


class Admission(Enum):
    NEW = "new"  # apply it, then call done() or abandon()
    DUPLICATE = "duplicate"  # applied before: acknowledge, change nothing


@dataclass
class _WorkerLog:
    incarnation: int
    floor: int = 0  # numbers below this are outside the window
    applied: set[int] = field(default_factory=set)
    in_flight: set[int] = field(default_factory=set)
    newest: int = -1


@dataclass(frozen=True)
class LedgerEntry:
    """One worker's state, as saved in checkpoints."""

    worker: int
    incarnation: int
    floor: int
    applied: tuple[int, ...]


class PushLedger:
    """Remembers applied pushes per worker. Thread-safe; `admit` may block on an in-flight twin."""

    def __init__(
        self, window: int = DEFAULT_WINDOW, clock: Callable[[], float] = time.monotonic,
        before_wait: Callable[[], None] = lambda: None,
    ) -> None:
        """`before_wait` runs before `admit` blocks on an in-flight twin (the shard gives
        up its caller's turn there)."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._window = window
        self._clock = clock
        self._before_wait = before_wait
        # Guards _logs and every _WorkerLog in it.
        self._cond = threading.Condition(threading.Lock())
        self._logs: dict[int, _WorkerLog] = {}

    def admit(self, worker: int, incarnation: int, seq: int, timeout_s: float) -> Admission:
        """Decides whether push (worker, incarnation, seq) is new.

        A NEW push is marked in flight; the caller must then call `done` or `abandon`. If the
        same push is in flight on another thread, waits (up to timeout_s) for its outcome.
        Raises FailedPreconditionError for a stale incarnation or a number below the window.
        """
        deadline = self._clock() + timeout_s
        with self._cond:
            while True:
                log = self._log_for(worker, incarnation)
                if seq in log.applied:
                    return Admission.DUPLICATE
                if seq in log.in_flight:
                    remaining = deadline - self._clock()
                    self._before_wait()
                    if remaining <= 0 or not self._cond.wait(remaining):
                        raise DeadlineExceededError(
                            f"push {seq} of worker {worker} is still being applied by an "
                            "earlier attempt; retry it"
                        )
                    continue
                if seq < log.floor:
                    raise FailedPreconditionError(
                        f"push {seq} of worker {worker} (incarnation {incarnation}) is older "
                        f"than the last {self._window} pushes this shard remembers (oldest "
                        f"{log.floor}); it cannot be checked for duplication and was refused"
                    )
                log.in_flight.add(seq)
                return Admission.NEW

    def done(self, worker: int, incarnation: int, seq: int) -> None:
        """Records push `seq` as applied and wakes any retry waiting on it."""
        with self._cond:
            log = self._logs.get(worker)
            if log is None or log.incarnation != incarnation:
                return
            log.in_flight.discard(seq)
            log.applied.add(seq)
            log.newest = max(log.newest, seq)
            if len(log.applied) > 2 * self._window:
                log.floor = log.newest - self._window + 1
                log.applied = {s for s in log.applied if s >= log.floor}
            self._cond.notify_all()

    def abandon(self, worker: int, incarnation: int, seq: int) -> None:
        """Forgets an in-flight push that was not applied, so a retry may apply it."""
        with self._cond:
            log = self._logs.get(worker)
            if log is not None and log.incarnation == incarnation:
                log.in_flight.discard(seq)
            self._cond.notify_all()

    def check_incarnation(self, worker: int, incarnation: int) -> bool:
        """FailedPreconditionError if a newer incarnation of `worker` has been seen.

        Returns True when `incarnation` is new (its log starts empty from now on).
        """
        with self._cond:
            known = self._logs.get(worker)
            self._log_for(worker, incarnation)
            return known is None or known.incarnation != incarnation

    def _log_for(self, worker: int, incarnation: int) -> _WorkerLog:
        log = self._logs.get(worker)
        if log is None or incarnation > log.incarnation:
            # A new incarnation starts with a clean slate: its numbers restart.
            log = _WorkerLog(incarnation)
            self._logs[worker] = log
        elif incarnation < log.incarnation:
            raise FailedPreconditionError(
                f"worker {worker} pushed as incarnation {incarnation}, but incarnation "
                f"{log.incarnation} has since joined; this process is stale and must restart"
            )
        return log

    def entries(self) -> list[LedgerEntry]:
        """A consistent copy of the ledger, for checkpoints."""
        with self._cond:
            return [
                LedgerEntry(w, log.incarnation, log.floor, tuple(sorted(log.applied)))
                for w, log in sorted(self._logs.items())
            ]

    def to_meta(self) -> list[list[object]]:
        """The ledger's checkpoint form: [worker, incarnation, floor, [applied...]] each."""
        return [[e.worker, e.incarnation, e.floor, list(e.applied)] for e in self.entries()]

    def restore_meta(self, meta: Sequence[Sequence[Any]]) -> None:
        """Replaces the ledger with what `to_meta` wrote (parsed from JSON)."""
        self.restore([
            LedgerEntry(int(w), int(inc), int(floor), tuple(int(s) for s in applied))
            for w, inc, floor, applied in meta
        ])

    def restore(self, entries: list[LedgerEntry]) -> None:
        """Replaces the ledger with checkpointed entries."""
        with self._cond:
            self._logs = {
                e.worker: _WorkerLog(
                    e.incarnation, e.floor, set(e.applied), set(), max(e.applied, default=-1)
                )
                for e in entries
            }
