"""The training stall a consistent checkpoint causes in async mode (checkpoint_io.py's
`--only stall` section; runnable alone).

    python benchmarks/snapshot_stall.py [--mb 1024] [--batch 1024] [--checkpoints 4]
        [--every-s 4] [--servers 2] [--workers 2] [--zipf S] [--json PATH]
        [-- extra `pstrain up` flags]

A real job on this machine: a private redis-server and `pstrain up --mode async` with two
servers and two workers (benchmarks/stall_worker.py; `--servers` and `--workers` change
how many: fewer processes than cores leave the checkpoint's write a core of its own, which
four busy processes on a 2-core machine do not). Worker 0 fills a sparse float32 table
of dim 64 with Adagrad state to about --mb MB in all (values and state, both servers
together); then both workers step as a training loop does, each step one exchange per
server (the gradients of --batch random ids, the end of the iteration, the next step's
rows), and record every step's wall-clock start and end. Every --every-s seconds this
script asks for a checkpoint through Redis, as `pstrain checkpoint` does, and waits until
every server has written its file (fsync, sha256). A step "during a checkpoint" overlaps the
time from the request to the last file written.

Figures: the median step outside checkpoints, the p99 and the longest step during them,
`snapshot_stall_p99_ratio` (p99 during / median outside; goal <= 2), and each checkpoint's
time from request to written. Extra flags after `--` go to `pstrain up` (for example the
checkpoint kinds: `-- --checkpoint-full-every 1`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from procs import free_port, wait_until  # noqa: E402

from scheduler.store import JobStore  # noqa: E402

JOB = "stall"
ROW_BYTES = 2 * 64 * 4 + 8  # value and Adagrad sum (float32 x 64) and the key


def measure(mb: float = 1024.0, batch: int = 1024, checkpoints: int = 4, every_s: float = 4.0,
            up_flags: list[str] | None = None, directory: str = "/tmp", servers: int = 2,
            workers: int = 2, zipf: float = 0.0) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="pstrain-stall-", dir=directory))
    rows = int(mb * 1e6 / ROW_BYTES)
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    out, stop = work / "out", work / "stop"
    log = (work / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "scheduler.cli", "up", "--redis", url, "--job", JOB,
         "--servers", str(servers), "--workers", str(workers),
         "--mode", "async", "--log-dir", str(work / "logs"),
         "--checkpoint-dir",
         str(work / "ckpt"), "--no-view", *(up_flags or []),
         str(REPO / "benchmarks" / "stall_worker.py"), "--", "--rows", str(rows),
         "--batch", str(batch), "--out", str(out), "--stop", str(stop), "--zipf", str(zipf)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    windows: list[tuple[float, float]] = []
    try:
        wait_until(lambda: redis.poll() is None and _store(url) is not None, 30, "redis")
        store = JobStore.connect(url, JOB)
        wait_until(lambda: all((out / f"ready-{r}").exists() for r in range(workers))
                   or up.poll(), 900, "the table to fill")
        if up.poll() is not None:
            raise RuntimeError(f"pstrain up ended early; see {work / 'up.log'}")
        time.sleep(every_s)
        for n in range(checkpoints):
            checkpoint_id = f"stall-{n}"
            start = time.time()
            store.request_checkpoint(checkpoint_id, -1)
            wait_until(lambda: len(store.checkpoint(checkpoint_id)) == servers,  # noqa: B023
                  300, f"checkpoint {checkpoint_id}")
            windows.append((start, time.time()))
            time.sleep(every_s)
        stop.touch()
        up.wait(120)
        steps = [tuple(s) for r in range(workers)
                 for s in json.loads((out / f"steps-{r}.json").read_text())]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
            up.wait(60)
        redis.terminate()
        redis.wait(30)
        log.close()
        if os.environ.get("PSTRAIN_BENCH_KEEP"):
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    def during(start: float, end: float) -> bool:
        return any(end >= a and start <= b for a, b in windows)

    inside = sorted(e - s for s, e in steps if during(s, e))
    outside = sorted(e - s for s, e in steps if not during(s, e))
    median = statistics.median(outside)
    # Where in its checkpoint each slow step (over 5x the median outside) began, in seconds
    # from the request: what holds steps up shows in when it does.
    slow_at = sorted(round(s - a, 3) for s, e in steps for a, b in windows
                     if a <= s <= b and e - s > 5 * median)
    p99 = float(np.percentile(inside, 99))
    return {
        "model_mb": round(rows * ROW_BYTES / 1e6), "batch": batch, "servers": servers,
        "workers": workers, "zipf": zipf,
        "checkpoints": checkpoints, "up_flags": up_flags or [],
        "steps_outside": len(outside), "steps_during": len(inside),
        "median_step_ms": round(median * 1e3, 2),
        "p99_step_during_checkpoint_ms": round(p99 * 1e3, 2),
        "max_step_during_checkpoint_ms": round(inside[-1] * 1e3, 2),
        "snapshot_stall_p99_ratio": round(p99 / median, 3),
        # The same figure with no checkpoint under way: how wide steps spread without one.
        "p99_outside_ratio": round(float(np.percentile(outside, 99)) / median, 3),
        "checkpoint_s": [round(b - a, 2) for a, b in windows],
        "slow_steps_at_s": slow_at,
    }


def _store(url: str) -> JobStore | None:
    try:
        store = JobStore.connect(url, JOB)
        store.spec()
        return store
    except Exception:  # not up yet
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=1024.0)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--every-s", type=float, default=4.0)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--zipf", type=float, default=0.0,
                        help="ids Zipf-ranked with this exponent (0: uniform)")
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--json", help="also write the figures to this path")
    parser.add_argument("up_flags", nargs="*", help="after --: flags for pstrain up")
    args = parser.parse_args()
    figures = measure(args.mb, args.batch, args.checkpoints, args.every_s, args.up_flags,
                      args.dir, args.servers, args.workers, args.zipf)
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
