"""`pstrain worker` without --rank: rank claims in a real Redis, and real worker processes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from procs import REPO, Proc, Procs, wait_until

from scheduler.runner import RankClaim
from scheduler.spec import JobSpec
from scheduler.store import ALL_FINISHED, NO_FREE_RANK, JobStore

JOB_WORKER = str(REPO / "tests" / "job_worker.py")


def holder(name: str) -> str:
    return json.dumps({"holder": name, "pid": 1, "host": "test"})


def test_claim_rank_takes_the_lowest_free_rank_and_never_a_finished_one(procs: Procs) -> None:
    store = JobStore.connect(procs.redis().address, "claims")
    ttl_s = 30.0
    assert [store.claim_rank(3, holder(f"w{i}"), ttl_s) for i in range(4)] == [
        0, 1, 2, NO_FREE_RANK]
    store.end_rank(1, holder("w1"), finished=True)
    store.end_rank(2, holder("w2"), finished=False)
    # Rank 1 finished, so the next claimant gets 2, the only rank left unfinished and free.
    assert store.claim_rank(3, holder("w3"), ttl_s) == 2
    assert store.claim_rank(3, holder("w4"), ttl_s) == NO_FREE_RANK
    assert store.finished_ranks() == {1}
    assert store.rank_holders(3)[2]["holder"] == "w3"
    # Ending a claim someone else holds changes nothing, finished or not.
    assert not store.end_rank(2, holder("w0"), finished=False)
    assert not store.end_rank(2, holder("w0"), finished=True)
    assert store.rank_holders(3)[2]["holder"] == "w3"
    assert store.finished_ranks() == {1}
    store.end_rank(0, holder("w0"), finished=True)
    store.end_rank(2, holder("w3"), finished=True)
    assert store.claim_rank(3, holder("w5"), ttl_s) == ALL_FINISHED
    assert store.rank_holders(3) == {}


def test_a_live_heartbeat_holds_a_rank_and_a_lapsed_claim_frees_it(procs: Procs) -> None:
    store = JobStore.connect(procs.redis().address, "beats")
    # A worker started with an explicit rank only heartbeats; claimants leave its rank alone.
    store.beat("worker", 0, {"rank": 0}, ttl_s=0.3)
    assert store.claim_rank(2, holder("a"), ttl_s=0.3) == 1
    assert store.claim_rank(2, holder("b"), ttl_s=0.3) == NO_FREE_RANK
    # worker.init()'s own claim leaves a rank held by `pstrain worker` alone as well.
    assert not store.claim("worker", 1, {"rank": 1}, ttl_s=0.3)
    wait_until(lambda: store.claim_rank(2, holder("b"), ttl_s=30) == 0, 5,
               "rank 0 to come free when its heartbeat lapses")
    # Rank 1's claim lapsed too: its holder takes it back, unless another took it first.
    wait_until(lambda: not store.rank_holders(2).get(1), 5, "rank 1's claim to lapse")
    assert store.renew_rank(1, holder("a"), ttl_s=30) == 2
    assert store.renew_rank(1, holder("a"), ttl_s=30) == 1
    assert store.renew_rank(1, holder("c"), ttl_s=30) == 0


def test_a_script_that_finishes_after_a_spare_took_its_rank_leaves_the_rank_to_the_spare(
        procs: Procs) -> None:
    # The first worker's claim and heartbeat lapse (cut off from Redis) while its script
    # trains on; a spare takes the rank and beats for it. The first script then returns:
    # its end must neither finish the rank nor drop the spare's beat.
    store = JobStore.connect(procs.redis().address, "taken")
    spec = JobSpec("taken", workers=1, heartbeat_interval_s=0.1, heartbeat_misses=3)
    first = RankClaim(store, spec, pid=101, host="a")
    assert first.acquire(wait_s=5) == 0
    store.beat("worker", 0, {"incarnation": 1, "clock": 7, "exiting": True}, ttl_s=0.3)
    spare = RankClaim(store, spec, pid=202, host="b")
    assert spare.acquire(wait_s=10) == 0  # once the first's claim and beat have lapsed
    store.beat("worker", 0, {"incarnation": 2, "clock": 3}, ttl_s=30)
    first.end(finished=True)
    assert store.finished_ranks() == set()
    assert store.departures() == (set(), {})
    assert json.loads(store.redis.get(store.keys.heartbeat("worker", 0)))["incarnation"] == 2
    assert store.rank_holders(1)[0]["pid"] == 202
    assert spare.renew()
    # The spare's own end finishes the rank, at the clock of its last beat.
    store.beat("worker", 0, {"incarnation": 2, "clock": 9, "exiting": True}, ttl_s=30)
    spare.end(finished=True)
    finished, left = store.departures()
    assert finished == {0} and left[0]["incarnation"] == 2 and left[0]["clock"] == 9
    assert store.rank_holders(1) == {}


def test_worker_init_s_own_claim_leaves_claimed_and_finished_ranks_alone(procs: Procs) -> None:
    store = JobStore.connect(procs.redis().address, "own")
    assert store.claim("worker", 0, {"rank": 0}, ttl_s=30)
    assert not store.claim("worker", 0, {"rank": 0}, ttl_s=30)  # its heartbeat holds it now
    assert store.claim_rank(3, holder("a"), ttl_s=30) == 1
    assert not store.claim("worker", 1, {"rank": 1}, ttl_s=30)
    store.end_rank(2, holder("b"), finished=True)
    assert not store.claim("worker", 2, {"rank": 2}, ttl_s=30)
    assert store.claim("server", 0, {"shard": 0}, ttl_s=30)  # other roles: the heartbeat only


def test_a_new_job_under_a_finished_job_s_name_runs_every_rank_again(procs: Procs) -> None:
    store = JobStore.connect(procs.redis().address, "again")
    store.create_job(JobSpec("again", workers=2), adopt=False)
    store.end_rank(0, holder("x"), finished=True)
    store.record_checkpoint("c1", 0, {"sha256": "0" * 64, "clock": 20})
    store.create_job(JobSpec("again", workers=2), adopt=True)  # adopting keeps its progress
    assert store.finished_ranks() == {0} and store.checkpoint_ids() == ["c1"]
    store.register("worker", 1, {"incarnation": 5})
    store.create_job(JobSpec("again", workers=2), adopt=False)
    assert store.finished_ranks() == set()
    assert store.checkpoint_ids() == [] and store.checkpoint("c1") == {}  # nothing restores it
    assert store.members("worker") == {}  # a scheduler taking over finds no one to call dead


def start_job(procs: Procs, redis: str, job: str, workers: int) -> JobStore:
    procs.pstrain(["scheduler", "--redis", redis, "--job", job, "--mode", "sync",
                   "--workers", str(workers)], "scheduler")
    store = JobStore.connect(redis, job)
    wait_until(store.leader, 30, "a leader")
    procs.pstrain(["server", "--redis", redis, "--job", job, "--bind", "127.0.0.1:0"], "server")
    wait_until(lambda: store.heartbeats("server", [0])[0], 60, "the server")
    return store


def claiming_worker(procs: Procs, redis: str, job: str, out: Path, steps: int,
                    name: str, *script_args: str) -> Proc:
    return procs.pstrain(["worker", "--redis", redis, "--job", job, JOB_WORKER, "--steps",
                          str(steps), "--out", str(out), "--sleep-ms", "10", *script_args],
                         name)


def claimed_by(store: JobStore, pid: int) -> int | None:
    for e in store.events():
        if e.type == "claimed" and e.detail.get("pid") == pid:
            return int(e.member)
    return None


def await_claim(store: JobStore, proc: Proc, timeout_s: float = 60.0) -> int:
    """The rank `proc` (a `pstrain worker`) claims, once it has."""
    wait_until(lambda: claimed_by(store, proc.pid) is not None, timeout_s,
               f"process {proc.pid} to claim a rank")
    rank = claimed_by(store, proc.pid)
    assert rank is not None
    return rank


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_workers_without_ranks_share_the_job_and_a_spare_takes_a_dead_one_s_rank(
    procs: Procs,
) -> None:
    redis = procs.redis().address
    store = start_job(procs, redis, "spare", workers=2)
    out = procs.workdir / "out"
    steps = 120
    # The first one's script returns without ctx.finish() or ctx.close().
    first = [claiming_worker(procs, redis, "spare", out, steps, f"w{i}",
                             *(("--end", "return") if i == 0 else ())) for i in range(2)]
    assert sorted(await_claim(store, p) for p in first) == [0, 1]
    spare = claiming_worker(procs, redis, "spare", out, steps, "spare")
    wait_until(lambda: "waiting as a spare" in spare.log(), 60, "the spare to wait")
    wait_until(lambda: store.heartbeats("server", [0])[0]["open_clock"] >= 10,  # type: ignore[index]
               60, "training")
    victim = first[1]
    rank = await_claim(store, victim)
    script_pid = int(store.members("worker")[rank]["pid"])
    assert script_pid != victim.pid  # the script runs as the claimant's child
    killed_at = time.time()
    procs.kill(victim, signal.SIGKILL)
    # The script dies with its `pstrain worker`, and the spare takes the rank over.
    wait_until(lambda: not alive(script_pid), 10, "the script to die with its parent")
    assert await_claim(store, spare, 20) == rank
    # The spare claims when the rank's claim lapses, which need not wait for the scheduler's
    # verdict; the verdict must still come.
    wait_until(lambda: any(e.type == "dead" and e.member == str(rank) and e.time_s >= killed_at
                           for e in store.events()), 10, "the scheduler to declare it dead")
    for proc in (first[0], spare):
        assert proc.popen.wait(timeout=120) == 0, proc.log()
    assert store.finished_ranks() == {0, 1}
    finals = [json.loads((out / f"worker{r}.json").read_text()) for r in range(2)]
    assert [f["clock"] for f in finals] == [steps, steps]
    # Both finishes are on the record with their clock, the returned script's too.
    assert {r: v["clock"] for r, v in store.departures()[1].items()} == {0: steps, 1: steps}
    # Every rank has finished: a worker started now has nothing to run and says so.
    late = claiming_worker(procs, redis, "spare", out, steps, "late")
    assert late.popen.wait(timeout=60) == 0
    assert "every rank (0..1) of job 'spare' has finished" in late.log()


@pytest.mark.parametrize(("flags", "message"), [
    (["--rank-wait-s", "-1"], "--rank-wait-s must be >= 0 (0: no limit), got -1"),
    (["--metrics-port", "70000"], "--metrics-port must be in [0, 65535], got 70000"),
])
def test_bad_worker_flags_are_refused_naming_the_value(procs: Procs, flags: list[str],
                                                       message: str) -> None:
    redis = procs.redis().address
    proc = procs.pstrain(["worker", "--redis", redis, "--job", "bad", *flags, JOB_WORKER],
                         "bad")
    assert proc.popen.wait(timeout=30) == 2
    assert message in proc.log()
    assert JobStore.connect(redis, "bad").redis.keys("*") == []


def test_missing_script_and_missing_job_are_named(procs: Procs) -> None:
    redis = procs.redis().address
    proc = procs.pstrain(["worker", "--redis", redis, "--job", "none", "nope.py"], "noscript")
    assert proc.popen.wait(timeout=30) == 2
    assert "training script 'nope.py' not found" in proc.log()
    proc = procs.pstrain(["worker", "--redis", redis, "--job", "none", "--spec-wait-s", "0.5",
                          JOB_WORKER], "nojob")
    assert proc.popen.wait(timeout=30) == 2
    assert "job 'none' has no spec in Redis" in proc.log()
    assert JobStore.connect(redis, "none").redis.keys("*") == []
