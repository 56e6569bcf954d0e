"""The heartbeat thread against a recording store, with its sleep and wall clock scripted.

No Redis: the store records what would have been written. The scripted sleep decides how
many beats the thread makes, so every count below is exact.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from scheduler.heartbeat import Heartbeat
from scheduler.store import Keys


class RecordingStore:
    """The two JobStore calls a heartbeat makes, recorded; `down` beats raise as in an outage."""

    def __init__(self, down: frozenset[int] = frozenset()) -> None:
        self.keys = Keys("job")
        self.down = down
        self.calls = 0
        self.beats: list[tuple[str, int, dict[str, Any], float, dict[str, Any]]] = []
        self.names: list[str] = []  # the connection name each beat gave
        self.forgotten: list[tuple[str, int]] = []
        self.hung_up = 0
        self.forget_down = False

    def beat(self, role: str, ident: int, payload: dict[str, Any], ttl_s: float,
             registration: dict[str, Any], name: str = "") -> None:
        self.calls += 1
        if self.calls in self.down:
            raise redis.exceptions.ConnectionError("connection refused")
        self.beats.append((role, ident, dict(payload), ttl_s, dict(registration)))
        self.names.append(name)

    def forget(self, role: str, ident: int, *, hang_up: bool = False) -> None:
        if self.forget_down:
            raise redis.exceptions.TimeoutError("timed out")
        self.forgotten.append((role, ident))
        self.hung_up += hang_up


class ScriptedSleep:
    """Lets the thread beat `beats` more times, then tells it to stop; records each wait."""

    def __init__(self, beats: int) -> None:
        self.left = beats
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.left -= 1
        return self.left < 0


def wall_clock(start: float = 1000.0) -> Iterator[float]:
    t = start
    while True:
        yield t
        t += 0.5


def heartbeat(store: RecordingStore, **kw: Any) -> Heartbeat:
    clock = wall_clock()
    fields: dict[str, Any] = {
        "interval_s": 1.5, "ttl_s": 4.5, "payload": lambda: {"open_clock": 7},
        "registration": {"address": "a:1", "incarnation": 2},
        "wall_clock": lambda: next(clock),
    }
    return Heartbeat(store, "worker", 3, **{**fields, **kw})  # type: ignore[arg-type]


def beating(role: str, ident: int) -> bool:
    return any(t.name == f"heartbeat-{role}{ident}" for t in threading.enumerate())


@pytest.mark.parametrize("more", [0, 1, 4])
def test_beats_at_start_then_once_per_interval(more: int) -> None:
    store = RecordingStore()
    sleep = ScriptedSleep(more)
    hb = heartbeat(store, sleep=sleep)
    hb.start()
    hb.stop(forget=False)
    assert not beating("worker", 3)
    assert sleep.waits == [1.5] * (more + 1)
    assert store.beats == [
        ("worker", 3, {"open_clock": 7, "time": 1000.0 + 0.5 * i}, 4.5,
         {"address": "a:1", "incarnation": 2})
        for i in range(more + 1)
    ]
    assert store.forgotten == []


def test_a_registration_update_reaches_the_next_beat_only() -> None:
    store = RecordingStore()
    registration = {"address": "a:1", "incarnation": 2}
    hb = heartbeat(store, registration=registration)
    hb.beat()
    hb.update_registration(address="b:2")
    hb.beat()
    assert [b[4]["address"] for b in store.beats] == ["a:1", "b:2"]
    assert registration == {"address": "a:1", "incarnation": 2}  # the caller's dict is kept


def test_each_beat_names_its_connection_after_the_incarnation_and_stop_hangs_up() -> None:
    # The failure detector tells a paused process (its named connection open) from one that
    # exited (closed) by these names; a restarted process beats under a name of its own.
    store = RecordingStore()
    hb = heartbeat(store, sleep=ScriptedSleep(1))
    hb.start()
    hb.update_registration(incarnation=5)
    hb.beat()
    hb.stop()
    assert store.names[0] == "pstrain:job:worker:3:2"
    assert store.names[-1] == "pstrain:job:worker:3:5"
    assert store.forgotten == [("worker", 3)] and store.hung_up == 1


def test_a_failing_hook_is_logged_and_beating_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    store = RecordingStore()
    hooked: list[int] = []

    def on_beat() -> None:
        hooked.append(len(store.beats))
        if len(hooked) == 1:
            raise RuntimeError("hook broke")

    hb = heartbeat(store, sleep=ScriptedSleep(3), on_beat=on_beat)
    with caplog.at_level(logging.ERROR, logger="scheduler.heartbeat"):
        hb.start()
        hb.stop()
    assert hooked == [2, 3, 4]  # after each beat of the thread, not the one at start
    assert len(store.beats) == 4
    assert "worker 3: heartbeat hook failed" in caplog.text and "hook broke" in caplog.text


def test_a_redis_outage_is_ridden_out() -> None:
    store = RecordingStore(down=frozenset({1, 3}))  # the beat at start and the second one
    hb = heartbeat(store, sleep=ScriptedSleep(3))
    hb.start()  # does not raise
    hb.stop()
    assert store.calls == 4
    assert [b[2]["time"] for b in store.beats] == [1000.5, 1001.5]
    assert store.forgotten == [("worker", 3)]


@pytest.mark.parametrize(("forget", "down", "forgotten"),
                         [(True, False, [("worker", 3)]), (False, False, []), (True, True, [])])
def test_stop_deletes_the_key_when_asked(forget: bool, down: bool,
                                         forgotten: list[tuple[str, int]]) -> None:
    store = RecordingStore()
    store.forget_down = down
    hb = heartbeat(store, sleep=ScriptedSleep(0))
    hb.start()
    hb.stop(forget=forget)  # an outage here is ridden out too
    assert store.forgotten == forgotten


def test_stop_interrupts_the_wait_between_beats() -> None:
    store = RecordingStore()
    hb = heartbeat(store, interval_s=3600.0, sleep=None)
    hb.start()
    started = time.monotonic()
    hb.stop()  # joins for at most 5 s
    assert not beating("worker", 3)
    assert time.monotonic() - started < 5
    assert len(store.beats) == 1
