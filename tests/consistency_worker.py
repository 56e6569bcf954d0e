"""A worker process for consistency tests: pull, known gradient, push, end the iteration.

    python tests/consistency_worker.py --servers A,B --rank R --steps K --out PATH
        [--sleep-ms MS] [--jitter-ms MS] [--table NAME] [--shape R,C]

It runs until its clock reaches K (a sync worker that falls behind jumps ahead). At clock t
worker r pushes the gradient (r + 1) * (t + 1) * ones, so the value a sync clock applies is
known in closed form. Every (clock, pulled value) and the drop count go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from worker.client import PSClient


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--table", default="w")
    p.add_argument("--shape", default="4,3")
    a = p.parse_args()
    torch.set_num_threads(1)
    shape = tuple(int(x) for x in a.shape.split(","))
    client = PSClient(a.servers.split(","), worker=a.rank, timeout_s=60)
    client.declare_dense(a.table, shape, optimizer="sgd", lr=1.0, init=("constant", 100.0, 0))
    rng = random.Random(a.rank)
    pulled: list[tuple[int, float]] = []
    while client.clock < a.steps:
        t = client.clock
        pulled.append((t, client.pull_dense(a.table).flatten()[0].item()))
        time.sleep((a.sleep_ms + rng.uniform(0, a.jitter_ms)) / 1000)
        client.push_dense(a.table, torch.full(shape, float((a.rank + 1) * (t + 1))))
        client.end_iteration()
    final = client.pull_dense(a.table).flatten()[0].item()
    Path(a.out).write_text(json.dumps(
        {"rank": a.rank, "pulled": pulled, "final": final, "dropped": client.dropped_pushes}
    ))
    client.close()


if __name__ == "__main__":
    main()
