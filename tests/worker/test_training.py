"""Training-loop helpers: AUC and log loss against brute force, sharding, look-ahead, the
table flags."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from worker.training import (
    TrainingError,
    add_table_args,
    even_batches,
    log_loss,
    lookahead,
    roc_auc,
    shard_indices,
    table_options,
)


def brute_force_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


@pytest.mark.parametrize("seed", range(5))
def test_auc_equals_the_pairwise_count_ties_included(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 300)
    scores = np.round(rng.normal(size=300) + labels, 1)  # rounding makes many ties
    assert roc_auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores), abs=1e-12)


@pytest.mark.parametrize(
    ("labels", "scores", "auc"),
    [
        ([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4], 1.0),
        ([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4], 0.0),
        ([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5], 0.5),
    ],
)
def test_auc_table(labels: list[int], scores: list[float], auc: float) -> None:
    assert roc_auc(labels, scores) == auc


def test_auc_needs_both_classes_and_matching_lengths() -> None:
    with pytest.raises(TrainingError, match="both classes"):
        roc_auc([1, 1], [0.2, 0.3])
    with pytest.raises(TrainingError, match="same length"):
        roc_auc([0, 1], [0.2])
    with pytest.raises(TrainingError, match="0 or 1"):
        roc_auc([0, 2], [0.2, 0.3])


def test_log_loss_is_the_mean_cross_entropy_clipped() -> None:
    expected = -(math.log(0.8) + math.log(1 - 0.3)) / 2
    assert log_loss([1, 0], [0.8, 0.3]) == pytest.approx(expected)
    assert math.isfinite(log_loss([1, 0], [0.0, 1.0]))


@pytest.mark.parametrize(("n", "world"), [(10, 3), (7, 7), (2, 4), (0, 2), (100, 1)])
def test_shards_cover_every_index_once_in_near_equal_blocks(n: int, world: int) -> None:
    shards = [shard_indices(n, r, world) for r in range(world)]
    assert np.concatenate(shards).tolist() == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_shard_indices_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(TrainingError, match="rank"):
        shard_indices(10, 3, 3)


@pytest.mark.parametrize(
    ("n", "batch", "world", "policy", "batches"),
    [
        # 10 samples, 3 ranks: drop leaves the last one out, 3 each.
        (10, 2, 3, "drop", [[[0, 1], [2]], [[3, 4], [5]], [[6, 7], [8]]]),
        # pad gives 4 each; the last rank wraps to sample 0 and 1.
        (10, 2, 3, "pad", [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [0, 1]]]),
        # Shares of 2 and 3 with batches of 2: 1 and 2 batches unequalised; 1 each dropped.
        (5, 2, 2, "drop", [[[0, 1]], [[2, 3]]]),
        (5, 2, 2, "pad", [[[0, 1], [2]], [[3, 4], [0]]]),
        # Divides evenly: both policies agree.
        (8, 4, 2, "drop", [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]),
        (8, 4, 2, "pad", [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]),
        # Fewer samples than ranks.
        (2, 4, 3, "drop", [[], [], []]),
        (2, 4, 3, "pad", [[[0]], [[1]], [[0]]]),
        (0, 4, 2, "pad", [[], []]),
        # One rank: every sample, in batches.
        (5, 2, 1, "drop", [[[0, 1], [2, 3], [4]]]),
    ],
)
def test_even_batches_table(n: int, batch: int, world: int, policy: str,
                            batches: list[list[list[int]]]) -> None:
    got = [[b.tolist() for b in even_batches(n, batch, r, world, policy)]  # type: ignore[arg-type]
           for r in range(world)]
    assert got == batches


@pytest.mark.parametrize("n", [0, 1, 7, 99, 100, 101, 1000])
@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("policy", ["drop", "pad"])
def test_even_batches_give_every_rank_as_many_batches_of_the_same_sizes(
    n: int, world: int, policy: str
) -> None:
    ranks = [even_batches(n, 32, r, world, policy) for r in range(world)]  # type: ignore[arg-type]
    sizes = {tuple(len(b) for b in batches) for batches in ranks}
    assert len(sizes) == 1
    used = np.concatenate([np.concatenate(b) if b else np.array([], np.int64) for b in ranks])
    if policy == "drop":
        # Every sample at most once; fewer than `world` left out.
        assert len(set(used.tolist())) == len(used) and n - len(used) < world
    else:
        # Every sample at least once; fewer than `world` used twice.
        assert set(used.tolist()) == set(range(n)) and len(used) - n < world


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((10, 2, 3, 3, "drop"), "rank"),
        ((10, 0, 0, 3, "drop"), "batch_size"),
        ((10, 2, 0, 0, "drop"), "world_size"),
        ((-1, 2, 0, 1, "drop"), "n_items"),
        ((10, 2, 0, 1, "repeat"), "policy"),
    ],
)
def test_even_batches_refuse_bad_input_naming_it(args: tuple[int, int, int, int, str],
                                                 match: str) -> None:
    with pytest.raises(TrainingError, match=match):
        even_batches(*args)  # type: ignore[arg-type]


def test_lookahead_pairs_each_item_with_the_next() -> None:
    assert list(lookahead([1, 2, 3])) == [(1, 2), (2, 3), (3, None)]
    nothing: list[int] = []
    assert list(lookahead(nothing)) == []


def test_lookahead_steps_ahead_pairs_each_item_with_the_one_that_far_on() -> None:
    assert list(lookahead(iter(range(5)), 2)) == [(0, 2), (1, 3), (2, 4), (3, None), (4, None)]
    assert list(lookahead([7], 3)) == [(7, None)]
    with pytest.raises(ValueError, match="steps must be >= 1"):
        list(lookahead([1], 0))


def test_table_options_are_the_table_flags_given_as_keywords() -> None:
    parser = argparse.ArgumentParser()
    add_table_args(parser)
    assert table_options(parser.parse_args([])) == ()
    given = parser.parse_args(["--admit", "count:2", "--max-rows", "5000", "--ttl-s", "60"])
    assert table_options(given) == (("admit", "count:2"), ("ttl_s", 60.0), ("max_rows", 5000))
