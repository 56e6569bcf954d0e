"""Type stub for the C extension ``ps._rows`` (see ps/_rows.c).

Buffers are C-contiguous; ``rows`` holds native int64 row ids. Each call checks every row id
before writing anything (ValueError), then releases the GIL.
"""

from typing import TypeAlias

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

# numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12, so name it explicitly.
_Buffer: TypeAlias = Buffer | npt.NDArray[np.generic]

def gather(table: _Buffer, row_bytes: int, rows: _Buffer, out: _Buffer, /) -> None:
    """``out[i] = table[rows[i]]``, rows of ``row_bytes`` bytes."""

def scatter(table: _Buffer, row_bytes: int, rows: _Buffer, src: _Buffer, /) -> None:
    """``table[rows[i]] = src[i]`` for distinct ``rows``."""

def add(table: _Buffer, dim: int, rows: _Buffer, src: _Buffer, alpha: float, double: bool,
        /) -> None:
    """``table[rows[i]] += alpha * src[i]`` over float32 rows (float64 if ``double``)."""

def adagrad(param: _Buffer, state_sum: _Buffer, dim: int, rows: _Buffer, grad: _Buffer,
            lr: float, eps: float, weight_decay: float, double: bool, /) -> None:
    """Adagrad on distinct ``rows`` of float32 (float64 if ``double``) ``param`` and
    ``state_sum``: ``g = grad + weight_decay * param; sum += g * g;
    param += (g * -lr) / (sqrt(sum) + eps)``, the first two fused multiply-adds."""

def adam(param: _Buffer, exp_avg: _Buffer, exp_avg_sq: _Buffer, grad: _Buffer, beta1: float,
         beta2: float, step_size: float, bias_correction2_sqrt: float, eps: float,
         weight_decay: float, double: bool, /) -> None:
    """Adam, element by element, on equally long float32 (float64 if ``double``) buffers, as
    torch.optim.Adam's single-tensor step with the given bias-corrected scalars."""

def first_nonfinite(buf: _Buffer, width: int, mask: int, /) -> int:
    """Index of the first ``width``-byte element with every bit of ``mask`` set, or -1."""
