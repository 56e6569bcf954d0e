"""A training script for job tests: clock-driven logistic regression, run by pstrain up.

    python tests/job_worker.py --steps K --out DIR [--sleep-ms MS] [--dim D] [--lr LR]
        [--steps-of R=K ...] [--finish] [--barrier NAME] [--end close|with|return]
        [--exit-status-of R=N ...] [--tables]

Its batch at clock t is a function of (rank, t) alone, so a run that is interrupted and
resumed at a clock computes what an uninterrupted one does. At the end it writes the final
weights to DIR/worker<rank>.json.

`--steps-of R=K` gives rank R K steps instead; `--finish` calls `ctx.finish()` after the last
step and `--barrier NAME` waits at `ctx.barrier(NAME)` before the final pull. `--end` says how
the script ends: `ctx.close()` (the default), a `with worker.init() as ctx:` block, or by
returning without either. `--exit-status-of R=N` makes rank R exit with status N at the end.
`--tables` also trains a sparse table "emb" (Adam: per-row state and steps) and a dense
table "v" split across servers (Adam), beside and independent of the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import worker
from worker.client import PSClient


def batch(rank: int, clock: int, dim: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1_000_003 * rank + clock)
    x = torch.randn(size, dim, generator=gen)
    w_true = torch.linspace(-1, 1, dim)
    y = (x @ w_true > 0).float()
    return x, y


def local_sync_run(workers: int, steps: int, dim: int = 16, lr: float = 0.5,
                   steps_of: dict[int, int] | None = None) -> torch.Tensor:
    """What a sync job computes: SGD on the mean of the workers' gradients per clock (of the
    workers that still take steps at that clock, with `steps_of` giving some fewer)."""
    counts = [(steps_of or {}).get(r, steps) for r in range(workers)]
    # One thread, as the workers run (PSTRAIN_TORCH_THREADS): a matrix product split over
    # more threads may round differently.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _sync_steps(counts, dim, lr)
    finally:
        torch.set_num_threads(threads)


def _sync_steps(counts: list[int], dim: int, lr: float) -> torch.Tensor:
    w = torch.zeros(dim)
    for t in range(max(counts)):
        grads = []
        for r in range(len(counts)):
            if t < counts[r]:
                x, y = batch(r, t, dim)
                grads.append(x.T @ (torch.sigmoid(x @ w) - y) / len(y))
        w -= lr * torch.stack(grads).sum(0) / len(grads)
    return w


def train_tables(client: PSClient, rank: int, clock: int) -> None:
    """One step of the side tables: gradients that depend on (rank, clock) and the rows."""
    keys = torch.arange(6) * 1009 + (rank * 7 + clock) % 40
    rows = client.pull_sparse("emb", keys)
    client.push_sparse("emb", keys, rows * 0.1 + 0.01 * (clock % 5 + 1))
    v = client.pull_dense("v")
    client.push_dense("v", v * 0.05 + 0.001 * (rank + 1))


def _rank_values(pairs: list[str]) -> dict[int, int]:
    """`R=N` pairs as {R: N}."""
    return {int(r): int(n) for r, n in (pair.split("=", 1) for pair in pairs)}


def train(ctx: worker.WorkerContext, a: argparse.Namespace) -> None:
    client = ctx.client
    steps = _rank_values(a.steps_of).get(ctx.rank, a.steps)
    client.declare_dense("w", (a.dim,), optimizer="sgd", lr=a.lr, init=("zeros", 0, 0))
    if a.tables:
        client.declare_sparse("emb", 4, optimizer="adam", lr=0.01)
        # Over 64 KiB, so split by rows across the servers, unevenly.
        client.declare_dense("v", (301, 64), optimizer="adam", lr=0.01,
                             init=("uniform", -1, 1))
    while client.clock < steps:
        x, y = batch(ctx.rank, client.clock, a.dim)
        w = client.pull_dense("w")
        logits = x @ w
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        grad = x.T @ (torch.sigmoid(logits) - y) / len(y)
        time.sleep(a.sleep_ms / 1000)
        if a.tables:
            train_tables(client, ctx.rank, client.clock)
        client.push_dense("w", grad)
        client.end_iteration()
        ctx.report(samples=len(y), loss=float(loss))
    if a.finish:
        ctx.finish()
    if a.barrier:
        ctx.barrier(a.barrier)
    final = client.pull_dense("w")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"worker{ctx.rank}.json").write_text(json.dumps(
        {"rank": ctx.rank, "clock": client.clock, "w": final.tolist()}
    ))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--steps-of", action="append", default=[], metavar="R=K")
    p.add_argument("--finish", action="store_true")
    p.add_argument("--barrier", default="")
    p.add_argument("--end", choices=("close", "with", "return"), default="close")
    p.add_argument("--exit-status-of", action="append", default=[], metavar="R=N")
    p.add_argument("--tables", action="store_true")
    a = p.parse_args()
    if a.end == "with":
        with worker.init() as ctx:
            train(ctx, a)
    else:
        ctx = worker.init()
        train(ctx, a)
        if a.end == "close":
            ctx.close()
    sys.exit(_rank_values(a.exit_status_of).get(ctx.rank, 0))


if __name__ == "__main__":
    main()
