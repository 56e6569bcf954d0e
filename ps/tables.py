"""The tables a shard holds: a row block of a dense tensor, or a growing sparse table.

A table owns its values, its optimizer state and its counters. It validates every request
fully before changing anything, so a rejected request leaves it as it was. It knows nothing
about gRPC, clocks or retries: the shard decides when to call it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from protos import modes
from protos.codec import FLOAT_DTYPES
from protos.partition import RowRange, shard_of_keys
from ps.errors import FailedPreconditionError, InvalidArgumentError
from ps.index import SLOT_BYTES, KeyIndex, capacity_for
from ps.initializers import InitSpec, init_rows
from ps.locks import RWLock
from ps.optim import Optimizer, compute_dtype, make_optimizer
from ps.rows import first_nonfinite as rows_first_nonfinite
from ps.rows import gather as rows_gather
from ps.rows import scatter_ as rows_scatter_

AnyOptimizer = Optimizer[Any]

TableKind = Literal["dense", "sparse"]

# First allocation of a sparse table's storage, in rows; it doubles from there.
_INITIAL_SPARSE_ROWS = 1024
# A dense table's step counter: one int64.
_STEP_BYTES = 8
# Sparse storage blocks from this size on are mapped on their own (see _storage).
_MAPPED_BYTES = 4 << 20


@dataclass(frozen=True)
class OptimizerConfig:
    """An optimizer by name with its hyperparameters, comparable for spec checks."""

    name: str = "sgd"
    params: tuple[tuple[str, float], ...] = ()

    def build(self) -> AnyOptimizer:
        return make_optimizer(self.name, dict(self.params))

    def describe(self) -> str:
        args = ", ".join(f"{k}={v:g}" for k, v in self.params)
        return f"{self.name}({args})"


@dataclass(frozen=True)
class TableSpec:
    """What a table is: identical on every shard, whatever rows the shard holds."""

    name: str
    kind: TableKind
    dtype: torch.dtype
    shape: tuple[int, ...] = ()  # dense: the whole tensor
    dim: int = 0  # sparse: row width
    init: InitSpec = field(default_factory=InitSpec)
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    allow_non_finite: bool = False
    mode: modes.Mode | None = None  # None: the server's default mode

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgumentError("a table needs a non-empty name")
        if self.dtype not in FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"table {self.name!r}: dtype {self.dtype} is not a floating type; "
                "use float32, float64, float16 or bfloat16"
            )
        if self.kind == "dense":
            if any(d < 0 for d in self.shape):
                raise InvalidArgumentError(
                    f"table {self.name!r}: shape {list(self.shape)} has a negative dimension"
                )
        elif self.kind == "sparse":
            if self.dim < 1:
                raise InvalidArgumentError(
                    f"table {self.name!r}: sparse dim must be >= 1, got {self.dim}"
                )
        else:
            raise InvalidArgumentError(
                f"table {self.name!r}: kind must be 'dense' or 'sparse', got {self.kind!r}"
            )
        # Builds the optimizer once so a bad name or hyperparameter fails at declaration.
        self.optimizer.build()

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready form, for checkpoints. The mode is kept in the user's grammar
        ("ssp:2"; "" for the server's default), as checkpoints have always stored it."""
        return {
            "name": self.name, "kind": self.kind, "dtype": _name(self.dtype),
            "shape": list(self.shape), "dim": self.dim,
            "init": [self.init.kind, self.init.a, self.init.b], "seed": self.seed,
            "optimizer": [self.optimizer.name, [list(p) for p in self.optimizer.params]],
            "allow_non_finite": self.allow_non_finite,
            "mode": "" if self.mode is None else str(self.mode),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableSpec:
        """The spec `to_dict` made. InvalidArgumentError naming the table for a stored mode
        this build does not know."""
        init = d["init"]
        name, params = d["optimizer"]
        try:
            mode = modes.parse_optional(d["mode"])
        except modes.ModeError as exc:
            raise InvalidArgumentError(
                f"table {d['name']!r}: the checkpointed spec has {exc}"
            ) from exc
        return cls(
            name=d["name"], kind=d["kind"], dtype=getattr(torch, d["dtype"]),
            shape=tuple(d["shape"]), dim=d["dim"], init=InitSpec(init[0], init[1], init[2]),
            seed=d["seed"], optimizer=OptimizerConfig(name, tuple((k, v) for k, v in params)),
            allow_non_finite=d["allow_non_finite"], mode=mode,
        )

    def describe(self) -> str:
        what = f"shape={list(self.shape)}" if self.kind == "dense" else f"dim={self.dim}"
        return (
            f"{self.kind} {what} dtype={str(self.dtype).removeprefix('torch.')} "
            f"init={self.init.kind}({self.init.a:g},{self.init.b:g}) seed={self.seed} "
            f"optimizer={self.optimizer.describe()} allow_non_finite={self.allow_non_finite} "
            f"mode={self.mode or 'job default'}"
        )


@dataclass
class TableCounters:
    """Traffic counters of one table; updated under the table's counter lock."""

    pushes_applied: int = 0
    pushes_duplicate: int = 0
    pushes_rejected: int = 0
    pulls: int = 0
    rows_pulled: int = 0
    rows_pushed: int = 0
    pushes_dropped: int = 0
    gradients_aggregated: int = 0
    pushes_kept: int = 0  # assigns with if_absent that found the block written


@dataclass(frozen=True)
class TableStats:
    name: str
    kind: TableKind
    optimizer: str
    rows: int
    value_bytes: int
    state_bytes: int
    index_bytes: int
    counters: TableCounters
    row_start: int = 0
    row_end: int = 0
    # What the table holds, as the server's --memory-budget counts it: values and optimizer
    # state at their reserved capacity, and the key index's slots.
    memory_bytes: int = 0


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None where libc is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def _return_freed_pages() -> None:
    """Hands the heap's free pages back to the OS, after a key index moved to a larger array.

    A server keeps freed heap memory for reuse (protos.runtime.tune_malloc), which would keep
    the index's old array resident, unused, and outside what the memory budget counts. An
    index moves a logarithmic number of times, so the trim (about a millisecond, blocking) is
    rare. It cannot reach the free top of a thread's heap, which is why storage is mapped on
    its own instead (_storage). Thread-safe.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _storage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised storage of a sparse table: large blocks in a mapping of their own.

    Pages never written are not resident, so spare capacity costs address space, not memory:
    resident size follows the rows created. And a freed mapping goes back to the OS at once,
    while a freed heap block is kept for reuse (protos.runtime.tune_malloc) where no trim
    reaches it (the top of a handler thread's heap): the old copy of a grown table would stay
    resident, outside what the memory budget counts. Small blocks stay on the heap, which
    keeps the count of mappings low however many small tables there are.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _MAPPED_BYTES:
        return torch.empty(shape, dtype=dtype)
    # The tensor holds the mapping, which is unmapped when the last view of it goes.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def _state_itemsize(spec: TableSpec) -> int:
    """Bytes of one element of the table's optimizer state (float32 for compact rows)."""
    return compute_dtype(spec.dtype).itemsize


def _sparse_bytes(row_bytes: int, capacity: int, index_slots: int) -> int:
    return capacity * row_bytes + SLOT_BYTES * max(index_slots, capacity_for(0))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_finite(table: str, values: torch.Tensor, offset: int = 0) -> None:
    """InvalidArgumentError naming the first NaN or Inf element of a gradient, or of its
    part that starts at flat element `offset`."""
    first = rows_first_nonfinite(values)
    if first >= 0:
        bad = values.reshape(-1)[first].item()
        raise InvalidArgumentError(
            f"gradient for table {table!r} has a non-finite value ({bad}) at flat element "
            f"{offset + first}; the push was refused whole. Fix the gradient (clip it, lower "
            f"the learning rate) or declare the table with allow_non_finite"
        )


def _update_guard(hogwild: bool) -> AbstractContextManager[object]:
    """What row updates hold: nothing under Hogwild, else a lock that applies pushes whole.

    Hogwild (the async mode) lets concurrent pushes interleave, and racing updates of one
    element may lose one of them, in exchange for never making a push wait for another.
    """
    return contextlib.nullcontext() if hogwild else threading.Lock()


class _Counted:
    """Mixin: counters and the lock that guards them."""

    def __init__(self) -> None:
        # Guards self._counters.
        self._counter_lock = threading.Lock()
        self._counters = TableCounters()

    def count(self, **deltas: int) -> None:
        """Adds to the named counters. Thread-safe."""
        with self._counter_lock:
            for key, delta in deltas.items():
                setattr(self._counters, key, getattr(self._counters, key) + delta)

    def counters(self) -> TableCounters:
        with self._counter_lock:
            return TableCounters(**vars(self._counters))


class DenseTable(_Counted):
    """This shard's rows [start, end) of a dense tensor, with its optimizer state."""

    def __init__(self, spec: TableSpec, placement: RowRange, hogwild: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.placement = placement
        self.optimizer = spec.optimizer.build()
        tail = spec.shape[1:]
        width = math.prod(tail) if spec.shape else 1
        keys = np.arange(placement.start, placement.end, dtype=np.int64)
        block = init_rows(keys, max(width, 1), spec.init, spec.seed, spec.dtype)
        # A scalar is one row: () on its shard, an empty (0,) block on the others.
        self.block_shape: tuple[int, ...] = (
            (placement.rows, *tail) if spec.shape or not placement.rows else ()
        )
        if width == 0:
            block = torch.empty(self.block_shape, dtype=spec.dtype)
        self.value = block.reshape(self.block_shape).contiguous()
        self.state = {s: self.optimizer.init_slot(s, self.value) for s in self.optimizer.slots}
        self.step = torch.zeros(1, dtype=torch.int64)
        self._update_lock = _update_guard(hogwild)
        # Guards `written`, and holds an assign if absent whole, even under Hogwild: two
        # racing workers' first values never mix, and exactly one of them writes.
        self._written_lock = threading.Lock()
        # Whether the block was ever written (an assign, an applied gradient, a restore of
        # saved values); until then it holds the spec's initial values.
        self.written = False

    @staticmethod
    def bytes_for(spec: TableSpec, placement: RowRange) -> int:
        """What a table of `spec` holding rows `placement` takes: its block, one block per
        optimizer slot and the step counter. Pure: a declare is checked against the memory
        budget before anything is allocated."""
        width = math.prod(spec.shape[1:]) if spec.shape else 1
        elements = placement.rows * width
        optimizer = spec.optimizer.build()
        shape = (placement.rows, width) if spec.shape else ()
        slots = sum(math.prod(optimizer.slot_shape(s, shape)) for s in optimizer.slots)
        return elements * spec.itemsize + slots * _state_itemsize(spec) + _STEP_BYTES

    def memory_bytes(self) -> int:
        """The bytes this table holds (bytes_for its spec and placement). Thread-safe."""
        return (self.value.nbytes + sum(t.nbytes for t in self.state.values())
                + self.step.nbytes)

    def check_push(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """InvalidArgumentError unless a push of this dtype and shape fits this block."""
        if dtype != self.spec.dtype:
            raise InvalidArgumentError(
                f"table {self.spec.name!r} holds {_name(self.spec.dtype)} values; the push "
                f"carries {_name(dtype)}. Cast the gradient to {_name(self.spec.dtype)}"
            )
        if shape != self.block_shape:
            raise InvalidArgumentError(
                f"table {self.spec.name!r}: this shard holds rows "
                f"[{self.placement.start}, {self.placement.end}) with block shape "
                f"{list(self.block_shape)}; the push carries shape {list(shape)}"
            )

    def read(self) -> torch.Tensor:
        """The block itself (not a copy): callers serialize it before the next update."""
        self.count(pulls=1, rows_pulled=self.placement.rows)
        return self.value

    def apply(
        self, parts: Sequence[tuple[int, torch.Tensor]], assign: bool, if_absent: bool = False
    ) -> bool:
        """Runs the optimizer with the gradient given in `parts`, or overwrites the block.

        `parts` are (flat element offset, 1-d values) slices that together cover the block
        once, as they came off the wire; input is validated already. Update rules act element
        by element, so updating slice by slice with the same step equals one whole update.
        With `if_absent` (an assign only) the block is overwritten only if it was never
        written; returns False when it was, and nothing changed. Thread-safe.
        """
        if if_absent and not assign:
            raise InvalidArgumentError(
                f"table {self.spec.name!r}: if_absent applies to an assign, not to a gradient"
            )
        flat = self.value.view(-1)
        with self._update_lock:
            if assign:
                with self._written_lock:
                    if if_absent and self.written:
                        self.count(pushes_kept=1)
                        return False
                    for offset, part in parts:
                        flat[offset : offset + part.numel()].copy_(part)
                    self.written = True
            else:
                if not self.written:  # set once: later gradients need not take the lock
                    with self._written_lock:
                        self.written = True
                before = self.step.clone()
                step = before
                if not self.optimizer.elementwise:
                    # A row-wise rule needs whole rows: the parts, joined, cover the block.
                    grad = (parts[0][1] if len(parts) == 1
                            else torch.cat([part for _, part in parts]))
                    self.optimizer.apply_dense(self.value, grad.view(self.block_shape),
                                               self.state, step)
                    parts = ()
                for offset, part in parts:
                    end = offset + part.numel()
                    state = {k: v.view(-1)[offset:end] for k, v in self.state.items()}
                    step = before.clone()
                    self.optimizer.apply_dense(flat[offset:end], part, state, step)
                self.step.copy_(step)
        self.count(pushes_applied=1, rows_pushed=self.placement.rows)
        return True

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the block, its optimizer state and step (whole pushes only), and
        whether it was ever written (a 0-d bool tensor)."""
        with self._update_lock, self._written_lock:
            out = {"value": self.value.clone(), "step": self.step.clone(),
                   "written": torch.tensor(self.written)}
            out.update({f"state.{k}": v.clone() for k, v in self.state.items()})
        return out

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Loads what `snapshot` made (of a table with this spec and placement).

        A snapshot from before the written state was saved counts as written: it may hold
        trained values, which an assign if absent must not overwrite.
        """
        written = tensors.get("written")
        with self._update_lock, self._written_lock:
            self.value.copy_(tensors["value"].reshape(self.value.shape))
            self.step.copy_(tensors["step"])
            for k, v in self.state.items():
                v.copy_(tensors[f"state.{k}"].reshape(v.shape))
            self.written = True if written is None else bool(written.item())

    def stats(self) -> TableStats:
        value_bytes = self.value.numel() * self.value.element_size()
        state_bytes = sum(t.numel() * t.element_size() for t in self.state.values())
        return TableStats(
            self.spec.name, "dense", self.spec.optimizer.describe(), self.placement.rows,
            value_bytes, state_bytes, 0, self.counters(), self.placement.start,
            self.placement.end, self.memory_bytes(),
        )


class SparseTable(_Counted):
    """Rows keyed by int64, created on first touch and initialised from (seed, key)."""

    def __init__(
        self, spec: TableSpec, shard: int, num_shards: int, hogwild: bool = False
    ) -> None:
        super().__init__()
        self.spec = spec
        self.shard = shard
        self.num_shards = num_shards
        self.optimizer = spec.optimizer.build()
        self.index = KeyIndex()
        self._capacity = 0
        self._row_bytes = self.row_bytes(spec)
        self.value = torch.empty((0, spec.dim), dtype=spec.dtype)
        self.state: dict[str, torch.Tensor] = {}
        self.step: torch.Tensor | None = None
        # Guards the index and row creation: lookup, insert, growth and initialisation.
        self._index_lock = threading.Lock()
        # Shared by every read and update of rows; exclusive while storage is reallocated.
        self._storage = RWLock()
        self._update_lock = _update_guard(hogwild)
        self._grow(_INITIAL_SPARSE_ROWS)

    # ---- memory --------------------------------------------------------------------------

    @staticmethod
    def row_bytes(spec: TableSpec) -> int:
        """What one row of storage takes: its values, one row per optimizer slot, and its
        step counter where the optimizer keeps one. Pure."""
        optimizer = spec.optimizer.build()
        return (spec.dim * spec.itemsize
                + optimizer.slot_width(spec.dim) * _state_itemsize(spec)
                + (_STEP_BYTES if optimizer.uses_step else 0))

    @classmethod
    def bytes_for(cls, spec: TableSpec, capacity: int = _INITIAL_SPARSE_ROWS,
                  index_slots: int = 0) -> int:
        """What a table of `spec` takes with storage for `capacity` rows and an index of
        `index_slots` slots (at least an empty index's). Pure: with the defaults, a newly
        declared table, checked against the memory budget before it is created."""
        return _sparse_bytes(cls.row_bytes(spec), capacity, index_slots)

    @property
    def rows(self) -> int:
        """Rows created so far (a moment's value: other requests may be creating more)."""
        return len(self.index)

    @property
    def capacity(self) -> int:
        """Rows the storage holds room for (a moment's value)."""
        return self._capacity

    @property
    def bytes_per_row(self) -> int:
        """What one row of storage takes (row_bytes of this table's spec)."""
        return self._row_bytes

    def memory_bytes(self) -> int:
        """What the table holds now: storage at its reserved capacity and the index's slots.

        Reserved capacity, not rows created, because that is what the table may fill without
        asking for more; it bounds resident memory from above (fresh pages are not resident
        until rows are written). Thread-safe; a moment's value while rows are being created.
        """
        return self.bytes_at(0, self._capacity)

    def bytes_at(self, rows: int, capacity: int) -> int:
        """What the table would take with `rows` rows in storage for `capacity` (capacity
        never shrinks, and the index grows as ps/_index.c does). Pure arithmetic on a moment's
        sizes; thread-safe."""
        return _sparse_bytes(self._row_bytes, max(capacity, self._capacity),
                             max(self.index.capacity, capacity_for(rows)))

    def reserve(self, rows: int, capacity: int) -> None:
        """Grows the index to room for `rows` keys and the storage to `capacity` rows,
        creating no row: the room the shard's memory budget has admitted, taken before the
        rows are created so that creating them allocates nothing more. Never shrinks.
        Blocking (copies the rows held when storage moves); thread-safe."""
        with self._index_lock:
            slots = self.index.capacity
            self.index.reserve(rows)
            if self.index.capacity != slots:
                _return_freed_pages()
            if capacity > self._capacity:
                self._grow(capacity)

    def absent(self, keys: np.ndarray) -> np.ndarray:
        """The keys of `keys` that have no row here yet (repeats kept). Changes nothing;
        thread-safe."""
        with self._index_lock:
            rows = self.index.lookup(keys)
        return keys[rows < 0]

    # ---- validation (changes nothing) -----------------------------------------------------

    def check_keys(self, keys: np.ndarray) -> None:
        """InvalidArgumentError if a key belongs to another shard."""
        if self.num_shards > 1 and len(keys):
            owners = shard_of_keys(keys, self.num_shards)
            wrong = np.flatnonzero(owners != self.shard)
            if len(wrong):
                key = int(keys[wrong[0]])
                raise InvalidArgumentError(
                    f"key {key} of table {self.spec.name!r} belongs to shard "
                    f"{int(owners[wrong[0]])}, not to this shard {self.shard} of "
                    f"{self.num_shards}: the client routes with another shard count"
                )

    def check_push(self, dtype: torch.dtype, dim: int, num_keys: int, value_bytes: int) -> None:
        """InvalidArgumentError unless (dtype, dim, counts) fit this table."""
        spec = self.spec
        if dtype != spec.dtype:
            raise InvalidArgumentError(
                f"table {spec.name!r} holds {_name(spec.dtype)} rows; the push carries "
                f"{_name(dtype)}. Cast the gradient to {_name(spec.dtype)}"
            )
        if dim != spec.dim:
            raise InvalidArgumentError(
                f"table {spec.name!r} has dim {spec.dim}; the push carries dim {dim}"
            )
        row_bytes = dim * spec.itemsize
        if value_bytes != num_keys * row_bytes:
            rows = value_bytes / row_bytes
            raise InvalidArgumentError(
                f"push to table {spec.name!r} carries {num_keys} keys but {rows:g} rows of "
                f"values ({value_bytes} bytes at dim {dim}); keys and values must match"
            )

    def check_unique(self, keys: np.ndarray) -> np.ndarray:
        """Row ids of `keys` (-1 where new); InvalidArgumentError naming a repeated key.

        Inserts nothing, so a refused push creates no rows. Repeats among known keys cost one
        bit test each; only new keys (rare once a table is warm) go through a scratch index.
        """
        with self._index_lock:
            rows = self.index.lookup(keys)
            known = rows >= 0
            everything_known = bool(known.all())
            known_rows = rows if everything_known else rows[known]
            repeat = self.index.first_repeat(known_rows)
        if repeat >= 0:
            key = (keys if everything_known else keys[known])[repeat]
            self._repeated(int(key))
        if not everything_known:
            scratch = KeyIndex()
            fresh = keys[~known]
            scratch_rows, distinct = scratch.lookup_or_insert(fresh)
            if distinct < len(fresh):
                self._repeated(int(fresh[scratch.first_repeat(scratch_rows)]))
        return rows

    def _repeated(self, key: int) -> None:
        raise InvalidArgumentError(
            f"key {key} appears more than once in one push to table {self.spec.name!r}; "
            "send each key once per request, with its gradients summed"
        )

    # ---- reads and writes ------------------------------------------------------------------

    def pull(self, keys: np.ndarray) -> SparseRows:
        """The rows of `keys` (created if new), to be gathered in slices by the caller."""
        rows = self._rows(keys)
        self.count(pulls=1, rows_pulled=len(keys))
        return SparseRows(self, rows)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copies rows `rows` (row ids from the index) into `out` (default: a new tensor).
        Thread-safe."""
        with self._storage.shared():
            return rows_gather(self.value, rows, out)

    def apply(
        self, keys: np.ndarray, values: torch.Tensor, assign: bool,
        known: np.ndarray | None = None,
    ) -> None:
        """Runs the optimizer on the rows of unique `keys` (creating new ones first).

        Input is validated. `known` are row ids from check_unique; row ids never change, so
        when every key was known they are used as they are.
        """
        if known is not None and bool((known >= 0).all()):
            rows = torch.from_numpy(known)
        else:
            rows = self._rows(keys, unique=True)
        with self._storage.shared(), self._update_lock:
            if assign:
                rows_scatter_(self.value, rows, values)
            else:
                self.optimizer.apply_rows(self.value, rows, values, self.state, self.step,
                                          trusted=True)
        self.count(pushes_applied=1, rows_pushed=len(keys))

    def _rows(self, keys: np.ndarray, unique: bool = False) -> torch.Tensor:
        """Row ids of `keys`, creating the rows of new ones; `unique`: no key repeats."""
        with self._index_lock:
            rows = self.index.lookup(keys)
            absent = rows < 0
            if absent.any():
                # Only the new keys, each once, go to the index: it reserves room for what
                # it is given, so a read of known keys never grows it and new keys grow it
                # by what the shard's memory budget counted for them.
                fresh = keys[absent]
                where = None
                if not unique and len(fresh) > 1:
                    scratch = KeyIndex(len(fresh))
                    positions, distinct = scratch.lookup_or_insert(fresh)
                    if distinct < len(fresh):
                        fresh, where = scratch.keys_by_row(), positions
                before, slots = len(self.index), self.index.capacity
                created, _ = self.index.lookup_or_insert(fresh)
                if self.index.capacity != slots:
                    _return_freed_pages()
                self._create(fresh, created, before)
                rows[absent] = created if where is None else created[where]
        return torch.from_numpy(rows)

    def _create(self, keys: np.ndarray, rows: np.ndarray, before: int) -> None:
        """Initialises rows [before, len(index)). Caller holds the index lock."""
        needed = len(self.index)
        if needed > self._capacity:
            self._grow(max(needed, 2 * self._capacity))
        fresh = rows >= before
        new_rows = torch.from_numpy(rows[fresh])
        init = init_rows(keys[fresh], self.spec.dim, self.spec.init, self.spec.seed,
                         self.spec.dtype)
        with self._storage.shared():
            # New rows are invisible to other requests until the index lock is released,
            # so writing them needs no update lock.
            rows_scatter_(self.value, new_rows, init)
            for name, slot in self.state.items():
                rows_scatter_(slot, new_rows, self.optimizer.init_slot(name, init))
            if self.step is not None:
                self.step.index_fill_(0, new_rows, 0)

    def _grow(self, capacity: int) -> None:
        """Reallocates storage for `capacity` rows. Caller holds the index lock (or __init__)."""
        dim, dtype = self.spec.dim, self.spec.dtype
        # Rows past the old capacity are being created by the caller; only older ones move.
        used = min(len(self.index), self._capacity)
        with self._storage.exclusive():
            value = _storage((capacity, dim), dtype)
            value[:used].copy_(self.value[:used])
            self.value = value
            for name in self.optimizer.slots:
                slot = _storage(self.optimizer.slot_shape(name, (capacity, dim)),
                                compute_dtype(dtype))
                if name in self.state:
                    slot[:used].copy_(self.state[name][:used])
                self.state[name] = slot
            if self.optimizer.uses_step:
                step = _storage((capacity,), torch.int64)
                if self.step is not None:
                    step[:used].copy_(self.step[:used])
                self.step = step
            self._capacity = capacity

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the keys (by row), values, optimizer state and steps of every row."""
        with self._index_lock, self._storage.shared(), self._update_lock:
            rows = len(self.index)
            out = {"keys": torch.from_numpy(self.index.keys_by_row()),
                   "value": self.value[:rows].clone()}
            out.update({f"state.{k}": v[:rows].clone() for k, v in self.state.items()})
            if self.step is not None:
                out["step"] = self.step[:rows].clone()
        return out

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replaces every row with what `snapshot` made."""
        keys = tensors["keys"].numpy()
        with self._index_lock:
            self.index.clear()
            rows, _ = self.index.lookup_or_insert(keys)
            if not np.array_equal(rows, np.arange(len(keys))):
                raise FailedPreconditionError(
                    f"checkpoint of table {self.spec.name!r} repeats keys; it cannot be restored"
                )
            if len(keys) > self._capacity:
                self._grow(len(keys))
            with self._storage.shared(), self._update_lock:
                n = len(keys)
                self.value[:n].copy_(tensors["value"])
                for k, v in self.state.items():
                    v[:n].copy_(tensors[f"state.{k}"])
                if self.step is not None:
                    self.step[:n].copy_(tensors["step"])

    def stats(self) -> TableStats:
        rows = len(self.index)
        row_bytes = self.spec.dim * self.spec.itemsize
        state_bytes = rows * self.optimizer.slot_width(self.spec.dim) * _state_itemsize(
            self.spec)
        if self.step is not None:
            state_bytes += rows * self.step.element_size()
        return TableStats(
            self.spec.name, "sparse", self.spec.optimizer.describe(), rows, rows * row_bytes,
            state_bytes, self.index.nbytes, self.counters(), memory_bytes=self.memory_bytes(),
        )


@dataclass(frozen=True)
class SparseRows:
    """The answer to a sparse pull: row ids resolved, values gathered slice by slice.

    Gathering a slice at a time keeps each copy small enough to stay in cache on its way to
    the wire, instead of building one large intermediate tensor.
    """

    table: SparseTable
    rows: torch.Tensor

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def dim(self) -> int:
        return self.table.spec.dim

    @property
    def dtype(self) -> torch.dtype:
        return self.table.spec.dtype

    def gather(self, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Values of answer rows [start, end), in key order (into `out` when given)."""
        return self.table.gather(self.rows[start:end], out)


Table = DenseTable | SparseTable


def check_same_spec(existing: TableSpec, declared: TableSpec) -> None:
    """FailedPreconditionError showing both specs when a redeclaration differs."""
    if existing != declared:
        raise FailedPreconditionError(
            f"table {declared.name!r} already exists with another spec.\n"
            f"  held:     {existing.describe()}\n  declared: {declared.describe()}\n"
            f"Use a new table name, or restart the servers to change it"
        )
