"""Where a worker's data goes: keys made unique and routed to their shards, dense tensors cut
into the shards' row blocks. Pure functions of their arguments; no I/O.

They run on the exchange thread, so they avoid torch ops where numpy or a check of the
tensor's attributes does (see `protos.codec`): each op lets go of the GIL."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protos.partition import RowRange, shard_of_keys
from worker.errors import PSClientError

KeysLike = np.ndarray | torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class TableInfo:
    """What a worker knows of a declared table."""

    name: str
    kind: str  # "dense" or "sparse"
    dtype: torch.dtype
    shape: tuple[int, ...]  # dense only
    dim: int  # sparse only
    placement: tuple[RowRange, ...]  # dense only: each shard's rows of dim 0

    @property
    def dense_width(self) -> int:
        """Elements per row of dim 0 (1 for a scalar)."""
        return math.prod(self.shape[1:]) if self.shape else 1

    def used_blocks(self) -> list[RowRange]:
        """The placement's non-empty blocks (a scalar is one row, on one shard)."""
        return [r for r in self.placement if r.rows]


def as_keys(keys: KeysLike) -> np.ndarray:
    """Keys as one contiguous int64 array; PSClientError for keys that are not integers."""
    if isinstance(keys, torch.Tensor):
        if keys.dtype != torch.int64:
            if keys.dtype.is_floating_point or keys.dtype.is_complex or keys.dtype == torch.bool:
                raise PSClientError(f"keys must be integers, got a tensor of {keys.dtype}")
            keys = keys.to(torch.int64)  # int32 and narrower ids widen as they are
        return np.ascontiguousarray(keys.numpy(force=True)).reshape(-1)
    array = np.asarray(keys)
    if array.size and array.dtype != np.int64:
        if not np.issubdtype(array.dtype, np.integer):
            raise PSClientError(f"keys must be integers, got an array of {array.dtype}")
        array = array.astype(np.int64)
    return np.ascontiguousarray(array, dtype=np.int64).reshape(-1)


def unique_keys(keys: np.ndarray, assume_unique: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(unique keys, each given key's position in them); None when `keys` are unique already,
    in which case their order is kept. Unique keys come sorted: the servers' index and row
    loops run faster over keys in order than over a hash's first-seen order."""
    if assume_unique or len(keys) < 2:
        return keys, None
    unique, inverse = torch.unique(torch.from_numpy(keys), return_inverse=True)
    if len(unique) == len(keys):
        return keys, None
    return unique.numpy(), inverse.numpy()


def route_keys(keys: np.ndarray, num_shards: int) -> list[tuple[int, np.ndarray | None]]:
    """(shard, positions of its keys in `keys`) for each shard with keys, in shard order;
    positions None means all of them (one shard)."""
    if num_shards == 1:
        return [(0, None)]
    owners = shard_of_keys(keys, num_shards)
    order = np.argsort(owners, kind="stable")
    bounds = np.searchsorted(owners[order], np.arange(num_shards + 1))
    return [
        (s, order[bounds[s] : bounds[s + 1]])
        for s in range(num_shards)
        if bounds[s + 1] > bounds[s]
    ]


def coalesce(table: TableInfo, keys: KeysLike, grads: torch.Tensor,
             assume_unique: bool) -> tuple[np.ndarray, torch.Tensor]:
    """(unique keys, their gradient rows), gradients of repeated keys summed;
    PSClientError when the gradient's shape does not fit the keys and the table."""
    all_keys = as_keys(keys)
    grads = on_host(grads)
    if grads.dim() != 2 or grads.shape[0] != len(all_keys) or grads.shape[1] != table.dim:
        raise PSClientError(
            f"push to {table.name!r} needs a [{len(all_keys)}, {table.dim}] gradient, got "
            f"{list(grads.shape)}"
        )
    unique, inverse = unique_keys(all_keys, assume_unique)
    if inverse is not None:
        summed = torch.zeros((len(unique), table.dim), dtype=grads.dtype)
        grads = summed.index_add_(0, torch.from_numpy(inverse), grads)
    return unique, grads.contiguous()


def dense_blocks(table: TableInfo,
                 values: torch.Tensor) -> list[tuple[RowRange, list[int], torch.Tensor]]:
    """(placement, block shape, block) of each shard's rows of dense `values`, each block a
    view of its rows of dim 0; PSClientError when the shape is not the table's."""
    if tuple(values.shape) != table.shape:
        raise PSClientError(
            f"table {table.name!r} has shape {list(table.shape)}; got {list(values.shape)}"
        )
    values = on_host(values)
    if not values.dim():
        return [(r, [], values) for r in table.used_blocks()]  # a scalar: one block
    rows = values.shape[0]
    return [(r, [r.rows, *table.shape[1:]],
             values if r.start == 0 and r.end == rows else values[r.start : r.end])
            for r in table.used_blocks()]


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached and in host memory, with no torch op when it is already both."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu")
