"""Failover benchmark: how fast deaths are noticed and training recovers.

    python benchmarks/failover.py [--kills 10] [--json PATH]

With a real redis-server, a scheduler, one server and two workers (async, as processes):
- detection: `kill -9` of a worker, time from the kill to the scheduler's dead event in
  Redis, over --kills kills (the worker is restarted after each); median and max. Heartbeats
  every 0.5 s, dead after 3 missed: the defaults.
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
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from checkpoint_io import drop_cache, make_state  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

from ps.checkpoint import read_shard, write_shard  # noqa: E402
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
    p.add_argument("--checkpoint-mb", type=float, default=1024.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="also write the figures to this path")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pstrain-failover-"))
    procs = Procs(work)
    try:
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
        "heartbeat_interval_s": 0.5, "heartbeat_misses": 3,
        "detection_s_median": statistics.median(detections),
        "detection_s_max": max(detections),
        "detections_s": detections,
        "server_recovery_s": failover["server_recovery_s"],
        "checkpoint_write_MBps": write_mbps,
        "checkpoint_restore_MBps": read_mbps,
    }
    print(f"\nfailover, {results['date']}, {results['machine']}")
    print(f"  detection: median {results['detection_s_median']:.2f} s, max "
          f"{results['detection_s_max']:.2f} s over {len(detections)} kills (goal: median <= 2 s)")
    print(f"  server kill to training resumed: {results['server_recovery_s']:.2f} s")
    print(f"  checkpoint of {a.checkpoint_mb:.0f} MB: write {write_mbps:.0f} MB/s, restore "
          f"{read_mbps:.0f} MB/s")
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"failover-{results['date']}.json"] + ([Path(a.json)] if a.json else [])
    for path in paths:
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
