"""A Criteo-shaped click stream with a planted model, to grow embedding tables on the servers.

    python examples/synthetic_ctr.py --servers HOST:PORT[,...] --rank R --world-size W \\
        --steps 2000 --batch 4096
    python examples/synthetic_ctr.py --local --steps 200      # plain PyTorch, hashed buckets

Each sample has 26 categorical features and 13 dense ones, like Criteo's display-ads data.
Feature f draws a Zipf-distributed rank (exponent `--zipf` for feature 0, rising to
`--zipf + 1` for feature 25, so some features have a huge tail and some a small vocabulary)
and hashes it to an id in [0, 10^9); its key is `f * 10^9 + id`. The label is drawn from a
planted logistic model: every (feature, id) has a fixed weight given by a hash, plus a
linear term in the dense features. The planted logit scores the evaluation set with the best
AUC any model can reach, printed as `best_auc`.

Keys are created on the servers the first time they are seen, so a long run grows the table
to tens of millions of rows; progress lines report them (from the servers' stats). `--local`
trains the same model in one process with torch.optim, hashing keys into `--local-buckets`
rows, because a table over 2.6 * 10^10 possible keys cannot be allocated. The run ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

from ps.initializers import InitSpec, init_rows
from worker.client import PSClient
from worker.context import WorkerContext
from worker.modules import PSDense, PSEmbedding
from worker.optimizer import PSOptimizer
from worker.training import (
    add_cluster_args,
    add_table_args,
    connect,
    log_loss,
    lookahead,
    roc_auc,
    table_options,
)

log = logging.getLogger("synthetic_ctr")

CATEGORICAL = 26
DENSE = 13
ID_SPACE = 10**9
TABLE = "ctr.fields"



class ExampleError(Exception):
    """The example cannot run as asked; the message says why."""


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser, elementwise (uint64 arithmetic wraps by design)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _hash(values: npt.NDArray[np.int64], salt: int) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        return _mix(values.astype(np.uint64) + np.uint64(salt) * _GOLDEN)


@dataclass(frozen=True)
class Stream:
    """The planted world: how ids are drawn and how labels follow from them."""

    seed: int
    zipf: float
    weight_std: float = 0.3
    dense_std: float = 0.3
    bias: float = -1.4

    def exponents(self) -> npt.NDArray[np.float64]:
        return self.zipf + np.linspace(0.0, 1.0, CATEGORICAL)

    def dense_weights(self) -> npt.NDArray[np.float64]:
        return np.random.default_rng(self.seed).normal(0.0, self.dense_std, DENSE)

    def sample(self, rng: np.random.Generator, n: int) -> tuple[
        npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32],
        npt.NDArray[np.float64],
    ]:
        """n samples: (keys [n, 26], dense [n, 13], labels [n], planted logits [n])."""
        ranks = np.stack([rng.zipf(a, n) for a in self.exponents()], axis=1).astype(np.int64)
        # Ranks past the id space wrap around: they are the far tail, seen about once each.
        ranks = (ranks - 1) % ID_SPACE
        features = np.arange(CATEGORICAL, dtype=np.int64)
        ids = (_hash(ranks, self.seed + 1) % np.uint64(ID_SPACE)).astype(np.int64)
        keys = features * ID_SPACE + ids
        # Each key's planted weight: a hash turned into a uniform in [-1, 1), scaled so its
        # standard deviation is weight_std.
        unit = (_hash(keys, self.seed + 2) >> np.uint64(11)).astype(np.float64) / 2.0**53
        weights = (2.0 * unit - 1.0) * self.weight_std * np.sqrt(3.0)
        raw = rng.lognormal(1.0, 1.2, size=(n, DENSE))
        dense = ((np.log1p(raw) - 1.3) / 0.8).astype(np.float32)
        logits = self.bias + weights.sum(axis=1) + dense @ self.dense_weights()
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        return keys, dense, labels, logits


class Optimizer(Protocol):
    """What the loop needs of torch.optim optimizers and of PSOptimizer alike."""

    def zero_grad(self) -> None: ...

    def step(self) -> object: ...


class CTRModel(nn.Module):
    """All 26 features in one embedding table, concatenated with the dense features, then an
    MLP to a logit. `fields` is a PSEmbedding, or locally a hashed nn.Embedding.
    """

    def __init__(self, fields: nn.Module, mlp: nn.Module, buckets: int | None = None) -> None:
        super().__init__()
        self.fields = fields
        self.mlp = mlp
        self.buckets = buckets

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        if self.buckets is None:
            return keys
        hashed = _hash(keys.numpy(), 7) % np.uint64(self.buckets)
        return torch.from_numpy(hashed.astype(np.int64))

    def forward(self, keys: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        embedded = self.fields(self.rows(keys)).flatten(1)
        logits: torch.Tensor = self.mlp(torch.cat([embedded, dense], dim=1))
        return logits.squeeze(1)

    def prefetch(self, keys: torch.Tensor) -> None:
        """Starts pulling the rows `keys` need (distributed mode; a no-op locally)."""
        if isinstance(self.fields, PSEmbedding):
            self.fields.prefetch(self.rows(keys))


def make_mlp(dim: int, hidden: Sequence[int], seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = CATEGORICAL * dim + DENSE
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def table_rows(client: PSClient) -> int:
    """Rows of the embedding table over every shard (one stats call per shard; blocks)."""
    return sum(t.rows for s in client.stats() for t in s.tables if t.name == TABLE)


@torch.no_grad()
def evaluate(
    model: CTRModel, keys: npt.NDArray[np.int64], dense: npt.NDArray[np.float32],
    labels: npt.NDArray[np.float32], batch: int,
) -> tuple[float, float]:
    model.eval()
    scores = [
        torch.sigmoid(model(torch.from_numpy(keys[i : i + batch]),
                            torch.from_numpy(dense[i : i + batch])))
        for i in range(0, len(labels), batch)
    ]
    model.train()
    probs = torch.cat(scores).numpy()
    return roc_auc(labels, probs), log_loss(labels, probs)


def train(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    torch.set_num_threads(args.threads)
    stream = Stream(args.seed, args.zipf)
    eval_keys, eval_dense, eval_labels, eval_logits = stream.sample(
        np.random.default_rng([args.seed, 1 << 20]), args.eval_samples
    )
    best_auc = roc_auc(eval_labels, eval_logits)
    mlp = make_mlp(args.dim, args.hidden, args.seed)
    init = InitSpec("normal", 0.0, 0.01)
    client: PSClient | None = None
    ctx: WorkerContext | None = None
    ps: PSOptimizer | None = None
    optimizers: list[Optimizer] = []
    if args.local:
        # Adagrad builds the sparse gradients itself; checking them each step costs time.
        torch.sparse.check_sparse_tensor_invariants.disable()  # type: ignore[no-untyped-call]
        fields = nn.Embedding(args.local_buckets, args.dim, sparse=True)
        with torch.no_grad():
            rows = np.arange(args.local_buckets, dtype=np.int64)
            fields.weight.copy_(init_rows(rows, args.dim, init, args.seed))
        model = CTRModel(fields, mlp, args.local_buckets)
        optimizers = [
            torch.optim.Adagrad([fields.weight], lr=args.emb_lr),
            torch.optim.Adam(mlp.parameters(), lr=args.dense_lr),
        ]
    else:
        client, ctx = connect(args)
        model = CTRModel(
            PSEmbedding(client, TABLE, args.dim, optimizer="adagrad", lr=args.emb_lr,
                        init=(init.kind, init.a, init.b), seed=args.seed,
                        **dict(table_options(args))),
            PSDense(client, mlp, "ctr.mlp", optimizer="adam", lr=args.dense_lr),
        )
        ps = PSOptimizer(model)
        optimizers = [ps]
    mode = "local" if args.local else "distributed"
    log.info("%s: %d steps of %d; best reachable AUC %.4f (the planted model's)", mode,
             args.steps, args.batch, best_auc)
    # A resumed or restarted worker carries on after the last batch the servers (or the
    # checkpoint they restored) counted for it: its data position. Each step's batch comes
    # from a seed of its own, so it carries on with that step's batch.
    position = ctx.position if ctx is not None else None
    done_steps = min(position.batch, args.steps) if position is not None else 0

    def stream_batches() -> Any:
        for step in range(done_steps, args.steps):
            rng = np.random.default_rng([args.seed, args.rank, step])
            keys, dense, labels, _ = stream.sample(rng, args.batch)
            yield torch.from_numpy(keys), torch.from_numpy(dense), torch.from_numpy(labels)

    train_start = time.monotonic()
    losses: list[float] = []
    step = done_steps
    ahead = ps.prefetch_depth if ps is not None else 1
    for (keys, dense, labels), upcoming in lookahead(stream_batches(), ahead):
        if upcoming is not None:
            model.prefetch(upcoming[0])
        loss = F.binary_cross_entropy_with_logits(model(keys, dense), labels)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        if ctx is not None:
            ctx.at(0, step + 1)  # the stream is one epoch; this step's batch is done
        for opt in optimizers:
            opt.step()  # PSOptimizer: push the gradients, the servers' optimizers apply them
        losses.append(loss.item())
        step += 1
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.monotonic() - train_start
            size = table_rows(client) if client is not None else args.local_buckets
            log.info("step %d: loss %.4f, %.0f samples/s, %d rows in %s", step,
                     float(np.mean(losses[-args.log_every :])),
                     (step - done_steps) * args.batch / elapsed,
                     size, TABLE if client is not None else "the local table")
    if ps is not None:
        # Detached from the optimizer, the modules pull at every forward: the evaluation
        # uses the servers' final values, not the ones cached for this worker's last step.
        ps.close()
    train_s = time.monotonic() - train_start
    if ctx is not None:
        # No worker waits for this one any more; the evaluation waits for every worker to
        # have trained, so each scores the same model.
        ctx.finish()
        ctx.barrier("trained")
    test_auc, test_loss = evaluate(model, eval_keys, eval_dense, eval_labels, 8192)
    result: dict[str, Any] = {
        "test_auc": round(test_auc, 5), "test_logloss": round(test_loss, 5),
        "best_auc": round(best_auc, 5),
        "samples_per_s": round((step - done_steps) * args.batch / max(train_s, 1e-9), 1),
        "wall_s": round(time.monotonic() - started, 2), "train_s": round(train_s, 2),
        "mode": mode, "rank": args.rank, "world_size": args.world_size, "steps": step,
        "batch": args.batch,
        "rows": table_rows(client) if client is not None else args.local_buckets,
        "overlap": ps.overlap if ps else None,
    }
    if ctx is not None:
        ctx.close()
    elif client is not None:
        client.close()
    return result


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local", action="store_true", help="train in plain single-process PyTorch")
    add_cluster_args(p)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zipf", type=float, default=1.1,
                   help="Zipf exponent of the longest-tailed feature (> 1; lower grows the "
                        "table faster)")
    p.add_argument("--eval-samples", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=16, help="embedding width")
    p.add_argument("--hidden", type=int, nargs="*", default=[256, 128], help="MLP widths")
    p.add_argument("--emb-lr", type=float, default=0.05, help="Adagrad lr of the embeddings")
    p.add_argument("--dense-lr", type=float, default=1e-3, help="Adam lr of the MLP")
    p.add_argument("--local-buckets", type=int, default=1 << 21,
                   help="--local: rows of the hashed embedding table")
    p.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_table_args(p)
    args = p.parse_args(argv)
    if not 0 <= args.rank < args.world_size:
        p.error(f"--rank must lie in [0, --world-size), got {args.rank} of {args.world_size}")
    if args.zipf <= 1.0:
        p.error(f"--zipf must be > 1, got {args.zipf}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = train(args)
    except ExampleError as exc:
        print(f"synthetic_ctr: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
