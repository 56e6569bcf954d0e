"""The membership rule as a transition table: (what is known, what one poll observes) ->
(the events published, what is known after).

The tracker keeps no time of its own: a member is observed dead when the failure detector
confirmed its lapsed heartbeat (tests/scheduler/test_detector.py holds that rule's timing), so
time enters only as the sequence of polls. An observation maps member -> incarnation, or None
where the member is dead.
"""

from __future__ import annotations

import pytest

from scheduler.membership import MembershipTracker, Transition, describe_change, merged_changes

Observed = dict[int, int | None]


def joined(member: int, incarnation: int) -> Transition:
    return Transition("joined", member, incarnation)


def dead(member: int, incarnation: int) -> Transition:
    return Transition("dead", member, incarnation)


def restored(member: int, incarnation: int, previous: int) -> Transition:
    return Transition("restored", member, incarnation, previous)


def refused(member: int, incarnation: int) -> Transition:
    return Transition("refused", member, incarnation)


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


# With fencing (the scheduler's workers: it fences each one it declares dead), an incarnation
# declared dead never joins again.
@pytest.mark.parametrize(
    ("polls", "fenced_after"),
    [
        pytest.param(
            [
                ({0: 7}, [joined(0, 7)]),
                ({0: None}, [dead(0, 7)]),  # declared dead (the detector confirmed it)
                ({0: 7}, [refused(0, 7)]),  # it was only paused: it stays out, once said
                ({0: 7}, []),
                ({0: None}, []),
                ({0: 9}, [joined(0, 9)]),  # restarted: the new incarnation joins
            ],
            {0: 7}, id="paused-past-its-death-restarts",
        ),
        pytest.param(
            [
                ({0: 7, 1: 3}, [joined(0, 7), joined(1, 3)]),
                ({0: None, 1: 3}, [dead(0, 7)]),
                ({0: 6, 1: 3}, [refused(0, 6)]),  # an older incarnation is fenced too
                ({0: 8, 1: None}, [joined(0, 8), dead(1, 3)]),
                ({0: None, 1: None}, [dead(0, 8)]),  # fenced incarnations only grow
            ],
            {0: 8, 1: 3}, id="older-incarnations-and-several-members",
        ),
        pytest.param(
            [
                ({0: 5}, [joined(0, 5)]),
                ({0: 6}, [restored(0, 6, 5)]),  # a restart within the TTL fences nothing
            ],
            {}, id="restored-is-no-death",
        ),
    ],
)
def test_a_dead_incarnation_never_rejoins(
    polls: list[tuple[Observed, list[Transition]]], fenced_after: dict[int, int],
) -> None:
    tracker = MembershipTracker()
    for at, (observed, events) in enumerate(polls):
        transitions = tracker.update(observed)
        assert transitions == events, f"poll {at}: {observed}"
        for t in transitions:
            if t.kind == "dead":
                tracker.fence(t.member, t.incarnation)
    assert tracker.fenced == fenced_after


def test_a_fence_read_from_redis_takes_a_live_member_out() -> None:
    # A new leader reads the fences of the one before; a fenced process still beating is dead.
    tracker = MembershipTracker(alive={0: 4})
    assert tracker.fence(0, 4) and not tracker.fence(0, 3)
    assert tracker.update({0: 4}) == [dead(0, 4), refused(0, 4)]
    assert tracker.alive == {} and tracker.dead == {0}


def test_without_fencing_a_dead_member_joins_again() -> None:
    # Servers (a paused server keeps its state), and workers whose end was no death (finished,
    # restarting after a rollback): the same incarnation may come back.
    tracker = MembershipTracker()
    tracker.update({0: 4})
    tracker.update({0: None})
    assert tracker.update({0: 4}) == [joined(0, 4)] and tracker.fenced == {}


def change(t: float, worker: int, kind: str) -> dict[str, object]:
    return {"time": t, "clock": int(t), "worker": worker, "change": kind, "incarnation": 7}


@pytest.mark.parametrize(("known", "more", "merged"), [
    # Redis came back empty: what the scheduler remembers is all there is.
    ([change(1, 0, "dead"), change(2, 0, "joined")], [],
     [change(1, 0, "dead"), change(2, 0, "joined")]),
    # A new lease reads an earlier leader's records: each once, in time order.
    ([change(2, 0, "joined")], [change(1, 0, "dead"), change(2, 0, "joined")],
     [change(1, 0, "dead"), change(2, 0, "joined")]),
    ([change(3, 1, "dead")], [change(1, 0, "dead"), change(2, 0, "joined")],
     [change(1, 0, "dead"), change(2, 0, "joined"), change(3, 1, "dead")]),
])
def test_records_of_worker_changes_merge_once_each_in_time_order(
        known: list[dict[str, object]], more: list[dict[str, object]],
        merged: list[dict[str, object]]) -> None:
    assert merged_changes(known, more) == merged


def test_merged_records_keep_the_newest() -> None:
    many = [change(t, 0, "dead" if t % 2 else "joined") for t in range(10)]
    assert merged_changes(many[5:], many[:5], kept=3) == many[7:]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"worker": 1, "change": "dead", "clock": 40}, "worker 1 left (dead) at clock 40"),
        ({"worker": 1, "change": "joined", "clock": 52}, "worker 1 joined at clock 52"),
        ({"worker": 2, "change": "undone", "clock": 60, "checkpoint": 30},
         "worker 2's steps from clock 30 to 60 were undone by a rollback after it had "
         "finished and left"),
    ],
)
def test_a_change_of_the_workers_in_words(change: dict[str, object], words: str) -> None:
    assert describe_change(change) == words
