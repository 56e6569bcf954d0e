"""The consistency policies, table-driven: a frozen view in, SERVE / WAIT / DROP out."""

from __future__ import annotations

import pytest

from protos import modes
from protos.modes import Kind, Mode
from ps.consistency import (
    AsyncPolicy,
    ClockView,
    Decision,
    SSPPolicy,
    SyncPolicy,
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
