"""Consistency benchmark: the modes' speed with a straggler, and what they converge to.

    python benchmarks/consistency.py [--quick] [--json PATH]

Five workers (four plus one backup), computation simulated by a sleep so the two cores are
not the bottleneck, worker 4 made 5x slower. In one run:
- steps/s of sync without a backup, sync with one backup, ssp (s=3) and async, beside sync
  with no straggler. A step is one iteration of the non-straggler workers (for sync, one
  closed clock); the figure is their mean rate.
- a seeded logistic-regression problem with a planted model: each mode's full-data loss after
  the same number of samples, beside plain single-process SGD on the same samples. Sync
  averages the quorum's gradients, so it uses learning rate lr; ssp and async apply every
  worker's gradient, so they use lr / workers, the same step per sample.
Prints a table, saves JSON and a PNG under benchmarks/results/ (and --json PATH).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from saved import save  # noqa: E402

from worker.client import PSClient  # noqa: E402

WORKERS = 5
STRAGGLER = 4


@dataclass(frozen=True)
class Run:
    name: str
    mode: str
    backups: int
    straggler: bool


RUNS = [
    Run("sync, no straggler", "sync", 0, False),
    Run("sync", "sync", 0, True),
    Run("sync, 1 backup", "sync", 1, True),
    Run("ssp s=3", "ssp:3", 0, True),
    Run("async", "async", 0, True),
]


# ---- the problem --------------------------------------------------------------------------


def problem(samples: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded features, a planted weight vector and Bernoulli labels drawn from it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, dim, generator=gen)
    w_true = torch.randn(dim, generator=gen)
    y = torch.bernoulli(torch.sigmoid(x @ w_true), generator=gen)
    return x, y, w_true


def loss_of(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y))


def gradient(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.T @ (torch.sigmoid(x @ w) - y) / len(y)


# ---- worker process -----------------------------------------------------------------------


def work(args: argparse.Namespace) -> None:
    """One worker: pull w, compute a logistic-regression gradient (and sleep), push, tick."""
    torch.set_num_threads(1)
    x, y, _ = problem(args.samples, args.dim)
    mine = torch.arange(args.rank, len(y), WORKERS)
    x, y = x[mine], y[mine]
    client = PSClient(args.servers.split(","), worker=args.rank, timeout_s=120)
    client.declare_dense("w", (args.dim,), optimizer="sgd", lr=args.lr, init=("zeros", 0, 0))
    sleep_s = args.compute_ms / 1000 * (5 if args.rank == STRAGGLER and args.straggler else 1)
    done_at: list[float] = []
    batch, i = args.batch, 0
    # Until the job's clock reaches the target: a straggler that jumps ahead stops with it.
    while client.clock < args.iterations:
        w = client.pull_dense("w")
        start = (i * batch) % len(y)
        i += 1
        g = gradient(w, x[start : start + batch], y[start : start + batch])
        time.sleep(sleep_s)
        client.push_dense("w", g)
        client.end_iteration()
        done_at.append(time.time())
    Path(args.out).write_text(json.dumps({"rank": args.rank, "done_at": done_at,
                                          "dropped": client.dropped_pushes}))
    client.close()


# ---- driver -------------------------------------------------------------------------------


def start_server(tmp: Path, run: Run) -> tuple[subprocess.Popen[bytes], str]:
    ready = tmp / f"server-{time.monotonic_ns()}.ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ps", "--bind", "127.0.0.1:0", "--ready-file", str(ready),
         "--mode", run.mode, "--workers", str(WORKERS), "--backups", str(run.backups),
         "--log-level", "WARNING"],
        cwd=REPO,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["address"]


def run_mode(tmp: Path, run: Run, *, iterations: int, lr: float,
             compute_ms: float, samples: int, dim: int, batch: int) -> dict[str, object]:
    server, address = start_server(tmp, run)
    try:
        outs = [tmp / f"w{r}-{time.monotonic_ns()}.json" for r in range(WORKERS)]
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, "--work", "--servers", address, "--rank", str(r),
                 "--out", str(outs[r]), "--iterations", str(iterations), "--lr", str(lr),
                 "--compute-ms", str(compute_ms),
                 "--samples", str(samples), "--dim", str(dim), "--batch", str(batch)]
                + (["--straggler"] if run.straggler else []),
                cwd=REPO,
            )
            for r in range(WORKERS)
        ]
        for proc in workers:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"a worker of {run.name} failed")
        results = [json.loads(o.read_text()) for o in outs]
        with PSClient([address]) as client:
            client.declare_dense("w", (dim,), optimizer="sgd", lr=lr, init=("zeros", 0, 0))
            w = client.pull_dense("w", clock=0)
            stats = client.stats()[0]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    fast = [r for r in results if not (run.straggler and r["rank"] == STRAGGLER)]
    rates = []
    for r in fast:
        times = r["done_at"]
        # Skip the first iterations (process start-up, first declare) for a steady rate.
        skip = len(times) // 5
        if len(times) - skip >= 2:
            rates.append((len(times) - 1 - skip) / (times[-1] - times[skip]))
    return {"steps_per_s": statistics.mean(rates) if rates else 0.0, "w": w,
            "dropped": sum(r["dropped"] for r in results),
            "clocks_closed": stats.clocks_closed}


def local_sgd(samples: int, dim: int, batch: int, lr: float, iterations: int) -> torch.Tensor:
    """Plain single-process SGD on the samples the workers see: WORKERS x batch a step."""
    x, y, _ = problem(samples, dim)
    shards = [torch.arange(r, len(y), WORKERS) for r in range(WORKERS)]
    w = torch.zeros(dim)
    for i in range(iterations):
        grads = []
        for idx in shards:
            start = (i * batch) % len(idx)
            part = idx[start : start + batch]
            grads.append(gradient(w, x[part], y[part]))
        w -= lr * torch.stack(grads).mean(0)
    return w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--json", help="also write the figures to this path")
    parser.add_argument("--work", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--servers", "--out"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    for flag, kind in (("--rank", int), ("--iterations", int),
                       ("--lr", float), ("--compute-ms", float), ("--samples", int),
                       ("--dim", int), ("--batch", int)):
        parser.add_argument(flag, type=kind, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--straggler", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.work:
        work(args)
        return

    torch.set_num_threads(1)
    steps = 60 if args.quick else 150
    samples, dim, batch, lr = 20_000, 20, 32, 0.5
    # Before convergence (local loss ~0.366, optimum ~0.336), so staleness and drops can show.
    iterations = 30
    tmp = Path(tempfile.mkdtemp(prefix="pstrain-consistency-"))
    speed: dict[str, float] = {}
    print(f"speed: {WORKERS} workers, 20 ms of compute, worker {STRAGGLER} 5x slower, "
          f"{steps} steps a mode", flush=True)
    for run in RUNS:
        r = run_mode(tmp, run, iterations=steps, lr=lr, compute_ms=20.0,
                     samples=samples, dim=dim, batch=batch)
        speed[run.name] = float(r["steps_per_s"])  # type: ignore[arg-type]
        print(f"  {run.name:<20} {speed[run.name]:6.2f} steps/s", flush=True)

    print(f"loss: logistic regression, {samples} samples x {dim}, {iterations} iterations of "
          f"{batch} per worker", flush=True)
    x, y, w_true = problem(samples, dim)
    local = loss_of(local_sgd(samples, dim, batch, lr, iterations), x, y)
    losses: dict[str, float] = {}
    for run in RUNS[1:]:
        run_lr = lr if run.mode == "sync" else lr / WORKERS
        r = run_mode(tmp, run, iterations=iterations, lr=run_lr, compute_ms=2.0,
                     samples=samples, dim=dim, batch=batch)
        assert isinstance(r["w"], torch.Tensor)
        losses[run.name] = loss_of(r["w"], x, y)
        print(f"  {run.name:<20} loss {losses[run.name]:.5f} (local {local:.5f})", flush=True)

    key = {"sync, no straggler": "sync_no_straggler", "sync": "sync", "sync, 1 backup":
           "sync_backup", "ssp s=3": "ssp", "async": "async"}
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "quick": args.quick,
        "backup_ratio": speed["sync, 1 backup"] / speed["sync, no straggler"],
        "steps_per_s": {key[k]: v for k, v in speed.items()},
        "loss": {key[k]: v for k, v in losses.items()} | {"local": local,
                                                          "planted": loss_of(w_true, x, y)},
        "loss_ratio": {key[k]: v / local for k, v in losses.items()},
    }
    print_table(results)
    stem = f"consistency-{results['date']}{'-quick' if args.quick else ''}"
    picture = save(results, stem, args.json).with_suffix(".png")
    plot(results, picture)
    print(f"wrote {picture}")


def print_table(r: dict[str, object]) -> None:
    steps, ratio = r["steps_per_s"], r["loss_ratio"]
    assert isinstance(steps, dict) and isinstance(ratio, dict)
    print(f"\nconsistency modes, {r['date']}, {r['machine']}")
    print(f"{'mode':<20}{'steps/s':>9}{'vs no straggler':>17}{'loss / local':>14}")
    base = steps["sync_no_straggler"]
    for k, v in steps.items():
        lr = f"{ratio[k]:.4f}" if k in ratio else "-"
        print(f"{k:<20}{v:>9.2f}{v / base:>16.2f}x{lr:>14}")
    print(f"backup_ratio {r['backup_ratio']:.2f} (goal >= 0.85)")


def plot(r: dict[str, object], path: Path) -> None:
    steps, ratio = r["steps_per_s"], r["loss_ratio"]
    assert isinstance(steps, dict) and isinstance(ratio, dict)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar(list(steps), list(steps.values()), color="#4477aa")
    a.set_ylabel("steps/s")
    a.set_title("speed, one worker 5x slower")
    a.tick_params(axis="x", rotation=30)
    b.bar(list(ratio), [v - 1 for v in ratio.values()], color="#cc6677")
    b.axhline(0.01, color="gray", linestyle="--", linewidth=0.8)
    b.axhline(0.03, color="gray", linestyle=":", linewidth=0.8)
    b.set_ylabel("loss / single-process loss - 1")
    b.set_title("loss after the same samples")
    b.tick_params(axis="x", rotation=30)
    fig.suptitle(f"pstrain consistency modes ({r['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
