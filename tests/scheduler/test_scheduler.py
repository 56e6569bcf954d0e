"""The scheduler with real processes: death detection, quorum, rejoin, failover."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from beats import live_beats, live_server_pid, worker_clock
from damage import corrupt
from procs import REPO, Proc, Procs, wait_until

from ps.checkpoint import latest_complete, list_checkpoints
from scheduler.launcher import status_of
from scheduler.store import JobStore
from worker.client import PSClient

JOB_WORKER = str(REPO / "tests" / "job_worker.py")
sys.path.insert(0, str(REPO / "tests"))

from job_worker import local_sync_run  # noqa: E402


def start_job(procs: Procs, redis: str, job: str, mode: str, workers: int, servers: int = 1,
              extra: list[str] | None = None) -> list[Proc]:
    started = [procs.pstrain(["scheduler", "--redis", redis, "--job", job, "--mode", mode,
                              "--workers", str(workers), "--servers", str(servers),
                              *(extra or [])], "scheduler")]
    store = JobStore.connect(redis, job)
    wait_until(store.leader, 30, "a leader")
    for k in range(servers):
        started.append(procs.pstrain(["server", "--redis", redis, "--job", job, "--shard",
                                      str(k), "--bind", "127.0.0.1:0"], f"server{k}"))
    wait_until(lambda: all(store.heartbeats("server", list(range(servers))).values()), 60,
               "servers")
    return started


def start_worker(procs: Procs, redis: str, job: str, rank: int, out: Path, steps: int,
                 sleep_ms: float) -> Proc:
    return procs.pstrain(["worker", "--redis", redis, "--job", job, "--rank", str(rank),
                          JOB_WORKER, "--steps", str(steps), "--out", str(out),
                          "--sleep-ms", str(sleep_ms)], f"worker{rank}")


def open_clock(store: JobStore) -> int:
    beat = store.heartbeats("server", [0])[0]
    return int(beat["open_clock"]) if beat else -1


def event(store: JobStore, kind: str, role: str, member: int, after: float = 0.0) -> object:
    for e in store.events():
        if e.type == kind and e.role == role and e.member == str(member) and e.time_s >= after:
            return e
    return None


def test_worker_killed_in_sync_mode_shrinks_quorum_rejoins_and_stays_on_the_record(
        procs: Procs) -> None:
    redis_proc = procs.redis()
    redis = redis_proc.address
    store = JobStore.connect(redis, "kill")
    start_job(procs, redis, "kill", "sync", workers=3)
    out = procs.workdir / "out"
    steps = 260
    workers = [start_worker(procs, redis, "kill", r, out, steps, 20.0) for r in range(3)]
    wait_until(lambda: open_clock(store) >= 15, 60, "training to run")
    killed_at = time.time()
    procs.kill(workers[2], signal.SIGKILL)
    dead = wait_until(lambda: event(store, "dead", "worker", 2), 10, "the dead event")
    detection = dead.time_s - killed_at  # type: ignore[attr-defined]
    assert detection < 3.0, detection
    # The quorum shrank: clocks close without worker 2.
    clock = open_clock(store)
    wait_until(lambda: open_clock(store) >= clock + 5, 20, "clocks to close without worker 2")
    # The restarted worker rejoins under a new incarnation and the job finishes.
    again = start_worker(procs, redis, "kill", 2, out, steps, 20.0)
    joined = wait_until(lambda: event(store, "joined", "worker", 2, after=killed_at), 30,
                        "the rejoin")
    assert joined.detail["incarnation"] != dead.detail["incarnation"]  # type: ignore[attr-defined]
    # The record of the change (what `pstrain up` and `pstrain status` report: the result is
    # no longer the single-process one) outlives Redis restarted empty.
    wait_until(lambda: len(store.membership_changes()) == 2, 10, "the membership records")
    changes = store.membership_changes()
    assert [(c["worker"], c["change"]) for c in changes] == [(2, "dead"), (2, "joined")]
    port = redis_proc.port
    procs.kill(redis_proc, signal.SIGKILL)
    procs.redis(port=port)
    wait_until(lambda: store.spec() is not None, 30, "the scheduler to rebuild the job")
    assert store.membership_changes() == changes
    for proc in (workers[0], workers[1], again):
        assert proc.popen.wait(timeout=120) == 0, proc.log()
    finals = [json.loads((out / f"worker{r}.json").read_text()) for r in range(3)]
    assert {f["clock"] for f in finals} == {steps}
    assert finals[0]["w"] == finals[1]["w"] == finals[2]["w"]


def test_an_async_worker_that_ran_ahead_died_and_came_back_holds_no_clock_back(
        procs: Procs) -> None:
    # Worker 0 is paused while worker 1 runs ahead; worker 1 is killed and, while it is
    # out, worker 0 alone closes clocks. Worker 1's new incarnation comes back at its own
    # clock, far ahead: the server's open clock must not wait for its ticks of the clocks
    # that opened while it was out (it did, for good, keeping every later tick in memory).
    redis = procs.redis().address
    store = JobStore.connect(redis, "ahead")
    # Worker 0 is paused for seconds: suspect, never declared dead, even on a loaded machine.
    start_job(procs, redis, "ahead", "async", workers=2, extra=["--suspect-timeout-s", "60"])
    out = procs.workdir / "out"
    steps = 1500
    workers = [start_worker(procs, redis, "ahead", r, out, steps, 5.0) for r in range(2)]
    wait_until(lambda: min(worker_clock(store, r) for r in range(2)) >= 20, 60,
               "training to run")
    beats = live_beats(store, "worker", [0, 1])
    slow, fast = (int(beats[r]["pid"]) for r in (0, 1))  # the scripts, not `pstrain worker`
    os.kill(slow, signal.SIGSTOP)
    try:
        ran_ahead = worker_clock(store, 1) + 300
        wait_until(lambda: worker_clock(store, 1) >= ran_ahead, 30, "worker 1 to run ahead")
        killed_at = time.time()
        os.kill(fast, signal.SIGKILL)
        assert workers[1].popen.wait(timeout=30) != 0
        wait_until(lambda: event(store, "dead", "worker", 1, after=killed_at), 10,
                   "worker 1's death")
        alone_to = worker_clock(store, 0) + 5
        os.kill(slow, signal.SIGCONT)
        wait_until(lambda: worker_clock(store, 0) >= alone_to, 10, "worker 0 to step alone")
        # Still behind worker 1 when it comes back: the case under test.
        os.kill(slow, signal.SIGSTOP)
        assert worker_clock(store, 0) < ran_ahead
        again = start_worker(procs, redis, "ahead", 1, out, steps, 5.0)
        wait_until(lambda: event(store, "joined", "worker", 1, after=killed_at), 60,
                   "worker 1 to come back")
    finally:
        os.kill(slow, signal.SIGCONT)
    # Both train on, worker 0 past where worker 1 came back: the open clock follows worker
    # 0 (without the rule it stayed where worker 1 came back until worker 1 finished).
    wait_until(lambda: worker_clock(store, 0) >= ran_ahead + 50, 30,
               "worker 0 to pass where worker 1 came back")
    assert again.popen.poll() is None  # worker 1 still trains: the case under test
    wait_until(lambda: open_clock(store) >= ran_ahead, 5, f"server 0's clock to pass {ran_ahead}")
    for proc in (workers[0], again):
        assert proc.popen.wait(timeout=120) == 0, proc.log()
    assert {json.loads((out / f"worker{r}.json").read_text())["clock"] for r in range(2)} == {
        steps}


def test_standby_scheduler_takes_over_and_still_detects_deaths(procs: Procs) -> None:
    redis = procs.redis().address
    store = JobStore.connect(redis, "failover")
    leader, *_ = start_job(procs, redis, "failover", "async", workers=2)
    first = store.leader()
    standby = procs.pstrain(["scheduler", "--redis", redis, "--job", "failover", "--adopt"],
                            "standby")
    out = procs.workdir / "out"
    workers = [start_worker(procs, redis, "failover", r, out, 100_000, 10.0) for r in range(2)]
    wait_until(lambda: event(store, "joined", "worker", 1), 60, "worker 1 to join")
    procs.kill(leader, signal.SIGKILL)
    wait_until(lambda: store.leader() not in (None, first), 10, "the standby to lead")
    assert standby.popen.poll() is None
    killed_at = time.time()
    procs.kill(workers[1], signal.SIGKILL)
    wait_until(lambda: event(store, "dead", "worker", 1, after=killed_at), 10,
               "the new leader to see worker 1 die")


def test_spec_mismatch_is_refused_showing_both_values(procs: Procs) -> None:
    redis = procs.redis().address
    start_job(procs, redis, "clash", "sync", workers=2)
    server = procs.pstrain(["server", "--redis", redis, "--job", "clash", "--shard", "0",
                            "--bind", "127.0.0.1:0", "--mode", "async", "--num-shards", "3"],
                           "clash")
    assert server.popen.wait(timeout=30) == 2
    log = server.log()
    assert "mode: the job has 'sync', this process was given 'async'" in log
    assert "servers: the job has 1, this process was given 3" in log


def test_second_job_with_a_live_name_is_refused(procs: Procs) -> None:
    redis = procs.redis().address
    start_job(procs, redis, "taken", "async", workers=1)
    second = procs.pstrain(["scheduler", "--redis", redis, "--job", "taken"], "second")
    assert second.popen.wait(timeout=30) == 2
    assert "job 'taken' is running" in second.log()


@pytest.mark.alone  # bounds a duration that includes the interpreter's start-up
@pytest.mark.parametrize("role", ["scheduler", "server"])
def test_unreachable_redis_fails_within_5s_naming_the_url(procs: Procs, role: str) -> None:
    url = "redis://127.0.0.1:9/0"  # the discard port: nothing listens there
    args = ["scheduler", "--redis", url, "--job", "x"] if role == "scheduler" else [
        "server", "--redis", url, "--job", "x", "--bind", "127.0.0.1:0"]
    start = time.monotonic()
    proc = procs.pstrain(args, role)
    assert proc.popen.wait(timeout=30) == 2
    assert time.monotonic() - start < 5.0 + 4.0  # 5 s, plus interpreter start-up
    assert "cannot reach Redis at redis://127.0.0.1:9/0" in proc.log()


def test_redis_password_in_url(procs: Procs) -> None:
    redis = procs.redis(password="s3cret").address
    store = JobStore.connect(redis, "auth")
    assert store.spec() is None
    wrong = redis.replace("s3cret", "nope")
    proc = procs.pstrain(["scheduler", "--redis", wrong, "--job", "auth"], "wrong")
    assert proc.popen.wait(timeout=30) == 2
    assert "***" in proc.log() and "nope" not in proc.log()


def test_status_lists_processes_and_events(procs: Procs) -> None:
    redis = procs.redis().address
    start_job(procs, redis, "shown", "async", workers=1)
    out = procs.workdir / "out"
    start_worker(procs, redis, "shown", 0, out, 100_000, 10.0)
    store = JobStore.connect(redis, "shown")
    wait_until(lambda: event(store, "joined", "worker", 0), 60, "the worker")
    done = subprocess.run([sys.executable, "-m", "scheduler.cli", "status", "--redis", redis,
                           "--job", "shown", "--json"], capture_output=True, text=True,
                          cwd=REPO, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    roles = {(p["role"], p["id"]): p for p in status["processes"]}
    assert roles[("worker", 0)]["alive"] and roles[("server", 0)]["address"]
    assert roles[("worker", 0)]["heartbeat_age_s"] < 2
    assert any(e["type"] == "joined" for e in status["events"])


def test_status_shows_the_newest_events_of_a_long_stream(procs: Procs) -> None:
    store = JobStore.connect(procs.redis().address, "long")
    with store.redis.pipeline(transaction=False) as pipe:
        for i in range(5000):
            pipe.xadd(store.keys.events(), {"type": "checkpoint", "role": "server",
                                            "member": "0", "time": f"{i}.0",
                                            "detail": json.dumps({"checkpoint": f"c{i}"})})
        pipe.execute()
    store.event("checkpoint", "server", 1, checkpoint="newest", clock=9)
    shown = status_of(store, events=3)["events"]
    assert [e["checkpoint"] for e in shown] == ["c4998", "c4999", "newest"]
    assert shown[-1]["id"] != "newest" and shown[-1]["member"] == "1"


def pushes_applied(address: str) -> int:
    """Read straight from a server over gRPC: no Redis involved."""
    with PSClient([address]) as c:
        return sum(t.pushes_applied for t in c.stats()[0].tables)


def test_redis_outage_pauses_coordination_not_training(procs: Procs) -> None:
    redis_proc = procs.redis()
    redis = redis_proc.address
    port = redis_proc.port
    store = JobStore.connect(redis, "outage")
    started = start_job(procs, redis, "outage", "async", workers=2)
    address = str(live_beats(store, "server", [0])[0]["address"])
    out = procs.workdir / "out"
    workers = [start_worker(procs, redis, "outage", r, out, 1500, 10.0) for r in range(2)]
    # Both joined: a worker still starting when Redis goes cannot register, and exits.
    wait_until(lambda: all(event(store, "joined", "worker", r) for r in range(2)), 60,
               "the workers")
    procs.kill(redis_proc, signal.SIGKILL)
    before = pushes_applied(address)
    time.sleep(10)
    during = pushes_applied(address)
    assert during > before + 100, (before, during)  # training went on without Redis
    exited = [p for p in [*started, *workers] if p.popen.poll() is not None]
    assert not exited, [(p.log_path.name, p.popen.returncode, p.log()[-3000:]) for p in exited]
    procs.redis(port=port)  # back, and empty
    fresh = JobStore.connect(redis, "outage")
    wait_until(lambda: fresh.spec() is not None, 30, "the scheduler to rebuild the job")
    wait_until(lambda: all(fresh.heartbeats("worker", [0, 1]).values())
               and all(fresh.heartbeats("server", [0]).values()), 30, "processes to re-register")
    assert any(e.type == "rebuilt" for e in fresh.events())
    assert fresh.members("server")[0]["address"] == address
    for w in workers:
        assert w.popen.wait(timeout=120) == 0, w.log()


# ---- Redis outages during a sync job ---------------------------------------------------------
# A sync job under `pstrain up` with an external Redis the test stalls, kills or wipes. Its
# batches follow its clock, so an outage that changes nothing leaves the uninterrupted result.

OUTAGE_STEPS = 600


def up_sync_job(procs: Procs, redis: str, job: str, steps: int = OUTAGE_STEPS,
                restart: bool = False, flags: tuple[str, ...] = ()) -> Proc:
    return procs.pstrain([
        "up", "--redis", redis, "--job", job, "--servers", "2", "--workers", "2", "--mode",
        "sync", *(["--restart"] if restart else []), "--checkpoint-dir",
        str(procs.workdir / "ckpt"), "--checkpoint-every-clocks", "20", "--log-dir",
        str(procs.workdir / "logs"), "--no-view", *flags, JOB_WORKER, "--", "--steps",
        str(steps), "--sleep-ms", "20", "--out", str(procs.workdir / "out")], "up")


def worker_restarts(up: Proc) -> int:
    return up.log().count("exited with 75; restarting it")


def assert_uninterrupted_result(procs: Procs, up: Proc, steps: int = OUTAGE_STEPS) -> None:
    assert up.popen.wait(timeout=120) == 0, up.log()[-5000:]
    expected = local_sync_run(2, steps)
    for r in range(2):
        result = json.loads((procs.workdir / "out" / f"worker{r}.json").read_text())
        assert result["clock"] == steps
        torch.testing.assert_close(torch.tensor(result["w"]), expected, atol=1e-6, rtol=0)


def finished_at(procs: Procs) -> float:
    """When the first worker wrote its result (after it, processes leave the job)."""
    return min((procs.workdir / "out" / f"worker{r}.json").stat().st_mtime for r in range(2))


def unavailable_lines(procs: Procs) -> int:
    text = (procs.workdir / "logs" / "scheduler.log").read_text(errors="replace")
    return text.count("Redis unavailable")


@pytest.mark.timeout(150)
def test_sync_job_rides_out_a_redis_stall_without_rollback(procs: Procs) -> None:
    redis_proc = procs.redis()
    store = JobStore.connect(redis_proc.address, "stall")
    up = up_sync_job(procs, redis_proc.address, "stall")
    wait_until(lambda: worker_clock(store, 0) >= 30 and store.latest_checkpoint(2), 90,
               "training to pass a checkpoint")
    os.kill(redis_proc.pid, signal.SIGSTOP)
    try:
        time.sleep(5)  # longer than the leader lease (2 s) and the heartbeats' life (1.5 s)
    finally:
        os.kill(redis_proc.pid, signal.SIGCONT)
    assert up.popen.poll() is None, "the job ended before Redis came back: raise OUTAGE_STEPS"
    resumed = time.time()
    wait_until(lambda: all(store.heartbeats("worker", [0, 1]).values()), 30,
               "the workers to beat again")
    assert worker_clock(store, 0) < OUTAGE_STEPS, "the job ended too soon: raise OUTAGE_STEPS"
    assert_uninterrupted_result(procs, up)
    assert not [e for e in store.events() if e.type in ("rollback", "restarting")]
    end = finished_at(procs)
    assert not [e for e in store.events() if e.type == "dead" and resumed <= e.time_s < end]
    assert worker_restarts(up) == 0, up.log()


@pytest.mark.timeout(150)
def test_sync_job_rides_out_redis_restarted_empty(procs: Procs) -> None:
    redis_proc = procs.redis()
    redis = redis_proc.address
    port = redis_proc.port
    store = JobStore.connect(redis, "empty")
    up = up_sync_job(procs, redis, "empty")
    wait_until(lambda: worker_clock(store, 0) >= 30 and store.latest_checkpoint(2), 90,
               "training to pass a checkpoint")
    procs.kill(redis_proc, signal.SIGKILL)
    time.sleep(6)
    procs.redis(port=port)  # back, and empty
    assert up.popen.poll() is None, "the job ended before Redis came back: raise OUTAGE_STEPS"
    fresh = JobStore.connect(redis, "empty")
    wait_until(lambda: fresh.spec() is not None, 30, "the scheduler to rebuild the job")
    wait_until(lambda: all(fresh.heartbeats("worker", [0, 1]).values()), 30,
               "the workers to register again")
    assert worker_clock(fresh, 0) < OUTAGE_STEPS, "the job ended too soon: raise OUTAGE_STEPS"
    assert_uninterrupted_result(procs, up)
    assert not [e for e in fresh.events() if e.type in ("rollback", "restarting")]
    assert not [e for e in fresh.events() if e.type == "dead" and e.time_s < finished_at(procs)]
    assert worker_restarts(up) == 0, up.log()
    # Once when Redis went away (the scheduler says so once, not on every poll).
    assert unavailable_lines(procs) <= 2


@pytest.mark.timeout(180)
def test_redis_wiped_around_a_server_restart_neither_wedges_nor_repeats_a_generation(
        procs: Procs) -> None:
    steps = 600
    redis = procs.redis().address
    store = JobStore.connect(redis, "wipe")
    up = up_sync_job(procs, redis, "wipe", steps=steps, restart=True)
    wait_until(lambda: worker_clock(store, 0) >= 25 and store.latest_checkpoint(2), 90,
               "training to pass a checkpoint")
    victim = live_server_pid(store, 0)
    os.kill(victim, signal.SIGKILL)
    first = wait_until(lambda: next((e for e in store.events() if e.type == "rollback"), None),
                       60, "the first rollback")
    assert first.detail["generation"] == 1  # type: ignore[attr-defined]
    back_at = int(first.detail["clock"])  # type: ignore[attr-defined]
    wait_until(lambda: worker_clock(store, 0) >= back_at + 30, 60, "training to resume")
    restarts = worker_restarts(up)
    assert restarts == 2, up.log()

    # Wiped after the restart: the restarted server still names its checkpoint, which Redis
    # no longer lists. Nothing rolls back; the generation comes back from the servers.
    restarted = live_server_pid(store, 0)
    wiped_at = time.time()
    store.redis.flushdb()
    wait_until(lambda: store.spec() is not None, 30, "the scheduler to rebuild the job")
    wait_until(lambda: store.generation() == 1, 30, "the generation to be rebuilt")
    clock = worker_clock(store, 0)
    wait_until(lambda: worker_clock(store, 0) >= clock + 20, 60, "training to go on")
    assert not [e for e in store.events() if e.type == "rollback"]
    assert worker_restarts(up) == restarts
    wait_until(lambda: store.latest_checkpoint(2), 10, "the servers to list a checkpoint again")

    # Restarted after the wipe: rolled back to the newest checkpoint on disk (not to the
    # empty model) under a generation never used before.
    victim = live_server_pid(store, 0)
    assert victim == restarted, up.log()[-5000:]  # the wipe restarted no server
    os.kill(victim, signal.SIGKILL)
    second = wait_until(
        lambda: next((e for e in store.events() if e.type == "rollback"), None), 60,
        "the second rollback")
    assert second.time_s > wiped_at  # type: ignore[attr-defined]
    assert second.detail["generation"] == 2  # type: ignore[attr-defined]
    assert int(second.detail["clock"]) > back_at, second  # type: ignore[attr-defined]
    assert worker_clock(store, 0) < steps, "the job ended too soon: raise steps"
    assert_uninterrupted_result(procs, up, steps)
    assert worker_restarts(up) == restarts + 2


@pytest.mark.timeout(180)
def test_server_killed_during_a_redis_outage_rolls_back_to_the_newest_checkpoint(
        procs: Procs) -> None:
    # Periodic checkpoints of clocks 20, 40, 60, 80...: full, delta, delta, full... (a full
    # one every 3), and only the newest full one and those after it kept.
    steps = 250  # the job stalls from the kill (sync) until the rollback: enough left
    redis_proc = procs.redis()
    redis = redis_proc.address
    port = redis_proc.port
    store = JobStore.connect(redis, "died")
    directory = procs.workdir / "ckpt"
    up = up_sync_job(procs, redis, "died", steps=steps, restart=True,
                     flags=("--checkpoint-full-every", "3", "--checkpoint-keep", "1"))
    wait_until(lambda: worker_clock(store, 0) >= 45 and store.latest_checkpoint(2), 90,
               "training to pass a checkpoint")
    victim = live_server_pid(store, 0)
    procs.kill(redis_proc, signal.SIGKILL)
    os.kill(victim, signal.SIGKILL)  # restarted by pstrain up, it cannot register yet
    time.sleep(6)
    # No clock closes without server 0: the newest checkpoint on disk stays the newest.
    newest = latest_complete(directory, "died")
    assert newest is not None and newest.kind == "delta", newest
    procs.redis(port=port)  # back, and empty: no checkpoint listed
    fresh = JobStore.connect(redis, "died")
    rollback = wait_until(
        lambda: next((e for e in fresh.events() if e.type == "rollback"), None), 90,
        "the rollback")
    # The newest checkpoint on disk (re-listed by the servers), not the empty model: a
    # delta, restored through its chain, as the uninterrupted result below shows.
    assert rollback.detail["checkpoint"] == newest.checkpoint_id, rollback  # type: ignore[attr-defined]
    assert int(rollback.detail["clock"]) >= 40, rollback  # type: ignore[attr-defined]
    assert rollback.detail["generation"] == 1  # type: ignore[attr-defined]
    # A full checkpoint asked for by hand is full, whatever the count says.
    asked = subprocess.run([sys.executable, "-m", "scheduler.cli", "checkpoint", "--redis",
                            redis, "--job", "died", "--full", "--wait-s", "60"],
                           capture_output=True, text=True, cwd=REPO, timeout=90, check=False)
    assert asked.returncode == 0, asked
    assert {e.get("kind", "full") for e in json.loads(asked.stdout)["shards"].values()} == {
        "full"}, asked.stdout
    assert worker_clock(fresh, 0) < steps, "the job ended too soon: raise steps"
    assert_uninterrupted_result(procs, up, steps)
    assert worker_restarts(up) == 2, up.log()
    # Retention: the newest full checkpoint and the deltas after it are all that is left.
    left = list_checkpoints(directory, "died")
    full = [m for m in left if m.kind == "full"]
    assert len(full) == 1 and full[0].clock >= 200, [(m.checkpoint_id, m.kind) for m in left]
    assert all(m.clock >= full[0].clock for m in left), left
    assert sorted(p.name for p in (directory / "died").iterdir()) == sorted(
        m.checkpoint_id for m in left)


# Enough steps for a job that stalls (a sync server stopped) from before its rollback: it
# cannot run out of them before the rollback.
STALLED_STEPS = 250


@dataclass
class Stalled:
    redis: str
    store: JobStore
    up: Proc
    victim: int  # server 0's pid, SIGSTOPped
    newest: str  # the two newest complete checkpoints
    older: str


def stalled_after_two_checkpoints(procs: Procs, job: str) -> Stalled:
    """`up_sync_job` of `job` with --restart, once it holds two complete checkpoints and is
    past clock 45, with server 0 SIGSTOPped: no clock closes, so no newer checkpoint
    completes."""
    redis = procs.redis().address
    store = JobStore.connect(redis, job)
    up = up_sync_job(procs, redis, job, steps=STALLED_STEPS, restart=True)
    wait_until(lambda: len(store.complete_checkpoints(2)) >= 2 and worker_clock(store, 0) >= 45,
               90, "two checkpoints")
    victim = live_server_pid(store, 0)
    os.kill(victim, signal.SIGSTOP)

    # A checkpoint server 0 listed before it stopped may still be on its way from server 1:
    # once it lands it is the newest, so the newest is read after that.
    def settled() -> bool:
        return all(1 in entries for entries in
                   (store.checkpoint(c) for c in store.checkpoint_ids()) if 0 in entries)

    wait_until(settled, 60, "server 1's part of the checkpoints server 0 wrote")
    (newest, _), (older, _) = sorted(store.complete_checkpoints(2), key=lambda c: -c[1])[:2]
    return Stalled(redis, store, up, victim, newest, older)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_corrupt_newest_checkpoint_rolls_back_to_the_one_before(
    procs: Procs, damage: str
) -> None:
    steps = STALLED_STEPS
    job = stalled_after_two_checkpoints(procs, "corrupt")
    store, up, victim, newest, older = job.store, job.up, job.victim, job.newest, job.older
    damaged = procs.workdir / "ckpt" / "corrupt" / newest / "shard-0-of-2.safetensors"
    if damage == "flipped":
        corrupt(damaged)
    else:
        damaged.write_bytes(damaged.read_bytes()[:damaged.stat().st_size // 2])
    os.kill(victim, signal.SIGKILL)  # restarted by pstrain up, it finds the newest unreadable
    rollback = wait_until(
        lambda: next((e for e in store.events() if e.type == "rollback"), None), 90,
        "the rollback")
    assert rollback.detail["checkpoint"] == older, rollback  # type: ignore[attr-defined]
    assert worker_clock(store, 0) < steps, "the job ended too soon: raise steps"
    assert_uninterrupted_result(procs, up, steps)
    # The restarted server found it unreadable and marked it bad, so the scheduler passed
    # over it without asking any shard to restore it (the mark went when training wrote a
    # checkpoint under that id again).
    marked = [(e.member, e.detail["checkpoint"]) for e in store.events()
              if e.type == "bad_checkpoint"]
    assert marked == [("0", newest)], marked
    server_log = (procs.workdir / "logs" / "server0.log").read_text(errors="replace")
    assert f"cannot restore checkpoint {newest!r}" in server_log
    scheduler_log = (procs.workdir / "logs" / "scheduler.log").read_text(errors="replace")
    assert f"cannot restore checkpoint {newest!r}" not in scheduler_log


@pytest.mark.timeout(240)
@pytest.mark.parametrize("change", ["older clock raised", "newest unsigned"])
def test_a_rollback_skips_checkpoint_entries_not_signed_with_the_job_secret(
    procs: Procs, change: str
) -> None:
    # `pstrain up` gives every process a secret made for the run: servers sign their
    # checkpoint entries in Redis, and the scheduler checks them before it restores one.
    steps = STALLED_STEPS
    job = stalled_after_two_checkpoints(procs, "forged")
    store, up, victim, newest, older = job.store, job.up, job.victim, job.newest, job.older
    if change == "older clock raised":
        # Whoever can write Redis makes an old checkpoint look the newest, for the rollback
        # (which takes the highest clock) to go back to it; it cannot sign the change.
        changed, expected = older, newest
        for shard, entry in store.checkpoint(older).items():
            store.record_checkpoint(older, shard, {**entry, "clock": 10**6})
    else:
        # Shard 1's entry: the restarted shard 0 restores the newest (its own entry is
        # signed), and only the scheduler's check keeps the job from rolling back to it.
        changed, expected = newest, older
        entry = store.checkpoint(newest)[1]
        store.record_checkpoint(newest, 1, {k: v for k, v in entry.items() if k != "mac"})
    os.kill(victim, signal.SIGKILL)  # restarted by pstrain up
    rollback = wait_until(
        lambda: next((e for e in store.events() if e.type == "rollback"), None), 90,
        "the rollback")
    assert rollback.detail["checkpoint"] == expected, rollback  # type: ignore[attr-defined]
    assert worker_clock(store, 0) < steps, "the job ended too soon: raise steps"
    assert_uninterrupted_result(procs, up, steps)
    scheduler_log = (procs.workdir / "logs" / "scheduler.log").read_text(errors="replace")
    warned = [line for line in scheduler_log.splitlines()
              if "not signed with the job's secret" in line and repr(changed) in line]
    assert len(warned) == 1, scheduler_log[-5000:]


@pytest.mark.timeout(240)
def test_a_server_restarted_while_no_scheduler_leads_is_rolled_back_for(procs: Procs) -> None:
    # The scheduler and sync server 0 die together; `pstrain up --restart` starts both again,
    # and the new scheduler, which never saw server 0's first incarnation, leads by the time
    # the new server beats. The incarnations a leader saw are in Redis for the next one.
    steps = STALLED_STEPS
    redis = procs.redis().address
    store = JobStore.connect(redis, "gap")
    up = up_sync_job(procs, redis, "gap", steps=steps, restart=True)
    wait_until(lambda: worker_clock(store, 0) >= 45 and store.latest_checkpoint(2), 90,
               "training to pass a checkpoint")
    leader = store.leader()
    assert leader is not None
    victim = live_server_pid(store, 0)
    os.kill(int(leader.split(":")[1]), signal.SIGKILL)  # the lease holds host:pid:start
    os.kill(victim, signal.SIGKILL)
    rollback = wait_until(
        lambda: next((e for e in store.events() if e.type == "rollback"), None), 90,
        "the rollback")
    assert int(rollback.detail["clock"]) >= 20, rollback  # type: ignore[attr-defined]
    assert worker_clock(store, 0) < steps, "the job ended too soon: raise steps"
    assert_uninterrupted_result(procs, up, steps)


def up_run(procs: Procs, redis: str, name: str, steps: int, *flags: str) -> Proc:
    """`pstrain up` of job "reused" in one checkpoint directory, its results in out-NAME."""
    return procs.pstrain([
        "up", "--redis", redis, "--job", "reused", "--servers", "2", "--workers", "2",
        "--mode", "sync", "--checkpoint-dir", str(procs.workdir / "ckpt"),
        "--checkpoint-every-clocks", "20", "--no-view", *flags, JOB_WORKER, "--", "--steps",
        str(steps), "--out", str(procs.workdir / f"out-{name}")], f"up-{name}")


def run_id_of(up: Proc) -> str:
    """The run id `pstrain up` printed at start."""
    line = next(x for x in up.log().splitlines() if x.startswith("pstrain up: job 'reused' run "))
    return line.split(" run ", 1)[1].split(",")[0].strip()


def assert_result(procs: Procs, name: str, steps: int) -> None:
    expected = local_sync_run(2, steps)
    for r in range(2):
        result = json.loads((procs.workdir / f"out-{name}" / f"worker{r}.json").read_text())
        assert result["clock"] == steps
        torch.testing.assert_close(torch.tensor(result["w"]), expected, atol=1e-6, rtol=0)


@pytest.mark.timeout(240)
def test_a_finished_job_s_name_reused_without_resume_starts_fresh(procs: Procs) -> None:
    # Runs of one job in one checkpoint directory: each gets a run id, its checkpoints are
    # recorded under it, and a restore picks the current run's unless asked otherwise.
    redis = procs.redis().address
    store = JobStore.connect(redis, "reused")
    first = up_run(procs, redis, "1", 100)
    assert first.popen.wait(timeout=120) == 0, first.log()[-3000:]
    run1 = run_id_of(first)
    assert store.run() == {"id": run1, "started": store.spec().created_s,  # type: ignore[union-attr]
                           "previous": "", "resumed_from": ""}
    assert {e["run"] for c in store.checkpoint_ids() for e in store.checkpoint(c).values()} \
        == {run1}  # the first run checkpointed, under its id
    # Without --resume: a new run from fresh rows, saying so in one line. Its 60 clocks
    # write clock-20..60 again (under its own id); clock-80 and clock-100 stay run 1's.
    second = up_run(procs, redis, "2", 60)
    assert second.popen.wait(timeout=120) == 0, second.log()[-3000:]
    run2 = run_id_of(second)
    assert run2 != run1
    assert_result(procs, "2", 60)  # from fresh rows, not from the first run's clock 100
    said = [x for x in second.log().splitlines() if "under the name of an earlier one" in x]
    assert len(said) == 1 and f"new run {run2}" in said[0] and f"(run {run1})" in said[0]
    assert f"--resume-from {run1}" in said[0]
    assert store.run()["previous"] == run1  # type: ignore[index]
    assert f"run {run2} (previous run {run1})" in status_text(redis, "reused")
    # --resume-from the first run: its newest checkpoint (clock 100), though run 2 wrote
    # checkpoints since; the batches follow the clock, so 120 clocks end as one run of 120.
    third = up_run(procs, redis, "3", 120, "--resume-from", run1)
    assert third.popen.wait(timeout=120) == 0, third.log()[-3000:]
    assert_result(procs, "3", 120)
    assert {m["restored"] for m in store.members("server").values()} == {"clock-0000000100"}
    assert store.run()["resumed_from"] == run1  # type: ignore[index]
    assert "under the name of an earlier one" not in third.log()
    # An id that names no checkpoint and no run is refused, naming it.
    fourth = up_run(procs, redis, "4", 120, "--resume-from", "no-such-run")
    assert fourth.popen.wait(timeout=120) == 2, fourth.log()[-3000:]
    assert "--resume-from 'no-such-run': no complete checkpoint" in fourth.log()


@pytest.mark.timeout(180)
def test_a_failing_checkpoint_is_an_event_that_status_shows(procs: Procs) -> None:
    redis = procs.redis().address
    job_dir = procs.workdir / "ckpt" / "unwritable"
    job_dir.mkdir(parents=True)
    (job_dir / "clock-0000000020").write_text("a file where that checkpoint's directory goes")
    up = up_sync_job(procs, redis, "unwritable", steps=60)
    assert up.popen.wait(timeout=120) == 0, up.log()[-3000:]  # training does not stop for it
    store = JobStore.connect(redis, "unwritable")
    failed = [e for e in store.events() if e.type == "checkpoint_failed"]
    assert sorted((e.member, e.detail["checkpoint"]) for e in failed) == [
        ("0", "clock-0000000020"), ("1", "clock-0000000020")], failed  # one per server
    assert "clock-0000000020" in failed[0].detail["error"]
    assert store.latest_checkpoint(2) is not None  # the later ones were written
    shown = subprocess.run([sys.executable, "-m", "scheduler.cli", "status", "--redis", redis,
                            "--job", "unwritable"], capture_output=True, text=True, cwd=REPO,
                           timeout=60, check=False)
    assert "checkpoint_failed server" in shown.stdout, shown
    assert "clock-0000000020" in shown.stdout, shown


# ---- bad checkpoints: marked, skipped, and a job that stops when none verifies -------------


def events_of(store: JobStore, kind: str) -> list[Any]:
    return [e for e in store.events() if e.type == kind]


def status_text(redis: str, job: str) -> str:
    shown = subprocess.run([sys.executable, "-m", "scheduler.cli", "status", "--redis", redis,
                            "--job", job], capture_output=True, text=True, cwd=REPO,
                           timeout=60, check=False)
    assert shown.returncode == 0, shown
    return shown.stdout


@pytest.mark.timeout(120)
def test_a_checkpoint_corrupt_on_the_live_shard_is_marked_bad_and_never_tried_again(
    procs: Procs,
) -> None:
    # Shard 0 restarts; the newest checkpoint's file of shard 1 (the live one) is corrupt, so
    # the rollback's Restore fails on shard 1: logged once with the reason, marked bad in
    # Redis and on disk, and the job falls back to the one before. A second recovery (shard
    # 1 restarts) passes over the mark without trying the checkpoint again.
    job = stalled_after_two_checkpoints(procs, "badmark")
    redis, store, up, victim = job.redis, job.store, job.up, job.victim
    newest, older = job.newest, job.older
    damaged = procs.workdir / "ckpt" / "badmark" / newest / "shard-1-of-2.safetensors"
    corrupt(damaged)
    os.kill(victim, signal.SIGKILL)  # restarted by pstrain up: shard 0's file of it is fine
    rollback = wait_until(lambda: next(iter(events_of(store, "rollback")), None), 60,
                          "the rollback")
    assert rollback.detail["checkpoint"] == older, rollback
    # Before any clock closes again (the workers restart first), shard 1 restarts too.
    other = live_server_pid(store, 1)
    os.kill(other, signal.SIGKILL)
    wait_until(lambda: len(events_of(store, "rollback")) >= 2, 60, "the second rollback")
    # The servers are held while the mark is read: once the restarted workers pass its clock
    # again, the job writes a checkpoint under the marked id, which clears the mark.
    held = [live_server_pid(store, k) for k in (0, 1)]
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        assert events_of(store, "rollback")[1].detail["checkpoint"] == older
        bad = store.bad_checkpoints()
        assert list(bad) == [newest] and bad[newest]["shard"] == 1, bad
        assert str(damaged) in bad[newest]["reason"] and "sha256" in bad[newest]["reason"]
        marker = damaged.parent / "BAD"
        assert marker.is_file() and str(damaged) in marker.read_text()
        assert "bad checkpoint " + newest in status_text(redis, "badmark")
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    assert up.popen.wait(timeout=90) == 0, up.log()[-5000:]
    logs = procs.workdir / "logs"
    scheduler_log = (logs / "scheduler.log").read_text(errors="replace")
    assert scheduler_log.count(f"cannot restore checkpoint {newest!r}") == 1, scheduler_log
    server1_log = (logs / "server1.log").read_text(errors="replace")
    assert f"cannot restore checkpoint {newest!r}" not in server1_log  # passed over unread
    assert f"passing over checkpoint {newest!r}, marked bad" in server1_log
    assert not events_of(store, "stopped")


@pytest.mark.timeout(120)
def test_when_no_checkpoint_verifies_the_job_stops_with_one_message_naming_the_files(
    procs: Procs,
) -> None:
    job = stalled_after_two_checkpoints(procs, "nowayback")
    redis, store, up, victim = job.redis, job.store, job.up, job.victim
    damaged = [procs.workdir / "ckpt" / "nowayback" / c / "shard-0-of-2.safetensors"
               for c, _ in store.complete_checkpoints(2)]
    for path in damaged:
        corrupt(path)
    os.kill(victim, signal.SIGKILL)  # restarted by pstrain up: nothing of shard 0 verifies
    assert up.popen.wait(timeout=60) == 76, up.log()[-5000:]
    out = up.log()
    message = [line for line in out.splitlines() if "stopped: " in line and "pstrain up" in line]
    assert len(message) == 1, out[-5000:]
    assert "recovery has no way back" in message[0]
    for path in damaged:
        assert str(path) in message[0], (path, message[0])
    assert '"stopped": "' in out  # the final JSON line
    scheduler_log = (procs.workdir / "logs" / "scheduler.log").read_text(errors="replace")
    assert scheduler_log.count("stopped: server 0: recovery has no way back") == 1
    assert len(events_of(store, "stopped")) == 1
    shown = status_text(redis, "nowayback")
    assert "STOPPED: server 0: recovery has no way back" in shown
    assert "stopped " in shown and str(damaged[0]) in shown
    assert "exited with 2; restarting it" not in out  # no crash loop
    assert not events_of(store, "rollback")
