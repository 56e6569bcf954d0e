"""Row gathers, scatters and adds over a sparse table's [capacity, dim] storage, Adagrad's
update of its rows (`adagrad_`) and Adam's of a dense block (`adam_`), those two always C loops.

The same results as torch's ``index_select``, ``index_copy_`` and ``index_add_`` along dim 0,
computed by ps._rows's loops where they pay (contiguous CPU tensors, enough rows; ``add_`` on
float32 and float64), which prefetch the scattered rows instead of sorting or iterating per
element.
On 64k random rows of 64 floats in a 10M-row table (this machine, one thread): gather 2.5 ms
against 4 ms, scatter 2.3 ms against 19 ms, add 5 ms against 7.4 ms. Anything else falls back
to torch.

Row ids must be valid; scatter_ and add_ need them distinct (a sparse table's index gives
each key one row). Each call blocks for its loop with the GIL released; callers serialise
writes to one table as they would with torch's ops.
"""

from __future__ import annotations

import numpy as np
import torch

from ps._rows import adagrad as _adagrad
from ps._rows import adam as _adam
from ps._rows import add as _add
from ps._rows import first_nonfinite as _first_nonfinite
from ps._rows import gather as _gather
from ps._rows import scatter as _scatter

# Element views numpy can take a buffer of: bfloat16 has no numpy dtype, so it travels as int16.
_VIEW = {torch.bfloat16: torch.int16}
_ADD_DTYPES = (torch.float32, torch.float64)
# Below these row counts torch's own ops are as fast or faster: their fixed cost is lower and
# few rows miss the cache. Measured with 64-float rows in a 5M-row table, one thread: scatters
# and adds win from about 128 rows, gathers break even at about 1024.
_MIN_ROWS = 256
_MIN_GATHER_ROWS = 4096


def _buffer(t: torch.Tensor) -> np.ndarray:
    view = _VIEW.get(t.dtype)
    return (t if view is None else t.view(view)).numpy()


def _native(rows: torch.Tensor, *tensors: torch.Tensor) -> bool:
    return rows.dtype == torch.int64 and all(
        t.device.type == "cpu" and t.is_contiguous() for t in (rows, *tensors))


def _row_bytes(table: torch.Tensor) -> int:
    return (table.stride(0) if table.dim() > 1 else 1) * table.element_size()


def gather(table: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``table.index_select(0, rows)``, into `out` when given."""
    if (rows.shape[0] < _MIN_GATHER_ROWS or table.shape[0] == 0
            or not _native(rows, table, *(() if out is None else (out,)))
            or (out is not None and out.dtype != table.dtype)):
        return table.index_select(0, rows) if out is None else torch.index_select(
            table, 0, rows, out=out)
    if out is None:
        out = torch.empty((rows.shape[0], *table.shape[1:]), dtype=table.dtype)
    _gather(_buffer(table), _row_bytes(table), rows.numpy(), _buffer(out))
    return out


def scatter_(table: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``table.index_copy_(0, rows, src)`` for distinct `rows`."""
    if (rows.shape[0] < _MIN_ROWS or table.shape[0] == 0 or src.dtype != table.dtype
            or not _native(rows, table, src)):
        table.index_copy_(0, rows, src)
        return
    _scatter(_buffer(table), _row_bytes(table), rows.numpy(), _buffer(src))


def add_(table: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, alpha: float = 1.0
         ) -> None:
    """``table.index_add_(0, rows, alpha * src)`` for distinct `rows`: ``alpha * src`` is
    rounded to the table's dtype before the add, as that expression does."""
    if (rows.shape[0] < _MIN_ROWS or table.dtype not in _ADD_DTYPES or src.dtype != table.dtype
            or table.dim() != 2 or table.shape[0] == 0 or not _native(rows, table, src)):
        table.index_add_(0, rows, src if alpha == 1.0 else src.mul(alpha))
        return
    _add(table.numpy(), table.shape[1], rows.numpy(), src.numpy(), alpha,
         table.dtype == torch.float64)


def adagrad_(param: torch.Tensor, state_sum: torch.Tensor, rows: torch.Tensor,
             grad: torch.Tensor, lr: float, eps: float, weight_decay: float) -> None:
    """Adagrad on the distinct `rows` of a [capacity, dim] float32 or float64 CPU `param` and
    its accumulator `state_sum`, with their [len(rows), dim] `grad`, in one pass over each
    row: the ops and roundings of torch.optim.Adagrad (lr_decay 0), without their ten
    tensor ops and temporaries per push. `grad` is not modified."""
    dtype = param.dtype
    if (dtype not in _ADD_DTYPES or state_sum.dtype != dtype or grad.dtype != dtype
            or param.dim() != 2 or rows.dtype != torch.int64):
        raise ValueError(
            f"adagrad_ takes CPU float32 or float64 [capacity, dim] tables, a [rows, dim] "
            f"gradient of their dtype and int64 rows; got param {dtype} {list(param.shape)}, "
            f"state {state_sum.dtype} {list(state_sum.shape)}, grad {grad.dtype} "
            f"{list(grad.shape)}, rows {rows.dtype}"
        )
    if not rows.shape[0] or not param.shape[1]:
        return
    # The loop checks every size and row id; .numpy() refuses tensors off the CPU, the buffer
    # protocol non-contiguous ones.
    _adagrad(param.numpy(), state_sum.numpy(), param.shape[1], rows.numpy(),
             grad.detach().contiguous().numpy(), lr, eps, weight_decay, dtype == torch.float64)


def adam_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
          grad: torch.Tensor, beta1: float, beta2: float, step_size: float,
          bias_correction2_sqrt: float, eps: float, weight_decay: float) -> None:
    """Adam on a contiguous float32 or float64 CPU block and its two moments, element by
    element in one pass: torch.optim.Adam's single-tensor step (its ops and roundings, the
    square root correctly rounded) with the bias-corrected `step_size` and
    `bias_correction2_sqrt` the caller worked out. `grad` is not modified."""
    dtype = param.dtype
    if (dtype not in _ADD_DTYPES or exp_avg.dtype != dtype or exp_avg_sq.dtype != dtype
            or grad.dtype != dtype or not param.is_contiguous() or not exp_avg.is_contiguous()
            or not exp_avg_sq.is_contiguous() or not grad.is_contiguous()):
        raise ValueError(
            "adam_ takes contiguous CPU float32 or float64 tensors of one dtype; got "
            + ", ".join(f"{t.dtype} {list(t.shape)}" for t in (param, exp_avg, exp_avg_sq, grad))
        )
    if not param.numel():
        return
    # The loop checks that the four are equally long; .numpy() refuses tensors off the CPU.
    _adam(param.view(-1).numpy(), exp_avg.view(-1).numpy(), exp_avg_sq.view(-1).numpy(),
          grad.detach().view(-1).numpy(), beta1, beta2, step_size, bias_correction2_sqrt, eps,
          weight_decay, dtype == torch.float64)


# Width in bytes and exponent mask of each IEEE-754 format: all exponent bits set is NaN or Inf.
_EXPONENT = {
    torch.float16: (2, 0x7C00),
    torch.bfloat16: (2, 0x7F80),
    torch.float32: (4, 0x7F800000),
    torch.float64: (8, 0x7FF0000000000000),
}


def first_nonfinite(values: torch.Tensor) -> int:
    """Flat index of the first NaN or infinity in `values`, or -1 when all are finite.

    One pass over the bits for contiguous CPU floating tensors; torch's isfinite otherwise.
    Integer tensors hold no NaN or infinity.
    """
    exponent = _EXPONENT.get(values.dtype)
    if exponent is None:
        if values.is_floating_point() or values.is_complex():
            finite = torch.isfinite(values).reshape(-1)
            return -1 if bool(finite.all()) else int(torch.argmin(finite.to(torch.uint8)))
        return -1
    if values.device.type != "cpu" or not values.is_contiguous() or values.requires_grad:
        values = values.detach().to("cpu").contiguous()
    width, mask = exponent
    return _first_nonfinite(_buffer(values), width, mask)

