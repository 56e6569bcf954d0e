"""PSClient's helpers that need no server: keys, unique keys, dense blocks, request chunks,
retry backoff. Table-driven; the client itself is never constructed."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from protos import codec
from protos import pstrain_pb2 as pb
from protos.partition import dense_placement
from worker.client import PSClient, RetryPolicy, _as_keys, _Table
from worker.errors import PSClientError

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
    ],
    ids=["empty", "list", "extremes", "int32", "2-d", "strided", "tensor", "empty-tensor"],
)
def test_keys_become_one_contiguous_int64_array(given: Any, expected: list[int]) -> None:
    keys = _as_keys(given)
    assert keys.dtype == np.int64 and keys.ndim == 1 and keys.flags.c_contiguous
    assert keys.tolist() == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (torch.tensor([1, 2], dtype=torch.int32),
         "keys must be int64, got a tensor of torch.int32"),
        (torch.tensor([1.0]), "got a tensor of torch.float32"),
        (np.array([1.5, 2.0]), "keys must be integers, got an array of float64"),
        ([1, 2.5], "got an array of float64"),
        (np.array([True, False]), "got an array of bool"),
    ],
)
def test_keys_that_are_not_integers_are_refused(given: Any, message: str) -> None:
    with pytest.raises(PSClientError, match=message):
        _as_keys(given)


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
    unique, inverse = PSClient._unique(given, assume_unique)
    assert unique.tolist() == expected_unique
    assert (inverse is not None) is has_inverse
    if inverse is not None:
        assert unique[inverse].tolist() == keys
    else:
        assert unique.tolist() == keys


# ---- dense blocks ---------------------------------------------------------------------------


def dense(shape: tuple[int, ...], num_shards: int, name: str = "w") -> _Table:
    placement = tuple(dense_placement(name, shape, 4, num_shards))
    return _Table(name, "dense", torch.float32, shape, 0, placement)


@pytest.mark.parametrize(
    ("shape", "num_shards"),
    [((20_000, 2), 1), ((20_000, 2), 3), ((8, 3), 4), ((7,), 2), ((16_384, 2, 2), 5)],
)
def test_dense_blocks_cover_the_tensor_once_in_placement_order(
    shape: tuple[int, ...], num_shards: int
) -> None:
    table = dense(shape, num_shards)
    values = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    blocks = PSClient._dense_blocks(table, values)
    assert [r for r, _, _ in blocks] == [r for r in table.placement if r.rows]
    for r, block_shape, flat in blocks:
        assert block_shape == [r.rows, *shape[1:]]
        assert torch.equal(flat.reshape(block_shape), values[r.start : r.end])
    assert torch.equal(torch.cat([flat for _, _, flat in blocks]), values.reshape(-1))


@pytest.mark.parametrize("shape", [(8, 4), (3, 3), (24,), ()])
def test_a_dense_push_of_another_shape_is_refused(shape: tuple[int, ...]) -> None:
    expected = f"table 'w' has shape [8, 3]; got {list(shape)}"
    with pytest.raises(PSClientError, match=re.escape(expected)):
        PSClient._dense_blocks(dense((8, 3), 2), torch.zeros(shape))


# ---- request chunks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "dim", "chunk_bytes", "rows_per_frame"),
    [
        (10, 4, 1 << 20, 10),  # one frame
        (10, 4, 24 * 3, 3),  # 24 bytes a row (16 of values, 8 of key): three rows a frame
        (10, 4, 1, 1),  # smaller than a row: still one row a frame
        (0, 4, 1024, 0),  # no keys: one frame with the header
    ],
)
def test_sparse_push_frames_carry_every_key_and_row_once(
    rows: int, dim: int, chunk_bytes: int, rows_per_frame: int
) -> None:
    keys = np.arange(rows, dtype=np.int64) * 1000 - 3
    grads = torch.arange(rows * dim, dtype=torch.float32).reshape(rows, dim)
    header = pb.PushSparseHeader(table="emb", dim=dim)
    frames = [codec.decode(pb.PushSparseChunk, f)
              for f in PSClient._sparse_frames(header, keys, grads, chunk_bytes)]
    assert [f.msg.HasField("header") for f in frames] == [True] + [False] * (len(frames) - 1)
    assert frames[0].msg.header == header
    counts = [f.payload("keys").nbytes // 8 for f in frames]
    assert max(counts) == rows_per_frame and sum(counts) == rows
    assert b"".join(bytes(f.payload("keys")) for f in frames) == keys.tobytes()
    assert b"".join(bytes(f.payload("values")) for f in frames) == grads.numpy().tobytes()


@pytest.mark.parametrize(
    ("elements", "itemsize", "chunk_bytes", "offsets"),
    [
        (10, 4, 1 << 20, [0]),
        (10, 4, 16, [0, 4, 8]),
        (10, 4, 18, [0, 4, 8]),  # a chunk never splits an element
        (3, 8, 4, [0, 1, 2]),  # smaller than an element: one element a frame
        (0, 4, 16, [0]),  # an empty block still sends its header
    ],
)
def test_dense_push_frames_carry_every_element_once(
    elements: int, itemsize: int, chunk_bytes: int, offsets: list[int]
) -> None:
    data = bytes(range(elements * itemsize))
    header = pb.PushDenseHeader(table="w", shape=[elements])
    frames = [codec.decode(pb.PushDenseChunk, f) for f in
              PSClient._dense_frames(header, memoryview(data), itemsize, chunk_bytes)]
    assert [f.msg.offset for f in frames] == offsets
    assert [f.msg.HasField("header") for f in frames] == [True] + [False] * (len(frames) - 1)
    assert b"".join(bytes(f.payload("data")) for f in frames) == data


# ---- retries ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "attempt", "base"),
    [
        (RetryPolicy(), 0, 0.05),
        (RetryPolicy(), 3, 0.4),
        (RetryPolicy(), 10, 2.0),  # capped
        (RetryPolicy(initial_backoff_s=1.0, max_backoff_s=1.5), 1, 1.5),
    ],
)
def test_backoff_doubles_up_to_its_cap_with_jitter_below_it(
    policy: RetryPolicy, attempt: int, base: float
) -> None:
    delays = [policy.delay_s(attempt) for _ in range(200)]
    assert all(base / 2 <= d <= base for d in delays)


def test_a_policy_needs_an_attempt() -> None:
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        RetryPolicy(attempts=0)
