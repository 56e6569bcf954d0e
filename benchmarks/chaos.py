"""Fault runs: `pstrain up --restart` jobs of the MovieLens example under random faults.

    python benchmarks/chaos.py [--modes sync,async,ssp:2] [--seed 1] [--epochs 20]
                               [--faults kill,pause,redis] [--servers 2] [--workers 2]
                               [--backups 0] [--json PATH]

Per mode, with its own redis-server: `pstrain up --restart` of examples/movielens.py on 2
servers and 2 workers (or --servers, --workers, with --backups; batch 128; checkpoints every
40 clocks in sync mode, every 4 s in the others). From 12 s in until the job ends, every
4-12 s one live server, worker or the leading scheduler (pids from `pstrain status --json`)
is SIGKILLed, or SIGSTOPped for 1-14 s and then continued, or Redis is SIGKILLed and started
again empty on its port after 1-8 s, or SIGSTOPped for 1-8 s (--faults picks which kinds;
seeded). What each run reports: the faults, the exit status (0 expected), each worker's test
AUC, restarts, the ERROR lines and tracebacks in every log (none expected), the WARNING
lines by kind, and the widest spread of the clocks the shards of one checkpoint were taken
at (`checkpoint_clock_spread_max`: a shard whose clock stopped following the workers shows
here; read from the job's events, so only of checkpoints taken since Redis last came back
empty). Prints a table and writes JSON to benchmarks/results/chaos-<date>.json (or --json
PATH). Runs minutes; not part of the tests.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from procs import Proc, Procs, wait_until  # noqa: E402
from saved import save  # noqa: E402

from scheduler.store import JobStore  # noqa: E402

PSTRAIN = [sys.executable, "-m", "scheduler.cli"]


def targets(redis: str, job: str) -> list[tuple[str, int, int]]:
    """(role, id, pid) of every live server and worker, and of the leading scheduler."""
    done = subprocess.run([*PSTRAIN, "status", "--redis", redis, "--job", job, "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=30, check=False)
    try:
        status = json.loads(done.stdout)
    except json.JSONDecodeError:
        return []
    found = [(p["role"], int(p["id"]), int(p["pid"])) for p in status.get("processes", [])
             if p.get("alive") and p.get("pid")]
    if status.get("leader"):
        found.append(("scheduler", 0, int(str(status["leader"]).split(":")[1])))
    return found


def fault(rng: random.Random, kinds: list[str], procs: Procs, redis: Proc,
          job: str) -> tuple[list[object] | None, Proc]:
    """One fault: on a random live process, or on Redis (SIGKILLed and started again empty
    on its port, or SIGSTOPped, for 1-8 s). What was done (None if nothing was live), and
    the Redis process from then on."""
    kind = rng.choice(kinds)
    if kind == "redis":
        span = round(rng.uniform(1.0, 8.0), 1)
        if rng.random() < 0.5:
            procs.kill(redis)
            time.sleep(span)
            return ["redis-restart-empty", span], procs.redis(redis.port)
        os.kill(redis.pid, signal.SIGSTOP)
        time.sleep(span)
        os.kill(redis.pid, signal.SIGCONT)
        return ["redis-pause", span], redis
    live = targets(redis.address, job)
    if not live:
        return None, redis
    role, ident, pid = rng.choice(live)
    try:
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
            return ["kill", role, ident], redis
        span = round(rng.uniform(1.0, 14.0), 1)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(span)
        os.kill(pid, signal.SIGCONT)
        return ["pause", role, ident, span], redis
    except ProcessLookupError:
        return None, redis


def log_lines(logs: Path) -> tuple[list[str], dict[str, int]]:
    """ERROR lines and tracebacks of every log, and WARNING lines counted by kind (numbers
    taken out)."""
    errors: list[str] = []
    warnings: collections.Counter[str] = collections.Counter()
    for path in sorted(logs.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if " ERROR " in line or line.startswith("Traceback"):
                errors.append(f"{path.name}: {line[:300]}")
            elif " WARNING " in line:
                kind = re.sub(r"\d+", "N", line.split(" WARNING ", 1)[1])[:200]
                warnings[kind] += 1
    return errors, dict(warnings.most_common())


def clock_spread(store: JobStore) -> int:
    """The widest spread of the clocks the shards of one checkpoint were taken at."""
    clocks: dict[str, list[int]] = collections.defaultdict(list)
    for event in store.events(count=100_000):
        if event.type == "checkpoint":
            clocks[str(event.detail["checkpoint"])].append(int(event.detail["clock"]))
    return max((max(c) - min(c) for c in clocks.values() if len(c) > 1), default=0)


def run(procs: Procs, mode: str, seed: int, epochs: int, kinds: list[str], servers: int,
        workers: int, backups: int) -> dict[str, Any]:
    redis_proc = procs.redis()
    redis = redis_proc.address
    job = f"chaos-{mode.replace(':', '')}"
    out = procs.workdir / job
    every = ["--checkpoint-every-clocks", "40"] if mode == "sync" else [
        "--checkpoint-every-s", "4"]
    up = procs.pstrain(["up", "--redis", redis, "--job", job, "--servers", str(servers),
                        "--workers", str(workers), "--backups", str(backups),
                        "--mode", mode, "--restart", "--checkpoint-dir", str(out / "ckpt"),
                        *every, "--log-dir", str(out / "logs"), "--no-view",
                        str(REPO / "examples" / "movielens.py"), "--", "--epochs", str(epochs),
                        "--batch-size", "128"], f"up-{job}")
    store = JobStore.connect(redis, job)
    rng = random.Random(seed)
    faults: list[list[object]] = []
    started = time.monotonic()
    wait_until(lambda: up.popen.poll() is not None or time.monotonic() - started > 12, 30,
               "the job to start")
    while up.popen.poll() is None:
        done, redis_proc = fault(rng, kinds, procs, redis_proc, job)
        if done is not None:
            faults.append(done)
            print(f"  {mode}: {done}", flush=True)
        end = time.monotonic() + rng.uniform(4.0, 12.0)
        while up.popen.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
    code = up.popen.wait()
    summary = json.loads(up.log().strip().splitlines()[-1])
    aucs = [json.loads(line.split(": ", 1)[1])["test_auc"]
            for line in up.log().splitlines() if re.match(r"worker \d+: \{", line)]
    errors, warnings = log_lines(out / "logs")
    return {"mode": mode, "seed": seed, "epochs": epochs, "servers": servers, "workers": workers,
            "backups": backups, "exit_status": code,
            "seconds": round(time.monotonic() - started, 1), "faults": faults,
            "test_auc": aucs, "restarts": summary.get("restarts", {}),
            "membership_changes": len(summary.get("membership_changes", [])),
            "errors": errors, "warnings": warnings,
            "checkpoint_clock_spread_max": clock_spread(store)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="sync,async,ssp:2")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--faults", default="kill,pause",
                   help="comma-separated: kill, pause, redis (each fault picks one)")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--backups", type=int, default=0,
                   help="backup workers of a sync job (the slowest gradients of a step dropped)")
    p.add_argument("--json", default=None, metavar="PATH")
    a = p.parse_args()
    kinds = a.faults.split(",")
    if not kinds or set(kinds) - {"kill", "pause", "redis"}:
        p.error(f"--faults must list some of kill, pause and redis, got {a.faults!r}")
    procs = Procs(Path(tempfile.mkdtemp(prefix="pstrain-chaos-")))
    runs = []
    try:
        for i, mode in enumerate(a.modes.split(",")):
            runs.append(run(procs, mode, a.seed + i, a.epochs, kinds, a.servers, a.workers,
                            a.backups))
    finally:
        procs.close()
    print(f"{'mode':<8}{'exit':>5}{'faults':>8}{'restarts':>10}{'errors':>8}{'spread':>8}  AUC")
    for r in runs:
        print(f"{r['mode']:<8}{r['exit_status']:>5}{len(r['faults']):>8}"
              f"{sum(r['restarts'].values()):>10}{len(r['errors']):>8}"
              f"{r['checkpoint_clock_spread_max']:>8}  {r['test_auc']}")
    save({"date": datetime.date.today().isoformat(), "runs": runs},
         f"chaos-{datetime.date.today().isoformat()}", a.json)


if __name__ == "__main__":
    main()
