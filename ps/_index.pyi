"""Type stub for the C extension ``ps._index`` (see ps/_index.c).

Every method takes 1-D C-contiguous native int64 buffers, releases the GIL while it works, and
is NOT thread-safe: callers serialise access with a lock.
"""

from typing import TypeAlias, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

# numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12, so name it explicitly.
_Int64Buffer: TypeAlias = Buffer | npt.NDArray[np.int64]

def first_repeat(rows: _Int64Buffer, bitmap: Buffer | npt.NDArray[np.uint8], /) -> int:
    """Position of the first element of ``rows`` equal to an earlier one, or -1."""

@final
class Int64Index:
    """Hash index from int64 keys to dense row ids ``0..len-1``, in order of first insertion."""

    def __init__(self, capacity_hint: int = 0, seed: int = 0) -> None: ...
    def lookup(self, keys: _Int64Buffer, out: _Int64Buffer, /) -> int:
        """Write each key's row id (or -1 when absent) into ``out``; return the number found."""
    def lookup_or_insert(self, keys: _Int64Buffer, out: _Int64Buffer, /) -> int:
        """Like ``lookup``, inserting absent keys; return the number of rows created.
        ``OverflowError`` (nothing inserted) past 2**31 - 1 rows."""
    def export(self, keys_out: _Int64Buffer, /) -> None:
        """Write ``keys_out[row] = key`` for every row; ``keys_out`` has length ``len(self)``."""
    def reserve(self, n: int, /) -> None:
        """Grow so that ``n`` keys fit without a rehash; never shrinks."""
    def clear(self) -> None:
        """Remove every key, keeping the capacity; row ids start again from 0."""
    def delete(self, keys: _Int64Buffer, out: _Int64Buffer, /) -> int:
        """Remove ``keys``, writing each one's former row id (or -1) into ``out``; return the
        number removed."""
    def insert_rows(self, keys: _Int64Buffer, rows: _Int64Buffer, /) -> None:
        """Insert absent, distinct ``keys`` with the given row ids; all-or-nothing."""
    def items(self, keys_out: _Int64Buffer, rows_out: _Int64Buffer, /) -> None:
        """Write every (key, row id) pair in slot order; both have length ``len(self)``."""
    def scan(self, start: int, max_slots: int, keys_out: _Int64Buffer, rows_out: _Int64Buffer,
             /) -> tuple[int, int]:
        """Write the (key, row id) pairs of slots ``start, ...`` (at most ``max_slots`` slots,
        up to the buffers' length); return ``(count, next_slot)``, 0 after the last slot."""
    @property
    def row_limit(self) -> int:
        """One past the largest row id handed out since the last clear."""
    def __len__(self) -> int: ...
    @property
    def capacity(self) -> int:
        """Number of slots (a power of two)."""
    @property
    def nbytes(self) -> int:
        """Bytes held by the slot array."""
