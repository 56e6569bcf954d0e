"""Per-clock gradient sums of sync tables, applied once when the clock closes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ps.tables import DenseTable, SparseTable


class DenseSum:
    """The sum of the dense gradients pushed for the open clock. Guarded by the shard."""

    def __init__(self, table: DenseTable) -> None:
        self.table = table
        self._sum: torch.Tensor | None = None
        self.count = 0

    def add(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        if self._sum is None:
            self._sum = torch.zeros(self.table.value.numel(), dtype=self.table.spec.dtype)
        for offset, part in parts:
            self._sum[offset : offset + part.numel()].add_(part)
        self.count += 1

    def apply(self, divisor: int) -> int:
        """Applies sum / divisor through the optimizer, once; returns the gradients used."""
        used = self.count
        if self._sum is not None:
            self.table.apply([(0, self._sum.div_(divisor))], assign=False)
        self._sum = None
        self.count = 0
        return used


class SparseSum:
    """The sparse gradients pushed for the open clock, coalesced when it closes."""

    def __init__(self, table: SparseTable) -> None:
        self.table = table
        self._keys: list[np.ndarray] = []
        self._values: list[torch.Tensor] = []
        self.count = 0

    def add(self, keys: np.ndarray, values: torch.Tensor) -> None:
        # Copied: the arrays may view a client's shared-memory region, which the client
        # reuses as soon as the push is answered.
        self._keys.append(np.array(keys, copy=True))
        self._values.append(values.clone())
        self.count += 1

    def apply(self, divisor: int) -> int:
        used = self.count
        if self._keys:
            keys = torch.from_numpy(np.concatenate(self._keys))
            values = torch.cat(self._values)
            unique, inverse = torch.unique(keys, return_inverse=True)
            summed = torch.zeros((len(unique), values.shape[1]), dtype=values.dtype)
            summed.index_add_(0, inverse, values).div_(divisor)
            self.table.apply(unique.numpy(), summed, assign=False)
        self._keys.clear()
        self._values.clear()
        self.count = 0
        return used


Aggregate = DenseSum | SparseSum
