"""Failover benchmark: how fast deaths are noticed, that pauses are not taken for deaths,
how long a job takes to start, and how fast training recovers.

    python benchmarks/failover.py [--kills 10] [--false-death-runs 20] [--hogs 2]
                                  [--startup-runs 3] [--json PATH]

With a real redis-server, a scheduler, one server and two workers (async, as processes):
- detection: `kill -9` of a worker, time from the kill to the scheduler's dead event in
  Redis, over --kills kills (the worker is restarted after each); median and max. Heartbeats
  every 0.5 s, suspect after 3 missed, dead once its connection closed: the defaults.
- false deaths: --false-death-runs `pstrain up` jobs (sync, 2 servers, 2 workers, default
  settings) beside a CPU hog of --hogs busy loops, each with worker 1 SIGSTOPped for 3x the
  heartbeat's TTL once; a dead event of any process before the workers finished is a false
  death. Also the longest gap between two heartbeats of a process that was not paused
  (`beat_gap_s_max`): the pauses that load alone causes.
- start-up: what `pstrain up` (2 servers, 2 workers, TLS on: the defaults) spends from its
  start to the first closed sync clock, median over --startup-runs runs without a hog.
- server recovery: `kill -9` of the server, restarted at once as a supervisor would, from the
  kill until the servers apply pushes again (the server restores its checkpoint and the
  workers find its new address in Redis).
- checkpoint write and restore rate (MB/s) of a 1 GB shard, as benchmarks/checkpoint_io.py
  measures it (fsync and sha256 included; restore from a cold page cache).
Prints a table and writes JSON to benchmarks/results/failover-<date>.json (and --json PATH).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from checkpoint_io import drop_cache, make_state  # noqa: E402
from procs import Proc, Procs, wait_until  # noqa: E402
from saved import save  # noqa: E402

from ps.checkpoint import read_shard, write_shard  # noqa: E402
from scheduler.spec import JobSpec  # noqa: E402
from scheduler.store import JobStore  # noqa: E402
from worker.client import PSClient  # noqa: E402

JOB_WORKER = str(REPO / "tests" / "job_worker.py")


def pushes(address: str) -> int:
    with PSClient([address], connect_timeout_s=2.0) as client:
        return sum(t.pushes_applied for t in client.stats()[0].tables)


def dead_after(store: JobStore, member: int, since: float) -> float | None:
    for e in store.events():
        if e.type == "dead" and e.role == "worker" and e.member == str(member) \
                and e.time_s >= since:
            return e.time_s
    return None


def measure_failover(procs: Procs, kills: int) -> dict[str, object]:
    redis = procs.redis().address
    job = "failover"
    ckpt = procs.workdir / "ckpt"
    procs.pstrain(["scheduler", "--redis", redis, "--job", job, "--workers", "2",
                   "--checkpoint-dir", str(ckpt), "--checkpoint-every-s", "1"], "scheduler")
    store = JobStore.connect(redis, job)
    wait_until(store.leader, 30, "a leader")
    server_args = ["server", "--redis", redis, "--job", job, "--shard", "0", "--bind",
                   "127.0.0.1:0"]
    server = procs.pstrain(server_args, "server")
    wait_until(lambda: store.heartbeats("server", [0])[0], 60, "the server")

    def start_worker(rank: int) -> object:
        return procs.pstrain(["worker", "--redis", redis, "--job", job, "--rank", str(rank),
                              JOB_WORKER, "--steps", "100000000", "--sleep-ms", "10",
                              "--out", str(procs.workdir / "out")], f"worker{rank}")

    workers = {r: start_worker(r) for r in range(2)}
    wait_until(lambda: all(store.heartbeats("worker", [0, 1]).values()), 60, "the workers")
    detections = []
    for i in range(kills):
        victim = workers[1]
        time.sleep(0.2 + 0.37 * (i % 4))  # kills land at different points of the beat
        killed = time.time()
        procs.kill(victim, signal.SIGKILL)  # type: ignore[arg-type]
        at = wait_until(lambda k=killed: dead_after(store, 1, k), 20, "the dead event")
        detections.append(float(at) - killed)  # type: ignore[arg-type]
        print(f"  kill {i + 1}: dead event after {detections[-1]:.2f} s", flush=True)
        workers[1] = start_worker(1)
        wait_until(lambda k=killed: any(e.type == "joined" and e.member == "1" and
                                        e.time_s > k for e in store.events()), 60, "rejoin")

    wait_until(lambda: store.latest_checkpoint(1), 60, "a checkpoint")
    address = str(store.heartbeats("server", [0])[0]["address"])  # type: ignore[index]
    wait_until(lambda: pushes(address) > 0, 30, "pushes")
    killed = time.time()
    procs.kill(server, signal.SIGKILL)  # type: ignore[arg-type]
    server = procs.pstrain(server_args, "server-again")

    def resumed() -> bool:
        beat = store.heartbeats("server", [0])[0]
        if beat is None or beat["address"] == address:
            return False
        try:
            return pushes(str(beat["address"])) > 0
        except Exception:  # not serving yet
            return False

    wait_until(resumed, 120, "training to resume on the restarted server")
    recovery = time.time() - killed
    print(f"  server kill: training resumed after {recovery:.2f} s", flush=True)
    return {"detections_s": detections, "server_recovery_s": recovery}


def hog(procs: Procs, count: int, seconds: float) -> list[Proc]:
    """`count` busy loops that end by themselves after `seconds` (the caller kills them by
    pid before that)."""
    loop = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    return [procs.spawn([sys.executable, "-c", loop], f"hog{k}") for k in range(count)]


@dataclass(frozen=True)
class Run:
    """What one `pstrain up` job run showed."""

    exit_status: int
    startup_s: float | None  # from the start to the first closed sync clock
    beat_gap_s_max: float  # the longest gap between two beats of a process not paused
    false_deaths: tuple[str, ...]  # "role id" of each dead event before the workers finished


def up_run(procs: Procs, redis: str, job: str, steps: int, hogs: int, pause_s: float,
           timeout_s: float = 300.0) -> Run:
    """One `pstrain up` sync job (2 servers, 2 workers, default settings) beside `hogs` busy
    loops, worker 1 SIGSTOPped for `pause_s` once it passed clock 40 (0: not paused).

    Samples every heartbeat each 50 ms: the seconds from the start to the first closed clock,
    the longest gap between two beats of a process that was not paused, and the dead events
    before the workers finished (false deaths: nothing was killed)."""
    out = procs.workdir / job
    hogging = hog(procs, hogs, timeout_s) if hogs else []
    try:
        started = time.time()
        up = procs.pstrain(["up", "--redis", redis, "--job", job, "--servers", "2", "--workers",
                            "2", "--mode", "sync", "--no-view", "--log-dir", str(out / "logs"),
                            JOB_WORKER, "--", "--steps", str(steps), "--sleep-ms", "20",
                            "--out", str(out)], f"up-{job}")
        store = JobStore.connect(redis, job)
        first_step: float | None = None
        last: dict[tuple[str, int, object], float] = {}
        gap_max = 0.0
        paused: tuple[int, float, float] | None = None  # (pid, from, until), wall clock
        continued = False
        while up.popen.poll() is None and time.time() - started < timeout_s:
            now = time.time()
            beats = [(("server", k), b) for k, b in store.heartbeats("server", [0, 1]).items()]
            beats += [(("worker", r), b) for r, b in store.heartbeats("worker", [0, 1]).items()]
            for (role, ident), beat in beats:
                if beat is None:
                    continue
                if role == "server" and first_step is None and int(beat["open_clock"]) >= 1:
                    first_step = now - started
                key = (role, ident, beat.get("incarnation"))
                at = float(beat["time"])
                before = last.get(key)
                last[key] = at
                stopped = paused is not None and role == "worker" and ident == 1 and \
                    before is not None and before <= paused[2] and at >= paused[1]
                if before is not None and at > before and not stopped:
                    gap_max = max(gap_max, at - before)
                if pause_s and paused is None and role == "worker" and ident == 1 and \
                        int(beat.get("clock", 0)) >= 40:
                    pid = int(beat["pid"])
                    os.kill(pid, signal.SIGSTOP)
                    paused = (pid, now, now + pause_s)
            if paused is not None and not continued and now >= paused[2]:
                os.kill(paused[0], signal.SIGCONT)
                continued = True
            time.sleep(0.05)
        if paused is not None and not continued:
            os.kill(paused[0], signal.SIGCONT)
        code = up.popen.wait(timeout=max(1.0, timeout_s - (time.time() - started)))
    finally:
        for proc in hogging:
            procs.kill(proc)
    results = [out / f"worker{r}.json" for r in range(2)]
    done = min((p.stat().st_mtime for p in results if p.exists()), default=time.time())
    false = [f"{e.role} {e.member}" for e in store.events(count=100_000)
             if e.type == "dead" and e.time_s < done]
    return Run(code, first_step, gap_max, tuple(false))


def measure_false_deaths(procs: Procs, runs: int, hogs: int, steps: int, pause_s: float
                         ) -> list[Run]:
    redis = procs.redis().address
    found = []
    for i in range(runs):
        run = up_run(procs, redis, f"hog{i}", steps, hogs, pause_s)
        found.append(run)
        print(f"  run {i + 1}: exit {run.exit_status}, false deaths {list(run.false_deaths)}, "
              f"longest beat gap {run.beat_gap_s_max:.2f} s", flush=True)
    return found


def measure_startup(procs: Procs, runs: int, steps: int) -> list[float]:
    redis = procs.redis().address
    found = []
    for i in range(runs):
        run = up_run(procs, redis, f"start{i}", steps, hogs=0, pause_s=0.0)
        if run.startup_s is None:
            raise RuntimeError(f"start-up run {i}: no step was made (exit {run.exit_status})")
        found.append(run.startup_s)
        print(f"  start-up {i + 1}: first step after {found[-1]:.1f} s", flush=True)
    return found


def measure_checkpoint_io(mb: float, reps: int) -> tuple[float, float]:
    tmp = Path(tempfile.mkdtemp(prefix="pstrain-failover-"))
    try:
        state = make_state(mb)
        nbytes = sum(t.numel() * t.element_size() for tab in state.tables
                     for t in tab.tensors.values())
        write_shard(tmp, state)  # untimed: first touch of fresh memory is slow on a VM
        writes, reads = [], []
        for _ in range(reps):
            start = time.perf_counter()
            written = write_shard(tmp, state)
            writes.append(nbytes / (time.perf_counter() - start) / 1e6)
            drop_cache(Path(written.path))
            start = time.perf_counter()
            read_shard(written.path, written.sha256)
            reads.append(nbytes / (time.perf_counter() - start) / 1e6)
        return statistics.median(writes), statistics.median(reads)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--false-death-runs", type=int, default=20,
                   help="jobs run beside a CPU hog, each with a worker paused once")
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 2,
                   help="busy loops of the CPU hog (default: one per core)")
    p.add_argument("--steps", type=int, default=400, help="steps of each job run")
    p.add_argument("--startup-runs", type=int, default=3)
    p.add_argument("--checkpoint-mb", type=float, default=1024.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="also write the figures to this path")
    p.add_argument("--tag", default="",
                   help="suffix of the results file's name (e.g. quick, for a short run)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pstrain-failover-"))
    procs = Procs(work)
    spec = JobSpec("defaults")
    pause_s = 3 * spec.heartbeat_ttl_s
    try:
        print(f"start-up of pstrain up over {a.startup_runs} runs ...", flush=True)
        startups = measure_startup(procs, a.startup_runs, a.steps)
        print(f"false deaths over {a.false_death_runs} runs beside {a.hogs} busy loops, a "
              f"worker paused {pause_s:.1f} s in each ...", flush=True)
        hogged = measure_false_deaths(procs, a.false_death_runs, a.hogs, a.steps, pause_s)
        print(f"failure detection over {a.kills} kills ...", flush=True)
        failover = measure_failover(procs, a.kills)
    finally:
        procs.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"checkpoint I/O of a {a.checkpoint_mb:.0f} MB shard ...", flush=True)
    write_mbps, read_mbps = measure_checkpoint_io(a.checkpoint_mb, a.reps)
    detections = failover["detections_s"]
    assert isinstance(detections, list)
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "heartbeat_interval_s": spec.heartbeat_interval_s,
        "heartbeat_misses": spec.heartbeat_misses, "suspect_timeout_s": spec.suspect_timeout_s,
        "startup_s": statistics.median(startups), "startup_s_runs": startups,
        "false_deaths": sum(len(r.false_deaths) for r in hogged),
        "false_death_runs": len(hogged), "hogs": a.hogs, "pause_s": pause_s,
        "false_death_failed_runs": sum(1 for r in hogged if r.exit_status != 0),
        "beat_gap_s_max": max((r.beat_gap_s_max for r in hogged), default=None),
        "detection_s_median": statistics.median(detections),
        "detection_s_max": max(detections),
        "detections_s": detections,
        "server_recovery_s": failover["server_recovery_s"],
        "checkpoint_write_MBps": write_mbps,
        "checkpoint_restore_MBps": read_mbps,
    }
    print(f"\nfailover, {results['date']}, {results['machine']}")
    print(f"  start-up of pstrain up (2 servers, 2 workers) to the first step: median "
          f"{results['startup_s']:.1f} s over {len(startups)} runs")
    print(f"  false deaths beside {a.hogs} busy loops, a worker paused {pause_s:.1f} s: "
          f"{results['false_deaths']} in {len(hogged)} runs (goal 0); failed runs "
          f"{results['false_death_failed_runs']}; longest beat gap of an unpaused process "
          f"{results['beat_gap_s_max']:.2f} s")
    print(f"  detection: median {results['detection_s_median']:.2f} s, max "
          f"{results['detection_s_max']:.2f} s over {len(detections)} kills (goal: median <= 2 s)")
    print(f"  server kill to training resumed: {results['server_recovery_s']:.2f} s")
    print(f"  checkpoint of {a.checkpoint_mb:.0f} MB: write {write_mbps:.0f} MB/s, restore "
          f"{read_mbps:.0f} MB/s")
    tag = f"-{a.tag}" if a.tag else ""
    save(results, f"failover-{results['date']}{tag}", a.json)


if __name__ == "__main__":
    main()
