"""The tables a shard holds: a row block of a dense tensor, or a growing sparse table.

A table owns its values, its optimizer state and its counters. It validates every request
fully before changing anything, so a rejected request leaves it as it was. It knows nothing
about gRPC, clocks or retries: the shard decides when to call it.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from protos import modes
from protos.codec import FLOAT_DTYPES
from protos.partition import RowRange, shard_of_keys
from protos.runtime import trim_heap
from ps.checkpoint import EVICTED_KEYS, LaterRows
from ps.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    out_of_memory,
)
from ps.index import MAX_ROWS, SLOT_BYTES, KeyIndex, capacity_for
from ps.initializers import InitSpec, init_rows
from ps.locks import RWLock
from ps.optim import Optimizer, compute_dtype, make_optimizer
from ps.row_policy import (
    SKETCH_DEPTH,
    SKETCH_WIDTH,
    AdmitRule,
    CountMinSketch,
    EvictRule,
    admitted_by_probability,
    expired,
    hash_keys,
    least_recent,
    parse_admit,
)
from ps.rows import first_nonfinite as rows_first_nonfinite
from ps.rows import gather as rows_gather
from ps.rows import scatter_ as rows_scatter_

AnyOptimizer = Optimizer[Any]

TableKind = Literal["dense", "sparse"]

# First allocation of a sparse table's storage, in rows; it doubles from there.
INITIAL_SPARSE_ROWS = 1024
# A dense table's step counter: one int64.
_STEP_BYTES = 8
# Sparse storage blocks from this size on are mapped on their own (see _storage).
_MAPPED_BYTES = 4 << 20
# New rows are initialised in parts of about this many bytes of float32 values: the initial
# values and optimizer state of a whole request (tens of MiB for 64K rows of dim 64, and as
# much again in hashing scratch) would raise the high-water mark of the server's heap, which
# it keeps resident between trims (protos.runtime.tune_malloc, trim_heap).
_INIT_BYTES = 1 << 20
# What an evicting table keeps per row slot: the clock it was last touched (int32) and the
# second (float32, counted from the table's epoch: its creation or last restore; steps of
# under 8 ms for a day from it, under 2 s for a year).
_STAMP_BYTES = 4 + 4
# The mark of a changed row slot (a delta lists the rows marked since the snapshot before).
_CHANGED_BYTES = 1
# An evicting table lists the keys it evicted since the last snapshot (for the next delta)
# up to this share of its rows; past it, the next snapshot holds the table whole and the
# list goes. A delta with that many evictions holds as many new rows besides, so it is an
# eighth of a full one or more. Counted as its bound: 8-byte keys for an eighth of the rows.
_GONE_SHARE = 8
_GONE_BYTES = 8 // _GONE_SHARE
# The largest clock an evicting table stamps; a request past it is refused.
STAMP_CLOCK_MAX = 2**31 - 1
# The clock stamp of a free row slot.
_FREE = -1
# Bits remembering evicted ids (hashed), to count those that come back (readmitted). They
# are cleared after _EVICTED_BITS // 8 evictions, which keeps the share of bits set, and so
# the overcount, under about 12% (1 - e^-1/8): readmitted counts ids evicted within that
# window, not ever.
_EVICTED_BITS = 1 << 20
_EVICTED_WINDOW = _EVICTED_BITS // 8
# Rows one eviction window looks at, walking at most EVICT_SCAN_SLOTS slots of the key index
# (a full table fills from 35% to 70% of its slots): the bound on a step's work, whatever the
# table's size.
EVICT_SCAN_ROWS = 1 << 16
EVICT_SCAN_SLOTS = 4 * EVICT_SCAN_ROWS


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
    # Sparse only: when an id gets a row (ps.row_policy grammar), what a pull of an id
    # without one returns (every element), and when rows are evicted (0: never).
    admit: str = "always"
    admit_default: float = 0.0
    ttl_clocks: int = 0
    ttl_s: float = 0.0
    max_rows: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgumentError("a table needs a non-empty name")
        # Kept in normal form, so that equal rules make equal specs.
        object.__setattr__(self, "admit", str(parse_admit(self.admit, self.name)))
        try:
            evict = self.evict_rule
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"table {self.name!r}: {exc}") from exc
        if not math.isfinite(self.admit_default):
            raise InvalidArgumentError(
                f"table {self.name!r}: admit_default must be finite, got {self.admit_default}"
            )
        if self.kind == "dense" and (
            self.admit != "always" or self.admit_default or evict.active
        ):
            raise InvalidArgumentError(
                f"table {self.name!r} is dense: admission (admit={self.admit!r}) and eviction "
                "(ttl_clocks, ttl_s, max_rows) apply to sparse tables only"
            )
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

    @property
    def admit_rule(self) -> AdmitRule:
        return parse_admit(self.admit, self.name)

    @property
    def evict_rule(self) -> EvictRule:
        return EvictRule(self.ttl_clocks, self.ttl_s, self.max_rows)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready form, for checkpoints. The mode is kept in the user's grammar
        ("ssp:2"; "" for the server's default), as checkpoints have always stored it.
        Admission and eviction options appear only when set, so a table without them is
        stored as before they existed (and older builds read it)."""
        extra = {k: v for k, v in [
            ("admit", self.admit), ("admit_default", self.admit_default),
            ("ttl_clocks", self.ttl_clocks), ("ttl_s", self.ttl_s), ("max_rows", self.max_rows),
        ] if v not in ("always", 0, 0.0)}
        return {
            "name": self.name, "kind": self.kind, "dtype": _name(self.dtype),
            "shape": list(self.shape), "dim": self.dim,
            "init": [self.init.kind, self.init.a, self.init.b], "seed": self.seed,
            "optimizer": [self.optimizer.name, [list(p) for p in self.optimizer.params]],
            "allow_non_finite": self.allow_non_finite,
            "mode": "" if self.mode is None else str(self.mode), **extra,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableSpec:
        """The spec `to_dict` made. InvalidArgumentError naming the table for a stored mode
        this build does not know. Specs stored before admission and eviction existed read as
        admit="always" without eviction."""
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
            admit=d.get("admit", "always"), admit_default=d.get("admit_default", 0.0),
            ttl_clocks=d.get("ttl_clocks", 0), ttl_s=d.get("ttl_s", 0.0),
            max_rows=d.get("max_rows", 0),
        )

    def describe(self) -> str:
        what = f"shape={list(self.shape)}" if self.kind == "dense" else f"dim={self.dim}"
        return (
            f"{self.kind} {what} dtype={str(self.dtype).removeprefix('torch.')} "
            f"init={self.init.kind}({self.init.a:g},{self.init.b:g}) seed={self.seed} "
            f"optimizer={self.optimizer.describe()} allow_non_finite={self.allow_non_finite} "
            f"mode={self.mode or 'job default'} admit={self.admit} "
            f"admit_default={self.admit_default:g} ttl_clocks={self.ttl_clocks} "
            f"ttl_s={self.ttl_s:g} max_rows={self.max_rows}"
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
    admitted: int = 0  # ids given a row (every row created)
    refused_by_admission: int = 0  # keys of pulls (served the default) and pushes (dropped)
    evicted: int = 0  # rows evicted (TTL or max_rows)
    readmitted: int = 0  # rows created for ids evicted before (estimated: hashed bits)


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
    # Admission and eviction bookkeeping: the sketch, row stamps, evicted-id bits.
    metadata_bytes: int = 0


def grown_capacity(rows: int, capacity: int, spare_rows: int | None = None,
                   max_rows: int = 0) -> int:
    """The capacity, in rows, a sparse table's storage takes on to hold `rows` rows.

    Its own when they fit. Else double (at least `rows`): few moves of the whole table as it
    grows. Under a memory budget that leaves `spare_rows` rows of room beyond `rows`, at most
    `rows` plus half of them, so one table near the budget does not take the room every other
    table may need. A table with `max_rows` doubles to at most max_rows: it evicts before it
    creates rows, so only a request that alone uses more rows takes it past (to what that
    request needs). Pure.
    """
    if rows <= capacity:
        return capacity
    doubled = max(rows, 2 * capacity)
    if max_rows:
        doubled = max(rows, min(doubled, max_rows))
    if spare_rows is None:
        return doubled
    return max(rows, min(doubled, rows + spare_rows // 2))


def _storage(shape: tuple[int, ...], dtype: torch.dtype, huge: bool) -> torch.Tensor:
    """Uninitialised storage of a sparse table: large blocks in a mapping of their own.

    Pages never written are not resident, so spare capacity costs address space, not memory:
    resident size follows the rows created. And a freed mapping goes back to the OS at once,
    while a freed heap block is kept for reuse (protos.runtime.tune_malloc) until the next
    trim (protos.runtime.trim_heap): the old copy of a grown table would stay resident,
    outside what the memory budget counts, for a while. Small blocks stay on the heap, which
    keeps the count of mappings low however many small tables there are. `huge`: on
    transparent huge pages (_mapping).
    """
    block = _mapping(math.prod(shape) * dtype.itemsize, huge)
    if block is None:
        return torch.empty(shape, dtype=dtype)
    # The tensor holds the mapping, which is unmapped when the last view of it goes.
    return torch.frombuffer(block, dtype=dtype).view(shape)


def _mapping(nbytes: int, huge: bool) -> mmap.mmap | None:
    """A mapping of its own for a block of `nbytes` of a table's storage or per-slot arrays,
    or None for a block under _MAPPED_BYTES, which stays on the heap (see _storage).

    Private and anonymous (zero pages, none resident yet). With `huge` (an evicting table's),
    advised onto transparent huge pages where the OS offers them: such a table reuses the
    slots of rows evicted anywhere, so its rows are written and read at random over hundreds
    of MiB, where 4 KiB pages miss the TLB on nearly every row. A table that only grows
    writes its rows in order and keeps 4 KiB pages, so that its resident size follows the
    rows written as `pstrain plan` counts them (with huge pages a 300,000-row table was
    resident 11% above the plan)."""
    if nbytes < _MAPPED_BYTES:
        return None
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge and advice is not None:
        with contextlib.suppress(OSError):  # advisory: without it the mapping still works
            block.madvise(advice)
    return block


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
        self.block_shape = self.block_shape_for(spec, placement)
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
        # Whether the block changed since the last snapshot (a new one has: a delta holds it
        # whole). Set after each change and cleared before each copy, so a change racing a
        # snapshot is in it or in the next one.
        self._changed = True

    @staticmethod
    def block_shape_for(spec: TableSpec, placement: RowRange) -> tuple[int, ...]:
        """The shape of the block of a shard holding rows `placement`: (rows, *the rest of
        the shape). A scalar is one row: () on its shard, an empty (0,) block on the others.
        Pure."""
        return (placement.rows, *spec.shape[1:]) if spec.shape or not placement.rows else ()

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
                    self._changed = True
            else:
                if not self.written:  # set once: later gradients need not take the lock
                    with self._written_lock:
                        self.written = True
                if len(parts) == 1 or not self.optimizer.elementwise:
                    # One update of the whole block: a push that came in one piece, or a
                    # row-wise rule, which needs whole rows (the parts, joined, cover it).
                    grad = (parts[0][1] if len(parts) == 1
                            else torch.cat([part for _, part in parts]))
                    self.optimizer.apply_dense(self.value, grad.view(self.block_shape),
                                               self.state, self.step, trusted=True)
                else:
                    # Slice by slice, each with the step count the whole block had.
                    before = self.step.clone()
                    step = before
                    for offset, part in parts:
                        end = offset + part.numel()
                        state = {k: v.view(-1)[offset:end] for k, v in self.state.items()}
                        step = before.clone()
                        self.optimizer.apply_dense(flat[offset:end], part, state, step,
                                                   trusted=True)
                    self.step.copy_(step)
                self._changed = True
        self.count(pushes_applied=1, rows_pushed=self.placement.rows)
        return True

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the block, its optimizer state and step (whole pushes only), and
        whether it was ever written (a 0-d bool tensor). The block counts as unchanged from
        here on (`snapshot_changes`)."""
        with self._update_lock, self._written_lock:
            self._changed = False
            out = {"value": self.value.clone(), "step": self.step.clone(),
                   "written": torch.tensor(self.written)}
            out.update({f"state.{k}": v.clone() for k, v in self.state.items()})
        return out

    def snapshot_later(self) -> tuple[dict[str, torch.Tensor], dict[str, LaterRows]]:
        """`snapshot`, with nothing left to read later (a dense block is copied whole)."""
        return self.snapshot(), {}

    def snapshot_changes(self) -> dict[str, torch.Tensor] | None:
        """What changed since the last snapshot, for a delta: {} when nothing did, None when
        the block did (a delta holds a dense block whole: take `snapshot`). Thread-safe."""
        return None if self._changed else {}

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
            self._changed = True

    def stats(self) -> TableStats:
        value_bytes = self.value.numel() * self.value.element_size()
        state_bytes = sum(t.numel() * t.element_size() for t in self.state.values())
        return TableStats(
            self.spec.name, "dense", self.spec.optimizer.describe(), self.placement.rows,
            value_bytes, state_bytes, 0, self.counters(), self.placement.start,
            self.placement.end, self.memory_bytes(),
        )


class SparseTable(_Counted):
    """Rows keyed by int64, created on first touch (or once admitted) and initialised from
    (seed, key); under an eviction rule, rows untouched too long or past max_rows go, and
    their slots (values and optimizer state) serve new ids."""

    def __init__(
        self, spec: TableSpec, shard: int, num_shards: int, hogwild: bool = False,
        clock: Callable[[], float] = time.monotonic,
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
        self._admit: AdmitRule = spec.admit_rule
        self._evict: EvictRule = spec.evict_rule
        self._sketch = (CountMinSketch(spec.seed) if self._admit.kind == "count" else None)
        # What a pull of an id without a row returns.
        self._default = torch.full((spec.dim,), spec.admit_default, dtype=spec.dtype)
        # Evicting tables only, per row slot: the clock and second (from _epoch_s) it was last
        # touched (clock _FREE: a free slot), and the free slots, a stack of _free_len. A row's
        # key is the key index's alone (scan, items).
        self._set_stamps(np.full(0, _FREE_STAMPS, dtype=np.int64))
        self._epoch_s = clock()
        self._free = np.zeros(0, dtype=np.int64)
        self._free_len = 0
        self._evicted_bits = np.zeros(
            _EVICTED_BITS // 8 if self._evict.active else 0, dtype=np.uint8
        )
        self._evicted_in_window = 0  # evictions since the bits were last cleared
        self._time = clock
        self._clock_now = 0  # the latest worker clock seen (observe_clock)
        self._ttl_cursor = 0  # the key index slot where the next TTL window starts
        self._lru_cursor = 0  # the key index slot where the next least-recent window starts
        # Change tracking, for delta snapshots: per row slot, whether the row changed since
        # the last snapshot (values, optimizer state, step or touch stamp; or created), set
        # after each change and cleared before the copy, so a change racing a snapshot is in
        # it or in the next one. The keys evicted since it, and whether the sketch or the
        # evicted-id bits changed. `_whole`: the next snapshot holds the table whole (it is
        # new, restored, or evicted more keys since the last one than it lists).
        self._changed = np.zeros(0, dtype=np.uint8)
        self._gone: list[np.ndarray] = []
        self._gone_count = 0
        self._items_changed = False
        self._whole = True
        # Guards the index, row creation and eviction: lookup, insert, delete, growth,
        # initialisation, the sketch, the per-slot arrays and the change tracking above
        # (the marks of updated rows are set under the storage lock instead).
        self._index_lock = threading.Lock()
        # Shared by every read and update of rows; exclusive while storage is reallocated.
        self._storage = RWLock()
        self._update_lock = _update_guard(hogwild)
        # The copy-on-write snapshot being read (`snapshot_later`), while its rows live.
        self._cow: weakref.ref[_CopyOnWrite] | None = None
        self._grow(INITIAL_SPARSE_ROWS)

    # ---- memory --------------------------------------------------------------------------

    @staticmethod
    def row_bytes(spec: TableSpec) -> int:
        """What one row of storage takes: value_bytes and bookkeeping_bytes. Pure."""
        return SparseTable.value_bytes(spec) + SparseTable.bookkeeping_bytes(spec)

    @staticmethod
    def bookkeeping_bytes(spec: TableSpec) -> int:
        """What one row takes beside its values and state: its change mark, and under
        eviction its stamps and its share of the evicted keys listed for the next delta.
        Pure."""
        return _CHANGED_BYTES + (_STAMP_BYTES + _GONE_BYTES if spec.evict_rule.active else 0)

    @staticmethod
    def value_bytes(spec: TableSpec) -> int:
        """The raw bytes of one row: its values, one row per optimizer slot and the step
        counter where the optimizer keeps one. Pure."""
        optimizer = spec.optimizer.build()
        return (spec.dim * spec.itemsize
                + optimizer.slot_width(spec.dim) * _state_itemsize(spec)
                + (_STEP_BYTES if optimizer.uses_step else 0))

    @staticmethod
    def fixed_bytes(spec: TableSpec) -> int:
        """What the table holds whatever its rows: the admission sketch and the bits that
        remember evicted ids. Pure."""
        sketch = SKETCH_DEPTH * SKETCH_WIDTH if spec.admit_rule.kind == "count" else 0
        return sketch + (_EVICTED_BITS // 8 if spec.evict_rule.active else 0)

    @classmethod
    def bytes_for(cls, spec: TableSpec, capacity: int = INITIAL_SPARSE_ROWS,
                  index_slots: int = 0) -> int:
        """What a table of `spec` takes with storage for `capacity` rows and an index of
        `index_slots` slots (at least an empty index's). Pure: with the defaults, a newly
        declared table, checked against the memory budget before it is created."""
        return _sparse_bytes(cls.row_bytes(spec), capacity, index_slots) + cls.fixed_bytes(spec)

    @property
    def rows(self) -> int:
        """Rows held now (a moment's value: other requests may be creating more)."""
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
        """What the table holds now: storage at its reserved capacity, the index's slots and
        the admission and eviction bookkeeping.

        Reserved capacity, not rows created, because that is what the table may fill without
        asking for more; it bounds resident memory from above (fresh pages are not resident
        until rows are written). Thread-safe; a moment's value while rows are being created.
        """
        return self.bytes_at(0, self._capacity)

    def bytes_at(self, rows: int, capacity: int) -> int:
        """What the table would take with `rows` rows in storage for `capacity` (capacity
        never shrinks, and the index grows as ps/_index.c does). Pure arithmetic on a moment's
        sizes; thread-safe."""
        return (_sparse_bytes(self._row_bytes, max(capacity, self._capacity),
                              max(self.index.capacity, capacity_for(rows)))
                + self.fixed_bytes(self.spec))

    def reserve(self, rows: int, capacity: int) -> None:
        """Grows the index to room for `rows` keys and the storage to `capacity` rows,
        creating no row: the room the shard's memory budget has admitted, taken before the
        rows are created so that creating them allocates nothing more. Never shrinks.
        Blocking (copies the rows held when storage moves); thread-safe."""
        with self._index_lock:
            slots = self.index.capacity
            self.index.reserve(rows)
            if self.index.capacity != slots:
                trim_heap()
            if capacity > self._capacity:
                self._grow(capacity)

    def absent(self, keys: np.ndarray) -> np.ndarray:
        """The keys of `keys` that have no row here yet (repeats kept). Changes nothing;
        thread-safe."""
        with self._index_lock:
            rows = self.index.lookup(keys)
        return keys[rows < 0]

    def admissible(self, keys: np.ndarray, sight: bool) -> np.ndarray:
        """Of `keys` without rows, those the admission rule would give a row if named now by
        a pull (`sight`) or a push (under count:K, those whose next sight is the K-th or
        later, or already seen K times): what the memory budget counts as new rows. Changes
        nothing; thread-safe."""
        rule = self._admit
        if rule.kind == "prob":
            return keys[admitted_by_probability(keys, self.spec.seed, rule.probability)]
        if self._sketch is not None and len(keys):
            with self._index_lock:
                seen = self._sketch.estimate(keys)
            return keys[seen.astype(np.int64) + int(sight) >= rule.count]
        return keys

    def observe_clock(self, clock: int) -> None:
        """Tells the table the clock of a request touching it: rows are stamped with the
        latest one, which TTLs in clocks count from. InvalidArgumentError, with nothing
        changed, for a clock past STAMP_CLOCK_MAX on an evicting table (its stamps are int32).
        Thread-safe."""
        if self._evict.active and clock > STAMP_CLOCK_MAX:
            raise InvalidArgumentError(
                f"table {self.spec.name!r} evicts rows by their last clock, which it keeps "
                f"up to {STAMP_CLOCK_MAX}; the request is at clock {clock}. A job running this "
                "long must declare the table without ttl_clocks, ttl_s and max_rows"
            )
        if self._evict.active and clock > self._clock_now:
            with self._index_lock:
                self._clock_now = max(self._clock_now, clock)

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
        """The rows of `keys` (created if new and admitted), to be gathered in slices by the
        caller; an id without a row reads as the table's default row.

        Under eviction the values are copied at once, under the index lock: a row id held
        past it could be evicted and given to another id before the caller gathers it."""
        if not self._evict.active:
            rows = self._rows(keys, sight=True)
            self.count(pulls=1, rows_pulled=len(keys))
            return SparseRows(self, rows)
        with self._index_lock:
            rows = self._rows_locked(keys, sight=True)
            values = self.gather(rows)
            self._evict_step()
        self.count(pulls=1, rows_pulled=len(keys))
        return SparseRows(self, rows, values)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copies rows `rows` (row ids from the index; -1: the default row) into `out`
        (default: a new tensor). Thread-safe."""
        with self._storage.shared():
            if self._admit.kind == "always" or not len(rows) or bool((rows >= 0).all()):
                return rows_gather(self.value, rows, out)
            if out is None:
                out = torch.empty((len(rows), self.spec.dim), dtype=self.spec.dtype)
            held = rows >= 0
            out[held] = rows_gather(self.value, rows[held])
            out[~held] = self._default
            return out

    def apply(
        self, keys: np.ndarray, values: torch.Tensor, assign: bool,
        known: np.ndarray | None = None,
    ) -> None:
        """Runs the optimizer on the rows of unique `keys` (creating new admitted ones first);
        the gradients of ids refused a row are dropped (counted in refused_by_admission).

        Input is validated. `known` are row ids from check_unique; without eviction row ids
        never change, so when every key was known they are used as they are.
        """
        if self._evict.active:
            with self._index_lock:
                rows = self._rows_locked(keys, unique=True)
                self._update(*_held(rows, values), assign)
                self._evict_step()
        elif known is not None and known.min(initial=0) >= 0:
            self._update(torch.from_numpy(known), values, assign)
        else:
            self._update(*_held(self._rows(keys, unique=True), values), assign)
        self.count(pushes_applied=1, rows_pushed=len(keys))

    def _update(self, rows: torch.Tensor, values: torch.Tensor, assign: bool) -> None:
        """Updates `rows` (all held) with `values`."""
        with self._storage.shared(), self._update_lock:
            self._save_for_snapshot(rows.numpy())
            if assign:
                rows_scatter_(self.value, rows, values)
            else:
                self.optimizer.apply_rows(self.value, rows, values, self.state, self.step,
                                          trusted=True)
            # After the update: a snapshot that clears the mark first copies the new values.
            self._changed[rows.numpy()] = 1

    def _rows(self, keys: np.ndarray, unique: bool = False, sight: bool = False) -> torch.Tensor:
        with self._index_lock:
            return self._rows_locked(keys, unique, sight)

    def _rows_locked(self, keys: np.ndarray, unique: bool = False,
                     sight: bool = False) -> torch.Tensor:
        """Row ids of `keys`, creating the rows of new ones the admission rule admits (-1 for
        the others); `unique`: no key repeats; `sight`: a pull, which counts towards count:K
        (a push does not: a training step pushes the ids it pulled, and one example must not
        count twice). Under max_rows, evicts the least recently touched rows first, to keep
        the table within max_rows once the new rows exist, never a row of these keys (unless
        the keys alone need more rows: the table then passes max_rows by them until later
        eviction steps). Stamps the rows under eviction. Caller holds the index lock."""
        rows = self.index.lookup(keys)
        absent = rows < 0
        now_s = np.float32(self._now_s() if self._evict.active else 0.0)
        if self._evict.active:
            # Stamped before any room is made: rows touched this instant are not evicted.
            self._stamp(rows[~absent], now_s)
        if absent.any():
            # Only the new keys, each once, go to the index: it reserves room for what it is
            # given, so a read of known keys never grows it and new keys grow it by what the
            # shard's memory budget counted for them.
            fresh = keys[absent]
            where = None
            if not unique and len(fresh) > 1:
                scratch = KeyIndex(len(fresh))
                positions, distinct = scratch.lookup_or_insert(fresh)
                if distinct < len(fresh):
                    fresh, where = scratch.keys_by_row(), positions
            created = np.full(len(fresh), -1, dtype=np.int64)
            admitted = self._admitted(fresh, sight)
            if admitted is not None:
                refused = len(fresh) - int(admitted.sum())
                if refused:
                    self.count(refused_by_admission=refused)
                fresh_admitted = fresh[admitted]
            else:
                fresh_admitted = fresh
            if len(fresh_admitted):
                if self._evict.max_rows:
                    self._make_room(len(fresh_admitted), now_s)
                slots = self._take_slots(len(fresh_admitted))
                self._create_rows(fresh_admitted, slots)
                if self._evict.active:
                    self._stamp(slots, now_s)
                if admitted is None:
                    created = slots
                else:
                    created[admitted] = slots
            rows[absent] = created if where is None else created[where]
        return torch.from_numpy(rows)

    def _set_stamps(self, stamps: np.ndarray) -> None:
        """Takes `stamps` (int64, one per row slot) as the table's stamps. A row's clock and
        second share 8 bytes, so that reading or writing the stamps of rows scattered over
        the table misses the cache once per row, not twice. Caller holds the index lock."""
        self._stamps = stamps
        self._touched_clock = stamps.view(np.int32)[0::2]  # views of `stamps`
        self._touched_s = stamps.view(np.float32)[1::2]

    def _stamps_of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the clocks and seconds of `rows`, read in one pass. Caller holds the
        index lock."""
        both = self._stamps[rows]
        return both.view(np.int32)[0::2], both.view(np.float32)[1::2]

    def _stamp(self, rows: np.ndarray, now_s: np.float32) -> None:
        """Stamps `rows` as touched now. Caller holds the index lock."""
        self._stamps[rows] = _stamp_pair(self._clock_now, now_s)
        self._changed[rows] = 1  # the stamp a snapshot holds

    def _admitted(self, fresh: np.ndarray, sight: bool) -> np.ndarray | None:
        """Which of `fresh` (distinct keys without rows) get one now; None: all. Under
        count:K, a `sight` (a pull) counts one for each. Caller holds the index lock."""
        rule = self._admit
        if rule.kind == "prob":
            return admitted_by_probability(fresh, self.spec.seed, rule.probability)
        if self._sketch is not None:
            if sight:
                self._items_changed = True
            seen = self._sketch.add(fresh) if sight else self._sketch.estimate(fresh)
            return seen >= rule.count
        return None

    def _take_slots(self, n: int) -> np.ndarray:
        """`n` row slots for new rows: freed ones first, then past the highest ever used.
        ResourceExhaustedError, with nothing taken, past the MAX_ROWS rows a key index holds.
        Caller holds the index lock."""
        reused = min(n, self._free_len)
        top = self.index.row_limit
        if top + n - reused > MAX_ROWS:
            raise ResourceExhaustedError(
                f"table {self.spec.name!r} would hold more than {MAX_ROWS} rows on this "
                f"server ({len(self.index)} held, {n} new), the most one server's key index "
                "holds; add servers, or declare the table with max_rows"
            )
        start = self._free_len - reused
        slots = self._free[start:self._free_len].copy()
        self._free_len = start
        return np.concatenate([slots, np.arange(top, top + n - reused, dtype=np.int64)])

    def _create_rows(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Gives the absent, distinct `keys` the row slots `slots` (from _take_slots) and
        initialises them. All or nothing: on any failure the keys stay absent and the slots
        free; when memory for them cannot be had (the storage, the index or the initial
        rows), ResourceExhaustedError says so. Caller holds the index lock."""
        needed = int(slots.max()) + 1 if len(slots) else 0
        inserted = False
        try:
            if needed > self._capacity:
                self._grow(grown_capacity(needed, self._capacity,
                                          max_rows=self._evict.max_rows))
            before = self.index.capacity
            self.index.insert_rows(keys, slots)
            inserted = True
            if self.index.capacity != before:
                trim_heap()
            self._init_rows(keys, slots)
        except BaseException as exc:
            if inserted:
                self.index.delete(keys)
            self._free_slots(slots)
            if not out_of_memory(exc):
                raise
            raise ResourceExhaustedError(
                f"table {self.spec.name!r}: this server could not allocate memory for "
                f"{len(keys)} new rows ({exc}); none of them was created. Give the server a "
                "--memory-budget (requests over it are then refused before anything is "
                "allocated), add servers, or declare the table with max_rows or a TTL"
            ) from exc

    def _free_slots(self, slots: np.ndarray) -> None:
        """Pushes `slots`, which no key holds, onto the free stack. Caller holds the index
        lock."""
        if self._evict.active:
            self._stamps[slots] = _FREE_STAMPS
        need = self._free_len + len(slots)
        if need > len(self._free):
            free = np.empty(max(need, 2 * len(self._free)), dtype=np.int64)
            free[:self._free_len] = self._free[:self._free_len]
            self._free = free
        self._free[self._free_len:need] = slots
        self._free_len = need

    def _init_rows(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Initialises the new rows `rows` of `keys` (values from the key, fresh optimizer
        state), within the storage's capacity. Caller holds the index lock."""
        with self._storage.shared():
            # New rows are invisible to other requests until the index lock is released,
            # so writing them needs no update lock; a slot freed by eviction may still hold
            # a row a snapshot reads.
            self._save_for_snapshot(rows)
            per_part = max(1, _INIT_BYTES // (4 * self.spec.dim))
            for start in range(0, len(rows), per_part):
                part = slice(start, start + per_part)
                new_rows = torch.from_numpy(rows[part])
                init = init_rows(keys[part], self.spec.dim, self.spec.init, self.spec.seed,
                                 self.spec.dtype)
                rows_scatter_(self.value, new_rows, init)
                for name, slot in self.state.items():
                    rows_scatter_(slot, new_rows, self.optimizer.init_slot(name, init))
                if self.step is not None:
                    self.step.index_fill_(0, new_rows, 0)
        self._changed[rows] = 1
        readmitted = 0
        if self._evict.active:
            bits = self._evicted_bit(keys)
            readmitted = int(((self._evicted_bits[bits >> 3] >> (bits & 7)) & 1).sum())
        self.count(admitted=len(keys), readmitted=readmitted)

    def _evicted_bit(self, keys: np.ndarray) -> np.ndarray:
        return (hash_keys(keys, self.spec.seed ^ 0x5EED) % _EVICTED_BITS).astype(np.intp)

    # ---- eviction ---------------------------------------------------------------------------

    def _now_s(self) -> float:
        """Seconds since the table's epoch: what `_touched_s` holds."""
        return self._time() - self._epoch_s

    def _evict_step(self) -> None:
        """One bounded step of eviction: the expired rows among the next window of the key
        index (up to EVICT_SCAN_ROWS rows in at most EVICT_SCAN_SLOTS slots, from a cursor
        that goes round it), and past max_rows the least recently touched rows of the window
        at the other cursor (of the whole table while its index fits one window, else of a
        window that moves each step: an approximation of LRU that keeps each step's work
        bounded). Caller holds the index lock."""
        if not len(self.index):
            return
        rule = self._evict
        if rule.ttl_clocks or rule.ttl_s:
            keys, rows, self._ttl_cursor = self.index.scan(
                self._ttl_cursor, EVICT_SCAN_SLOTS, EVICT_SCAN_ROWS)
            gone = expired(rule, *self._stamps_of(rows), self._clock_now, self._now_s())
            self._evict_keys(keys[gone])
        excess = len(self.index) - rule.max_rows if rule.max_rows else 0
        if excess > 0:
            self._evict_least_recent(excess, whole_pass=False)

    def _make_room(self, new: int, now_s: np.float32) -> None:
        """Evicts the least recently touched rows until `new` more rows fit within max_rows,
        none stamped at this clock and second `now_s` (the running request stamped the rows it
        resolved so, which go back to its caller): window after window, and no further than
        once round the index, so fewer when the rest were touched now. Caller holds the index
        lock."""
        need = len(self.index) + new - self._evict.max_rows
        if need > 0:
            self._evict_least_recent(need, whole_pass=True, spare_s=now_s)

    def _evict_least_recent(self, n: int, whole_pass: bool,
                            spare_s: np.float32 | None = None) -> None:
        """Evicts the `n` least recently touched rows of the window at the least-recent
        cursor, but none stamped at the current clock and `spare_s` or later; with
        `whole_pass`, window after window until `n` went or the cursor went once round the
        index. A key a window meets twice (moved back across the wrap by a deletion) is
        deleted once: `_evict_keys` frees only what the index removed. Caller holds the index
        lock."""
        walked, slots = 0, self.index.capacity
        while n > 0 and walked < slots:
            start = self._lru_cursor
            keys, rows, self._lru_cursor = self.index.scan(
                start, EVICT_SCAN_SLOTS, EVICT_SCAN_ROWS)
            walked += (self._lru_cursor or slots) - start
            clocks, seconds = self._stamps_of(rows)
            if spare_s is not None:
                clocks[(clocks == self._clock_now) & (seconds >= spare_s)] = _FREE
            n -= self._evict_keys(keys[least_recent(clocks, seconds, n)])
            if not whole_pass:
                return

    def _evict_keys(self, keys: np.ndarray) -> int:
        """Removes the rows of `keys` and frees their slots; returns how many went (a key no
        longer held frees nothing). Caller holds the index lock."""
        if not len(keys):
            return 0
        rows = self.index.delete(keys)
        held = rows >= 0
        slots, keys = rows[held], keys[held]
        self._free_slots(slots)
        self._record_evicted(keys)
        return len(slots)

    def _record_evicted(self, keys: np.ndarray) -> None:
        """Counts `keys` as evicted: the evicted-id bits, the keys a delta lists, the counter.
        Caller holds the index lock."""
        self._evicted_in_window += len(keys)
        if self._evicted_in_window > _EVICTED_WINDOW:
            self._evicted_bits[:] = 0
            self._evicted_in_window = len(keys)
        bits = self._evicted_bit(keys)
        np.bitwise_or.at(self._evicted_bits, bits >> 3, (1 << (bits & 7)).astype(np.uint8))
        self._items_changed = True
        if not self._whole:
            self._gone.append(keys)
            self._gone_count += len(keys)
            # A longer list is no delta worth writing (_GONE_SHARE): the next snapshot holds
            # the table whole, and the list goes.
            if self._gone_count > max(self._capacity, INITIAL_SPARSE_ROWS) // _GONE_SHARE:
                self._whole, self._gone, self._gone_count = True, [], 0
        self.count(evicted=len(keys))

    def evict(self) -> int:
        """Runs one bounded eviction step now (exchanges run one each); returns the rows
        evicted. Blocking under the table's index lock; thread-safe."""
        if not self._evict.active:
            return 0
        with self._index_lock:
            before = len(self.index)
            self._evict_step()
            return before - len(self.index)

    def _grow(self, capacity: int) -> None:
        """Reallocates storage for `capacity` rows. Caller holds the index lock (or __init__).

        Block by block, each old one freed as its copy replaces it, so that growing takes
        the memory of one block more than the table. A failed allocation leaves the table
        as it was: its capacity changes last, and blocks already larger are harmless."""
        dim, dtype = self.spec.dim, self.spec.dtype
        # Rows past the old capacity are being created by the caller; only older ones move.
        used = min(self.index.row_limit, self._capacity)
        with self._storage.exclusive():
            huge = self._evict.active
            value = _storage((capacity, dim), dtype, huge)
            value[:used].copy_(self.value[:used])
            self.value = value
            for name in self.optimizer.slots:
                slot = _storage(self.optimizer.slot_shape(name, (capacity, dim)),
                                compute_dtype(dtype), huge)
                if name in self.state:
                    slot[:used].copy_(self.state[name][:used])
                self.state[name] = slot
            if self.optimizer.uses_step:
                step = _storage((capacity,), torch.int64, huge)
                if self.step is not None:
                    step[:used].copy_(self.step[:used])
                self.step = step
            if self._evict.active:
                self._set_stamps(
                    _resized(self._stamps, capacity, used, _FREE_STAMPS, huge))
            self._changed = _resized(self._changed, capacity, used, 0, huge)
            self._capacity = capacity

    # ---- checkpoints ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the keys, values, optimizer state and steps of every row held (rows in
        slot order; an evicted row is not there), the clock each was last touched and the
        evicted-id bits (under eviction) and the admission sketch (under count:K). Every row
        counts as unchanged from here on (`snapshot_changes`). Blocking (copies every row);
        thread-safe."""
        return self._snapshot(later=False)[0]

    def snapshot_later(self) -> tuple[dict[str, torch.Tensor], dict[str, LaterRows]]:
        """`snapshot` without stopping the table for the copy of its rows: it copies the
        keys (and stamps) at once, and the values, optimizer state and steps of its rows
        (the second dict, `TableState.later`, read as the snapshot is written) on a thread
        of its own, a piece at a time, while updates go on; an update of a row not copied
        yet copies it first (copy on write). It takes the memory of a copy of the rows, as
        `snapshot` does, and lasts while those row objects live. One at a time: while one
        lives, this copies every row at once, as `snapshot` does. Thread-safe."""
        return self._snapshot(later=True)

    def _snapshot(self, later: bool) -> tuple[dict[str, torch.Tensor], dict[str, LaterRows]]:
        with self._index_lock, self._storage.shared(), self._update_lock:
            self._forget_changes()
            whole = self.index.row_limit == len(self.index)  # no holes: rows 0..n-1
            if whole:
                keys = self.index.keys_by_row()
                held = np.arange(len(keys), dtype=np.int64)
            else:
                keys, held = self.index.items()
                order = np.argsort(held)
                keys, held = keys[order], held[order]
            out = {"keys": torch.from_numpy(keys)}
            rows: dict[str, LaterRows] = {}
            if later and (self._cow is None or self._cow() is None):
                cow = _CopyOnWrite(held, self.index.row_limit, self._row_tensors())
                self._cow = weakref.ref(cow)
                threading.Thread(target=self._copy_snapshot, args=(cow,), daemon=True,
                                 name=f"snapshot-copy-{self.spec.name}").start()
                rows = {name: _SnapshotRows(self, cow, name, tensor)
                        for name, tensor in self._row_tensors().items()}
            elif whole:
                out.update({name: t[:len(held)].clone()
                            for name, t in self._row_tensors().items()})
            else:
                at = torch.from_numpy(held)
                out.update({name: t.index_select(0, at)
                            for name, t in self._row_tensors().items()})
            if self._evict.active:
                out["touched"] = torch.from_numpy(self._touched_clock[held].copy())
                out["evicted_bits"] = torch.from_numpy(self._evicted_bits.copy())
            if self._sketch is not None:
                out["sketch"] = torch.from_numpy(self._sketch.counters.copy())
        return out, rows

    def _row_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that hold one row per slot, by their names in a snapshot. Caller holds
        the storage lock (shared) while it uses them."""
        rows = {"value": self.value, **{f"state.{k}": v for k, v in self.state.items()}}
        if self.step is not None:
            rows["step"] = self.step
        return rows

    def _save_for_snapshot(self, slots: np.ndarray) -> None:
        """Before rows at `slots` change: copies aside those a live copy-on-write snapshot
        still reads from the table. Caller holds the storage lock (shared)."""
        cow = self._cow() if self._cow is not None else None
        if cow is not None:
            cow.save(self._row_tensors, slots)

    def _snapshot_rows(self, cow: _CopyOnWrite, name: str, rows: torch.Tensor) -> torch.Tensor:
        with self._storage.shared():
            return cow.gather(self._row_tensors()[name], name, rows)

    def _copy_snapshot(self, cow: _CopyOnWrite) -> None:
        """Copies the rows of `cow` a piece at a time, letting updates in between (the
        thread `snapshot_later` starts)."""
        for start in range(0, max(1, len(cow.slots)), _COPY_PIECE_ROWS):
            with self._storage.shared():
                cow.copy_piece(self._row_tensors(), start)
            time.sleep(0)  # let a waiting update have the interpreter

    def snapshot_changes(self) -> dict[str, torch.Tensor] | None:
        """A row delta of what changed since the last snapshot (ps/checkpoint.py): the keys
        of the rows changed or created, with copies of their values, optimizer state, steps
        and (under eviction) touch stamps; the keys evicted since (under eviction); the
        sketch and the evicted-id bits if they changed. {} when nothing changed; None when
        the table must be snapshot whole (`snapshot`): it is new or restored since, or
        evicted too many keys to list. Every row counts as unchanged from here on. Blocking
        (copies the changed rows); thread-safe."""
        with self._index_lock, self._storage.shared(), self._update_lock:
            if self._whole:
                return None
            limit = self.index.row_limit
            slots = np.flatnonzero(self._changed[:limit])
            # Cleared before the copy: a row updated from now on is marked again.
            self._changed[slots] = 0
            gone = np.concatenate(self._gone) if self._gone else np.zeros(0, dtype=np.int64)
            items = self._items_changed
            self._gone, self._gone_count, self._items_changed = [], 0, False
            if limit == len(self.index):  # no holes: rows 0..n-1
                keys = self.index.keys_by_row()[slots]
            else:
                held_keys, held = self.index.items()
                by_slot = np.empty(limit, dtype=np.int64)
                by_slot[held] = held_keys
                in_use = np.zeros(limit, dtype=bool)
                in_use[held] = True
                slots = slots[in_use[slots]]  # a freed slot holds no row
                keys = by_slot[slots]
            if not len(slots) and not len(gone) and not items:
                return {}
            at = torch.from_numpy(slots.astype(np.int64))
            out = {"keys": torch.from_numpy(np.ascontiguousarray(keys, dtype=np.int64)),
                   "value": self.value.index_select(0, at)}
            out.update({f"state.{k}": v.index_select(0, at) for k, v in self.state.items()})
            if self.step is not None:
                out["step"] = self.step.index_select(0, at)
            if self._evict.active:
                out["touched"] = torch.from_numpy(self._touched_clock[slots])
                out[EVICTED_KEYS] = torch.from_numpy(gone)
                if items:
                    out["evicted_bits"] = torch.from_numpy(self._evicted_bits.copy())
            if self._sketch is not None and items:
                out["sketch"] = torch.from_numpy(self._sketch.counters.copy())
        return out

    def _forget_changes(self) -> None:
        """Every row counts as unchanged from now on. Caller holds the index lock."""
        self._changed[:] = 0
        self._gone, self._gone_count = [], 0
        self._items_changed = self._whole = False

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replaces every row with what `snapshot` made (or a snapshot from before admission
        and eviction existed, or from before stamps were int32). Under max_rows, keeps the
        most recently touched rows (the others count as evicted). FailedPreconditionError for
        a checkpoint that repeats keys, or (before anything changes) that stamps a row with a
        clock past STAMP_CLOCK_MAX."""
        keys = np.ascontiguousarray(tensors["keys"].numpy())
        keep: torch.Tensor | None = None
        stamps = gone = np.zeros(0, dtype=np.int64)
        if self._evict.active:
            touched = tensors.get("touched")
            stamps = (np.full(len(keys), self._clock_now, dtype=np.int64) if touched is None
                      else touched.numpy().astype(np.int64))
            if stamps.max(initial=0) > STAMP_CLOCK_MAX:
                raise FailedPreconditionError(
                    f"checkpoint of table {self.spec.name!r} stamps a row with clock "
                    f"{int(stamps.max())}, past the {STAMP_CLOCK_MAX} an evicting table "
                    "keeps; it cannot be restored into this table"
                )
            excess = len(keys) - self._evict.max_rows if self._evict.max_rows else 0
            if excess > 0:
                # Only the rows kept take storage: the restored table stays within max_rows.
                older = least_recent(stamps, np.zeros(len(keys), dtype=np.float32), excess)
                kept = np.delete(np.arange(len(keys)), older)
                gone, keys, stamps = keys[older], keys[kept], stamps[kept]
                keep = torch.from_numpy(kept)
        n = len(keys)

        def rows_of(name: str) -> torch.Tensor:
            return tensors[name] if keep is None else tensors[name].index_select(0, keep)

        with self._index_lock:
            self.index.clear()
            try:
                self.index.insert_rows(keys, np.arange(n, dtype=np.int64))
            except ValueError as exc:
                raise FailedPreconditionError(
                    f"checkpoint of table {self.spec.name!r} repeats keys; it cannot be restored"
                ) from exc
            except OverflowError as exc:
                raise FailedPreconditionError(
                    f"checkpoint of table {self.spec.name!r} holds {n} rows for one server, "
                    f"more than the {MAX_ROWS} its key index holds; restore it onto more servers"
                ) from exc
            if n > self._capacity:
                self._grow(n)
            with self._storage.shared(), self._update_lock:
                self._save_for_snapshot(np.arange(self._capacity, dtype=np.int64))
                self.value[:n].copy_(rows_of("value"))
                for k, v in self.state.items():
                    v[:n].copy_(rows_of(f"state.{k}"))
                if self.step is not None:
                    self.step[:n].copy_(rows_of("step"))
            if self._sketch is not None:
                sketch = tensors.get("sketch")
                self._sketch.counters[...] = 0
                if sketch is not None:
                    self._sketch.load(sketch.numpy())
            if self._evict.active:
                self._free_len = self._ttl_cursor = self._lru_cursor = 0
                bits = tensors.get("evicted_bits")
                self._evicted_bits[:] = 0
                if bits is not None and bits.numel() == len(self._evicted_bits):
                    self._evicted_bits[:] = bits.numpy()
                self._touched_clock[:] = _FREE
                self._touched_clock[:n] = stamps
                self._clock_now = max(self._clock_now, int(stamps.max(initial=0)))
                self._epoch_s = self._time()
                self._touched_s[:n] = 0.0
                if len(gone):
                    self._record_evicted(gone)
            self._whole = True

    def stats(self) -> TableStats:
        rows = len(self.index)
        row_bytes = self.spec.dim * self.spec.itemsize
        state_bytes = rows * self.optimizer.slot_width(self.spec.dim) * _state_itemsize(
            self.spec)
        if self.step is not None:
            state_bytes += rows * self.step.element_size()
        metadata = self.fixed_bytes(self.spec) + rows * self.bookkeeping_bytes(self.spec)
        return TableStats(
            self.spec.name, "sparse", self.spec.optimizer.describe(), rows, rows * row_bytes,
            state_bytes, self.index.nbytes, self.counters(), memory_bytes=self.memory_bytes(),
            metadata_bytes=metadata,
        )


def _held(rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that have a row id (not -1: refused by admission), and their values."""
    held = rows >= 0
    if bool(held.all()):
        return rows, values
    return rows[held], values[held]


def _stamp_pair(clock: int, seconds: float | np.floating[Any]) -> int:
    """The 8 bytes of an evicting table's stamps of one row (SparseTable._set_stamps), as
    the int64 they read as."""
    pair = np.empty(1, dtype=np.int64)
    pair.view(np.int32)[0] = clock
    pair.view(np.float32)[1] = seconds
    return int(pair[0])


# The stamps of a free row slot.
_FREE_STAMPS = _stamp_pair(_FREE, 0.0)


def _resized(array: np.ndarray, capacity: int, used: int, fill: float,
             huge: bool) -> np.ndarray:
    """A per-slot array of `capacity` slots holding `array`'s first `used`, `fill` after.

    Large ones are mapped on their own, as storage is (_storage): the old array of a grown
    table then goes back to the OS when it is dropped, instead of staying resident as free heap.
    """
    block = _mapping(capacity * array.dtype.itemsize, huge)
    # The array holds the mapping, which is unmapped when the last view of it goes.
    out = (np.empty(capacity, dtype=array.dtype) if block is None
           else np.frombuffer(block, dtype=array.dtype))
    out[:used] = array[:used]
    out[used:] = fill
    return out


@dataclass(frozen=True)
class SparseRows:
    """The answer to a sparse pull: row ids resolved, values gathered slice by slice.

    Gathering a slice at a time keeps each copy small enough to stay in cache on its way to
    the wire, instead of building one large intermediate tensor. A table that evicts copies
    the values at once (`values`), as its row ids may change hands after the pull.
    """

    table: SparseTable
    rows: torch.Tensor
    values: torch.Tensor | None = None

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
        if self.values is None:
            return self.table.gather(self.rows[start:end], out)
        part = self.values[start:end]
        return part if out is None else out.copy_(part)


Table = DenseTable | SparseTable


def check_same_spec(existing: TableSpec, declared: TableSpec) -> None:
    """FailedPreconditionError showing both specs when a redeclaration differs."""
    if existing != declared:
        raise FailedPreconditionError(
            f"table {declared.name!r} already exists with another spec.\n"
            f"  held:     {existing.describe()}\n  declared: {declared.describe()}\n"
            f"Use a new table name, or restart the servers to change it"
        )


# Rows of a snapshot its background copy takes at a time (see _CopyOnWrite), holding the
# lock that updates of the table's rows wait for: 4 MiB of 64 float32 values.
_COPY_PIECE_ROWS = 16384


class _CopyOnWrite:
    """A snapshot of a SparseTable's rows taken without stopping it (`snapshot_later`): a
    copy made on a thread of its own, a piece at a time (`copy_piece`), and of each row not
    copied yet, by the first update that changes it, just before."""

    def __init__(self, slots: np.ndarray, limit: int, like: dict[str, torch.Tensor]) -> None:
        self.slots = slots  # row i of the snapshot is slot slots[i] of the table
        self.row_of_slot = np.full(limit, -1, dtype=np.int64)
        self.row_of_slot[slots] = np.arange(len(slots), dtype=np.int64)
        self.copied = np.zeros(len(slots), dtype=bool)
        self.done = False  # every row copied
        # In mappings of their own (_storage): resident as they are written, unmapped when
        # the snapshot goes.
        self.saved = {name: _storage((len(slots), *t.shape[1:]), t.dtype, huge=False)
                      for name, t in like.items()}
        # Held while rows are copied or read: a row the reader finds not copied has not
        # changed since the snapshot.
        self.lock = threading.Lock()

    def save(self, live: Callable[[], dict[str, torch.Tensor]], slots: np.ndarray) -> None:
        """Copies the rows of the snapshot at `slots` (of the table's tensors, `live()`) not
        copied yet, before the caller changes them. Once all are, costs one test."""
        if self.done:
            return
        with self.lock:
            slots = slots[slots < len(self.row_of_slot)]
            rows = self.row_of_slot[slots]
            todo = rows >= 0
            todo[todo] = ~self.copied[rows[todo]]
            if todo.any():
                self._copy(live(), slots[todo], rows[todo])

    def copy_piece(self, live: dict[str, torch.Tensor], start: int) -> None:
        """Copies the rows [start, start + _COPY_PIECE_ROWS) of the snapshot not copied yet;
        past its last row, it counts as copied whole."""
        with self.lock:
            end = min(start + _COPY_PIECE_ROWS, len(self.slots))
            todo = np.flatnonzero(~self.copied[start:end]) + start
            if len(todo):
                self._copy(live, self.slots[todo], todo)
            if end == len(self.slots):
                self.done = True

    def _copy(self, live: dict[str, torch.Tensor], slots: np.ndarray, rows: np.ndarray) -> None:
        """Caller holds self.lock."""
        at, to = torch.from_numpy(slots), torch.from_numpy(rows)
        for name, tensor in live.items():
            self.saved[name].index_copy_(0, to, tensor.index_select(0, at))
        self.copied[rows] = True

    def gather(self, live: torch.Tensor, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` of the snapshot's tensor `name`, whose table tensor is `live`."""
        with self.lock:
            if self.done:
                return self.saved[name].index_select(0, rows)
            wanted = rows.numpy()
            copied = self.copied[wanted]
            out = torch.empty((len(wanted), *live.shape[1:]), dtype=live.dtype)
            out[torch.from_numpy(copied)] = self.saved[name].index_select(
                0, torch.from_numpy(wanted[copied]))
            out[torch.from_numpy(~copied)] = live.index_select(
                0, torch.from_numpy(self.slots[wanted[~copied]]))
            return out


class _SnapshotRows:
    """One row tensor (values, a state slot, steps) of a copy-on-write snapshot: a
    `ps.checkpoint.LaterRows`. The snapshot lasts while these live."""

    def __init__(self, table: SparseTable, cow: _CopyOnWrite, name: str,
                 like: torch.Tensor) -> None:
        self._table, self._cow, self._name = table, cow, name
        self.dtype = like.dtype
        self.shape = (len(cow.slots), *like.shape[1:])

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return self._table._snapshot_rows(self._cow, self._name, rows)
