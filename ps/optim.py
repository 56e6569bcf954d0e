"""Server-side optimizers: the update rule a shard applies to a pushed gradient.

An optimizer is a pure update rule. It owns no tensors: the table that calls it holds the
parameters, the per-element state tensors named by ``slots`` and the update counters, and
decides whether to lock around an update or to run it lock-free (Hogwild). The optimizer
never locks, sleeps, logs or does I/O, and the only mutable thing it touches is what it is
handed. One instance may therefore be shared by any number of threads and tables.

Two entry points cover the two table layouts:

* ``apply_dense`` updates one whole dense block in place.
* ``apply_rows`` updates some rows of a sparse table's preallocated ``[capacity, dim]``
  storage. Each row keeps its own update count, so a row that has been pushed ``k`` times
  is in exactly the state ``torch.optim`` would leave a parameter in after ``k`` steps,
  however many pushes touched other rows meanwhile ("lazy" per-row Adam).

The arithmetic follows ``torch.optim.SGD`` (no momentum), ``torch.optim.Adagrad``
(``lr_decay=0``) and ``torch.optim.Adam`` (``amsgrad=False``, ``maximize=False``,
``foreach=False``), including their L2 ``weight_decay`` (``grad + weight_decay * param``).
The tests hold both entry points to those classes within 1e-6 in float32. On CPU every
update is in fact bit-identical to ``torch.optim`` except SGD's row updates, which differ by
at most one rounding of ``lr * grad`` (see ``SGD._update_rows`` for why).

Rows stored in float16 or bfloat16 (compact rows) are updated in float32: the touched rows
are widened, the rule runs on them with float32 state, and the result is rounded back to the
storage dtype once per update (``compute_dtype``).

Two rules for click models have no ``torch.optim`` counterpart: row-wise Adagrad (one
accumulator per row, the mean of the row's squared gradient, as FBGEMM's
``EXACT_ROWWISE_ADAGRAD``: a ``[capacity, 1]`` slot instead of ``[capacity, dim]``) and
FTRL-Proximal (per coordinate, McMahan et al. 2013, "Ad click prediction: a view from the
trenches", Algorithm 1). The tests hold them to plain implementations of those formulas.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar

import torch

from ps.errors import InvalidArgumentError
from ps.rows import adagrad_ as rows_adagrad
from ps.rows import adam_ as rows_adam
from ps.rows import add_ as rows_add
from ps.rows import gather, scatter_

__all__ = [
    "FTRL",
    "OPTIMIZERS",
    "SGD",
    "Adagrad",
    "AdagradConfig",
    "Adam",
    "AdamConfig",
    "FTRLConfig",
    "Optimizer",
    "OptimizerConfig",
    "RowwiseAdagrad",
    "SGDConfig",
    "make_optimizer",
]

# apply_rows works through the touched rows in blocks of about this many elements. Each
# temporary of a block is then 256 KiB in float32: it stays in cache between the several
# passes an update makes over it, and the allocator recycles it from block to block instead
# of mapping (and page-faulting) a fresh multi-megabyte buffer for every push.
_ROWS_BLOCK_ELEMENTS = 1 << 16


# Storage dtypes whose updates run in float32, with float32 optimizer state.
_COMPACT = frozenset({torch.float16, torch.bfloat16})


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype updates of `dtype` storage run in, and its optimizer state is kept in. Pure."""
    return torch.float32 if dtype in _COMPACT else dtype


def _check_real(owner: str, field: str, value: object) -> float:
    # bool is an int subclass; True as a learning rate is a caller bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(
            f"{owner}.{field} must be a real number, got {value!r} of type "
            f"{type(value).__name__}; pass a float"
        )
    as_float = float(value)
    if not math.isfinite(as_float):
        raise InvalidArgumentError(f"{owner}.{field} must be finite, got {value!r}")
    return as_float


def _check_positive(owner: str, field: str, value: object) -> None:
    if _check_real(owner, field, value) <= 0.0:
        raise InvalidArgumentError(f"{owner}.{field} must be > 0, got {value!r}")


def _check_non_negative(owner: str, field: str, value: object) -> None:
    if _check_real(owner, field, value) < 0.0:
        raise InvalidArgumentError(f"{owner}.{field} must be >= 0, got {value!r}")


def _check_beta(owner: str, field: str, value: object) -> None:
    beta = _check_real(owner, field, value)
    if not 0.0 <= beta < 1.0:
        raise InvalidArgumentError(
            f"{owner}.{field} must lie in [0, 1), got {value!r}; typical values are 0.9 "
            "for beta1 and 0.999 for beta2"
        )


@dataclass(frozen=True)
class SGDConfig:
    """Hyperparameters of plain SGD (no momentum). Validated on construction."""

    lr: float = 0.01
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("SGDConfig", "lr", self.lr)
        _check_non_negative("SGDConfig", "weight_decay", self.weight_decay)


@dataclass(frozen=True)
class AdagradConfig:
    """Hyperparameters of Adagrad without learning-rate decay. Validated on construction."""

    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("AdagradConfig", "lr", self.lr)
        _check_positive("AdagradConfig", "eps", self.eps)
        _check_non_negative(
            "AdagradConfig", "initial_accumulator_value", self.initial_accumulator_value
        )
        _check_non_negative("AdagradConfig", "weight_decay", self.weight_decay)


@dataclass(frozen=True)
class AdamConfig:
    """Hyperparameters of Adam with L2 weight decay (not AdamW). Validated on construction."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("AdamConfig", "lr", self.lr)
        _check_beta("AdamConfig", "beta1", self.beta1)
        _check_beta("AdamConfig", "beta2", self.beta2)
        _check_positive("AdamConfig", "eps", self.eps)
        _check_non_negative("AdamConfig", "weight_decay", self.weight_decay)


@dataclass(frozen=True)
class FTRLConfig:
    """Hyperparameters of FTRL-Proximal: the per-coordinate learning rate is
    ``lr / (beta + sqrt(n))``, with L1 and L2 strengths as in the paper's Algorithm 1 (the
    L2 term is ``l2``, not TensorFlow's ``2 * l2_regularization_strength``). Validated on
    construction."""

    lr: float = 0.1  # the paper's alpha
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("FTRLConfig", "lr", self.lr)
        for name in ("beta", "l1", "l2", "initial_accumulator_value"):
            _check_non_negative("FTRLConfig", name, getattr(self, name))
        if self.beta == 0.0 and self.l2 == 0.0 and self.initial_accumulator_value == 0.0:
            raise InvalidArgumentError(
                "FTRLConfig needs beta > 0, l2 > 0 or initial_accumulator_value > 0: with all "
                "three 0 a coordinate whose gradients were all 0 divides by 0 (the paper "
                "uses beta = 1)"
            )


OptimizerConfig = SGDConfig | AdagradConfig | AdamConfig | FTRLConfig
ConfigT = TypeVar("ConfigT", SGDConfig, AdagradConfig, AdamConfig, FTRLConfig)


class Optimizer(ABC, Generic[ConfigT]):
    """An update rule: hyperparameters plus arithmetic, no tensors of its own.

    Subclasses declare ``name``, ``slots`` (names of the per-element state tensors the table
    must keep, each shaped like the parameter), ``uses_step`` (whether the rule reads the
    update counter) and ``config_type``.

    Thread-safety: an instance is immutable, so sharing it between threads is safe. The
    ``apply_*`` calls mutate only the tensors passed in and take no locks; concurrent calls on
    the same tensors race exactly as Hogwild intends, and a table that wants serialised
    updates must hold its own lock around them. Nothing here blocks or does I/O.
    """

    name: ClassVar[str]
    slots: ClassVar[tuple[str, ...]]
    uses_step: ClassVar[bool]
    config_type: ClassVar[type[OptimizerConfig]]
    # Whether the rule acts element by element (a block may then be updated slice by slice);
    # a row-wise rule needs whole rows.
    elementwise: ClassVar[bool] = True

    __slots__ = ("_config",)

    def __init__(self, config: ConfigT) -> None:
        if not isinstance(config, self.config_type):
            raise InvalidArgumentError(
                f"{type(self).__name__} takes a {self.config_type.__name__}, got {config!r}"
            )
        self._config: ConfigT = config

    @property
    def config(self) -> ConfigT:
        """The hyperparameters (a frozen dataclass)."""
        return self._config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._config!r})"

    def init_slot(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Return a new contiguous state tensor for slot ``name`` shaped like ``like``.

        The table calls this to allocate state for a new block, or for the new rows when it
        grows a sparse table. Does not block; thread-safe.
        """
        if name not in self.slots:
            raise InvalidArgumentError(
                f"optimizer {self.name!r} has no state slot {name!r}; its slots are "
                f"{list(self.slots)}"
            )
        return torch.full(self.slot_shape(name, tuple(like.shape)),
                          self._slot_initial_value(name), dtype=compute_dtype(like.dtype),
                          device=like.device)

    def slot_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of slot ``name`` for a parameter of ``shape``: the same, unless the rule
        keeps less (row-wise state). Pure."""
        return shape

    def slot_width(self, dim: int) -> int:
        """Elements per row that all slots together keep for a row of ``dim`` elements. Pure."""
        return sum(math.prod(self.slot_shape(s, (1, dim))) for s in self.slots)

    def apply_dense(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: torch.Tensor,
        *,
        trusted: bool = False,
    ) -> None:
        """Apply one update to a whole dense block, in place.

        ``trusted`` skips the checks below, as for ``apply_rows``: for the dense table, whose
        block, state and step are its own and whose gradient's shape and dtype it checked.

        ``state`` maps each name in ``slots`` to a tensor shaped like ``param``. ``step`` is an
        integer tensor of shape [1] holding how many updates the block has had; it is
        incremented here, before bias corrections are computed, as ``torch.optim`` does.
        Gradients are not checked for NaN or infinity: that costs a pass over the data and
        belongs to whoever decodes the push.

        Raises InvalidArgumentError, before touching anything, if shapes, dtypes or state
        do not match. Does not block; see the class docstring for thread-safety.
        """
        if not trusted:
            self._check_floating("param", param)
            self._check_like("grad", grad, param)
            self._check_state(state, param)
            if step.shape != (1,) or step.is_floating_point() or step.is_complex():
                raise InvalidArgumentError(
                    f"step must be an integer tensor of shape [1], got dtype {step.dtype} "
                    f"and shape {list(step.shape)}"
                )
        with torch.no_grad():
            step.add_(1)
            if param.dtype in _COMPACT:
                work = param.float()
                self._update_dense(work, grad.float(), state, int(step.item()))
                param.copy_(work)
            else:
                self._update_dense(param, grad, state, int(step.item()))

    def apply_rows(
        self,
        param: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: torch.Tensor | None,
        *,
        trusted: bool = False,
    ) -> None:
        """Apply one update to rows ``rows`` of a sparse table's storage, in place.

        ``trusted`` skips the checks below: for a caller (the sparse table) whose storage,
        state, step and row numbers are its own, and so valid by construction; on the
        small pushes of a training step the checks cost as much as the update.

        ``param`` is the table's ``[capacity, dim]`` storage, ``rows`` a 1-D int64 tensor of
        row numbers, ``grad`` the ``[len(rows), dim]`` gradient, and ``state`` maps each name
        in ``slots`` to a ``[capacity, dim]`` tensor. ``step`` is an int32 or int64 tensor of
        shape [capacity] with each row's update count, or None; it is required when
        ``uses_step`` is true, and when given it is incremented for the touched rows.

        Only the touched rows of ``param``, ``state`` and ``step`` change. Row ``r`` ends up
        as ``torch.optim`` would leave a parameter that had been stepped ``step[r]`` times.

        ``rows`` must not repeat a row: a repeated row would get every occurrence's parameter
        update but only one occurrence's state. That is not checked because it would cost a
        pass per push and the table already maps each key to one row. Gradients are not
        checked for NaN either.
        Shapes, dtypes and the range of ``rows`` are checked before anything is written, so a
        rejected call (InvalidArgumentError) leaves the table untouched.

        Does not block; see the class docstring for thread-safety.
        """
        if trusted:
            if rows.shape[0]:
                with torch.no_grad():
                    self._update_rows_of(param, rows, grad, state, step)
            return
        self._check_floating("param", param)
        if param.dim() != 2:
            raise InvalidArgumentError(
                f"param must be a [capacity, dim] table, got shape {list(param.shape)}"
            )
        capacity, dim = param.shape
        if rows.dtype != torch.int64 or rows.dim() != 1:
            raise InvalidArgumentError(
                f"rows must be a 1-D int64 tensor, got dtype {rows.dtype} and shape "
                f"{list(rows.shape)}"
            )
        if rows.device != param.device:
            raise InvalidArgumentError(
                f"rows is on {rows.device} but param is on {param.device}; move them together"
            )
        n = rows.shape[0]
        if grad.shape != (n, dim):
            raise InvalidArgumentError(
                f"grad must have shape [len(rows), dim] = {[n, dim]}, got {list(grad.shape)}"
            )
        self._check_like("grad", grad, param, check_shape=False)
        self._check_state(state, param)
        if step is not None:
            if step.dtype not in (torch.int32, torch.int64) or step.shape != (capacity,):
                raise InvalidArgumentError(
                    f"step must be an int32 or int64 tensor of shape [capacity] = "
                    f"{[capacity]}, got dtype {step.dtype} and shape {list(step.shape)}"
                )
            if step.device != param.device:
                raise InvalidArgumentError(
                    f"step is on {step.device} but param is on {param.device}"
                )
        elif self.uses_step:
            raise InvalidArgumentError(
                f"optimizer {self.name!r} keeps a per-row update count; pass the table's "
                "step tensor instead of None"
            )
        if n == 0:
            return
        lowest, highest = (int(v) for v in torch.aminmax(rows))
        if lowest < 0 or highest >= capacity:
            raise InvalidArgumentError(
                f"rows must lie in [0, {capacity}), got values from {lowest} to {highest}"
            )
        with torch.no_grad():
            self._update_rows_of(param, rows, grad, state, step)

    def _update_rows_of(
        self,
        param: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: torch.Tensor | None,
    ) -> None:
        """`_update_rows`, in float32 on a widened copy of the rows for compact storage."""
        if param.dtype not in _COMPACT:
            self._update_rows(param, rows, grad, state, step)
            return
        local = torch.arange(rows.shape[0])
        work = gather(param, rows).float()
        work_state = {k: gather(v, rows) for k, v in state.items()}
        work_step = None if step is None else step.index_select(0, rows)
        self._update_rows(work, local, grad.float(), work_state, work_step)
        scatter_(param, rows, work.to(param.dtype))
        for k, v in state.items():
            scatter_(v, rows, work_state[k])
        if step is not None and work_step is not None:
            step.index_copy_(0, rows, work_step)

    def _slot_initial_value(self, name: str) -> float:
        """The value a fresh element of slot ``name`` starts at; zero unless overridden."""
        return 0.0

    @abstractmethod
    def _update_dense(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: int,
    ) -> None:
        """Update ``param`` and ``state`` in place; ``step`` already counts this update."""

    @abstractmethod
    def _update_rows(
        self,
        param: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: torch.Tensor | None,
    ) -> None:
        """Update validated, in-range rows in place, including their ``step`` counts."""

    @staticmethod
    def _check_floating(what: str, tensor: torch.Tensor) -> None:
        if not tensor.is_floating_point():
            raise InvalidArgumentError(
                f"{what} must be a floating-point tensor, got dtype {tensor.dtype}"
            )

    @staticmethod
    def _check_like(
        what: str, tensor: torch.Tensor, param: torch.Tensor, *, check_shape: bool = True
    ) -> None:
        if check_shape and tensor.shape != param.shape:
            raise InvalidArgumentError(
                f"{what} has shape {list(tensor.shape)} but param has shape "
                f"{list(param.shape)}; they must match"
            )
        if tensor.dtype != param.dtype:
            raise InvalidArgumentError(
                f"{what} has dtype {tensor.dtype} but param has dtype {param.dtype}; "
                "convert it before applying"
            )
        if tensor.device != param.device:
            raise InvalidArgumentError(
                f"{what} is on {tensor.device} but param is on {param.device}"
            )

    def _check_state(self, state: Mapping[str, torch.Tensor], param: torch.Tensor) -> None:
        for slot in self.slots:
            tensor = state.get(slot)
            if tensor is None:
                raise InvalidArgumentError(
                    f"optimizer {self.name!r} needs state slot {slot!r}, got slots "
                    f"{sorted(state)}; allocate it with init_slot()"
                )
            if tensor.dtype != compute_dtype(param.dtype):
                raise InvalidArgumentError(
                    f"state[{slot!r}] has dtype {tensor.dtype}, but a {param.dtype} parameter "
                    f"keeps its state in {compute_dtype(param.dtype)}; allocate it with "
                    "init_slot()"
                )
            if tensor.device != param.device:
                raise InvalidArgumentError(
                    f"state[{slot!r}] is on {tensor.device} but param is on {param.device}")
            expected = self.slot_shape(slot, tuple(param.shape))
            if tuple(tensor.shape) != expected:
                raise InvalidArgumentError(
                    f"state[{slot!r}] has shape {list(tensor.shape)}, but optimizer "
                    f"{self.name!r} keeps {list(expected)} for a parameter of shape "
                    f"{list(param.shape)}; allocate it with init_slot()"
                )


def _blocks(n: int, dim: int) -> Iterator[slice]:
    """Consecutive slices of ``range(n)`` holding about _ROWS_BLOCK_ELEMENTS elements each."""
    size = max(1, _ROWS_BLOCK_ELEMENTS // max(dim, 1))
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


# Below this many rows the sweep is too short for address order to pay for the sort.
_SORT_MIN_ROWS = 4096


def _in_address_order(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sorted, and the permutation that sorts them (to gather the gradient with).

    Adagrad and Adam read and write two or three [capacity, dim] tensors per row. Sweeping
    those in address order rather than at random makes the gathers and scatters cheaper
    than sorting and gathering the gradient cost: about 15% of the whole update, measured
    at 64k random rows of 64 floats in a 2M-row table. The result does not depend on the order
    because rows are unique.
    """
    if rows.shape[0] < _SORT_MIN_ROWS:
        return rows, torch.arange(rows.shape[0])
    return torch.sort(rows)


def _count_rows(step: torch.Tensor | None, rows: torch.Tensor) -> None:
    if step is not None:
        step.index_add_(0, rows, torch.ones(rows.shape, dtype=step.dtype, device=step.device))


class SGD(Optimizer[SGDConfig]):
    """Plain stochastic gradient descent: ``param -= lr * (grad + weight_decay * param)``.

    Keeps no state. Immutable; the ``apply_*`` calls do not block and take no locks.
    """

    name = "sgd"
    slots = ()
    uses_step = False
    config_type = SGDConfig

    __slots__ = ()

    def __init__(self, config: SGDConfig | None = None) -> None:
        super().__init__(SGDConfig() if config is None else config)

    def _update_dense(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: int,
    ) -> None:
        cfg = self._config
        if cfg.weight_decay != 0.0:
            grad = grad.add(param, alpha=cfg.weight_decay)
        param.add_(grad, alpha=-cfg.lr)

    def _update_rows(
        self,
        param: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: torch.Tensor | None,
    ) -> None:
        cfg = self._config
        for block in _blocks(rows.shape[0], param.shape[1]):
            block_rows, block_grad = rows[block], grad[block]
            if cfg.weight_decay != 0.0:
                gathered = gather(param, block_rows)
                block_grad = torch.add(block_grad, gathered, alpha=cfg.weight_decay, out=gathered)
            # param + (-lr * grad), rounded once per op: the result differs from
            # torch.optim.SGD's fused multiply-add by at most one rounding of lr * grad.
            rows_add(param, block_rows, block_grad, -cfg.lr)
        _count_rows(step, rows)


class Adagrad(Optimizer[AdagradConfig]):
    """Adagrad without learning-rate decay, as ``torch.optim.Adagrad(lr_decay=0)``.

    Slot ``"sum"`` accumulates squared gradients, starting at
    ``initial_accumulator_value``. Immutable; the ``apply_*`` calls do not block and take no
    locks.
    """

    name = "adagrad"
    slots = ("sum",)
    uses_step = False
    config_type = AdagradConfig

    __slots__ = ()

    def __init__(self, config: AdagradConfig | None = None) -> None:
        super().__init__(AdagradConfig() if config is None else config)

    def _slot_initial_value(self, name: str) -> float:
        return self._config.initial_accumulator_value

    def _update_dense(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: int,
    ) -> None:
        cfg = self._config
        state_sum = state["sum"]
        if cfg.weight_decay != 0.0:
            grad = grad.add(param, alpha=cfg.weight_decay)
        state_sum.addcmul_(grad, grad, value=1)
        std = state_sum.sqrt().add_(cfg.eps)
        param.addcdiv_(grad, std, value=-cfg.lr)

    def _update_rows(
        self,
        param: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: torch.Tensor | None,
    ) -> None:
        cfg = self._config
        # One pass over each row, with torch.optim.Adagrad's ops and roundings (its square
        # root correctly rounded, which torch's CPU kernel is not always).
        rows_adagrad(param, state["sum"], rows, grad, cfg.lr, cfg.eps, cfg.weight_decay)
        _count_rows(step, rows)


class Adam(Optimizer[AdamConfig]):
    """Adam with L2 weight decay, as ``torch.optim.Adam(amsgrad=False)``; per-row on sparse tables.

    Slots ``"exp_avg"`` and ``"exp_avg_sq"`` start at zero. Bias corrections use each row's own
    update count, so a row first touched late starts with full bias correction rather than
    inheriting the table's age. Immutable; the ``apply_*`` calls do not block and take no
    locks.
    """

    name = "adam"
    slots = ("exp_avg", "exp_avg_sq")
    uses_step = True
    config_type = AdamConfig

    __slots__ = ()

    def __init__(self, config: AdamConfig | None = None) -> None:
        super().__init__(AdamConfig() if config is None else config)

    def _update_dense(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: int,
    ) -> None:
        cfg = self._config
        # Python floats, in the same order as torch.optim.Adam, so the scalars match bit for
        # bit; the elementwise ops are torch's, in one pass (ps.rows.adam_).
        bias_correction1 = 1 - cfg.beta1**step
        bias_correction2 = 1 - cfg.beta2**step
        step_size = cfg.lr / bias_correction1
        rows_adam(param, state["exp_avg"], state["exp_avg_sq"], grad, cfg.beta1, cfg.beta2,
                  step_size, bias_correction2**0.5, cfg.eps, cfg.weight_decay)

    def _update_rows(
        self,
        param: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: torch.Tensor | None,
    ) -> None:
        if step is None:
            # apply_rows() has already refused this; the check narrows the type.
            raise InvalidArgumentError("Adam needs the table's per-row step tensor")
        cfg = self._config
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        rows, order = _in_address_order(rows)

        counts = gather(step, rows).add_(1)
        scatter_(step, rows, counts)
        # Bias corrections per row in float64, rounded to the parameter dtype only at the
        # end, as torch.optim.Adam does with its Python-float scalars.
        t = counts.to(torch.float64)
        neg_step_size = (
            torch.full_like(t, -cfg.lr)
            .div_(torch.pow(cfg.beta1, t).neg_().add_(1))
            .to(param.dtype)
            .unsqueeze_(1)
        )
        bias_correction2_sqrt = (
            torch.pow(cfg.beta2, t).neg_().add_(1).sqrt_().to(param.dtype).unsqueeze_(1)
        )

        for block in _blocks(rows.shape[0], param.shape[1]):
            block_rows = rows[block]
            block_grad = grad.index_select(0, order[block])
            if cfg.weight_decay != 0.0:
                block_grad.add_(param.index_select(0, block_rows), alpha=cfg.weight_decay)
            m = gather(exp_avg, block_rows)
            m.lerp_(block_grad, 1 - cfg.beta1)
            scatter_(exp_avg, block_rows, m)
            v = gather(exp_avg_sq, block_rows)
            v.mul_(cfg.beta2).addcmul_(block_grad, block_grad, value=1 - cfg.beta2)
            scatter_(exp_avg_sq, block_rows, v)
            # m and v are saved, so their buffers become the update. torch.optim.Adam computes
            # param + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps); so does this, one
            # elementwise op at a time in the same order, with per-row columns for scalars.
            denom = v.sqrt_().div_(bias_correction2_sqrt[block]).add_(cfg.eps)
            update = m.mul_(neg_step_size[block]).div_(denom)
            rows_add(param, block_rows, update)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A dense block as [rows, width] (a scalar is one row of one element): a view."""
    if t.dim() == 0:
        return t.view(1, 1)
    rows = t.shape[0]
    return t.view(rows, t.numel() // rows if rows else 1)


class RowwiseAdagrad(Adagrad):
    """Adagrad with one accumulator per row: the mean of the row's squared gradient, as
    FBGEMM's exact row-wise Adagrad (TorchRec's default for embeddings).

    ``sum[r] += mean(g[r]**2)``; ``param[r] -= lr * g[r] / (sqrt(sum[r]) + eps)``, with
    ``g = grad + weight_decay * param``. Slot ``"sum"`` is ``[rows, 1]``: a row's state costs
    one element instead of ``dim``. A dense block's rows are its first dimension (a scalar is
    one row). Sparse rows are updated a block of rows at a time with torch ops. Immutable; the
    ``apply_*`` calls do not block and take no locks.
    """

    name = "rowwise_adagrad"
    elementwise = False

    __slots__ = ()

    def slot_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0], 1) if shape else ()

    @staticmethod
    def _accumulate(acc: torch.Tensor, grad: torch.Tensor) -> None:
        """Adds each row's mean squared gradient to its accumulator, in place."""
        acc.add_(grad.square().mean(dim=1, keepdim=True))

    def _update_rows(
        self,
        param: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: torch.Tensor | None,
    ) -> None:
        cfg = self._config
        state_sum = state["sum"]
        rows, order = _in_address_order(rows)
        for block in _blocks(rows.shape[0], param.shape[1]):
            block_rows = rows[block]
            block_grad = grad.index_select(0, order[block])
            if cfg.weight_decay != 0.0:
                block_grad.add_(param.index_select(0, block_rows), alpha=cfg.weight_decay)
            acc = gather(state_sum, block_rows)
            self._accumulate(acc, block_grad)
            scatter_(state_sum, block_rows, acc)
            # The accumulator is saved, so its buffer can become the denominator.
            std = acc.sqrt_().add_(cfg.eps)
            rows_add(param, block_rows, block_grad.mul_(-cfg.lr).div_(std))
        _count_rows(step, rows)

    def _update_dense(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: int,
    ) -> None:
        value, g = _as_rows(param), _as_rows(grad)
        acc = state["sum"].view(-1, 1)
        cfg = self._config
        if cfg.weight_decay != 0.0:
            g = g.add(value, alpha=cfg.weight_decay)
        self._accumulate(acc, g)
        value.addcdiv_(g, acc.sqrt().add_(cfg.eps), value=-cfg.lr)


class FTRL(Optimizer[FTRLConfig]):
    """FTRL-Proximal, per coordinate (McMahan et al. 2013, Algorithm 1).

    With ``n`` the sum of squared gradients and ``z`` the adjusted gradient sum, a gradient
    ``g`` of a weight ``w`` does ``sigma = (sqrt(n + g**2) - sqrt(n)) / lr``,
    ``z += g - sigma * w``, ``n += g**2``, and then sets ``w = 0`` where ``|z| <= l1`` and
    ``w = -(z - sign(z) * l1) / ((beta + sqrt(n)) / lr + l2)`` elsewhere. The weights start
    from the table's initial values (the ``sigma * w`` term keeps them), as TensorFlow's
    ``Ftrl`` does. Slots ``"z"`` and ``"n"`` are shaped like the parameter. Immutable; the
    ``apply_*`` calls do not block and take no locks.
    """

    name = "ftrl"
    slots = ("z", "n")
    uses_step = False
    config_type = FTRLConfig

    __slots__ = ()

    def __init__(self, config: FTRLConfig | None = None) -> None:
        super().__init__(FTRLConfig() if config is None else config)

    def _slot_initial_value(self, name: str) -> float:
        return self._config.initial_accumulator_value if name == "n" else 0.0

    def _step(self, w: torch.Tensor, g: torch.Tensor, z: torch.Tensor,
              n: torch.Tensor) -> torch.Tensor:
        """Updates ``z`` and ``n`` in place; returns the new weights (a new tensor)."""
        cfg = self._config
        n_new = n.addcmul(g, g, value=1)
        sigma = n_new.sqrt().sub_(n.sqrt()).div_(cfg.lr)
        z.add_(g).sub_(sigma.mul_(w))
        n.copy_(n_new)
        shrunk = z.abs().sub_(cfg.l1).clamp_(min=0).mul_(z.sign()).neg_()
        return shrunk.div_(n_new.sqrt_().add_(cfg.beta).div_(cfg.lr).add_(cfg.l2))

    def _update_dense(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: int,
    ) -> None:
        param.copy_(self._step(param, grad, state["z"], state["n"]))

    def _update_rows(
        self,
        param: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        step: torch.Tensor | None,
    ) -> None:
        z_all, n_all = state["z"], state["n"]
        rows, order = _in_address_order(rows)
        for block in _blocks(rows.shape[0], param.shape[1]):
            block_rows = rows[block]
            block_grad = grad.index_select(0, order[block])
            z, n = gather(z_all, block_rows), gather(n_all, block_rows)
            w = self._step(gather(param, block_rows), block_grad, z, n)
            scatter_(z_all, block_rows, z)
            scatter_(n_all, block_rows, n)
            scatter_(param, block_rows, w)
        _count_rows(step, rows)


OPTIMIZERS: Mapping[str, type[Optimizer[Any]]] = MappingProxyType(
    {cls.name: cls for cls in (SGD, Adagrad, Adam, RowwiseAdagrad, FTRL)}
)
"""Optimizer classes by ``name``; read-only."""


def make_optimizer(name: str, params: Mapping[str, float]) -> Optimizer[Any]:
    """Build the optimizer called ``name`` from hyperparameters named as in its config.

    Hyperparameters left out take the config's defaults. Raises InvalidArgumentError for an
    unknown name, an unknown hyperparameter, or a value its config rejects. Does not block;
    thread-safe.
    """
    cls = OPTIMIZERS.get(name)
    if cls is None:
        raise InvalidArgumentError(
            f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}"
        )
    valid = [f.name for f in fields(cls.config_type)]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise InvalidArgumentError(
            f"optimizer {name!r} has no hyperparameter {', '.join(map(repr, unknown))}; "
            f"valid ones are {valid}"
        )
    return cls(cls.config_type(**params))
