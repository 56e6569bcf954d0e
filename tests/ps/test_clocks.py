"""The clock board: quorum slots, early ticks, membership changes."""

from __future__ import annotations

import json

import pytest

from ps.clocks import JOIN_GRACE_S, POSITIONS, ClockBoard, Quorum
from ps.consistency import SyncPolicy
from ps.errors import FencedError, InvalidArgumentError, RolledBackError


def closes(board: ClockBoard) -> bool:
    return SyncPolicy.closes(len(board.contributors), len(board.finished), board.quorum)


def test_first_quorum_workers_count_and_the_clock_closes() -> None:
    board = ClockBoard(Quorum(workers=4, backups=1))
    assert board.quorum == 3
    for w in (2, 0, 3):
        board.claim(w)
    for w in (2, 0):
        board.tick(w, 0)
    assert not closes(board)
    board.tick(1, 0)  # not a contributor and the quorum is full: a backup
    assert board.contributors == {0, 2, 3} and not closes(board)
    board.tick(3, 0)
    assert closes(board)
    board.close()
    assert board.open_clock == 1 and not board.contributors


def test_tick_without_push_counts_as_an_empty_contribution() -> None:
    board = ClockBoard(Quorum(workers=2))
    board.tick(0, 0)
    board.tick(1, 0)
    assert closes(board)


def test_early_ticks_count_when_their_clock_opens() -> None:
    board = ClockBoard(Quorum(workers=2))
    board.tick(0, 0)
    board.tick(0, 1)  # worker 0 had nothing to push here in iteration 1 either
    board.tick(1, 0)
    board.close()
    assert board.finished == {0}
    board.tick(1, 1)
    assert closes(board)


def test_removing_a_worker_shrinks_quorum_and_min_clock() -> None:
    board = ClockBoard(Quorum(workers=3))
    for w in (0, 1):
        board.tick(w, 0)
        board.tick(w, 1)
    assert board.min_live_clock() == 0 and board.unfinished() == [(2, 0)]
    board.set_live([0, 1])
    assert board.quorum == 2 and board.min_live_clock() == 2


def test_joiner_enters_at_the_current_clock() -> None:
    board = ClockBoard(Quorum(workers=2))
    for w in (0, 1):
        for c in range(5):
            board.tick(w, c)
    board.set_live([0, 1, 7])
    assert board.clocks[7] == 5 and board.min_live_clock() == 5


@pytest.mark.parametrize(("workers", "backups"), [(0, 0), (2, 2), (3, -1)])
def test_bad_quorum(workers: int, backups: int) -> None:
    with pytest.raises(InvalidArgumentError):
        Quorum(workers, backups)


def test_checkpoint_form_round_trips_through_json() -> None:
    board = ClockBoard(Quorum(3))
    for worker in (0, 1, 2):
        board.tick(worker, 0, f"w{worker}@0".encode())
    board.close()
    board.tick(0, 1, b"w0@1")
    board.set_live({0, 2})
    meta = json.loads(json.dumps(board.to_meta()))
    assert meta == {"open_clock": 1, "clocks_closed": 1, "clocks": {"0": 2, "1": 1, "2": 1},
                    "live": [0, 2], "positions": {"0": "w0@1", "1": "w1@0", "2": "w2@0"}}
    copy = ClockBoard(Quorum(3))
    copy.restore_meta(meta, clock=0)
    assert (copy.open_clock, copy.clocks_closed, copy.clocks, copy.live) == (
        1, 1, {0: 2, 1: 1, 2: 1}, {0, 2})
    assert [copy.latest_position(w) for w in (0, 1, 2)] == [b"w0@1", b"w1@0", b"w2@0"]
    # A worker rejoining the restored board gets the position of its clock there.
    assert copy.position_before(0, copy.clocks[0]) == b"w0@1"


def test_a_cut_takes_each_worker_at_its_cut_clock_with_its_position_of_then() -> None:
    board = ClockBoard(Quorum(2))
    for clock in range(4):
        board.tick(0, clock, f"e0b{clock + 1}".encode())
    board.tick(1, 0, b"e0b1")
    meta = board.to_meta({0: 2, 1: 5})
    assert meta["clocks"] == {"0": 2, "1": 1}
    assert meta["positions"] == {"0": "e0b2", "1": "e0b1"}
    # Without a cut, each worker is taken at its clock, with its newest position.
    assert board.to_meta()["positions"] == {"0": "e0b4", "1": "e0b1"}


def test_ticks_out_of_order_count_through_only_once_the_gap_fills() -> None:
    board = ClockBoard(Quorum(1))
    assert board.short_of_cut({}, 0.0) == []  # live by default, never seen: nothing to cut
    board.restart(0, 1, 0.0)  # joins at clock 0
    board.tick(0, 1)  # iteration 1's exchange overtook iteration 0's
    assert board.through[0] == 0
    assert board.short_of_cut({0: 2}, 0.0) == [0]
    board.tick(0, 0)
    assert board.through[0] == 2
    assert board.short_of_cut({0: 2}, 0.0) == []
    # A live worker without a mark holds a cut back; a dead one does not.
    assert board.short_of_cut({}, 0.0) == [0]
    board.set_live(set())
    assert board.short_of_cut({}, 0.0) == []


def test_a_new_incarnation_not_yet_listed_live_counts_for_cuts_for_a_grace() -> None:
    # Another shard may list it live already (the scheduler tells shards one by one, late
    # while Redis is away): every shard must wait for its mark alike.
    board = ClockBoard(Quorum(2))
    board.set_live({0})
    board.restart(1, incarnation=7, at=100.0)
    assert board.short_of_cut({}, 101.0) == [1]
    assert board.short_of_cut({1: 0}, 101.0) == []
    assert board.short_of_cut({}, 100.0 + JOIN_GRACE_S) == []  # never listed: a lost joiner
    board.fence({1: 6})  # an older incarnation declared dead: this one still counts
    assert board.short_of_cut({}, 101.0) == [1]
    board.fence({1: 7})  # this one declared dead
    assert board.short_of_cut({}, 101.0) == []
    board.restart(1, incarnation=8, at=200.0)
    board.set_live({0, 1})  # listed live: counted as live from now on, with no deadline
    assert board.joining == {}
    assert board.short_of_cut({}, 200.0 + JOIN_GRACE_S) == [1]
    board.set_live({0})  # finished or dead: no longer waited for
    assert board.short_of_cut({}, 201.0) == []


def test_positions_kept_are_bounded_per_worker() -> None:
    board = ClockBoard(Quorum(1))
    for clock in range(3 * POSITIONS):
        board.tick(0, clock, str(clock).encode())
    assert len(board.positions[0]) == POSITIONS
    assert board.position_before(0, 3 * POSITIONS) == str(3 * POSITIONS - 1).encode()
    assert board.position_before(0, 1) == b""  # long gone



@pytest.mark.parametrize(
    ("fences", "worker", "incarnation", "refused"),
    [
        ([], 1, 7, False),
        ([{1: 7}], 1, 7, True),  # the incarnation declared dead
        ([{1: 7}], 1, 6, True),  # an older one of that worker
        ([{1: 7}], 1, 8, False),  # its restart, a new incarnation
        ([{1: 7}], 0, 7, False),  # another worker
        ([{1: 7}, {1: 5}], 1, 6, True),  # a fence never goes down
        ([{1: 7}, {1: 9, 2: 3}], 1, 8, True),  # it goes up
    ],
)
def test_a_fenced_incarnation_is_refused_so_it_restarts(
    fences: list[dict[int, int]], worker: int, incarnation: int, refused: bool,
) -> None:
    board = ClockBoard(Quorum(workers=3))
    for fenced in fences:
        board.fence(fenced)
    if not refused:
        board.check_not_fenced(worker, incarnation)
        return
    with pytest.raises(FencedError, match="declared dead") as err:
        board.check_not_fenced(worker, incarnation)
    assert isinstance(err.value, RolledBackError)  # marked so the client restarts


def test_an_acknowledged_clock_fills_gaps_a_restored_shard_never_sees_ticked() -> None:
    board = ClockBoard(Quorum(1))
    board.restore_meta({"clocks": {"0": 480}, "live": [0]}, clock=0)
    board.tick(0, 500)  # the worker went on while this shard was down: 480..499 are lost
    board.tick(0, 501)
    assert board.short_of_cut({0: 502}, 0.0) == [0]
    board.acked(0, 500)  # the worker's next request: every shard answered up to 499
    assert board.through[0] == 502
    assert board.short_of_cut({0: 502}, 0.0) == []
    board.acked(0, 10)  # never backwards
    assert board.through[0] == 502


def test_a_restored_shard_s_open_clock_follows_workers_acknowledged_past_it() -> None:
    # Async and ssp workers go on from their own clocks while a shard restarts: the
    # iterations its checkpoint did not have (20..499 here) never tick again. Their
    # acknowledgements close those clocks, and no tick is held for them.
    board = ClockBoard(Quorum(2))
    board.restore_meta({"open_clock": 20, "clocks": {"0": 20, "1": 20}, "live": [0, 1]}, 0)
    for clock in range(500, 600):
        for worker in (0, 1):
            board.acked(worker, clock)
            board.tick(worker, clock)
            while closes(board):
                board.close()
    assert board.open_clock == 600
    assert board.held() == 0
    assert board.through == {0: 600, 1: 600}


def test_an_acknowledgement_moves_the_worker_s_clock_for_the_ssp_bound() -> None:
    # A restored ssp shard that hears of a worker only through read-only exchanges (its
    # evaluation after training) must still see it at the clock it acknowledges: the bound
    # of every pull, its own included, reads these clocks.
    board = ClockBoard(Quorum(2))
    board.restore_meta({"open_clock": 20, "clocks": {"0": 20, "1": 20}, "live": [0, 1]}, 0)
    board.acked(0, 500)
    assert board.clocks == {0: 500, 1: 20} and board.min_live_clock() == 20
    board.acked(1, 480)
    assert board.min_live_clock() == 480


def test_a_worker_restarted_past_the_open_clock_holds_it_back_no_more() -> None:
    # Async: worker 1 ran ahead to 50 while worker 0 was slow, then died and came back as a
    # new incarnation at its own clock. Clocks 10..19 opened while it was out (its early
    # ticks for them were spent then); it is past the open clock 20 when it is live again,
    # and clocks it is past close with worker 0 alone, with nothing kept for them.
    board = ClockBoard(Quorum(2))

    def tick(worker: int, clock: int) -> None:
        board.tick(worker, clock)
        while closes(board):
            board.close()

    for clock in range(50):
        tick(1, clock)
    for clock in range(10):
        tick(0, clock)
    assert board.open_clock == 10
    board.set_live([0])  # worker 1 declared dead
    for clock in range(10, 20):
        tick(0, clock)
    assert board.open_clock == 20
    assert board.restart(1, 2, 0.0) == 50
    board.set_live([0, 1])
    for clock in range(20, 50):
        tick(0, clock)
    assert board.open_clock == 50 and board.held() == 0
    tick(0, 50)
    assert board.open_clock == 50  # from its clock on, worker 1 counts again
    tick(1, 50)
    assert board.open_clock == 51


def test_an_acknowledgement_finishes_the_open_clock_only_for_its_worker() -> None:
    board = ClockBoard(Quorum(2))
    board.restore_meta({"open_clock": 20, "clocks": {"0": 20, "1": 20}, "live": [0, 1]}, 0)
    assert board.acked(0, 30)
    assert not board.acked(0, 25)  # never backwards
    assert board.finished == {0} and not closes(board)  # worker 1 still owes clock 20
    board.tick(1, 20)
    assert closes(board)
    board.close()
    assert board.open_clock == 21 and board.finished == {0}  # worker 0 is through 21 too
