"""Small helpers for training loops: sharding data by rank, look-ahead iteration, metrics.

Everything here is pure (no network, no global state), so each helper is thread-safe and
never blocks beyond its own computation.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt

from protos.security import Security, SecurityError
from worker.bulk import TransportSettings
from worker.client import PSClient
from worker.context import WorkerContext, init
from worker.errors import PSClientError

__all__ = ["TrainingError", "even_batches", "log_loss", "lookahead", "roc_auc",
           "shard_indices"]

T = TypeVar("T")


class TrainingError(PSClientError):
    """A training helper was called with inputs it cannot use (the message says why)."""


def _check_share(what: str, n: int, rank: int, world_size: int) -> None:
    """TrainingError naming the first of `world_size`, `rank`, `n` (called `what`) that is out
    of range."""
    if world_size < 1:
        raise TrainingError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise TrainingError(f"rank must lie in [0, {world_size}), got {rank}")
    if n < 0:
        raise TrainingError(f"{what} must be >= 0, got {n}")


def shard_indices(n: int, rank: int, world_size: int) -> npt.NDArray[np.int64]:
    """The indices of `n` samples that worker `rank` of `world_size` trains on.

    Contiguous, near-equal blocks (sizes differ by at most one) that together cover 0..n-1
    exactly once, so shuffle the data once (with a seed shared by every worker) before
    sharding it. Pure; thread-safe.
    """
    _check_share("n", n, rank, world_size)
    start, end = rank * n // world_size, (rank + 1) * n // world_size
    return np.arange(start, end, dtype=np.int64)


def even_batches(n_items: int, batch_size: int, rank: int, world_size: int,
                 policy: Literal["drop", "pad"] = "drop") -> list[npt.NDArray[np.int64]]:
    """This rank's batches of `n_items` samples: every rank gets as many, of the same sizes.

    A sync job closes a clock when every worker has pushed for it, so every worker must take
    as many steps; splitting n samples W ways leaves some ranks a sample short, and (when the
    short share is a multiple of `batch_size`) a batch short. Each rank here gets a
    contiguous block of the same number of samples, batched in order (the last batch may be
    smaller, the same on every rank):

    - "drop": n // W samples each; the last n % W samples (fewer than W) are left out.
    - "pad": ceil(n / W) samples each; the last rank's block runs past the end and wraps to
      the first samples, which are used twice (as torch's DistributedSampler pads).

    Returns each batch's sample indices (0..n_items-1). Shuffle the samples once with a seed
    every worker shares before using it (and with a per-epoch seed for each epoch). Pure;
    thread-safe.
    """
    if policy not in ("drop", "pad"):
        raise TrainingError(f"policy must be 'drop' or 'pad', got {policy!r}")
    if batch_size < 1:
        raise TrainingError(f"batch_size must be >= 1, got {batch_size}")
    _check_share("n_items", n_items, rank, world_size)
    share = n_items // world_size if policy == "drop" else -(-n_items // world_size)
    mine = np.arange(rank * share, (rank + 1) * share, dtype=np.int64)
    if policy == "pad" and n_items:
        mine %= n_items
    return [mine[start : start + batch_size] for start in range(0, share, batch_size)]


def lookahead(items: Iterable[T], steps: int = 1) -> Iterator[tuple[T, T | None]]:
    """Yields (item, the item `steps` after it), with None for the last `steps` items.

    A training loop uses it to prefetch the parameters of a batch ahead while the current
    batch computes (`steps` is the PSOptimizer's `prefetch_depth`)::

        for batch, upcoming in lookahead(batches, ps.prefetch_depth):
            if upcoming is not None:
                model.prefetch(upcoming)

    Consumes `items` `steps` elements ahead; blocks only as `items` does.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    it = iter(items)
    window: collections.deque[T] = collections.deque(itertools.islice(it, steps))
    for upcoming in it:
        window.append(upcoming)
        yield window.popleft(), upcoming
    while window:
        yield window.popleft(), None


def _as_binary_labels(labels: npt.ArrayLike, scores: npt.ArrayLike) -> tuple[
    npt.NDArray[np.bool_], npt.NDArray[np.float64]
]:
    y = np.asarray(labels).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise TrainingError(
            f"labels and scores must have the same length, got {y.shape[0]} and {s.shape[0]}"
        )
    if not np.all((y == 0) | (y == 1)):
        raise TrainingError("labels must be 0 or 1 (or False/True)")
    return y.astype(bool), s


def roc_auc(labels: npt.ArrayLike, scores: npt.ArrayLike) -> float:
    """Area under the ROC curve of `scores` for binary `labels` (0/1).

    The Mann-Whitney statistic: the probability that a random positive scores above a random
    negative, ties counting one half (tied scores get their average rank), so it equals
    sklearn's roc_auc_score. O(n log n). Raises TrainingError when one class is missing or
    the inputs disagree in length. Pure; thread-safe.
    """
    y, s = _as_binary_labels(labels, scores)
    positives = int(y.sum())
    negatives = len(y) - positives
    if positives == 0 or negatives == 0:
        raise TrainingError(
            f"AUC needs both classes; got {positives} positives and {negatives} negatives"
        )
    if not np.all(np.isfinite(s)):
        raise TrainingError("scores must be finite to rank them")
    order = np.argsort(s, kind="mergesort")
    sorted_scores = s[order]
    # Average ranks over runs of equal scores: each run [start, end) gets (start + end + 1) / 2
    # in 1-based ranks, which is what makes a tie count one half.
    run_starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    run_ends = np.r_[run_starts[1:], len(s)]
    run_ranks = (run_starts + run_ends + 1) / 2.0
    ranks = np.empty(len(s), dtype=np.float64)
    ranks[order] = np.repeat(run_ranks, run_ends - run_starts)
    rank_sum = float(ranks[y].sum())
    return (rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives)


def log_loss(labels: npt.ArrayLike, probabilities: npt.ArrayLike, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of `probabilities` (clipped to [eps, 1 - eps]) for 0/1 labels.

    Pure; thread-safe.
    """
    y, p = _as_binary_labels(labels, probabilities)
    if len(y) == 0:
        raise TrainingError("log loss of an empty set is undefined")
    p = np.clip(p, eps, 1.0 - eps)
    return float(-np.mean(np.where(y, np.log(p), np.log1p(-p))))


def add_table_args(parser: argparse.ArgumentParser) -> None:
    """Flags for the sparse tables' admission and eviction (PSEmbedding's `admit`,
    `ttl_clocks`, `ttl_s`, `max_rows`); `table_options` reads them back."""
    parser.add_argument("--admit", default="always",
                        help="when an id gets a row: always, count:K (its K-th pull) or prob:P")
    parser.add_argument("--ttl-clocks", type=int, default=0,
                        help="evict rows untouched this many steps (0: never)")
    parser.add_argument("--ttl-s", type=float, default=0.0,
                        help="evict rows untouched this many seconds (0: never)")
    parser.add_argument("--max-rows", type=int, default=0,
                        help="rows per server and table; past it the least recently used go "
                             "(0: no limit)")


def table_options(args: argparse.Namespace) -> tuple[tuple[str, str | int | float], ...]:
    """The flags of `add_table_args` that differ from their defaults, as (keyword, value)
    pairs for PSEmbedding and PSEmbeddingBag. Pure."""
    given: dict[str, str | int | float] = {
        "admit": args.admit, "ttl_clocks": args.ttl_clocks, "ttl_s": args.ttl_s,
        "max_rows": args.max_rows,
    }
    defaults: dict[str, str | int | float] = {"admit": "always", "ttl_clocks": 0, "ttl_s": 0.0,
                                              "max_rows": 0}
    return tuple((k, v) for k, v in given.items() if v != defaults[k])


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """Flags for a script that runs as a worker: where the servers are, and who it is.

    Under `pstrain up` or `pstrain worker` the job's environment supplies all of it.
    """
    env = os.environ
    parser.add_argument("--servers", default=env.get("PSTRAIN_SERVERS", ""),
                        help="server addresses in shard order, comma-separated, for servers "
                             "run by hand (env PSTRAIN_SERVERS)")
    parser.add_argument("--rank", type=int, default=int(env.get("PSTRAIN_RANK", "0")),
                        help="this worker's rank (env PSTRAIN_RANK)")
    parser.add_argument("--world-size", type=int,
                        default=int(env.get("PSTRAIN_WORLD_SIZE", "1")),
                        help="number of workers (env PSTRAIN_WORLD_SIZE)")


def connect(args: argparse.Namespace) -> tuple[PSClient, WorkerContext | None]:
    """The client of a worker script, and its job context when it runs inside a job.

    Inside a job (PSTRAIN_REDIS set, as `pstrain up` and `pstrain worker` do) this is
    `worker.init()`, and `args.rank` and `args.world_size` are set from the job. Otherwise a
    client for `args.servers`, joined at the servers' clock for its rank. Blocks until
    connected; TrainingError when no servers are given.
    """
    if os.environ.get("PSTRAIN_REDIS"):
        ctx = init()
        args.rank, args.world_size = ctx.rank, ctx.world_size
        return ctx.client, ctx
    servers = [s for s in args.servers.split(",") if s]
    if not servers:
        raise TrainingError(
            "give --servers HOST:PORT[,...] (or PSTRAIN_SERVERS), or run the script with "
            "pstrain up / pstrain worker"
        )
    try:
        security = Security.from_env(os.environ)
    except SecurityError as exc:
        raise TrainingError(str(exc)) from exc
    client = PSClient(servers, worker=args.rank, timeout_s=120.0, security=security,
                      **asdict(TransportSettings.from_env(os.environ)))
    client.join()  # a rerun or restart carries on at the servers' clock for this rank
    return client, None
