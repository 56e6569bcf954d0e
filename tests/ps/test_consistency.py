"""The consistency policies, table-driven: a frozen view in, SERVE / WAIT / DROP out."""

from __future__ import annotations

import pytest

from protos import modes
from protos.modes import Kind, Mode
from ps.consistency import (
    AsyncPolicy,
    ClockView,
    Decision,
    Policy,
    SSPPolicy,
    SyncPolicy,
    Waiters,
    make_policy,
)
from ps.errors import InvalidArgumentError

SERVE, WAIT, DROP = Decision.SERVE, Decision.WAIT, Decision.DROP


def view(clock: int = 0, min_live: int = 0, open_clock: int = 0, contributors: int = 0,
         quorum: int = 3, mine: bool = False) -> ClockView:
    return ClockView(worker=0, clock=clock, min_live_clock=min_live, open_clock=open_clock,
                     contributors=contributors, quorum=quorum, is_contributor=mine)


@pytest.mark.parametrize(
    ("v", "push", "pull"),
    [
        (view(clock=0, open_clock=0), SERVE, SERVE),
        (view(clock=5, open_clock=0), WAIT, WAIT),  # ahead of the open clock
        (view(clock=2, open_clock=3), DROP, SERVE),  # its clock closed without it
        (view(clock=3, open_clock=3, contributors=2), SERVE, SERVE),  # a slot is free
        (view(clock=3, open_clock=3, contributors=3), DROP, SERVE),  # quorum full: backup
        (view(clock=3, open_clock=3, contributors=3, mine=True), SERVE, SERVE),  # already in
        (view(clock=4, open_clock=3, contributors=3), WAIT, WAIT),  # pull needs 3 closed
    ],
)
def test_sync(v: ClockView, push: Decision, pull: Decision) -> None:
    assert SyncPolicy().on_push(v) is push
    assert SyncPolicy().on_pull(v) is pull


@pytest.mark.parametrize(
    ("contributors", "finished", "quorum", "closes"),
    [(3, 3, 3, True), (3, 2, 3, False), (2, 2, 3, False), (2, 2, 2, True), (0, 0, 1, False)],
)
def test_sync_closes(contributors: int, finished: int, quorum: int, closes: bool) -> None:
    assert SyncPolicy.closes(contributors, finished, quorum) is closes


@pytest.mark.parametrize(
    ("staleness", "clock", "min_live", "pull"),
    [
        (2, 5, 3, SERVE),  # exactly at the bound
        (2, 5, 2, WAIT),  # one past it
        (0, 4, 4, SERVE),  # lock-step
        (0, 4, 3, WAIT),
        (3, 1, 0, SERVE),  # early clocks never wait
    ],
)
def test_ssp(staleness: int, clock: int, min_live: int, pull: Decision) -> None:
    policy = SSPPolicy(staleness)
    v = view(clock=clock, min_live=min_live)
    assert policy.on_pull(v) is pull
    assert policy.on_push(v) is SERVE  # pushes always apply at once


@pytest.mark.parametrize("v", [view(), view(clock=100, min_live=0), view(clock=0, open_clock=9)])
def test_async_never_waits(v: ClockView) -> None:
    assert AsyncPolicy().on_pull(v) is SERVE and AsyncPolicy().on_push(v) is SERVE


@pytest.mark.parametrize(
    ("mode", "default", "expected"),
    [
        ("sync", 4, Mode(Kind.SYNC)),
        ("async", 4, Mode(Kind.ASYNC)),
        ("ssp", 4, Mode(Kind.SSP, 4)),  # the bound left to the default
        ("ssp:2", 4, Mode(Kind.SSP, 2)),  # its own bound wins
        ("ssp:0", 4, Mode(Kind.SSP, 0)),
    ],
)
def test_make_policy(mode: str, default: int, expected: Mode) -> None:
    policy = make_policy(modes.parse(mode), default_staleness=default)
    assert policy.mode == expected
    assert make_policy(policy.mode).mode == expected  # a filled-in mode makes the same one


def test_make_policy_rejects_a_negative_default_bound() -> None:
    with pytest.raises(InvalidArgumentError, match="must be an int >= 0, got -1"):
        make_policy(modes.SSP, default_staleness=-1)
    with pytest.raises(InvalidArgumentError, match="staleness must be >= 0, got -2"):
        SSPPolicy(-2)
    assert make_policy(modes.SYNC, default_staleness=-1).mode == modes.SYNC  # unused there


# What the executor does around each policy's answers; it never asks which class it holds.
@pytest.mark.parametrize(
    ("policy", "aggregates", "pull_waits", "hogwild", "records_pulls"),
    [
        (SyncPolicy(), True, True, False, False),
        (SSPPolicy(0), False, True, False, True),
        (SSPPolicy(3), False, True, False, True),
        (AsyncPolicy(), False, False, True, False),
    ],
)
def test_what_the_executor_needs(
    policy: Policy, aggregates: bool, pull_waits: bool, hogwild: bool, records_pulls: bool
) -> None:
    assert (policy.aggregates, policy.pull_waits, policy.hogwild, policy.records_pulls) == (
        aggregates, pull_waits, hogwild, records_pulls
    )


@pytest.mark.parametrize("policy", [SyncPolicy(), SSPPolicy(0), SSPPolicy(2), AsyncPolicy()])
def test_a_policy_that_never_waits_says_so(policy: Policy) -> None:
    # pull_waits False lets the executor skip the clocks: on_pull must then never say WAIT.
    views = [view(clock=c, min_live=m, open_clock=o) for c in range(4) for m in range(4)
             for o in range(4)]
    assert policy.pull_waits is any(policy.on_pull(v) is WAIT for v in views)


@pytest.mark.parametrize("policy", [SyncPolicy(), SSPPolicy(2), AsyncPolicy()])
@pytest.mark.parametrize(
    ("contributors", "finished", "quorum", "closes"),
    [(3, 3, 3, True), (3, 2, 3, False), (2, 2, 3, False), (2, 2, 2, True), (0, 0, 1, False),
     (4, 4, 3, True)],
)
def test_every_policy_closes_a_clock_on_a_finished_quorum(
    policy: Policy, contributors: int, finished: int, quorum: int, closes: bool
) -> None:
    assert policy.closes(contributors, finished, quorum) is closes


WAITERS = Waiters(clocks=((0, 3), (1, 1), (2, 2)), finished=frozenset({0}))


@pytest.mark.parametrize(
    ("policy", "v", "text"),
    [
        # Sync names who has not finished the open clock, whatever their clocks: worker 2
        # (pushed ahead to clock 2) too, though it is not behind the pull's clock.
        (SyncPolicy(), view(clock=2, open_clock=1, contributors=1, quorum=3),
         "pull of sync table 'w' by worker 0 at clock 2 needs clock 1 closed, but clock 1 is "
         "open (1 of quorum 3 counted); waiting for workers 1 (clock 1), 2 (clock 2)"),
        (SSPPolicy(1), view(clock=3, min_live=1),
         "pull of ssp table 'w' by worker 0 at clock 3 needs every live worker at clock >= 2 "
         "(staleness 1); waiting for workers 1 (clock 1)"),
        (SSPPolicy(0), view(clock=3, min_live=1),
         "pull of ssp table 'w' by worker 0 at clock 3 needs every live worker at clock >= 3 "
         "(staleness 0); waiting for workers 1 (clock 1), 2 (clock 2)"),
        (AsyncPolicy(), view(clock=3), "async pulls never wait"),
    ],
)
def test_pull_wait_explanations(policy: Policy, v: ClockView, text: str) -> None:
    assert text in policy.explain_pull_wait("w", v, WAITERS)


@pytest.mark.parametrize(
    ("policy", "v", "text"),
    [
        (SyncPolicy(), view(clock=2, open_clock=1),
         "push to sync table 'w' by worker 0 for clock 2 needs clock 1 closed first; waiting "
         "for workers 1 (clock 1), 2 (clock 2)"),
        (SSPPolicy(1), view(clock=2), "its mode never holds pushes back"),
        (AsyncPolicy(), view(clock=2), "its mode never holds pushes back"),
    ],
)
def test_push_wait_explanations(policy: Policy, v: ClockView, text: str) -> None:
    assert text in policy.explain_push_wait("w", v, WAITERS)


def test_an_explanation_with_nobody_to_name_says_why() -> None:
    everyone_done = Waiters(clocks=((0, 1), (1, 1)), finished=frozenset({0, 1}))
    text = SyncPolicy().explain_pull_wait("w", view(clock=1, open_clock=0), everyone_done)
    assert text.endswith("waiting for workers none (the quorum is waiting on ticks in flight)")


@pytest.mark.parametrize(
    ("clocks", "finished", "unfinished", "behind_2"),
    [
        (((0, 3), (1, 1), (2, 2)), {0}, [(1, 1), (2, 2)], [(1, 1)]),
        (((0, 0),), set(), [(0, 0)], [(0, 0)]),
        ((), set(), [], []),
        (((4, 2), (5, 2)), {4, 5, 9}, [], []),  # a finished worker that left counts nowhere
    ],
)
def test_waiters(clocks: tuple[tuple[int, int], ...], finished: set[int],
                 unfinished: list[tuple[int, int]], behind_2: list[tuple[int, int]]) -> None:
    w = Waiters(clocks, frozenset(finished))
    assert w.unfinished() == unfinished and w.behind(2) == behind_2
