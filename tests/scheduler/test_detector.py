"""The failure detector: its rule as tables with a fake clock, then real jobs whose workers
are paused (SIGSTOP) beside a CPU hog or not, run by `pstrain up` with a real redis-server.

A paused process keeps its Redis connection open; a killed one loses it at once. The rule:
a lapsed heartbeat makes a process suspect; it is dead once its connection is gone, or after
`suspect_timeout_s` as a suspect.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from beats import live_beats, worker_clock
from procs import REPO, Proc, Procs, wait_until

from scheduler.detector import FailureDetector, Health, Notice, Suspicions
from scheduler.membership import MembershipTracker, Transition
from scheduler.store import JobStore

JOB_WORKER = str(REPO / "tests" / "job_worker.py")
sys.path.insert(0, str(REPO / "tests"))

from job_worker import local_sync_run  # noqa: E402

# ---- the rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("silent_s", "connected", "timeout_s", "health"),
    [
        (None, None, 10.0, Health.ALIVE),  # it beats
        (None, False, 10.0, Health.ALIVE),  # beating decides, whatever the connections say
        (0.0, True, 10.0, Health.SUSPECT),  # just lapsed, its process still connected
        (0.0, None, 10.0, Health.SUSPECT),  # just lapsed, connections not known
        (0.0, False, 10.0, Health.DEAD),  # lapsed and its connection closed: it exited
        (9.9, True, 10.0, Health.SUSPECT),  # a long pause, still within the timeout
        (10.0, True, 10.0, Health.DEAD),  # silent past the timeout: dead, connected or not
        (10.0, None, 10.0, Health.DEAD),
        (0.0, True, 0.0, Health.DEAD),  # timeout 0: dead at the lapse (no suspicion)
    ],
)
def test_health(silent_s: float | None, connected: bool | None, timeout_s: float,
                health: Health) -> None:
    assert FailureDetector(timeout_s).health(silent_s, connected) is health


Poll = tuple[float, dict[int, int | None], dict[int, bool | None]]


def run_polls(polls: list[Poll], timeout_s: float = 10.0
              ) -> Iterator[tuple[list[Notice], list[Transition]]]:
    """Drives the detector and the membership tracker as the scheduler does, one poll at a
    time with the given fake times: (now, heartbeats seen, connections found)."""
    tracker = MembershipTracker()
    suspicions = Suspicions(FailureDetector(timeout_s))
    for now, observed, connected in polls:
        probe = suspicions.to_probe(observed, tracker.alive)
        assert set(probe) <= set(connected), f"at {now}: the probe asked for {probe}"
        judged, notices = suspicions.judge(observed, tracker.alive, now,
                                           {m: connected[m] for m in probe})
        transitions = tracker.update(judged)
        for dead in (t for t in transitions if t.kind == "dead"):
            tracker.fence(dead.member, dead.incarnation)
        yield notices, transitions


def suspect(member: int, incarnation: int) -> Notice:
    return Notice("suspect", member, incarnation)


def cleared(member: int, incarnation: int, silent_s: float) -> Notice:
    return Notice("cleared", member, incarnation, silent_s)


def t(kind: str, member: int, incarnation: int, previous: int = 0) -> Transition:
    return Transition(kind, member, incarnation, previous)


# Each case: polls (fake time, heartbeats seen, connections found) and, per poll, the
# suspicions and membership transitions it gives.
@pytest.mark.parametrize(
    ("polls", "expected"),
    [
        pytest.param(
            [(0.0, {0: 5}, {}), (1.5, {0: None}, {0: False})],
            [([], [t("joined", 0, 5)]), ([], [t("dead", 0, 5)])],
            id="killed: dead at the lapse, never suspect",
        ),
        pytest.param(
            [(0.0, {0: 5}, {}), (1.5, {0: None}, {0: True}), (4.0, {0: None}, {0: True}),
             (6.0, {0: 5}, {}), (6.5, {0: 5}, {})],
            [([], [t("joined", 0, 5)]), ([suspect(0, 5)], []), ([], []),
             ([cleared(0, 5, 4.5)], []), ([], [])],
            id="paused 3x the TTL: suspect, then cleared; never dead",
        ),
        pytest.param(
            [(0.0, {0: 5}, {}), (1.5, {0: None}, {0: True}), (11.4, {0: None}, {0: True}),
             (11.5, {0: None}, {0: True}), (13.0, {0: 5}, {}), (14.0, {0: 6}, {})],
            [([], [t("joined", 0, 5)]), ([suspect(0, 5)], []), ([], []),
             ([], [t("dead", 0, 5)]), ([], [t("refused", 0, 5)]), ([], [t("joined", 0, 6)])],
            id="paused past the timeout: dead; back as itself it is refused; a restart joins",
        ),
        pytest.param(
            [(0.0, {0: 5}, {}), (1.5, {0: None}, {0: True}), (3.0, {0: None}, {0: False})],
            [([], [t("joined", 0, 5)]), ([suspect(0, 5)], []), ([], [t("dead", 0, 5)])],
            id="suspect, then its connection closes: dead then",
        ),
        pytest.param(
            [(0.0, {0: 5}, {}), (1.5, {0: None}, {0: None}), (11.0, {0: None}, {0: None}),
             (11.5, {0: None}, {0: None})],
            [([], [t("joined", 0, 5)]), ([suspect(0, 5)], []), ([], []),
             ([], [t("dead", 0, 5)])],
            id="connections not known: dead after the timeout only",
        ),
        pytest.param(
            [(0.0, {0: 5, 1: 2}, {}), (1.5, {0: None, 1: 2}, {0: True}),
             (2.0, {0: 6, 1: None}, {1: False})],
            [([], [t("joined", 0, 5), t("joined", 1, 2)]), ([suspect(0, 5)], []),
             ([], [t("restored", 0, 6, 5), t("dead", 1, 2)])],
            id="a suspect replaced by a new incarnation is restored, not cleared",
        ),
        pytest.param(
            [(0.0, {0: None}, {}), (5.0, {0: None}, {}), (20.0, {0: 1}, {})],
            [([], []), ([], []), ([], [t("joined", 0, 1)])],
            id="never seen alive: pending, neither suspect nor dead",
        ),
    ],
)
def test_polls(polls: list[Poll],
               expected: list[tuple[list[Notice], list[Transition]]]) -> None:
    assert list(run_polls(polls)) == expected


def test_timeout_zero_is_the_old_rule() -> None:
    polls: list[Poll] = [(0.0, {0: 5}, {}), (1.5, {0: None}, {0: True})]
    assert list(run_polls(polls, timeout_s=0.0)) == [([], [t("joined", 0, 5)]),
                                                     ([], [t("dead", 0, 5)])]


def test_a_reset_counts_silence_again() -> None:
    # While Redis was down its lapses said nothing: the timeout starts again once they do.
    suspicions = Suspicions(FailureDetector(10.0))
    alive = {0: 5}
    assert suspicions.judge({0: None}, alive, 1.0, {0: True}) == ({}, [suspect(0, 5)])
    suspicions.reset()
    assert suspicions.judge({0: None}, alive, 11.5, {0: True}) == ({}, [suspect(0, 5)])
    assert suspicions.judge({0: None}, alive, 21.5, {0: True}) == ({0: None}, [])


# ---- real jobs -----------------------------------------------------------------------------------

STEPS = 500
TTL_S = 1.5  # the default heartbeat: every 0.5 s, 3 misses


def up_job(procs: Procs, redis: str, job: str, extra: list[str] | None = None) -> Proc:
    return procs.pstrain([
        "up", "--redis", redis, "--job", job, "--servers", "2", "--workers", "2", "--mode",
        "sync", "--no-tls", "--no-view", "--log-dir", str(procs.workdir / "logs"),
        *(extra or []), JOB_WORKER, "--", "--steps", str(STEPS), "--sleep-ms", "20", "--out",
        str(procs.workdir / "out")], "up")


def wait_training(up: Proc, store: JobStore) -> None:
    """Waits until worker 1 is past clock 40; fails at once, with its log, if `up` ended."""
    def running() -> bool:
        assert up.popen.poll() is None, up.log()[-5000:]
        return worker_clock(store, 1) >= 40

    wait_until(running, 150, "training to run")


def pause(store: JobStore, rank: int, seconds: float) -> int:
    """SIGSTOPs worker `rank`'s script process for `seconds`, then SIGCONTs it; its pid."""
    pid = int(live_beats(store, "worker", [rank])[rank]["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    return pid


def final_line(up: Proc) -> dict[str, Any]:
    """`pstrain up`'s last line: the job's result."""
    line = up.log().strip().splitlines()[-1]
    result: dict[str, Any] = json.loads(line)
    return result


def events(store: JobStore, kind: str, role: str | None = None) -> list[Any]:
    return [e for e in store.events(count=100_000)
            if e.type == kind and (role is None or e.role == role)]


def assert_single_process_result(procs: Procs) -> None:
    expected = local_sync_run(2, STEPS)
    for r in range(2):
        result = json.loads((procs.workdir / "out" / f"worker{r}.json").read_text())
        assert result["clock"] == STEPS
        torch.testing.assert_close(torch.tensor(result["w"]), expected, atol=1e-6, rtol=0)


def hog(procs: Procs, count: int = 2, seconds: float = 150.0) -> list[Proc]:
    """`count` busy loops (as many as the machine's cores here), each ending by itself after
    `seconds`; the test ends them by pid before that."""
    loop = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    return [procs.spawn([sys.executable, "-c", loop], f"hog{k}") for k in range(count)]


def paused_job_keeps_its_result(procs: Procs, job: str, hogs: int) -> None:
    redis = procs.redis().address
    hogging = hog(procs, hogs) if hogs else []
    try:
        up = up_job(procs, redis, job)
        store = JobStore.connect(redis, job)
        wait_training(up, store)
        pause(store, 1, 3 * TTL_S)
        assert up.popen.wait(timeout=150) == 0, up.log()[-5000:]
    finally:
        for proc in hogging:
            procs.kill(proc)
    assert [e.detail for e in events(store, "suspect", "worker")] and all(
        e.member == "1" for e in events(store, "suspect", "worker"))
    assert [e.member for e in events(store, "cleared", "worker")] == ["1"]
    # `up` stops the servers once the workers are done: deaths before that are false ones.
    done = min((procs.workdir / "out" / f"worker{r}.json").stat().st_mtime for r in range(2))
    false = [(e.role, e.member, e.detail) for e in events(store, "dead") if e.time_s < done]
    assert not false
    result = final_line(up)
    assert result["exit_status"] == 0 and result["restarts"] == {}
    assert result["membership_changes"] == []
    assert result["suspicions"]["worker:1"] == 1
    assert_single_process_result(procs)


@pytest.mark.timeout(240)
def test_a_sync_worker_paused_for_3x_the_ttl_is_suspect_not_dead(procs: Procs) -> None:
    paused_job_keeps_its_result(procs, "pause", hogs=0)


@pytest.mark.timeout(240)
def test_under_a_cpu_hog_a_paused_worker_and_the_rest_see_no_false_death(procs: Procs) -> None:
    paused_job_keeps_its_result(procs, "hogged", hogs=2)


@pytest.mark.timeout(240)
def test_a_worker_paused_past_its_death_restarts_and_the_result_reports_it(
        procs: Procs) -> None:
    redis = procs.redis().address
    suspect_s = 3.0  # shorter than the default (the rule, not its default, is under test)
    up = up_job(procs, redis, "fenced", ["--suspect-timeout-s", str(suspect_s)])
    store = JobStore.connect(redis, "fenced")
    wait_training(up, store)
    first = int(live_beats(store, "worker", [1])[1]["incarnation"])
    # Paused past the suspicion the settings allow: declared dead, then resumed.
    pause(store, 1, TTL_S + suspect_s + 2.0)
    assert up.popen.wait(timeout=150) == 0, up.log()[-5000:]
    dead = [e for e in events(store, "dead", "worker") if e.member == "1"]
    assert [e.detail["incarnation"] for e in dead] == [first]
    # Back as itself it was kept out, and it restarted as a new incarnation.
    joined = [int(e.detail["incarnation"]) for e in events(store, "joined", "worker")
              if e.member == "1"]
    assert joined[0] == first and len(joined) == 2 and joined[1] > first
    assert store.fenced_workers() == {1: first}
    log = (procs.workdir / "logs" / "worker1.log").read_text(errors="replace")
    assert "was declared dead" in log and "exiting to be restarted" in log
    result = final_line(up)
    assert result["restarts"] == {"worker1": 1}
    changes = [(c["worker"], c["change"], c["incarnation"]) for c in result["membership_changes"]]
    assert changes == [(1, "dead", first), (1, "joined", joined[1])]
    left_at, back_at = (c["clock"] for c in result["membership_changes"])
    assert 40 <= left_at <= back_at <= STEPS
    assert "its result is not the single-process one" in up.log()
    for r in range(2):
        done = json.loads((procs.workdir / "out" / f"worker{r}.json").read_text())
        assert done["clock"] == STEPS
    # `pstrain status` says the same.
    shown = subprocess.run([sys.executable, "-m", "scheduler.cli", "status", "--redis", redis,
                            "--job", "fenced", "--json"], capture_output=True, text=True,
                           cwd=REPO, timeout=60, check=True)
    status = json.loads(shown.stdout)
    assert status["membership_changes"] == result["membership_changes"]
    text = subprocess.run([sys.executable, "-m", "scheduler.cli", "status", "--redis", redis,
                           "--job", "fenced"], capture_output=True, text=True, cwd=REPO,
                          timeout=60, check=True).stdout
    assert f"worker 1 left (dead) at clock {left_at}" in text
    assert f"worker 1 joined at clock {back_at}" in text
