"""Workers that finish, and barriers: pure rules over what Redis holds, with no I/O.

A worker that has done its steps calls `ctx.finish()`: it records in Redis that its rank
finished (with its incarnation), waits until every server has taken it out of the live set,
and only then stops its heartbeat. The scheduler reads those records after the heartbeats of
each poll, so a finished worker's heartbeat never seems to vanish first: `Departures` decides
which ranks are out of the membership, and the scheduler calls the end of their heartbeat
"finished", not "dead". `finishes_past` decides what a sync rollback does to workers that
finished after its checkpoint, `exit_record` what a script that returned without
`ctx.finish()` leaves on the record, and `barrier_missing` whom a barrier still waits for.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Departures:
    """Finished ranks, each with the incarnation that finished (None: not known, for a rank
    whose script only exited with status 0). Kept in the scheduler's memory, so a Redis that
    comes back empty does not bring finished ranks back. Not thread-safe."""

    finished: dict[int, int | None] = field(default_factory=dict)

    def update(self, marked: Collection[int], left: Mapping[int, int],
               alive: Mapping[int, int]) -> None:
        """Takes one read of Redis: the ranks marked finished, the incarnation that called
        `finish()` per rank, and the incarnations the scheduler saw alive until now (the
        process that ran a rank marked without an incarnation is the one last seen)."""
        for rank in sorted(set(marked) | set(left)):
            if rank in left:
                self.finished[rank] = left[rank]
            elif rank not in self.finished:
                self.finished[rank] = alive.get(rank)

    def departed(self, beats: Mapping[int, int | None]) -> set[int]:
        """The finished ranks out of the membership, given each rank's heartbeat incarnation
        (None where it lapsed): every finished rank, unless a process other than the one that
        finished heartbeats for it (one started for it again, as `--resume` does)."""
        return {rank for rank, incarnation in self.finished.items()
                if beats.get(rank) is None or beats.get(rank) == incarnation}

    def forget(self, rank: int) -> None:
        """The rank's finish was voided: it is a member again."""
        self.finished.pop(rank, None)


def finishes_past(left: Mapping[int, Mapping[str, Any]], clock: int,
                  beating: Mapping[int, int]) -> tuple[dict[int, int], dict[int, int]]:
    """What a sync rollback to a checkpoint of `clock` does to the workers that finished past
    it, whose last steps it undoes. `left`: rank -> {incarnation, clock} of each finish
    recorded (a worker that finished at clock F took steps 0..F-1); `beating`: rank -> the
    incarnation that still heartbeats (a worker still in `ctx.finish()`).

    Returns (rank -> incarnation of those whose finishing process still beats: their finish
    is void, and they restart to train those steps again; rank -> the clock it finished at
    of those already let go, whose heartbeat has stopped: their process may have exited, so
    the job does not take those steps again). A finish at or before `clock` stands.
    """
    void: dict[int, int] = {}
    undone: dict[int, int] = {}
    for rank, record in sorted(left.items()):
        finished_at, incarnation = int(record.get("clock", -1)), int(record["incarnation"])
        if finished_at <= clock:
            continue
        if beating.get(rank) == incarnation:
            void[rank] = incarnation
        else:
            undone[rank] = finished_at
    return void, undone


def exit_record(beat: Mapping[str, Any] | None, record: Mapping[str, Any] | None,
                voided: int | None, now: float) -> dict[str, Any] | None:
    """The finish record of a script that exited with status 0 without `ctx.finish()`,
    taken from the last beat it left at exit (`beat`, marked "exiting", carries the clock it
    stopped at), so a later rollback past that clock can say which steps it undid.

    None (nothing to write) without such a beat, when the rank's `record` is already this
    process's (it called `ctx.finish()`), or when a rollback voided this process's finish
    (`voided`: that incarnation). A record of another process (an earlier run) is replaced.
    """
    if beat is None or not beat.get("exiting") or "clock" not in beat:
        return None
    incarnation = int(beat["incarnation"])
    if voided == incarnation or (record is not None
                                 and int(record.get("incarnation", -1)) == incarnation):
        return None
    return {"incarnation": incarnation, "clock": int(beat["clock"]), "time": now,
            "exited": True}


def barrier_missing(expected: Collection[int], registered: Mapping[int, int],
                    left: Mapping[int, int], arrived: Mapping[int, int]) -> list[int]:
    """The ranks a barrier still waits for, in order.

    `expected` are the ranks the scheduler counts live (dead and finished ones left out),
    `registered` each rank's current incarnation, `left` the incarnation that finished per
    rank and `arrived` the incarnation that reached the barrier per rank. A rank counts as
    there when its current process finished or arrived; an arrival or finish of an earlier
    process of the rank (before a restart, or an earlier run of the job) does not count.
    A rank with no registered process (still starting) is waited for.
    """
    missing = []
    for rank in sorted(expected):
        current = registered.get(rank)
        if current is None or (left.get(rank) != current and arrived.get(rank) != current):
            missing.append(rank)
    return missing
