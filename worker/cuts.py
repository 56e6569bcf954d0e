"""A worker's marks of checkpoint cuts (async and ssp checkpoints), as a pure policy.

A shard cutting a checkpoint tells each worker in its answers; the worker marks the cut on
every shard with one cut clock, the first iteration it has not sent yet (all before it are
answered, or on their way and counted in when they arrive). From then on its exchanges
carry the mark until every shard has answered one that carried it: a later iteration never
reaches a shard ahead of the mark that puts it after the cut.

A worker whose own exchange waits (an ssp pull waiting for a slower worker) may be what a
cut waits for while that slower worker is held by the cut: so while an exchange waits, or a
mark is not yet on every shard, the worker asks every shard with an empty exchange that
carries the mark (`due`, `probe_s`). Its answer tells of a cut not yet marked, and the mark
goes out at once, without waiting for the exchange in flight.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable

from protos import pstrain_pb2 as pb

# How long an exchange waits, or a mark stays undelivered, before the worker asks every shard.
PROBE_S = 1.0
# Cuts remembered as marked (a shard tells of a cut until it has the worker's mark).
MARKED_KEPT = 16


class CutMarks:
    """Which cut this worker marked, at which clock, and which shards have the mark yet.
    Thread-safe."""

    def __init__(self, num_shards: int, probe_s: float = PROBE_S,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.num_shards = num_shards
        self.probe_s = probe_s
        self._now = now
        self._lock = threading.Lock()
        self._sent = -1  # the newest iteration an exchange pushed for or ended (-1: none)
        self._mark: tuple[str, int] | None = None  # the newest cut marked, and its clock
        self._missing: set[int] = set()  # shards that have not answered a request with it
        self._marked: collections.deque[str] = collections.deque(maxlen=MARKED_KEPT)
        self._missing_since = 0.0
        self._exchanges = itertools.count()
        self._waiting: dict[int, float] = {}  # exchange -> when it was sent

    def send(self, header: pb.ExchangeRequest, clock: int, sends_iteration: bool) -> int:
        """An exchange is about to go out: puts the mark in `header` while some shard lacks
        it, and counts iteration `clock` as sent when the exchange pushes for it or ends it.
        Returns the exchange's number for `done`."""
        with self._lock:
            if self._missing and self._mark is not None:
                header.cut, header.cut_clock = self._mark
            if sends_iteration:
                self._sent = max(self._sent, clock)
            number = next(self._exchanges)
            self._waiting[number] = self._now()
            return number

    def done(self, number: int) -> None:
        """Exchange `number` was answered, or failed."""
        with self._lock:
            self._waiting.pop(number, None)

    def answered(self, shard: int, sent: str, told: str, clock: int) -> None:
        """`shard` answered a request that carried the mark of cut `sent` ("": none), and
        told of cut `told` ("": none); the worker's clock is `clock` now."""
        if not sent and not told:
            return
        with self._lock:
            if sent and self._mark is not None and sent == self._mark[0]:
                self._missing.discard(shard)
            if not told:
                return
            if self._mark is not None and told == self._mark[0]:
                # A shard that asks again (a restarted one, or one that began the cut after
                # the mark went by) gets the same mark: one clock on every shard. If it holds
                # iterations past that clock by now, it gives the cut up at once.
                if not self._missing:
                    self._missing_since = self._now()
                self._missing.add(shard)
            elif told not in self._marked and not self._missing:
                # (An older cut is not marked again; a new one while the last mark is on
                # its way waits: the shard tells again.)
                self._mark = (told, max(self._sent + 1, clock))
                self._marked.append(told)
                self._missing = set(range(self.num_shards))
                self._missing_since = self._now()

    def mark_for(self, shard: int) -> tuple[str, int] | None:
        """The mark a request to `shard` carries now (None: it has it, or there is none)."""
        with self._lock:
            return self._mark if shard in self._missing else None

    def due(self) -> bool:
        """Whether to ask every shard now: an exchange has waited `probe_s`, or a mark has
        not reached every shard within it."""
        with self._lock:
            since = min(self._waiting.values(), default=None)
            if self._missing:
                since = self._missing_since if since is None else min(since, self._missing_since)
            return since is not None and self._now() - since >= self.probe_s
