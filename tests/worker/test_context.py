"""The worker's job context with real processes: finishing, barriers, how a script ends."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from beats import live_server_pid, worker_clock
from damage import corrupt
from procs import REPO, Proc, Procs, wait_until

from scheduler.store import Event, JobStore
from worker.client import PSClient
from worker.context import WorkerContext
from worker.errors import BarrierTimeoutError

JOB_WORKER = str(REPO / "tests" / "job_worker.py")
sys.path.insert(0, str(REPO / "tests"))

from job_worker import local_sync_run  # noqa: E402


def worker_events(store: JobStore, kind: str) -> list[Event]:
    return [e for e in store.events() if e.type == kind and e.role == "worker"]


def summary(up_log: str) -> dict[str, Any]:
    """`pstrain up`'s final JSON line."""
    result: dict[str, Any] = json.loads(
        [line for line in up_log.splitlines() if line.startswith("{")][-1])
    return result


def finals(procs: Procs, ranks: int) -> list[dict[str, Any]]:
    return [json.loads((procs.workdir / "out" / f"worker{r}.json").read_text())
            for r in range(ranks)]


def test_unequal_step_counts_in_sync_finish_and_nobody_waits_for_a_finished_worker(
    procs: Procs,
) -> None:
    # Rank 1 takes 12 steps, rank 0 30. Rank 1 finishes, then waits at a barrier for rank 0
    # (alive, as a worker that evaluates is): rank 0's clocks 12..29 close without it. Then
    # rank 1 exits with status 3, and --restart does not run the finished rank again.
    redis = procs.redis().address
    store = JobStore.connect(redis, "unequal")
    up = procs.pstrain(["up", "--redis", redis, "--job", "unequal", "--servers", "2",
                        "--workers", "2", "--mode", "sync", "--restart", "--no-view",
                        "--log-dir", str(procs.workdir / "logs"),
                        JOB_WORKER, "--", "--steps", "30", "--steps-of", "1=12", "--finish",
                        "--barrier", "trained", "--exit-status-of", "1=3",
                        "--out", str(procs.workdir / "out")], "up")
    assert up.popen.wait(timeout=240) == 3, up.log()[-3000:]
    result = summary(up.log())
    assert (result["exit_status"], result["restarts"]) == (3, {}), result
    assert "worker1 exited with status 3 after it finished training" in up.log()
    # Clocks 0..11 average both gradients, 12..29 use rank 0's alone.
    expected = local_sync_run(2, 30, steps_of={1: 12})
    results = finals(procs, 2)
    assert [r["clock"] for r in results] == [30, 12]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["w"]), expected, atol=1e-6, rtol=0)
    left = {e.member: e.detail["clock"] for e in worker_events(store, "left")}
    assert left == {"1": 12, "0": 30}
    assert worker_events(store, "dead") == []
    assert store.finished_ranks() == {0, 1}


def test_a_barrier_gives_every_async_worker_the_same_final_model(procs: Procs) -> None:
    # Rank 1 takes 5 quick steps, rank 0 40 slow ones; both wait at the barrier, then pull.
    # The script runs in a `with worker.init() as ctx:` block, which finishes on its end.
    redis = procs.redis().address
    store = JobStore.connect(redis, "async-barrier")
    up = procs.pstrain(["up", "--redis", redis, "--job", "async-barrier", "--servers", "2",
                        "--workers", "2", "--mode", "async", "--no-view",
                        "--log-dir", str(procs.workdir / "logs"), JOB_WORKER, "--",
                        "--steps", "40", "--steps-of", "1=5", "--sleep-ms", "20",
                        "--barrier", "trained", "--end", "with",
                        "--out", str(procs.workdir / "out")], "up")
    assert up.popen.wait(timeout=240) == 0, up.log()[-3000:]
    results = finals(procs, 2)
    assert [r["clock"] for r in results] == [40, 5]
    assert results[0]["w"] == results[1]["w"]
    assert {e.member for e in worker_events(store, "left")} == {"0", "1"}
    assert worker_events(store, "dead") == []


@pytest.mark.parametrize("rank", ["claimed", "given"])
def test_a_worker_that_exits_0_is_recorded_finished_not_dead(procs: Procs, rank: str) -> None:
    # The script returns without ctx.finish() or close(): `pstrain worker` (claiming a rank,
    # or given one with --rank) records the rank finished when it exits 0, and the scheduler
    # calls the end of its heartbeat a finish.
    redis = procs.redis().address
    store = JobStore.connect(redis, "exit0")
    procs.pstrain(["scheduler", "--redis", redis, "--job", "exit0", "--mode", "async",
                   "--workers", "2", "--servers", "1"], "scheduler")
    wait_until(store.leader, 30, "a leader")
    procs.pstrain(["server", "--redis", redis, "--job", "exit0", "--shard", "0", "--bind",
                   "127.0.0.1:0"], "server")
    workers = [procs.pstrain(["worker", "--redis", redis, "--job", "exit0",
                              *(["--rank", str(k)] if rank == "given" else []), JOB_WORKER,
                              "--steps", "20", "--end", "return",
                              "--out", str(procs.workdir / "out")], f"worker{k}")
               for k in range(2)]
    for proc in workers:
        assert proc.popen.wait(timeout=120) == 0, proc.log()
    wait_until(lambda: {e.member for e in worker_events(store, "finished")} == {"0", "1"}, 15,
               "both workers' finished events")
    time.sleep(1.0)  # a death would be declared by now too
    assert worker_events(store, "dead") == []
    # Its last heartbeat outlived the process until the exit status was recorded.
    assert worker_events(store, "suspect") == []
    assert store.finished_ranks() == {0, 1}


def test_a_worker_of_up_that_returns_is_recorded_finished_not_dead(procs: Procs) -> None:
    # Rank 1's script returns after 5 steps without ctx.finish(); rank 0 trains on.
    redis = procs.redis().address
    store = JobStore.connect(redis, "up-exit0")
    up = procs.pstrain(["up", "--redis", redis, "--job", "up-exit0", "--servers", "1",
                        "--workers", "2", "--mode", "async", "--no-view", JOB_WORKER, "--",
                        "--steps", "60", "--steps-of", "1=5", "--sleep-ms", "50",
                        "--end", "return", "--out", str(procs.workdir / "out")], "up")
    wait_until(lambda: [e for e in worker_events(store, "finished") if e.member == "1"], 60,
               "rank 1's finished event")
    assert up.popen.wait(timeout=120) == 0, up.log()[-3000:]
    assert worker_events(store, "dead") == []
    # Its last heartbeat outlived the process until `up` recorded the exit status.
    assert not [e for e in worker_events(store, "suspect") if e.member == "1"]
    assert "worker1 finished" in up.log()


def test_a_finished_worker_that_a_rollback_catches_stays_finished(procs: Procs) -> None:
    # Rank 1 finishes after 10 clocks and waits at a barrier (alive, as an evaluating worker
    # is). Then a server dies and the sync job rolls back: rank 0 restarts, rank 1 is not
    # restarted, and after the barrier it pulls the model under the new generation.
    redis = procs.redis().address
    store = JobStore.connect(redis, "caught")
    up = procs.pstrain(["up", "--redis", redis, "--job", "caught", "--servers", "2",
                        "--workers", "2", "--mode", "sync", "--restart", "--no-view",
                        "--checkpoint-dir", str(procs.workdir / "ckpt"),
                        "--checkpoint-every-clocks", "20", "--log-dir",
                        str(procs.workdir / "logs"), JOB_WORKER, "--", "--steps", "250",
                        "--steps-of", "1=10", "--sleep-ms", "20", "--finish", "--barrier",
                        "trained", "--out", str(procs.workdir / "out")], "up")
    wait_until(lambda: worker_events(store, "left") and store.latest_checkpoint(2)
               and worker_clock(store, 0) >= 45, 60, "rank 1 to leave and a checkpoint")
    victim = live_server_pid(store, 0)
    os.kill(victim, signal.SIGKILL)  # restarted by pstrain up; the job rolls back
    wait_until(lambda: [e for e in store.events() if e.type == "rollback"], 60, "the rollback")
    assert up.popen.wait(timeout=120) == 0, up.log()[-5000:]
    result = summary(up.log())
    assert "worker1" not in result["restarts"], result
    assert result["restarts"].get("worker0") == 1, result
    assert "worker1 exited" not in up.log()
    assert worker_events(store, "dead") == []
    results = finals(procs, 2)
    assert [r["clock"] for r in results] == [250, 10]
    assert results[0]["w"] == results[1]["w"]  # both pulled the end of the rolled-back job
    worker1_log = (procs.workdir / "logs" / "worker1.log").read_text(errors="replace")
    assert "finished before the job rolled back; it stays finished" in worker1_log


ROLLED_STEPS, ROLLED_SHORT, ROLLED_TO = 100, 60, 30


FINISH_AND_WAIT = ("--finish", "--barrier", "trained")


def up_with_a_checkpoint_before_rank_1_finishes(
    procs: Procs, job: str, ending: tuple[str, ...] = FINISH_AND_WAIT,
) -> tuple[JobStore, Proc]:
    """A 2 + 2 sync job of ROLLED_STEPS steps, rank 1 ROLLED_SHORT of them (then each script
    ends as `ending` says: by default it finishes and waits at a barrier), with one
    checkpoint, at clock ROLLED_TO, once it is written."""
    redis = procs.redis().address
    store = JobStore.connect(redis, job)
    up = procs.pstrain(["up", "--redis", redis, "--job", job, "--servers", "2",
                        "--workers", "2", "--mode", "sync", "--restart", "--no-view",
                        "--checkpoint-dir", str(procs.workdir / "ckpt"), "--log-dir",
                        str(procs.workdir / "logs"), JOB_WORKER, "--", "--steps",
                        str(ROLLED_STEPS), "--steps-of", f"1={ROLLED_SHORT}", "--sleep-ms", "50",
                        *ending, "--out",
                        str(procs.workdir / "out")], "up")
    wait_until(lambda: worker_clock(store, 1) >= 0, 90, "training to start")
    store.request_checkpoint("early", ROLLED_TO)  # as `pstrain checkpoint` asks, at a clock
    wait_until(lambda: "early" in dict(store.complete_checkpoints(2)), 60, "the checkpoint")
    assert worker_clock(store, 1) < ROLLED_SHORT - 10, "rank 1 is about to finish: raise steps"
    return store, up


def test_a_worker_still_finishing_when_the_job_rolls_back_past_its_finish_trains_again(
    procs: Procs,
) -> None:
    # Rank 1 finishes at clock 60, after the checkpoint the job later rolls back to. With the
    # scheduler paused no server lets it go, so it is still in ctx.finish() (beating) when
    # server 0 dies. The rollback undoes its steps past the checkpoint, so its finish is
    # voided: it restarts with rank 0, trains them again and finishes again, and the job
    # ends with the uninterrupted result.
    store, up = up_with_a_checkpoint_before_rank_1_finishes(procs, "voided")
    leader = store.leader()
    assert leader is not None
    scheduler = int(leader.split(":")[1])
    os.kill(scheduler, signal.SIGSTOP)
    try:
        wait_until(lambda: 1 in store.departures()[1], 60, "rank 1's finish record")
        assert store.departures()[1][1]["clock"] == ROLLED_SHORT
        assert store.heartbeats("worker", [1])[1] is not None  # it waits to be let go
        os.kill(live_server_pid(store, 0), signal.SIGKILL)  # restarted by pstrain up
    finally:
        os.kill(scheduler, signal.SIGCONT)
    rollback = wait_until(lambda: worker_events(store, "unfinished") and next(
        (e for e in store.events() if e.type == "rollback"), None), 90, "the rollback")
    assert rollback.detail["clock"] == ROLLED_TO, rollback  # type: ignore[attr-defined]
    assert up.popen.wait(timeout=120) == 0, up.log()[-5000:]
    result = summary(up.log())
    assert result["restarts"].get("worker1") == 1, result
    assert result["membership_changes"] == [], result
    expected = local_sync_run(2, ROLLED_STEPS, steps_of={1: ROLLED_SHORT})
    assert [r["clock"] for r in finals(procs, 2)] == [ROLLED_STEPS, ROLLED_SHORT]
    for r in finals(procs, 2):
        torch.testing.assert_close(torch.tensor(r["w"]), expected, atol=1e-6, rtol=0)
    scheduler_log = (procs.workdir / "logs" / "scheduler.log").read_text(errors="replace")
    assert "worker 1 finished past checkpoint 'early'" in scheduler_log


@pytest.mark.parametrize("ending", [FINISH_AND_WAIT, ("--end", "return")],
                         ids=["finished", "returned"])
def test_steps_a_rollback_undoes_after_a_worker_finished_for_good_are_on_the_record(
    procs: Procs, ending: tuple[str, ...],
) -> None:
    # The same, but rank 1 was let go before server 0 dies: it no longer beats (it waits at
    # the barrier), so nothing can take its steps 30..59 again. It stays finished, the job
    # ends without them, and `pstrain up` says so, as for any change of a sync job's workers.
    # So too when its script returned without ctx.finish() or ctx.close() and exited: the
    # clock of its last beat is where it finished.
    store, up = up_with_a_checkpoint_before_rank_1_finishes(procs, "undone", ending)
    wait_until(lambda: worker_events(store, "finished"), 60, "rank 1 to finish and be let go")
    os.kill(live_server_pid(store, 0), signal.SIGKILL)  # restarted by pstrain up
    assert up.popen.wait(timeout=180) == 0, up.log()[-5000:]
    result = summary(up.log())
    assert "worker1" not in result["restarts"], result
    changes = [(c["worker"], c["change"], c["checkpoint"], c["clock"])
               for c in result["membership_changes"]]
    assert changes == [(1, "undone", ROLLED_TO, ROLLED_SHORT)], result
    assert ("worker 1's steps from clock 30 to 60 were undone by a rollback after it had "
            "finished and left") in up.log()
    assert worker_events(store, "unfinished") == []
    # What the job computed: rank 1's gradients end at the checkpoint's clock.
    expected = local_sync_run(2, ROLLED_STEPS, steps_of={1: ROLLED_TO})
    results = finals(procs, 2)
    assert results[0]["clock"] == ROLLED_STEPS
    # A script that returned waited for no one: its final pull saw an earlier model.
    for r in results if ending == FINISH_AND_WAIT else results[:1]:
        torch.testing.assert_close(torch.tensor(r["w"]), expected, atol=1e-6, rtol=0)


def test_undone_steps_are_counted_from_the_checkpoint_a_rollback_falls_back_to(
    procs: Procs,
) -> None:
    # A second checkpoint, at clock 45, is unreadable on the live shard 1: the rollback
    # first chooses it (the restarted shard 0 restored its own, sound part), then falls back
    # to the one at clock 30. Rank 1, let go at clock 60, lost its steps from 30, not 45.
    store, up = up_with_a_checkpoint_before_rank_1_finishes(procs, "fallback")
    store.request_checkpoint("late", ROLLED_TO + 15)
    wait_until(lambda: "late" in dict(store.complete_checkpoints(2)), 60, "the second one")
    corrupt(procs.workdir / "ckpt" / "fallback" / "late" / "shard-1-of-2.safetensors")
    wait_until(lambda: worker_events(store, "finished"), 60, "rank 1 to finish and be let go")
    os.kill(live_server_pid(store, 0), signal.SIGKILL)  # restarted by pstrain up
    assert up.popen.wait(timeout=180) == 0, up.log()[-5000:]
    rollback = next(e for e in store.events() if e.type == "rollback")
    assert rollback.detail["checkpoint"] == "early", rollback
    assert "late" in store.bad_checkpoints()
    changes = [(c["worker"], c["change"], c["checkpoint"], c["clock"])
               for c in summary(up.log())["membership_changes"]]
    assert changes == [(1, "undone", ROLLED_TO, ROLLED_SHORT)], changes
    expected = local_sync_run(2, ROLLED_STEPS, steps_of={1: ROLLED_TO})
    for r in finals(procs, 2):
        torch.testing.assert_close(torch.tensor(r["w"]), expected, atol=1e-6, rtol=0)


def _context(store: JobStore, rank: int, incarnation: int, world_size: int = 3
             ) -> WorkerContext:
    """A context for barriers alone: they use Redis and the client's incarnation, no server."""
    client = cast(PSClient, SimpleNamespace(incarnation=incarnation))
    store.register("worker", rank, {"incarnation": incarnation})
    return WorkerContext(rank, world_size, store.keys.job, client, store=store)


def test_a_finish_that_redis_loses_is_written_again_until_the_servers_let_go(
    procs: Procs,
) -> None:
    # Redis acknowledged the record, then came back empty before the scheduler read it (it
    # keeps its data in memory): the worker must write it again, or it waits for nothing.
    store = JobStore.connect(procs.redis().address, "lost")
    live_on = [0]  # the shards that still list the worker live
    client = cast(PSClient, SimpleNamespace(incarnation=7, clock=12,
                                            live_on=lambda: list(live_on)))
    ctx = WorkerContext(0, 1, "lost", client, store=store)
    errors: list[BaseException] = []

    def finish() -> None:
        try:
            ctx.finish(timeout_s=30)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=finish)
    thread.start()
    wait_until(lambda: store.departures()[1].get(0), 10, "the finish record")
    store.redis.flushdb()
    record = wait_until(lambda: store.departures()[1].get(0), 10, "the record written again")
    assert (record["incarnation"], record["clock"]) == (7, 12)  # type: ignore[index]
    assert 0 in store.finished_ranks()
    live_on.clear()  # the scheduler read it and the servers took the worker out
    thread.join(timeout=10)
    assert not thread.is_alive() and not errors and ctx.finished


def test_a_barrier_names_the_missing_workers_and_stops_waiting_for_finished_and_dead_ones(
    procs: Procs,
) -> None:
    store = JobStore.connect(procs.redis().address, "barrier")
    ranks = [_context(store, r, 100 + r) for r in range(3)]
    store.set_live_workers([0, 1, 2])
    with pytest.raises(BarrierTimeoutError, match=r"still missing workers \[1, 2\]"):
        ranks[0].barrier("ready", timeout_s=0.3)
    # Rank 2 finishes and the scheduler declares rank 1 dead: nobody is left to wait for.
    store.finish_worker(2, 102, clock=7)
    store.set_live_workers([0, 2])
    assert not store.claim("worker", 2, {"incarnation": 103}, 1.0)  # never run again
    started = time.monotonic()
    ranks[0].barrier("ready", timeout_s=5)
    assert time.monotonic() - started < 1.0


def test_barrier_rounds_wait_for_each_other(procs: Procs) -> None:
    store = JobStore.connect(procs.redis().address, "rounds")
    ranks = [_context(store, r, 200 + r, world_size=2) for r in range(2)]
    store.set_live_workers([0, 1])
    passed: list[tuple[int, int]] = []
    lock = threading.Lock()

    def run(rank: int) -> None:
        for epoch in range(3):
            if rank == 1:
                time.sleep(0.2)  # the slow one: rank 0 must wait for it every round
            ranks[rank].barrier("epoch", timeout_s=10)
            with lock:
                passed.append((epoch, rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    # Nobody passes round e before both have reached it.
    assert sorted(passed[:2]) == [(0, 0), (0, 1)]
    assert sorted(passed[2:4]) == [(1, 0), (1, 1)]
    assert sorted(passed[4:]) == [(2, 0), (2, 1)]
