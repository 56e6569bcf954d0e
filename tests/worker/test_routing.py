"""The routing helpers: keys made unique and routed to shards, dense tensors cut into blocks."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from torch_calls import Calls

from protos.partition import dense_placement, shard_of_keys
from worker.errors import PSClientError
from worker.routing import TableInfo, as_keys, coalesce, dense_blocks, route_keys, unique_keys

# ---- keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ([], []),
        ([3, -1, 3], [3, -1, 3]),  # repeats and order kept
        ((2**63 - 1, -(2**63)), [2**63 - 1, -(2**63)]),
        (np.array([1, 2], dtype=np.int32), [1, 2]),
        (np.array([[1, 2], [3, 4]], dtype=np.int64), [1, 2, 3, 4]),  # flattened
        (np.arange(10, dtype=np.int64)[::3], [0, 3, 6, 9]),  # a strided view
        (torch.tensor([[5], [-6]]), [5, -6]),
        (torch.tensor([], dtype=torch.int64), []),
        (torch.tensor([7, -2**31], dtype=torch.int32), [7, -2**31]),  # as numpy's int32
    ],
    ids=["empty", "list", "extremes", "int32", "2-d", "strided", "tensor", "empty-tensor",
         "int32-tensor"],
)
def test_keys_become_one_contiguous_int64_array(given: Any, expected: list[int]) -> None:
    keys = as_keys(given)
    assert keys.dtype == np.int64 and keys.ndim == 1 and keys.flags.c_contiguous
    assert keys.tolist() == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (torch.tensor([1.0]), "keys must be integers, got a tensor of torch.float32"),
        (torch.tensor([True]), "got a tensor of torch.bool"),
        (np.array([1.5, 2.0]), "keys must be integers, got an array of float64"),
        ([1, 2.5], "got an array of float64"),
        (np.array([True, False]), "got an array of bool"),
    ],
)
def test_keys_that_are_not_integers_are_refused(given: Any, message: str) -> None:
    with pytest.raises(PSClientError, match=message):
        as_keys(given)


@pytest.mark.parametrize(
    ("keys", "assume_unique", "expected_unique", "has_inverse"),
    [
        ([], False, [], False),
        ([7], False, [7], False),
        ([9, -2, 4], False, [9, -2, 4], False),  # already unique: caller's order kept
        ([4, 4, -1, 9, -1], False, [-1, 4, 9], True),
        ([-(2**63), 2**63 - 1, -(2**63)], False, [-(2**63), 2**63 - 1], True),
        ([4, 4], True, [4, 4], False),  # the caller vouched for them: not checked
    ],
)
def test_unique_keys_and_how_to_put_them_back(
    keys: list[int], assume_unique: bool, expected_unique: list[int], has_inverse: bool
) -> None:
    given = np.array(keys, dtype=np.int64)
    unique, inverse = unique_keys(given, assume_unique)
    assert unique.tolist() == expected_unique
    assert (inverse is not None) is has_inverse
    if inverse is not None:
        assert unique[inverse].tolist() == keys
    else:
        assert unique.tolist() == keys


# ---- dense blocks ---------------------------------------------------------------------------


def dense(shape: tuple[int, ...], num_shards: int, name: str = "w") -> TableInfo:
    placement = tuple(dense_placement(name, shape, 4, num_shards))
    return TableInfo(name, "dense", torch.float32, shape, 0, placement)


@pytest.mark.parametrize(
    ("shape", "num_shards"),
    [((20_000, 2), 1), ((20_000, 2), 3), ((8, 3), 4), ((7,), 2), ((16_384, 2, 2), 5), ((), 3)],
)
def test_dense_blocks_cover_the_tensor_once_in_placement_order(
    shape: tuple[int, ...], num_shards: int
) -> None:
    table = dense(shape, num_shards)
    values = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    blocks = dense_blocks(table, values)
    assert [r for r, _, _ in blocks] == [r for r in table.placement if r.rows]
    if not shape:  # a scalar goes to one shard only, as a 0-d block
        assert [(b, f.tolist()) for _, b, f in blocks] == [([], 0.0)]
        return
    for r, block_shape, block in blocks:
        assert block_shape == [r.rows, *shape[1:]] == list(block.shape)
        assert torch.equal(block, values[r.start : r.end])
    assert torch.equal(torch.cat([block for _, _, block in blocks]), values)


@pytest.mark.parametrize("shape", [(8, 4), (3, 3), (24,), ()])
def test_a_dense_push_of_another_shape_is_refused(shape: tuple[int, ...]) -> None:
    expected = f"table 'w' has shape [8, 3]; got {list(shape)}"
    with pytest.raises(PSClientError, match=re.escape(expected)):
        dense_blocks(dense((8, 3), 2), torch.zeros(shape))




# ---- routing and coalescing -------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 2, 5])
def test_every_key_goes_to_its_shard_once(num_shards: int) -> None:
    keys = np.array([5, -3, 2**62, 0, 17, 99, -(2**63)], dtype=np.int64)
    routes = route_keys(keys, num_shards)
    if num_shards == 1:
        assert routes == [(0, None)]
        return
    owners = shard_of_keys(keys, num_shards)
    seen = np.concatenate([positions for _, positions in routes if positions is not None])
    assert sorted(seen.tolist()) == list(range(len(keys)))
    assert [s for s, _ in routes] == sorted({int(o) for o in owners})
    for shard, positions in routes:
        assert positions is not None and (owners[positions] == shard).all()
        assert positions.tolist() == sorted(positions.tolist())  # the caller's order kept


def test_repeated_keys_have_their_gradients_summed() -> None:
    table = TableInfo("e", "sparse", torch.float32, (), 2, ())
    keys, grads = coalesce(table, [4, 1, 4], torch.tensor([[1.0, 2], [3, 4], [5, 6]]), False)
    assert keys.tolist() == [1, 4] and grads.tolist() == [[3.0, 4.0], [6.0, 8.0]]


@pytest.mark.parametrize("shape", [(3, 3), (2, 2), (3,)])
def test_a_sparse_gradient_of_another_shape_is_refused(shape: tuple[int, ...]) -> None:
    table = TableInfo("e", "sparse", torch.float32, (), 2, ())
    with pytest.raises(PSClientError, match=re.escape("push to 'e' needs a [3, 2] gradient")):
        coalesce(table, [1, 2, 3], torch.zeros(shape), False)


def test_a_steps_keys_and_gradients_are_routed_holding_the_gil() -> None:
    """The exchange thread routes a training step's keys and gradients with no torch op:
    each would let go of the GIL and wait for the training thread to give it back."""
    table = TableInfo("e", "sparse", torch.float32, (), 4, ())
    keys, grads = torch.tensor([7, 3, 11]), torch.randn(3, 4)
    values = torch.randn(40, 3)
    with Calls() as calls:
        assert as_keys(keys).tolist() == [7, 3, 11]
        unique, rows = coalesce(table, keys, grads, assume_unique=True)
        blocks = dense_blocks(dense((40, 3), 3), values)
    assert calls.releasing() == []
    assert unique.tolist() == [7, 3, 11] and torch.equal(rows, grads)
    assert torch.equal(torch.cat([block for _, _, block in blocks]), values)
