"""The training script of benchmarks/snapshot_stall.py, run by `pstrain up`.

    python benchmarks/stall_worker.py --rows N --batch B --out DIR --stop FILE [--zipf S]

Rank 0 fills sparse table "stall.emb" (dim 64, Adagrad) with rows 0..N-1; both ranks then
write DIR/ready-<rank> and step until FILE exists: each step one exchange per server with
the gradients of B random ids, the end of the iteration and the next step's rows. At the
end each writes DIR/steps-<rank>.json: every step's wall-clock (start, end). Ids are drawn
uniformly, or with `--zipf S` (> 0) the id of rank k (a fixed permutation of the rows) with
probability proportional to 1 / (k + 1)^S, as a click model's ids are.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

import worker
from worker.plan import Pull, Push

FILL = 1 << 17  # rows per filling request: 32 MiB of float32 x 64


def ids(rows: int, batch: int, zipf: float,
        rng: np.random.Generator) -> Callable[[], np.ndarray]:
    """A step's unique ids: uniform over the rows, or Zipf-ranked (`zipf` > 0)."""
    if zipf <= 0:
        return lambda: np.unique(rng.integers(0, rows, batch))
    cdf = np.cumsum(1.0 / np.arange(1, rows + 1, dtype=np.float64) ** zipf)
    cdf /= cdf[-1]
    ranked = np.random.default_rng(12345).permutation(rows)  # the same on every rank
    # cdf[-1] is 1.0 and draws are below it: every search lands on a row.
    return lambda: np.unique(ranked[np.searchsorted(cdf, rng.random(batch))])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--zipf", type=float, default=0.0)
    a = p.parse_args()
    ctx = worker.init()
    client = ctx.client
    client.declare_sparse("stall.emb", 64, optimizer="adagrad", lr=0.01,
                          init=("normal", 0.0, 0.01))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0:
        for start in range(0, a.rows, FILL):
            keys = np.arange(start, min(a.rows, start + FILL), dtype=np.int64)
            client.assign_sparse("stall.emb", keys, torch.zeros(len(keys), 64))
    (out / f"ready-{ctx.rank}").touch()
    rng = np.random.default_rng(ctx.rank)
    draw = ids(a.rows, a.batch, a.zipf, rng)
    steps: list[tuple[float, float]] = []
    keys = draw()
    stop = Path(a.stop)
    while not stop.exists():
        nxt = draw()
        start = time.time()
        client.exchange([Push("stall.emb", torch.full((len(keys), 64), 1e-3), keys, True)],
                        end_iteration=True, pulls=[Pull("stall.emb", nxt)])
        steps.append((start, time.time()))
        keys = nxt
    (out / f"steps-{ctx.rank}.json").write_text(json.dumps(steps))
    ctx.close()


if __name__ == "__main__":
    main()
