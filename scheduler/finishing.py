"""Workers that finish, and barriers: pure rules over what Redis holds, with no I/O.

A worker that has done its steps calls `ctx.finish()`: it records in Redis that its rank
finished (with its incarnation), waits until every server has taken it out of the live set,
and only then stops its heartbeat. The scheduler reads those records after the heartbeats of
each poll, so a finished worker's heartbeat never seems to vanish first: `Departures` decides
which ranks are out of the membership, and the scheduler calls the end of their heartbeat
"finished", not "dead". `barrier_missing` decides whom a barrier still waits for.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field


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
