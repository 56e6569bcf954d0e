"""Routing: deterministic, balanced, and dense placements that cover every row once."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from protos.partition import (
    MIN_SPLIT_BYTES,
    dense_placement,
    key_range,
    route_hash,
    shard_of_keys,
)


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


# ---- shard_of_keys, table-driven -------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _reference_shard(key: int, num_shards: int) -> int:
    """The documented rule in Python integers: splitmix64 of the key (two's complement,
    xor the routing seed), then the top 32 bits scaled onto [0, num_shards). Routing is a
    contract between every client and server of a job, so it is pinned here independently
    of the vectorised uint64 code."""
    if num_shards == 1:
        return 0
    z = (((key & _MASK64) ^ 0x5EED0F5A4D) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return ((z >> 32) * num_shards) >> 32


EXTREMES = [-(2**63), -(2**63) + 1, -(2**32), -1, 0, 1, 2**31, 2**32 - 1, 2**62, 2**63 - 1]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 16, 1000, 2**31 - 1])
@pytest.mark.parametrize(
    "keys",
    [[], [0], EXTREMES, list(range(-20, 20)), [5, 5, 5, -5]],
    ids=["empty", "zero", "extremes", "around-zero", "repeats"],
)
def test_shard_of_keys_follows_the_reference_rule(keys: list[int], num_shards: int) -> None:
    got = shard_of_keys(np.array(keys, dtype=np.int64), num_shards)
    assert got.dtype == np.int64 and got.shape == (len(keys),)
    assert got.tolist() == [_reference_shard(k, num_shards) for k in keys]


@pytest.mark.parametrize(
    "as_input",
    [
        lambda a: a.tolist(),  # a Python list
        lambda a: a.astype(np.int32),  # a narrower integer type
        lambda a: np.repeat(a, 2)[::2],  # a strided view
        lambda a: a.astype(">i8"),  # big-endian bytes
    ],
    ids=["list", "int32", "strided", "big-endian"],
)
def test_shard_of_keys_takes_any_integer_array_alike(as_input: object) -> None:
    keys = np.arange(-1000, 1000, 7, dtype=np.int64)
    expected = shard_of_keys(keys, 5)
    assert shard_of_keys(as_input(keys), 5).tolist() == expected.tolist()  # type: ignore[operator]


def test_shard_of_keys_leaves_its_input_alone_and_answers_alike_every_call() -> None:
    keys = np.array(EXTREMES, dtype=np.int64)
    kept = keys.copy()
    answers = [shard_of_keys(keys, 6).tolist() for _ in range(3)]
    assert answers[0] == answers[1] == answers[2]
    assert np.array_equal(keys, kept)


@pytest.mark.parametrize("num_shards", [0, -1])
def test_no_shards_is_refused(num_shards: int) -> None:
    with pytest.raises(ValueError, match=f"num_shards must be >= 1, got {num_shards}"):
        shard_of_keys(np.array([1], dtype=np.int64), num_shards)
    with pytest.raises(ValueError, match=f"num_shards must be >= 1, got {num_shards}"):
        dense_placement("w", (10,), 4, num_shards)


# ---- dense_placement, table-driven -----------------------------------------------------------

WHOLE = None  # the tensor lives whole on one shard picked from its name


@pytest.mark.parametrize(
    ("shape", "itemsize", "num_shards", "ranges"),
    [
        ((16384, 1), 4, 1, [(0, 16384)]),  # one shard holds everything
        ((16384,), 4, 4, [(0, 4096), (4096, 8192), (8192, 12288), (12288, 16384)]),  # = limit
        ((16383,), 4, 4, WHOLE),  # one element under the split size
        ((8192,), 8, 4, [(0, 2048), (2048, 4096), (4096, 6144), (6144, 8192)]),
        ((16387,), 4, 3, [(0, 5462), (5462, 10924), (10924, 16387)]),  # uneven split
        ((5, 100_000), 4, 3, [(0, 1), (1, 3), (3, 5)]),
        ((3, 1_000_000), 4, 4, WHOLE),  # more shards than rows
        ((4, 1_000_000), 4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # as many shards as rows
        ((), 8, 3, WHOLE),  # a scalar is one row
        ((0, 4), 4, 2, WHOLE),  # no rows: every range empty
        ((10, 0), 4, 2, WHOLE),  # rows of nothing: under the split size
    ],
)
def test_dense_placement(
    shape: tuple[int, ...], itemsize: int, num_shards: int, ranges: list[tuple[int, int]] | None
) -> None:
    got = dense_placement("w", shape, itemsize, num_shards)
    assert [r.shard for r in got] == list(range(num_shards))
    if ranges is not None:
        assert [(r.start, r.end) for r in got] == ranges
        return
    rows = shape[0] if shape else 1
    holders = [r for r in got if (r.start, r.end) == (0, rows)]
    assert len(holders) == 1 or rows == 0
    assert all((r.start, r.end) == (0, 0) for r in got if r not in holders)


@pytest.mark.parametrize("num_shards", [2, 3, 5])
def test_a_small_tensor_s_shard_follows_its_name_alone(num_shards: int) -> None:
    def owner(name: str, shape: tuple[int, ...], itemsize: int) -> int:
        return next(r.shard for r in dense_placement(name, shape, itemsize, num_shards)
                    if r.rows)

    for name in ("bias", "layer1.weight", "w"):
        owners = {owner(name, shape, itemsize)
                  for shape, itemsize in (((7,), 4), ((1, 3), 2), ((), 8), ((100,), 8))}
        assert len(owners) == 1, name
    # Many small tensors spread over every shard.
    assert {owner(f"t{i}", (10,), 4) for i in range(64)} == set(range(num_shards))


def test_a_large_split_is_balanced_to_one_row() -> None:
    ranges = dense_placement("w", (1_000_003, 16), 4, 7)
    sizes = [r.rows for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1_000_003
    assert all(a.end == b.start for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize(("old", "new"), [(1, 3), (2, 3), (3, 2), (4, 6), (5, 1)])
def test_a_key_moves_only_between_shards_whose_key_ranges_overlap(old: int, new: int) -> None:
    for n in (old, new):  # the ranges tile the hash's top 32 bits
        ranges = [key_range(s, n) for s in range(n)]
        assert ranges[0][0] == 0 and ranges[-1][1] == 1 << 32
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    keys = np.random.default_rng(old * 10 + new).integers(-(2**63), 2**63 - 1, 20_000)
    moves = set(zip(shard_of_keys(keys, old).tolist(), shard_of_keys(keys, new).tolist(),
                    strict=True))
    overlapping = {(i, k) for i in range(old) for k in range(new)
                   if key_range(i, old)[0] < key_range(k, new)[1]
                   and key_range(k, new)[0] < key_range(i, old)[1]}
    assert moves == overlapping  # every overlap is used by some key, and nothing else


@pytest.mark.parametrize("count", [1, 2, 3, 5, 7])
def test_a_key_lies_in_its_shards_range_of_the_route_hash(count: int) -> None:
    keys = np.random.default_rng(count).integers(-(2**63), 2**63 - 1, 20_000)
    hashes = route_hash(keys)
    assert hashes.dtype == np.uint64 and int(hashes.max()) < 1 << 32
    ranges = np.array([key_range(s, count) for s in range(count)], dtype=np.uint64)
    owner = shard_of_keys(keys, count)
    assert np.all((ranges[owner, 0] <= hashes) & (hashes < ranges[owner, 1]))
    # So keys in route-hash order hold each shard's keys in one run.
    in_order = owner[np.argsort(hashes, kind="stable")]
    assert np.all(np.diff(in_order) >= 0)
