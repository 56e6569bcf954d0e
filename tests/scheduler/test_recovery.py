"""The scheduler's pure recovery rules, as tables of cases with a fake clock."""

from __future__ import annotations

import pytest

from scheduler.recovery import RedisWatch, next_generation, restarted, rollback_target


def watch() -> RedisWatch:
    return RedisWatch(settle_s=2.0, max_call_s=0.5)


# (what happens, at time, how long the call took) ... then: is a lapse believed at time t?
@pytest.mark.parametrize(("events", "at", "believed"), [
    ([], 10.0, False),  # never reached Redis
    ([("ok", 0.0, 0.01)], 1.9, False),  # not yet settled
    ([("ok", 0.0, 0.01), ("ok", 1.0, 0.01)], 2.0, True),  # settled
    ([("ok", 0.0, 0.01), ("failed", 1.0, 0.0)], 5.0, False),  # down
    ([("ok", 0.0, 0.01), ("failed", 1.0, 0.0), ("ok", 6.0, 0.01)], 7.9, False),  # just back
    ([("ok", 0.0, 0.01), ("failed", 1.0, 0.0), ("ok", 6.0, 0.01)], 8.0, True),
    ([("ok", 0.0, 0.01), ("ok", 5.0, 1.9)], 6.0, False),  # a call stalled: Redis was stopped
    ([("ok", 0.0, 0.01), ("ok", 5.0, 1.9)], 7.0, True),
    ([("ok", 0.0, 0.01), ("emptied", 5.0, 0.0)], 6.0, False),  # came back empty
    ([("ok", 0.0, 0.01), ("emptied", 5.0, 0.0), ("ok", 5.1, 0.01)], 7.0, True),
])
def test_lapses_are_believed_only_after_redis_settled(
        events: list[tuple[str, float, float]], at: float, believed: bool) -> None:
    w = watch()
    for kind, now, took in events:
        if kind == "ok":
            w.ok(now, took)
        elif kind == "failed":
            w.failed()
        else:
            w.emptied(now)
    assert w.trusts_lapses(at) is believed


def test_an_outage_is_reported_once_each_way() -> None:
    w = watch()
    assert w.ok(0.0, 0.01) is False
    assert [w.failed() for _ in range(50)] == [True] + [False] * 49
    assert w.ok(9.0, 0.01) is True
    assert w.ok(9.1, 0.01) is False


@pytest.mark.parametrize(("last_seen", "incarnation", "expected"), [
    (None, 5, False),  # first sight
    (5, 5, False),  # registered again (outage, empty Redis, new lease): not a restart
    (5, 6, True),  # a new process
])
def test_restarted(last_seen: int | None, incarnation: int, expected: bool) -> None:
    assert restarted(last_seen, incarnation) is expected


@pytest.mark.parametrize(("known", "expected"), [
    ([], 1),
    ([0, 0], 1),
    ([3, 0, 0], 4),  # Redis's count
    ([0, 3, 3], 4),  # Redis was wiped: the servers still hold generation 3
    ([0, 0, 5, 2], 6),  # this scheduler published 5 before the wipe
])
def test_next_generation_never_repeats(known: list[int], expected: int) -> None:
    assert next_generation(known) == expected


@pytest.mark.parametrize(("restored", "complete", "expected"), [
    ("", [], ""),  # nothing written yet: the initial state
    ("", [("clock-40", 40)], "clock-40"),  # the restarted one started empty, a checkpoint exists
    ("clock-40", [("clock-60", 60), ("clock-40", 40)], "clock-60"),  # the newest
    ("clock-40", [("clock-40", 40), ("clock-60", 60)], "clock-60"),  # relisted out of order
    ("clock-40", [], None),  # Redis came back empty: wait for it to be listed again
    ("clock-40", [("clock-20", 20)], None),
])
def test_rollback_target(restored: str, complete: list[tuple[str, int]],
                         expected: str | None) -> None:
    assert rollback_target(restored, complete) == expected
