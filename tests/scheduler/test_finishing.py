"""Finished workers and barriers: the pure rules, as tables of cases."""

from __future__ import annotations

import pytest

from scheduler.finishing import Departures, barrier_missing, exit_record, finishes_past


@pytest.mark.parametrize(
    ("marked", "left", "alive", "beats", "departed"),
    [
        # Nothing finished: nobody departs, whatever the beats say.
        (set(), {}, {0: 10, 1: 11}, {0: 10, 1: None}, set()),
        # ctx.finish(): out at once, while it still beats under the incarnation that finished.
        ({1}, {1: 11}, {0: 10, 1: 11}, {0: 10, 1: 11}, {1}),
        # ... and after its beat has gone.
        ({1}, {1: 11}, {0: 10}, {0: 10, 1: None}, {1}),
        # A new process of a finished rank (started again, as --resume does) is a member.
        ({1}, {1: 11}, {0: 10, 1: 11}, {0: 10, 1: 99}, set()),
        # Exit status 0 without finish(): the process last seen alive is the one that ended.
        ({0}, {}, {0: 10, 1: 11}, {0: 10, 1: 11}, {0}),
        ({0}, {}, {0: 10, 1: 11}, {0: None, 1: 11}, {0}),
        # Marked before it was ever seen alive: out only while no process beats for it.
        ({0}, {}, {}, {0: None}, {0}),
        ({0}, {}, {}, {0: 12}, set()),
    ],
)
def test_departures(marked: set[int], left: dict[int, int], alive: dict[int, int],
                    beats: dict[int, int | None], departed: set[int]) -> None:
    d = Departures()
    d.update(marked, left, alive)
    assert d.departed(beats) == departed


def test_departures_survive_a_redis_that_came_back_empty() -> None:
    d = Departures()
    d.update({1}, {1: 11}, {0: 10, 1: 11})
    d.update(set(), {}, {0: 10})  # Redis lost the records
    assert d.departed({0: 10, 1: None}) == {1}


def test_a_later_finish_of_a_new_process_replaces_the_incarnation() -> None:
    d = Departures()
    d.update({1}, {1: 11}, {})
    assert d.departed({1: 12}) == set()
    d.update({1}, {1: 12}, {})
    assert d.departed({1: 12}) == {1}


@pytest.mark.parametrize(
    ("expected", "registered", "left", "arrived", "missing"),
    [
        # Everyone there under its current incarnation.
        ([0, 1], {0: 10, 1: 11}, {}, {0: 10, 1: 11}, []),
        # Rank 1 has not come.
        ([0, 1], {0: 10, 1: 11}, {}, {0: 10}, [1]),
        # Rank 1 finished: it is not waited for.
        ([0, 1], {0: 10, 1: 11}, {1: 11}, {0: 10}, []),
        # Dead (not expected): not waited for.
        ([0], {0: 10, 1: 11}, {}, {0: 10}, []),
        # Still starting (never registered): waited for.
        ([0, 1], {0: 10}, {}, {0: 10}, [1]),
        # An arrival or finish of an earlier process of the rank does not count.
        ([0, 1], {0: 10, 1: 12}, {}, {0: 10, 1: 11}, [1]),
        ([0, 1], {0: 10, 1: 12}, {1: 11}, {0: 10}, [1]),
        # Nobody expected: nothing to wait for.
        ([], {}, {}, {}, []),
        # Missing ranks in order.
        ([3, 0, 2], {0: 1, 2: 2, 3: 3}, {}, {}, [0, 2, 3]),
    ],
)
def test_barrier_missing(expected: list[int], registered: dict[int, int],
                         left: dict[int, int], arrived: dict[int, int],
                         missing: list[int]) -> None:
    assert barrier_missing(expected, registered, left, arrived) == missing


@pytest.mark.parametrize(
    ("left", "clock", "beating", "void", "undone"),
    [
        # A finish at or before the checkpoint's clock stands, beating or not.
        ({1: {"incarnation": 11, "clock": 30}}, 30, {1: 11}, {}, {}),
        ({1: {"incarnation": 11, "clock": 12}}, 30, {}, {}, {}),
        # Past it, still in ctx.finish(): void, it trains those steps again.
        ({1: {"incarnation": 11, "clock": 31}}, 30, {0: 10, 1: 11}, {1: 11}, {}),
        # Past it, its process gone (or another incarnation beats): steps lost, recorded.
        ({1: {"incarnation": 11, "clock": 60}}, 30, {0: 10}, {}, {1: 60}),
        ({1: {"incarnation": 11, "clock": 60}}, 30, {1: 12}, {}, {1: 60}),
        # A record without a clock (written before clocks were kept) stands.
        ({1: {"incarnation": 11}}, 30, {1: 11}, {}, {}),
        # Several at once, in rank order.
        ({2: {"incarnation": 12, "clock": 50}, 1: {"incarnation": 11, "clock": 40},
          0: {"incarnation": 10, "clock": 20}}, 30, {1: 11}, {1: 11}, {2: 50}),
    ],
)
def test_finishes_past_a_rollback_s_checkpoint(
    left: dict[int, dict[str, int]], clock: int, beating: dict[int, int],
    void: dict[int, int], undone: dict[int, int],
) -> None:
    assert finishes_past(left, clock, beating) == (void, undone)


def test_a_voided_finish_is_forgotten() -> None:
    departures = Departures()
    departures.update({1}, {1: 11}, {1: 11})
    departures.forget(1)
    departures.forget(2)  # never finished: nothing to forget
    assert departures.departed({1: 11}) == set()


EXITING = {"incarnation": 11, "clock": 60, "exiting": True}


@pytest.mark.parametrize(
    ("beat", "record", "voided", "written"),
    [
        # A script that returned: its last beat's clock is where it finished.
        (EXITING, None, None, {"incarnation": 11, "clock": 60, "time": 5.0, "exited": True}),
        # An earlier run's record of the rank is replaced.
        (EXITING, {"incarnation": 3, "clock": 9}, None,
         {"incarnation": 11, "clock": 60, "time": 5.0, "exited": True}),
        # It called ctx.finish(): its own record stands.
        (EXITING, {"incarnation": 11, "clock": 58}, None, None),
        # No beat, a beat not left at exit (its clock may be stale), or one without a clock.
        (None, None, None, None),
        ({"incarnation": 11, "clock": 60}, None, None, None),
        ({"incarnation": 11, "exiting": True}, None, None, None),
        # A rollback voided this process's finish: it may not record one again.
        (EXITING, None, 11, None),
        (EXITING, None, 10, {"incarnation": 11, "clock": 60, "time": 5.0, "exited": True}),
    ],
)
def test_the_record_of_a_script_that_returned_without_finishing(
    beat: dict[str, object] | None, record: dict[str, int] | None, voided: int | None,
    written: dict[str, object] | None,
) -> None:
    assert exit_record(beat, record, voided, 5.0) == written
