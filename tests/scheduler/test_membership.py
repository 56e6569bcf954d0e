"""The membership rule as a transition table: (what is known, what one poll observes) ->
(the events published, what is known after).

The tracker keeps no time of its own: a member is observed dead when its heartbeat key has
lapsed in Redis (its time to live ran out, `heartbeat_misses` beats missed), so time enters
only as the sequence of polls. An observation maps member -> incarnation, or None where the
heartbeat has lapsed.
"""

from __future__ import annotations

import pytest

from scheduler.membership import MembershipTracker, Transition

Observed = dict[int, int | None]


def joined(member: int, incarnation: int) -> Transition:
    return Transition("joined", member, incarnation)


def dead(member: int, incarnation: int) -> Transition:
    return Transition("dead", member, incarnation)


def restored(member: int, incarnation: int, previous: int) -> Transition:
    return Transition("restored", member, incarnation, previous)


@pytest.mark.parametrize(
    ("alive", "was_dead", "observed", "events", "alive_after", "dead_after"),
    [
        # A first beat: the member joins.
        ({}, set(), {0: 1}, [joined(0, 1)], {0: 1}, set()),
        # Beating on under the same incarnation: nothing to say.
        ({0: 1}, set(), {0: 1}, [], {0: 1}, set()),
        # Its heartbeat lapsed: dead, with the incarnation that died.
        ({0: 3}, set(), {0: None}, [dead(0, 3)], {}, {0}),
        # Never seen alive and silent: pending, not dead (a starting job keeps its quorum).
        ({}, set(), {0: None}, [], {}, set()),
        # Dead already and still silent: no second event.
        ({}, {0}, {0: None}, [], {}, {0}),
        # A new incarnation beats in place of a live one: restored, naming both.
        ({0: 1}, set(), {0: 2}, [restored(0, 2, 1)], {0: 2}, set()),
        # A dead member beats again: it joins again, and is no longer dead.
        ({}, {0}, {0: 2}, [joined(0, 2)], {0: 2}, set()),
        # A member the poll did not ask about keeps its state.
        ({0: 1}, {5}, {1: 1}, [joined(1, 1)], {0: 1, 1: 1}, {5}),
        # Several at once: events in member order, whatever the order observed.
        ({1: 1, 2: 1}, set(), {3: 1, 2: None, 0: 4, 1: 2},
         [joined(0, 4), restored(1, 2, 1), dead(2, 1), joined(3, 1)], {0: 4, 1: 2, 3: 1}, {2}),
        # An empty poll changes nothing.
        ({0: 1}, {1}, {}, [], {0: 1}, {1}),
    ],
)
def test_one_poll(
    alive: dict[int, int], was_dead: set[int], observed: Observed, events: list[Transition],
    alive_after: dict[int, int], dead_after: set[int],
) -> None:
    tracker = MembershipTracker(dict(alive), set(was_dead))
    assert tracker.update(observed) == events
    assert tracker.alive == alive_after
    assert tracker.dead == dead_after


@pytest.mark.parametrize(
    "polls",
    [
        pytest.param(
            [
                ({0: None, 1: None}, []),  # the job is starting: nobody has beaten yet
                ({0: 1, 1: None}, [joined(0, 1)]),
                ({0: 1, 1: 1}, [joined(1, 1)]),
                ({0: 1, 1: 1}, []),
                ({0: None, 1: 1}, [dead(0, 1)]),  # worker 0's key lapsed
                ({0: None, 1: 1}, []),
                ({0: 2, 1: 1}, [joined(0, 2)]),  # restarted by its supervisor
            ],
            id="start-die-restart",
        ),
        pytest.param(
            [
                ({0: 1}, [joined(0, 1)]),
                ({0: 2}, [restored(0, 2, 1)]),  # restarted within one time to live
                ({0: 3}, [restored(0, 3, 2)]),
                ({0: None}, [dead(0, 3)]),
            ],
            id="quick-restarts",
        ),
    ],
)
def test_polls_in_sequence(polls: list[tuple[Observed, list[Transition]]]) -> None:
    tracker = MembershipTracker()
    for at, (observed, events) in enumerate(polls):
        assert tracker.update(observed) == events, f"poll {at}: {observed}"
