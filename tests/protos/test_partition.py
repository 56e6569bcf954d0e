"""Routing: deterministic, balanced, and dense placements that cover every row once."""

from __future__ import annotations

import numpy as np
import pytest

from protos.partition import MIN_SPLIT_BYTES, dense_placement, shard_of_keys


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_consecutive_ids_spread_evenly(num_shards: int) -> None:
    keys = np.arange(70_000, dtype=np.int64)
    counts = np.bincount(shard_of_keys(keys, num_shards), minlength=num_shards)
    assert counts.sum() == len(keys)
    assert counts.min() > 0.95 * len(keys) / num_shards


def test_routing_is_a_pure_function_of_key() -> None:
    keys = np.array([0, -1, 2**63 - 1, -(2**63), 12345], dtype=np.int64)
    first = shard_of_keys(keys, 5)
    again = np.array([shard_of_keys(keys[i : i + 1], 5)[0] for i in range(len(keys))])
    assert (first == again).all() and ((first >= 0) & (first < 5)).all()


@pytest.mark.parametrize(
    ("shape", "num_shards"), [((1000, 64), 3), ((7,), 4), ((), 2), ((100_000,), 8), ((0, 4), 2)]
)
def test_dense_placement_covers_every_row_once(shape: tuple[int, ...], num_shards: int) -> None:
    ranges = dense_placement("t", shape, 4, num_shards)
    assert [r.shard for r in ranges] == list(range(num_shards))
    rows = shape[0] if shape else 1
    covered = sorted(i for r in ranges for i in range(r.start, r.end))
    assert covered == list(range(rows))


def test_small_tensors_stay_whole_and_large_ones_split() -> None:
    small = dense_placement("bias", (100,), 4, 4)
    assert sum(1 for r in small if r.rows) == 1
    rows = MIN_SPLIT_BYTES // 4
    large = dense_placement("w", (rows, 4), 4, 4)
    assert all(r.rows == rows // 4 for r in large)
