"""Sync sums, table-driven: what a clock's pushes add up to, and the one update they make.

Tables start at a constant 1 with SGD at lr 1, and gradients are small multiples of 1/4, so
every expected value is exact: value after = 1 - (sum of gradients) / divisor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protos.partition import RowRange
from ps.aggregate import DenseSum, SparseSum
from ps.initializers import InitSpec
from ps.tables import DenseTable, OptimizerConfig, SparseTable, TableSpec

SGD_1 = OptimizerConfig("sgd", (("lr", 1.0),))
ONES = InitSpec("constant", 1.0, 0.0)

Parts = list[tuple[int, list[float]]]


def dense_table(optimizer: OptimizerConfig = SGD_1) -> DenseTable:
    spec = TableSpec("w", "dense", torch.float32, shape=(2, 3), init=ONES, optimizer=optimizer)
    return DenseTable(spec, RowRange(0, 0, 2))


def sparse_table(optimizer: OptimizerConfig = SGD_1) -> SparseTable:
    spec = TableSpec("emb", "sparse", torch.float32, dim=2, init=ONES, optimizer=optimizer)
    return SparseTable(spec, 0, 1)


def rows_of(table: SparseTable) -> dict[int, list[float]]:
    snap = table.snapshot()
    return {int(k): v.tolist() for k, v in zip(snap["keys"], snap["value"], strict=True)}


@pytest.mark.parametrize(
    ("pushes", "divisor", "expected"),
    [
        # One push, whole.
        ([[(0, [1, 2, 3, 4, 5, 6])]], 1, [0, -1, -2, -3, -4, -5]),
        # Two workers' pushes: the mean of the two.
        ([[(0, [1, 1, 1, 1, 1, 1])], [(0, [3, 3, 3, 3, 3, 3])]], 2, [-1] * 6),
        # Pushes sliced differently still add element by element.
        ([[(0, [1, 2]), (2, [3, 4, 5, 6])], [(0, [1, 1, 1, 1, 1]), (5, [1])]], 2,
         [0, -0.5, -1, -1.5, -2, -2.5]),
        # The divisor is the clock's contributors, not the pushes: a worker that finished
        # without a gradient for this shard counts with nothing to add.
        ([[(0, [2, 2, 2, 2, 2, 2])]], 2, [0] * 6),
        ([[(0, [1] * 6)], [(0, [1] * 6)], [(0, [-1] * 6)]], 4, [0.75] * 6),
    ],
)
def test_dense_sum_applies_the_mean(
    pushes: list[Parts], divisor: int, expected: list[float]
) -> None:
    table = dense_table()
    total = DenseSum(table)
    for parts in pushes:
        total.add([(offset, torch.tensor(values)) for offset, values in parts])
    assert total.count == len(pushes)
    assert total.apply(divisor) == len(pushes)
    assert table.read().reshape(-1).tolist() == expected
    assert table.counters().pushes_applied == 1  # one update for the whole clock


def test_an_empty_dense_sum_changes_nothing() -> None:
    table = dense_table()
    before = table.snapshot()
    assert DenseSum(table).apply(3) == 0
    after = table.snapshot()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert table.counters().pushes_applied == 0


def test_a_dense_sum_starts_again_after_it_applies() -> None:
    table = dense_table(OptimizerConfig("adam", (("lr", 0.1),)))
    total = DenseSum(table)
    total.add([(0, torch.ones(6))])
    total.add([(0, torch.ones(6))])
    assert total.apply(2) == 2
    assert int(table.step) == 1  # Adam stepped once for two gradients
    assert total.count == 0
    assert total.apply(2) == 0  # nothing left over from the closed clock
    assert int(table.step) == 1
    total.add([(0, torch.ones(6))])
    assert total.apply(1) == 1
    assert int(table.step) == 2


@pytest.mark.parametrize(
    ("pushes", "divisor", "expected"),
    [
        # Disjoint keys of two workers.
        ([([1], [[1, 2]]), ([2], [[3, 4]])], 2, {1: [0.5, 0], 2: [-0.5, -1]}),
        # The same key from two workers, in different orders: summed once.
        ([([5, -3], [[1, 1], [2, 2]]), ([-3, 5], [[4, 4], [1, 1]])], 2,
         {5: [0, 0], -3: [-2, -2]}),
        # Extreme keys and a key only one worker pushed.
        ([([2**63 - 1, -(2**63)], [[1, 0], [0, 1]]), ([2**63 - 1], [[1, 2]]), ([7], [[4, 4]])],
         4, {2**63 - 1: [0.5, 0.5], -(2**63): [1, 0.75], 7: [0, 0]}),
        # A push with no keys adds nothing, yet counts as a gradient.
        ([([], []), ([9], [[2, -2]])], 2, {9: [0, 2]}),
    ],
)
def test_sparse_sum_coalesces_keys_across_pushes(
    pushes: list[tuple[list[int], list[list[float]]]], divisor: int,
    expected: dict[int, list[float]],
) -> None:
    table = sparse_table()
    total = SparseSum(table)
    for keys, values in pushes:
        total.add(np.array(keys, dtype=np.int64),
                  torch.tensor(values, dtype=torch.float32).reshape(len(keys), 2))
    assert total.apply(divisor) == len(pushes)
    assert rows_of(table) == expected  # only pushed keys got rows
    assert table.counters().pushes_applied == 1
    assert table.counters().rows_pushed == len(expected)  # each key updated once


def test_an_empty_sparse_sum_creates_no_rows() -> None:
    table = sparse_table()
    assert SparseSum(table).apply(2) == 0
    assert table.stats().rows == 0
    assert table.counters().pushes_applied == 0


def test_a_sparse_sum_keeps_its_own_copy_of_a_push() -> None:
    # A push may view a client's shared-memory buffer, reused once the push is answered.
    table = sparse_table()
    total = SparseSum(table)
    keys = np.array([1, 2], dtype=np.int64)
    values = torch.ones(2, 2)
    total.add(keys, values)
    keys[:] = [3, 4]
    values.fill_(100.0)
    total.apply(1)
    assert rows_of(table) == {1: [0, 0], 2: [0, 0]}


def test_a_sparse_sum_starts_again_after_it_applies() -> None:
    table = sparse_table()
    total = SparseSum(table)
    total.add(np.array([1], dtype=np.int64), torch.ones(1, 2))
    total.apply(1)
    assert (total.count, total.apply(1)) == (0, 0)
    assert rows_of(table) == {1: [0, 0]}  # not applied a second time
