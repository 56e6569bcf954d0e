"""What a shard knows about worker clocks, liveness and the open sync clock.

A ClockBoard is plain state with no locking of its own: the shard's executor holds its
condition variable around every call and waits on it for the board to change.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ps.consistency import ClockView, Waiters
from ps.errors import FencedError, InvalidArgumentError

# Closed sync clocks remembered for inspection.
HISTORY = 10_000
# Data positions remembered per worker: those of its newest ticks. A cut takes the one of the
# iteration before its clock, at most a pipeline's depth of iterations back.
POSITIONS = 16
# How long a new incarnation that joined a shard counts for that shard's cuts before the
# scheduler lists it live: past the scheduler's poll, and Redis outages of a few seconds.
JOIN_GRACE_S = 30.0


@dataclass(frozen=True)
class Quorum:
    """Workers in the job, backups included; a sync clock needs workers - backups of them."""

    workers: int = 1
    backups: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise InvalidArgumentError(f"workers must be >= 1, got {self.workers}")
        if not 0 <= self.backups < self.workers:
            raise InvalidArgumentError(
                f"backups must be in [0, workers={self.workers}), got {self.backups}"
            )


class ClockBoard:
    """Worker clocks, the live set, and who counts for the open sync clock. Not thread-safe."""

    def __init__(self, quorum: Quorum) -> None:
        self.config = quorum
        self.live: set[int] = set(range(quorum.workers))
        self.clocks: dict[int, int] = dict.fromkeys(self.live, 0)
        self.open_clock = 0
        self.clocks_closed = 0
        self.contributors: set[int] = set()  # count for the open clock
        self.finished: set[int] = set()  # contributors that ticked the open clock
        self._early: dict[int, list[int]] = {}  # clock -> workers that ticked it before it opened
        # Recent sync clocks: clock -> [workers counted, gradients dropped].
        self.history: collections.OrderedDict[int, list[int]] = collections.OrderedDict()
        # Worker -> the newest incarnation declared dead; it and older ones are refused.
        self.fenced: dict[int, int] = {}
        # Worker -> every iteration below this one has ticked here. Ticks of one worker may
        # arrive out of order (its pipeline keeps several exchanges in flight): those past a
        # gap wait in `_ahead` until it fills.
        self.through: dict[int, int] = {}
        self._ahead: dict[int, set[int]] = {}
        # New incarnations that joined here (`restart`) and are not yet listed live: worker
        # -> (incarnation, when it joined). A cut counts them for JOIN_GRACE_S.
        self.joining: dict[int, tuple[int, float]] = {}
        # Worker -> (iteration -> where it was in its data once that iteration was done), for
        # its newest ticks that said.
        self.positions: dict[int, collections.OrderedDict[int, bytes]] = {}

    @property
    def quorum(self) -> int:
        """Contributors a sync clock needs: N of N + b, fewer when fewer are live."""
        return max(1, min(self.config.workers - self.config.backups, len(self.live)))

    def min_live_clock(self) -> int:
        if not self.live:
            return max(self.clocks.values(), default=0)
        return min(self.clocks[w] for w in self.live)

    def view(self, worker: int, clock: int) -> ClockView:
        return ClockView(
            worker=worker, clock=clock, min_live_clock=self.min_live_clock(),
            open_clock=self.open_clock, contributors=len(self.contributors),
            quorum=self.quorum, is_contributor=worker in self.contributors,
        )

    def report(self, worker: int, clock: int) -> None:
        """A request from `worker` at iteration `clock`: its clock is at least that."""
        self.clocks[worker] = max(self.clocks.get(worker, self._entry_clock()), clock)

    def claim(self, worker: int) -> None:
        """`worker`'s gradients count for the open clock."""
        self.contributors.add(worker)

    def tick(self, worker: int, clock: int, position: bytes = b"") -> None:
        """`worker` finished iteration `clock`, and was then at `position` in its data
        (b"": it did not say)."""
        self.report(worker, clock + 1)
        self._tick_through(worker, clock)
        if position:
            kept = self.positions.setdefault(worker, collections.OrderedDict())
            kept[clock] = position
            kept.move_to_end(clock)
            while len(kept) > POSITIONS:
                kept.popitem(last=False)
        if clock == self.open_clock:
            self._finish(worker)
        elif clock > self.open_clock:
            self._early.setdefault(clock, []).append(worker)

    def _tick_through(self, worker: int, clock: int) -> None:
        through = self.through.get(worker)
        if through is None or clock < through:
            # The first tick seen (a worker that never joined here), or a repeated one.
            self.through.setdefault(worker, clock + 1)
            return
        ahead = self._ahead.setdefault(worker, set())
        ahead.add(clock)
        while through in ahead:
            ahead.discard(through)
            through += 1
        self.through[worker] = through

    def acked(self, worker: int, clock: int) -> bool:
        """Every iteration of `worker` before `clock` was answered by every shard: none is
        still to tick here (one this shard lost, restarted from a checkpoint, never will).
        Its clock is at least `clock` (the ssp bound reads it), and a worker acknowledged
        past the open clock has finished it. True if this moved anything."""
        if clock <= self.through.get(worker, 0):
            return False
        self.report(worker, clock)
        ahead = self._ahead.get(worker, set())
        ahead.difference_update([c for c in ahead if c < clock])
        while clock in ahead:
            ahead.discard(clock)
            clock += 1
        self.through[worker] = clock
        if clock > self.open_clock:
            self._finish(worker)
        return True

    def position_before(self, worker: int, clock: int) -> bytes:
        """Where `worker` was in its data after its newest iteration below `clock` that said
        (b"": none did, or too long ago)."""
        best, found = -1, b""
        for ticked, position in self.positions.get(worker, {}).items():
            if best < ticked < clock:
                best, found = ticked, position
        return found

    def _finish(self, worker: int) -> None:
        if worker in self.contributors:
            self.finished.add(worker)
        elif len(self.contributors) < self.quorum and worker in self.live:
            # Finished without a gradient for this shard: it counts, with nothing to add.
            self.contributors.add(worker)
            self.finished.add(worker)

    def count_drop(self, clock: int) -> None:
        """A gradient for `clock` was dropped (late, or past the quorum)."""
        self._record(clock)[1] += 1

    def _record(self, clock: int) -> list[int]:
        record = self.history.setdefault(clock, [0, 0])
        while len(self.history) > HISTORY:
            self.history.popitem(last=False)
        return record

    def close(self) -> None:
        """Closes the open clock and opens the next one."""
        self._record(self.open_clock)[0] = len(self.contributors)
        self.open_clock += 1
        self.clocks_closed += 1
        self.contributors.clear()
        self.finished.clear()
        for worker in self._early.pop(self.open_clock, []):
            self._finish(worker)
        self._finish_through()

    def _finish_through(self) -> None:
        """Finishes the open clock for every live worker already through it, whose tick for
        it will not come: a restart of this shard lost it (their acknowledgement said so,
        see `acked`), or it was spent while the worker was out of the live set, which it
        rejoined past this clock."""
        for worker in sorted(self.live):
            if self.through.get(worker, 0) > self.open_clock:
                self._finish(worker)

    def restart(self, worker: int, incarnation: int, at: float) -> int:
        """A new incarnation of `worker` joined here at time `at`; returns the clock it starts
        at.

        A gradient its previous incarnation pushed for the open clock stays counted, and the
        open clock is finished for it; otherwise it resumes where the old one stood. Until
        the scheduler lists it live (a poll; longer while Redis is away), cuts count it as
        live for JOIN_GRACE_S: another shard may count it already, and every shard must hold
        its iterations past its mark alike.
        """
        if worker in self.live:
            self.joining.pop(worker, None)
        else:
            self.joining[worker] = (incarnation, at)
        if worker in self.contributors:
            self.finished.add(worker)
            self.report(worker, self.open_clock + 1)
        else:
            self.report(worker, self._entry_clock() if worker not in self.clocks else 0)
        # The new incarnation's first iteration is its clock: ticks count on from there.
        self.through[worker] = self.clocks[worker]
        self._ahead.pop(worker, None)
        self._finish_through()
        return self.clocks[worker]

    def set_live(self, workers: Iterable[int]) -> None:
        """Replaces the live set. Dead contributors count as finished; joiners enter at the
        slowest live worker's clock, so they hold nobody back."""
        new = set(workers)
        for worker in new:
            self.joining.pop(worker, None)
        entry = self._entry_clock()
        for worker in new - self.live:
            self.clocks[worker] = max(self.clocks.get(worker, 0), entry)
        for worker in self.live - new:
            if worker in self.contributors:
                self.finished.add(worker)
        self.live = new
        self._finish_through()

    def fence(self, fenced: Mapping[int, int]) -> None:
        """Records incarnations declared dead (worker -> incarnation); never lowers one."""
        for worker, incarnation in fenced.items():
            if incarnation > self.fenced.get(worker, -1):
                self.fenced[worker] = incarnation
            if worker in self.joining and self.joining[worker][0] <= incarnation:
                del self.joining[worker]

    def check_not_fenced(self, worker: int, incarnation: int) -> None:
        """FencedError when `incarnation` of `worker` was declared dead."""
        dead = self.fenced.get(worker)
        if dead is not None and incarnation <= dead:
            raise FencedError(
                f"worker {worker} incarnation {incarnation} was declared dead (its heartbeat "
                f"stopped for longer than the job allows) and the job went on without it; "
                "this process must restart: a new incarnation joins at the open clock"
            )

    def to_meta(self, cut: Mapping[int, int] | None = None) -> dict[str, object]:
        """The board's checkpoint form: the open clock, clocks closed, each worker's clock,
        the live set, and each worker's data position.

        `cut` (worker -> clock) says where each worker's iterations stop counting: a worker
        ahead of its cut clock is taken at it, with its position of then; workers without a
        cut clock are taken as they are.
        """
        cut = cut or {}
        clocks = {w: min(c, cut.get(w, c)) for w, c in self.clocks.items()}
        positions = {w: self.position_before(w, clocks[w]) for w in self.positions}
        return {"open_clock": self.open_clock, "clocks_closed": self.clocks_closed,
                "clocks": {str(w): c for w, c in clocks.items()}, "live": sorted(self.live),
                "positions": {str(w): p.decode() for w, p in positions.items() if p}}

    def restore_meta(self, meta: Mapping[str, Any], clock: int) -> None:
        """Takes the state `to_meta` wrote; `clock` is the open clock when the meta lacks one."""
        self.open_clock = int(meta.get("open_clock", clock))
        self.clocks_closed = int(meta.get("clocks_closed", 0))
        self.clocks = {int(w): int(c) for w, c in meta.get("clocks", {}).items()}
        self.live = {int(w) for w in meta.get("live", sorted(self.live))}
        self.through = dict(self.clocks)
        self._ahead = {}
        self.positions = {
            int(w): collections.OrderedDict([(self.clocks.get(int(w), 0) - 1, p.encode())])
            for w, p in meta.get("positions", {}).items()
        }

    def short_of_cut(self, cut: Mapping[int, int], now: float) -> list[int]:
        """Live workers a consistent cut still waits for: of those this shard has seen (a
        join, a tick), the ones without a cut clock in `cut` (worker -> the first iteration
        after the cut), and those with iterations before it that have not ticked here yet.
        A worker never seen here has nothing here to cut: what it sends later comes after.
        A new incarnation not yet listed live counts as live for JOIN_GRACE_S after its
        join (`restart`; `now` is the time on the same clock)."""
        counted = self.live | {w for w, (_, at) in self.joining.items()
                               if now - at < JOIN_GRACE_S}
        return sorted(w for w in counted
                      if w in self.through and (w not in cut or self.through[w] < cut[w]))

    def held(self) -> int:
        """Ticks kept for later: early ones waiting for their clock to open, and those past
        a gap in their worker's iterations. A pipeline's depth per worker, in a job whose
        workers all step."""
        return sum(len(w) for w in self._early.values()) + sum(len(a) for a in self._ahead.values())

    def latest_position(self, worker: int) -> bytes:
        """Where `worker` was in its data after its newest iteration that said (b"": none)."""
        kept = self.positions.get(worker)
        return next(reversed(kept.values())) if kept else b""

    def _entry_clock(self) -> int:
        return max(self.open_clock, self.min_live_clock()) if self.live else self.open_clock

    def waiters(self) -> Waiters:
        """A frozen copy of who a wait may be waiting for, for a policy's explanation."""
        return Waiters(
            tuple(sorted((w, self.clocks[w]) for w in self.live)), frozenset(self.finished)
        )

    def unfinished(self) -> list[tuple[int, int]]:
        """(worker, clock) of live workers the open sync clock still waits for."""
        return self.waiters().unfinished()
