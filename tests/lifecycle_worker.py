"""A training script for lifecycle tests: epochs over a fixed set of sample ids, resumable.

    python tests/lifecycle_worker.py --samples N --epochs E --batch B --out DIR
        [--sleep-ms MS] [--hold FILE]

Rank r trains samples r, r + W, r + 2W, ... of 0..N-1 (W workers), in an order shuffled
per epoch by a seed of (rank, epoch), through a PSEmbedding (Adagrad) and a PSDense head
(Adam) with the optimizer's overlap on. Before each step it says where it will be once the
step is done (`ctx.at`), and appends the step's epoch, batch index and sample ids to
DIR/seen-<rank>.jsonl, so a test can count every sample trained across an interruption.
Resumed (`ctx.position` set), it carries on from that position.

`--hold FILE`: before training, it waits until FILE exists, pulling (without stepping)
every 20 ms meanwhile: a checkpoint's cut can complete while it waits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from torch import nn

import worker
from worker.modules import PSDense, PSEmbedding
from worker.optimizer import PSOptimizer


class Net(nn.Module):
    def __init__(self, client: worker.WorkerContext) -> None:
        super().__init__()
        self.emb = PSEmbedding(client.client, "lc.emb", 4, optimizer="adagrad", lr=0.1,
                               seed=3)
        self.head = PSDense(client.client, nn.Linear(4, 1), "lc.head", optimizer="adam",
                            lr=0.01)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--hold", default="")
    a = p.parse_args()
    ctx = worker.init()
    torch.manual_seed(0)
    model = Net(ctx)
    opt = PSOptimizer(model, overlap=True)
    if a.hold:
        while not Path(a.hold).exists():
            ctx.client.pull_dense("lc.head")
            time.sleep(0.02)
    mine = np.arange(ctx.rank, a.samples, ctx.world_size, dtype=np.int64)
    per_epoch = -(-len(mine) // a.batch)
    start = ctx.position or worker.DataPosition()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"seen-{ctx.rank}.jsonl").open("a") as seen:
        for epoch in range(start.epoch, a.epochs):
            order = mine[np.random.default_rng([ctx.rank, epoch]).permutation(len(mine))]
            first = start.batch if epoch == start.epoch else 0
            for index in range(first, per_epoch):
                ids = order[index * a.batch : (index + 1) * a.batch]
                x = torch.from_numpy(ids)
                loss = nn.functional.binary_cross_entropy_with_logits(
                    model(x), (x % 3 == 0).float())
                opt.zero_grad()
                loss.backward()
                ctx.at(epoch, index + 1)
                opt.step()
                seen.write(json.dumps({"epoch": epoch, "batch": index,
                                       "ids": ids.tolist()}) + "\n")
                seen.flush()
                time.sleep(a.sleep_ms / 1000)
    opt.close()
    ctx.close()


if __name__ == "__main__":
    main()
