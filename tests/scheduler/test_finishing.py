"""Finished workers and barriers: the pure rules, as tables of cases."""

from __future__ import annotations

import pytest

from scheduler.finishing import Departures, barrier_missing


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
