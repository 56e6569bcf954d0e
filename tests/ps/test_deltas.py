"""Full or delta: the policy, and the shard's log of its snapshots and their writes."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from ps.checkpoint import DELTA, FULL, CheckpointError, ShardFile, ShardState
from ps.deltas import SnapshotLog, WriteCounts, snapshot_kind
from ps.errors import InvalidArgumentError


@pytest.mark.parametrize(
    ("deltas_since_full", "full_every", "has_base", "last_failed", "full_asked", "kind"),
    [
        (0, 10, False, False, False, FULL),  # the first snapshot, or the first after a restore
        (0, 10, True, False, False, DELTA),
        (8, 10, True, False, False, DELTA),  # the 9th delta after a full
        (9, 10, True, False, False, FULL),  # ... and the 10th snapshot is full again
        (0, 1, True, False, False, FULL),  # 1: every one full
        (0, 2, True, False, False, DELTA),
        (1, 2, True, False, False, FULL),
        (3, 10, True, True, False, FULL),  # a write of the chain failed
        (3, 10, True, False, True, FULL),  # asked for (pstrain checkpoint --full)
    ],
)
def test_snapshot_kind(deltas_since_full: int, full_every: int, has_base: bool,
                       last_failed: bool, full_asked: bool, kind: str) -> None:
    assert snapshot_kind(deltas_since_full=deltas_since_full, full_every=full_every,
                         has_base=has_base, last_failed=last_failed,
                         full_asked=full_asked) == kind


@pytest.mark.parametrize("full_every", [0, -3])
def test_a_full_every_below_one_is_refused(full_every: int) -> None:
    with pytest.raises(InvalidArgumentError, match=f"must be >= 1, got {full_every}"):
        snapshot_kind(deltas_since_full=0, full_every=full_every, has_base=True,
                      last_failed=False, full_asked=False)
    with pytest.raises(InvalidArgumentError, match=f"must be >= 1, got {full_every}"):
        SnapshotLog(full_every)


def take(log: SnapshotLog, checkpoint_id: str) -> ShardState:
    """What a shard does: plan, build the state, record it."""
    kind, base = log.plan(checkpoint_id)
    state = ShardState("j", 0, 1, checkpoint_id, 0, {}, [], kind=kind, base=base)
    log.taken(state)
    return state


def file_of(state: ShardState) -> ShardFile:
    return ShardFile(f"/ckpt/j/{state.checkpoint_id}/shard-0-of-1.safetensors", "0" * 64, 1,
                     kind=state.kind, base=state.base)


def test_deltas_build_on_the_snapshot_before_and_a_full_one_comes_every_n() -> None:
    log = SnapshotLog(3)
    kinds = []
    for i in range(7):
        state = take(log, f"c{i}")
        kinds.append((state.kind, state.base))
        log.written(state, file_of(state))
    assert kinds == [(FULL, ""), (DELTA, "c0"), (DELTA, "c1"), (FULL, ""), (DELTA, "c3"),
                     (DELTA, "c4"), (FULL, "")]


def test_a_delta_is_written_after_its_base_and_with_its_file() -> None:
    log = SnapshotLog(10)
    base = take(log, "c0")
    delta = take(log, "c1")
    got: list[ShardFile | None] = []
    writer = threading.Thread(target=lambda: got.append(log.wait_turn(delta, 30)))
    writer.start()
    writer.join(0.3)
    assert writer.is_alive()  # waits: its base is still being written
    assert log.wait_turn(base, 1) is None  # a full one builds on nothing
    log.written(base, file_of(base))
    writer.join(10)
    assert got == [file_of(base)]


def test_a_failed_write_fails_the_deltas_on_it_and_makes_the_next_full() -> None:
    log = SnapshotLog(10)
    base = take(log, "c0")
    log.written(base, file_of(base))
    failing = take(log, "c1")
    on_failed = take(log, "c2")  # taken before the failure was known
    log.written(failing, None)
    with pytest.raises(CheckpointError, match="delta of 'c1', whose write failed"):
        log.wait_turn(on_failed, 1)
    log.written(on_failed, None)
    after = take(log, "c3")
    assert (after.kind, after.base) == (FULL, "")


def test_a_failure_before_the_newest_full_one_does_not_force_another() -> None:
    log = SnapshotLog(10)
    old = take(log, "c0")
    log.ask_full("c1")
    full = take(log, "c1")  # its chain does not need c0
    log.written(old, None)
    log.written(full, file_of(full))
    assert take(log, "c2").kind == DELTA


def test_a_restore_makes_the_next_snapshot_full_and_forgets_the_ones_before() -> None:
    log = SnapshotLog(10)
    first = take(log, "c0")
    log.written(first, file_of(first))
    stale = take(log, "c1")
    log.reset()
    with pytest.raises(CheckpointError, match="taken before the shard was restored"):
        log.wait_turn(stale, 1)
    log.written(stale, None)  # too late to matter
    after = take(log, "c2")
    assert (after.kind, after.base) == (FULL, "")
    assert log.wait_turn(after, 1) is None  # nothing before it to wait for
    log.written(after, file_of(after))
    assert take(log, "c3").kind == DELTA


def test_full_on_demand_and_after_deltas_cannot_be_linked() -> None:
    log = SnapshotLog(10)
    first = take(log, "c0")
    log.written(first, file_of(first))
    log.ask_full("manual-1")
    asked = take(log, "manual-1")
    assert asked.kind == FULL
    log.written(asked, file_of(asked))
    delta = take(log, "c2")
    assert delta.kind == DELTA
    log.written(delta, None, deltas_ok=False, why="no hard links here")
    assert [take(log, f"c{i}").kind for i in range(3, 6)] == [FULL] * 3


def test_a_snapshot_no_one_writes_counts_as_failed() -> None:
    log = SnapshotLog(10)
    take(log, "c0")  # dropped at once: no writer will report it
    assert take(log, "c1").kind == FULL
    base = take(log, "c2")
    delta = take(log, "c3")
    assert delta.kind == DELTA
    del base  # its writer gave up without a word
    with pytest.raises(CheckpointError, match="delta of 'c2', whose write failed"):
        log.wait_turn(delta, 5)
    log.written(delta, None)
    assert take(log, "c4").kind == FULL


def test_writing_holds_from_taken_until_written_or_dropped() -> None:
    log = SnapshotLog(10)
    assert not log.writing()
    state = take(log, "c0")
    assert log.writing()
    log.written(state, file_of(state))
    assert not log.writing()
    take(log, "c1")  # dropped at once: no writer will report it
    assert not log.writing()


def test_the_writes_are_counted_by_kind_with_their_bytes_and_the_time_of_the_last() -> None:
    now = [1000.0]
    log = SnapshotLog(2, wall_clock=lambda: now[0])
    assert log.counts() == WriteCounts()
    full = take(log, "c0")
    log.written(full, dataclasses.replace(file_of(full), nbytes=100))
    now[0] = 2000.0
    delta = take(log, "c1")
    log.written(delta, dataclasses.replace(file_of(delta), nbytes=7))
    now[0] = 3000.0
    failing = take(log, "c2")
    log.written(failing, None)
    assert log.counts() == WriteCounts(full=1, delta=1, failed=1, nbytes=107,
                                       last_written_s=2000.0)
