"""Full or delta: which kind a shard's next snapshot is, and the record a delta needs.

`snapshot_kind` is the policy, a pure function. `SnapshotLog` is the shard's memory of its
snapshots: what the next one would build on, how many deltas the chain holds, and how each
write went, so that

- a delta is written only after the snapshot it builds on, and with that file's sha256 and
  chain (`wait_turn`), and every snapshot after the ones taken before it (a checkpoint that
  completes is never older, per shard, than one still being written);
- a write that failed makes the next snapshot full (its changes were taken from the tables'
  marks and are nowhere else), and so does a restore;
- a delta whose base failed is not written.

The shard calls `plan` and `taken` while it holds its clocks (one snapshot at a time); the
writer calls `wait_turn` and then `written`. Thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from ps.checkpoint import DELTA, FULL, CheckpointError, ShardFile, ShardState
from ps.errors import InvalidArgumentError

log = logging.getLogger(__name__)

# How long a write waits for the writes of the snapshots taken before it.
WAIT_FOR_EARLIER_S = 600.0


def snapshot_kind(*, deltas_since_full: int, full_every: int, has_base: bool,
                  last_failed: bool, full_asked: bool) -> str:
    """FULL or DELTA for a shard's next snapshot. Pure.

    Full when asked for, when there is nothing to build on (the first snapshot, or the
    first after a restore), when a write of the current chain failed, or when the chain
    already holds `full_every` - 1 deltas (a full one every `full_every` snapshots; 1: all
    full). Else a delta of the snapshot before.
    """
    if full_every < 1:
        raise InvalidArgumentError(f"checkpoint_full_every must be >= 1, got {full_every}")
    if full_asked or not has_base or last_failed:
        return FULL
    return DELTA if deltas_since_full < full_every - 1 else FULL


@dataclass(eq=False)
class _Taken:
    """A snapshot taken: its number, the one it builds on, and (once written) its file."""

    seq: int
    # The snapshot itself, matched by identity; weak, so that a snapshot no one writes (a
    # caller that only wanted the state) is not kept alive here: once it is gone, it counts
    # as a write that failed.
    state: weakref.ref[ShardState]
    base: _Taken | None
    kind: str
    checkpoint_id: str
    done: bool = False
    file: ShardFile | None = None
    forgotten: bool = False  # taken before a restore


@dataclass(frozen=True)
class WriteCounts:
    """How a shard's checkpoint writes went since it started (its metrics)."""

    full: int = 0  # written
    delta: int = 0
    failed: int = 0  # failed, or taken and never written
    nbytes: int = 0  # of the files written
    last_written_s: float = 0.0  # wall clock (Unix seconds) of the newest written; 0: none


class SnapshotLog:
    """A shard's snapshots: what the next one builds on, and how their writes went.
    Thread-safe; blocking only in `wait_turn`. Every snapshot a caller writes must be
    reported to `written`, whatever happened."""

    def __init__(self, full_every: int = 1, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        snapshot_kind(deltas_since_full=0, full_every=full_every, has_base=False,
                      last_failed=False, full_asked=False)  # checks full_every
        self.full_every = full_every
        self._now = clock
        self._wall = wall_clock
        self._counts = WriteCounts()
        # Guards every field below; writers wait on it for the writes before theirs.
        self._cond = threading.Condition(threading.Lock())
        self._seq = 0
        self._last: _Taken | None = None  # the newest snapshot: the next delta's base
        self._chain_start = 0  # seq of the newest full snapshot
        self._deltas = 0  # deltas taken since it
        self._failed = False  # a write of the current chain failed
        self._asked: set[str] = set()  # checkpoint ids asked to be full
        self._pending: list[_Taken] = []  # taken, not yet written, in order
        self._no_deltas = ""  # why deltas cannot be written here ("": they can)

    def ask_full(self, checkpoint_id: str) -> None:
        """The snapshot under `checkpoint_id`, when it is taken, is full."""
        with self._cond:
            self._asked.add(checkpoint_id)

    def plan(self, checkpoint_id: str) -> tuple[str, str]:
        """(kind, base id) of the snapshot about to be taken under `checkpoint_id`: (FULL,
        "") or (DELTA, the newest snapshot's id). Follow it with `taken`."""
        with self._cond:
            self._sweep()
            asked = checkpoint_id in self._asked
            self._asked.discard(checkpoint_id)
            kind = snapshot_kind(
                deltas_since_full=self._deltas, full_every=self.full_every,
                has_base=self._last is not None, last_failed=self._failed,
                full_asked=asked or bool(self._no_deltas))
            base = self._last.checkpoint_id if kind == DELTA and self._last else ""
            return kind, base

    def taken(self, state: ShardState) -> None:
        """Records the snapshot `plan` planned: the next builds on it; its write waits for
        the writes of those before it."""
        with self._cond:
            self._seq += 1
            base = self._last if state.kind == DELTA else None
            entry = _Taken(self._seq, weakref.ref(state), base, state.kind, state.checkpoint_id)
            if state.kind == FULL:
                self._chain_start, self._deltas, self._failed = self._seq, 0, False
            else:
                self._deltas += 1
            self._last = entry
            self._pending.append(entry)

    def writing(self) -> bool:
        """Whether a snapshot taken is still to be written (or reported)."""
        with self._cond:
            self._sweep()
            return bool(self._pending)

    def reset(self) -> None:
        """The shard was restored: its next snapshot is full, and snapshots taken before
        are no one's base (their writes, if any are still to come, need not wait)."""
        with self._cond:
            for entry in self._pending:
                entry.forgotten = True
            self._pending.clear()
            self._last = None
            self._deltas, self._failed = 0, False
            self._cond.notify_all()

    def wait_turn(self, state: ShardState, timeout_s: float = WAIT_FOR_EARLIER_S
                  ) -> ShardFile | None:
        """Blocks until the writes of the snapshots taken before `state` have ended (at most
        `timeout_s`); returns the file of its base for a delta (None for a full one).

        CheckpointError for a delta whose base was not written (its write failed or was
        never tried), or is still being written after `timeout_s`, or that this log never
        took (or forgot in a restore); a full snapshot goes ahead after the timeout."""
        deadline = self._now() + timeout_s
        with self._cond:
            entry = self._find(state)
            while entry is not None and not entry.forgotten:
                self._sweep()
                if not any(e.seq < entry.seq for e in self._pending):
                    break
                left = deadline - self._now()
                if left <= 0:
                    break
                # Also wakes for a sweep: an earlier snapshot no one writes is let go.
                self._cond.wait(min(left, 1.0))
            if state.kind != DELTA:
                return None
            base = entry.base if entry is not None else None
            if base is None or not base.done:
                raise CheckpointError(
                    f"checkpoint {state.checkpoint_id!r} shard {state.shard} is a delta of "
                    f"{state.base!r}, which is not written after {timeout_s:g} s (or was "
                    "taken before the shard was restored); the next checkpoint is full"
                )
            if base.file is None:
                raise CheckpointError(
                    f"checkpoint {state.checkpoint_id!r} shard {state.shard} is a delta of "
                    f"{state.base!r}, whose write failed; the next checkpoint is full"
                )
            return base.file

    def written(self, state: ShardState, file: ShardFile | None, deltas_ok: bool = True,
                why: str = "") -> None:
        """The write of `state` ended: `file` when it was written, None when it failed (the
        next snapshot is then full, if it failed in the current chain). Without `deltas_ok`
        (`why` says why), every later snapshot is full."""
        with self._cond:
            if not deltas_ok and not self._no_deltas:
                self._no_deltas = why or "deltas cannot be written here"
                log.error("shard %d: writing full checkpoints only from now on: %s",
                          state.shard, self._no_deltas)
            entry = self._find(state)
            if entry is not None:
                self._end(entry, file)
            self._cond.notify_all()

    def _end(self, entry: _Taken, file: ShardFile | None) -> None:
        """Caller holds the lock."""
        entry.done, entry.file, entry.base = True, file, None
        if file is None and entry.seq >= self._chain_start:
            self._failed = True
        self._pending.remove(entry)
        c = self._counts
        self._counts = (dataclasses.replace(c, failed=c.failed + 1) if file is None else
                        dataclasses.replace(c, full=c.full + (file.kind != DELTA),
                                            delta=c.delta + (file.kind == DELTA),
                                            nbytes=c.nbytes + file.nbytes,
                                            last_written_s=self._wall()))

    def counts(self) -> WriteCounts:
        """How the writes reported so far went."""
        with self._cond:
            return self._counts

    def _sweep(self) -> None:
        """Ends, as failed, the pending snapshots no one holds any more. Caller holds the
        lock."""
        for entry in [e for e in self._pending if e.state() is None]:
            log.debug("snapshot %s was dropped unwritten", entry.checkpoint_id)
            self._end(entry, None)

    def _find(self, state: ShardState) -> _Taken | None:
        """The pending entry of `state` (the very object `taken` recorded). Caller holds
        the lock."""
        return next((e for e in self._pending if e.state() is state), None)
