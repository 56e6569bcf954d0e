"""KeyIndex: the server's map from int64 feature keys to dense row ids.

A typed numpy wrapper over the C extension ``ps._index.Int64Index``. Row ids are dense: the
n-th distinct key ever inserted gets row ``n``, so they index straight into the value arrays
that hold the embedding rows. A table that evicts rows deletes keys and gives their row ids
to new keys itself (``delete``, ``insert_rows``), so its row ids stay below ``row_limit``, and
walks the index in bounded windows (``scan``) to pick what to evict. An index holds at most
``MAX_ROWS`` rows (row ids are int32 in its slots).

Calls are blocking and release the GIL while they work, but a ``KeyIndex`` is NOT thread-safe:
callers must serialise every call (reads included, when a writer may run) with their own lock.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ps._index import Int64Index, first_repeat
from ps.errors import InvalidArgumentError

__all__ = ["MAX_ROWS", "SLOT_BYTES", "KeyIndex", "capacity_for", "count_distinct"]

# Bytes of one hash slot (an int64 key and an int32 row id, packed), as ps/_index.c lays
# them out.
SLOT_BYTES = 12
# Rows one index holds at most: row ids are below this (int32 in the slots).
MAX_ROWS = 2**31 - 1
# ps/_index.c's smallest table and its load limit (keys <= capacity * 7 / 10).
_MIN_CAPACITY = 8


def capacity_for(n: int) -> int:
    """The slots an index holding ``n`` keys has at least: the capacity ps/_index.c grows
    to for them (the smallest power of two, from 8, whose load limit holds ``n``). Pure;
    what memory accounting projects before any key is inserted."""
    cap = _MIN_CAPACITY
    while cap * 7 // 10 < n:
        cap <<= 1
    return cap


def count_distinct(keys: npt.NDArray[np.int64]) -> int:
    """How many distinct keys ``keys`` holds: one pass through a scratch index, no sort.
    Blocking (GIL released while hashing); thread-safe, as it touches no shared index."""
    if len(keys) < 2:
        return len(keys)
    _, distinct = KeyIndex(len(keys)).lookup_or_insert(keys)
    return distinct


def _as_keys(keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Checks that ``keys`` is a 1-D native int64 array; returns it C-contiguous."""
    if not isinstance(keys, np.ndarray):
        raise InvalidArgumentError(f"keys must be a numpy.ndarray, got {type(keys).__name__}")
    if keys.dtype != np.int64:
        raise InvalidArgumentError(
            f"keys must have dtype int64, got {keys.dtype.str} ({keys.dtype})"
        )
    if keys.ndim != 1:
        raise InvalidArgumentError(f"keys must be 1-D, got shape {keys.shape}")
    return np.ascontiguousarray(keys)


class KeyIndex:
    """Hash index from int64 keys to dense row ids ``0..len(self)-1``.

    Every int64 is a valid key. Blocking, and NOT thread-safe: callers hold a lock around
    every call. Overlapping calls from two threads are detected on a best-effort basis and
    raise ``RuntimeError`` rather than corrupting the table.
    """

    __slots__ = ("_bits", "_index")

    def __init__(self, capacity_hint: int = 0, seed: int = 0) -> None:
        """Pre-sizes the table for ``capacity_hint`` keys; ``seed`` (0 <= seed < 2**64)
        perturbs the hash. Negative values raise ``ValueError``."""
        self._index = Int64Index(capacity_hint, seed)
        # One bit per row, all zero between calls; see first_repeat.
        self._bits = np.zeros(0, dtype=np.uint8)

    def lookup(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Returns the row id of each key, or -1 where the key is absent. Inserts nothing."""
        keys = _as_keys(keys)
        rows = np.empty(keys.shape[0], dtype=np.int64)
        self._index.lookup(keys, rows)
        return rows

    def lookup_or_insert(self, keys: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], int]:
        """Returns ``(rows, n_new)``: the row id of each key, inserting absent keys first.

        New keys get rows ``len(self), len(self) + 1, ...`` in order of first appearance in
        ``keys`` (repeats share a row), so the new rows are exactly those ``>=`` the length
        before the call, and ``n_new`` is how many there are. All-or-nothing: on
        ``MemoryError``, or ``OverflowError`` when the rows would pass ``MAX_ROWS``, the index
        is unchanged.
        """
        keys = _as_keys(keys)
        rows = np.empty(keys.shape[0], dtype=np.int64)
        n_new = self._index.lookup_or_insert(keys, rows)
        return rows, n_new

    def first_repeat(self, rows: npt.NDArray[np.int64]) -> int:
        """Position of the first row id in ``rows`` that repeats an earlier one, or -1.

        ``rows`` are row ids of this index (0 <= row < row_limit). One bit test per element,
        far cheaper than sorting. Not thread-safe, like every call here.
        """
        need = (self._index.row_limit + 8) // 8
        if self._bits.size < need:
            self._bits = np.zeros(max(need, 2 * self._bits.size), dtype=np.uint8)
        return first_repeat(_as_keys(rows), self._bits)

    def delete(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Removes ``keys``; returns the row id each held (-1 where absent). The freed row ids
        are the caller's to reuse with ``insert_rows``."""
        keys = _as_keys(keys)
        rows = np.empty(keys.shape[0], dtype=np.int64)
        self._index.delete(keys, rows)
        return rows

    def insert_rows(self, keys: npt.NDArray[np.int64], rows: npt.NDArray[np.int64]) -> None:
        """Inserts absent, distinct ``keys`` with the row ids ``rows`` (each in [0, MAX_ROWS),
        held by no other key). All-or-nothing: ``ValueError`` naming a present key or a
        negative row, ``OverflowError`` naming a row of MAX_ROWS or more."""
        self._index.insert_rows(_as_keys(keys), _as_keys(rows))

    def items(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(keys, rows)`` of every key, in slot order (not by row)."""
        keys = np.empty(len(self._index), dtype=np.int64)
        rows = np.empty(len(self._index), dtype=np.int64)
        self._index.items(keys, rows)
        return keys, rows

    def scan(self, start: int, max_slots: int, max_items: int
             ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
        """``(keys, rows, next_slot)``: the pairs held in slots ``start, start + 1, ...``, in
        slot order, stopping after ``max_slots`` slots, after the last slot or at
        ``max_items`` pairs; ``next_slot`` is where the next window starts (0 after the last
        slot). 0 <= start < capacity. A cursor fed back from ``next_slot`` goes round the
        table in bounded steps; keys deleted in between may move an entry back past the
        cursor (that pass misses it, or meets it twice across the wrap), never on every
        pass."""
        keys = np.empty(max_items, dtype=np.int64)
        rows = np.empty(max_items, dtype=np.int64)
        count, next_slot = self._index.scan(start, max_slots, keys, rows)
        return keys[:count], rows[:count], next_slot

    @property
    def row_limit(self) -> int:
        """One past the largest row id handed out since the last ``clear``: ``len(self)``
        until a key is deleted."""
        return self._index.row_limit

    def keys_by_row(self) -> npt.NDArray[np.int64]:
        """Returns the key of every row: ``keys_by_row()[row] == key``. For checkpoints.
        ``ValueError`` once keys were deleted (rows have holes): use ``items``."""
        keys = np.empty(len(self._index), dtype=np.int64)
        self._index.export(keys)
        return keys

    def reserve(self, n: int) -> None:
        """Grows the table so that ``n`` keys fit without another rehash. Never shrinks."""
        self._index.reserve(n)

    def clear(self) -> None:
        """Removes every key; the capacity is kept and row ids start again from 0."""
        self._index.clear()

    def __len__(self) -> int:
        """The number of keys (equal to the number of rows)."""
        return len(self._index)

    @property
    def capacity(self) -> int:
        """The number of slots in the hash table (a power of two)."""
        return self._index.capacity

    @property
    def nbytes(self) -> int:
        """The bytes held by the slot array (SLOT_BYTES per slot)."""
        return self._index.nbytes

    def __repr__(self) -> str:
        return f"KeyIndex(len={len(self)}, capacity={self.capacity})"
