"""Where data lives: which shard holds a sparse key, and which rows of a dense tensor.

Clients route with these functions and servers check against them, so both sides must run
the same code: that is why it lives beside the wire contract.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

# Dense tensors smaller than this stay whole on one shard: splitting a bias vector across
# every shard would cost one round trip per shard for a few bytes.
MIN_SPLIT_BYTES = 64 * 1024

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# Distinct from the server index's hash seed, so the keys a shard holds are not clustered
# in its own hash table.
_ROUTE_SEED = np.uint64(0x5EED_0F_5A4D)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        z = values.view(np.uint64) ^ _ROUTE_SEED
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def shard_of_keys(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard (0 <= s < num_shards) of each int64 key, as an int64 array.

    Keys are hashed first, so consecutive ids (the usual output of a feature vocabulary)
    spread evenly. Pure and thread-safe.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if num_shards == 1:
        return np.zeros(len(keys), dtype=np.int64)
    high = route_hash(keys)
    # Multiply-shift maps the top 32 hash bits onto [0, num_shards) without a division.
    with np.errstate(over="ignore"):
        return ((high * np.uint64(num_shards)) >> np.uint64(32)).astype(np.int64)


def route_hash(keys: np.ndarray) -> np.ndarray:
    """The top 32 bits of each int64 key's routing hash, as uint64: `shard_of_keys` gives a
    key the shard whose `key_range` holds this value, under every shard count, so rows kept
    in this order leave each shard's keys in one run. Pure."""
    return _splitmix64(np.ascontiguousarray(keys, dtype=np.int64)) >> np.uint64(32)


def key_range(shard: int, num_shards: int) -> tuple[int, int]:
    """The keys `shard_of_keys` gives `shard` of `num_shards`, as the range [start, end) of
    the top 32 bits of their hash. Shards own consecutive ranges that tile [0, 2**32), so
    under another shard count a shard's keys come only from the old shards whose ranges
    overlap its own. Pure."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"need 0 <= shard < num_shards, got {shard} of {num_shards}")
    return -(-(shard << 32) // num_shards), -(-((shard + 1) << 32) // num_shards)


@dataclass(frozen=True)
class RowRange:
    """Rows [start, end) of dim 0 of a dense tensor, held by `shard`."""

    shard: int
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


def dense_placement(
    name: str, shape: tuple[int, ...], itemsize: int, num_shards: int
) -> list[RowRange]:
    """How a dense tensor's rows (dim 0) are split across shards; one entry per shard.

    A 0-d tensor counts as one row. Tensors under MIN_SPLIT_BYTES, or with fewer rows than
    shards, live whole on one shard picked from the name, so that many small tensors spread
    over the shards. Others are split into near-equal row ranges. Empty ranges are listed
    too (start == end). Pure and thread-safe.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    rows = shape[0] if shape else 1
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * itemsize < MIN_SPLIT_BYTES or rows < num_shards:
        owner = zlib.crc32(name.encode()) % num_shards
        return [
            RowRange(s, 0, rows) if s == owner else RowRange(s, 0, 0) for s in range(num_shards)
        ]
    return [
        RowRange(s, s * rows // num_shards, (s + 1) * rows // num_shards)
        for s in range(num_shards)
    ]
