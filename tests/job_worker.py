"""A training script for job tests: clock-driven logistic regression, run by pstrain up.

    python tests/job_worker.py --steps K --out DIR [--sleep-ms MS] [--dim D] [--lr LR]

Its batch at clock t is a function of (rank, t) alone, so a run that is interrupted and
resumed at a clock computes what an uninterrupted one does. At the end it writes the final
weights to DIR/worker<rank>.json.
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


def batch(rank: int, clock: int, dim: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1_000_003 * rank + clock)
    x = torch.randn(size, dim, generator=gen)
    w_true = torch.linspace(-1, 1, dim)
    y = (x @ w_true > 0).float()
    return x, y


def local_sync_run(workers: int, steps: int, dim: int = 16, lr: float = 0.5) -> torch.Tensor:
    """What a sync job computes: SGD on the mean of the workers' gradients per clock."""
    w = torch.zeros(dim)
    for t in range(steps):
        grads = []
        for r in range(workers):
            x, y = batch(r, t, dim)
            grads.append(x.T @ (torch.sigmoid(x @ w) - y) / len(y))
        w -= lr * torch.stack(grads).sum(0) / workers
    return w


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.5)
    a = p.parse_args()
    ctx = worker.init()
    client = ctx.client
    client.declare_dense("w", (a.dim,), optimizer="sgd", lr=a.lr, init=("zeros", 0, 0))
    while client.clock < a.steps:
        x, y = batch(ctx.rank, client.clock, a.dim)
        w = client.pull_dense("w")
        logits = x @ w
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        grad = x.T @ (torch.sigmoid(logits) - y) / len(y)
        time.sleep(a.sleep_ms / 1000)
        client.push_dense("w", grad)
        client.end_iteration()
        ctx.report(samples=len(y), loss=float(loss))
    final = client.pull_dense("w")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"worker{ctx.rank}.json").write_text(json.dumps(
        {"rank": ctx.rank, "clock": client.clock, "w": final.tolist()}
    ))
    ctx.close()


if __name__ == "__main__":
    main()
