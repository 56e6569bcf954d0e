"""A checkpoint written by N servers, cut into the share of one of M servers.

`reshard` takes the states of the shards of one checkpoint (each as `load_checkpoint`
returns it) and returns the state shard k of M holds, which `Shard.restore` takes as it
takes a checkpoint of its own. It is pure: no I/O, no locks, nothing shared.

Which old shards: keys route by ranges of their hash (`protos.partition.key_range`), so the
sparse rows of shard k of M lie on the old shards whose ranges overlap its range, one or two
of them when M >= N; dense rows lie on the old blocks that overlap its new block.
`shards_needed` names them, and only they are read: the others hold nothing of shard k.

What goes where:

- Sparse rows go to the shard `protos.partition.shard_of_keys(keys, M)` names, each with
  everything kept per row (its values, optimizer state, step counter and, under eviction,
  the clock it was last touched). Rows keep the order of the old shards, then their order
  within each.
- A dense table's rows are cut again by `protos.partition.dense_placement` for M: the new
  block is assembled row by row from the old blocks that held those rows, and so is each
  optimizer slot, element-wise (the shape of the block) or row-wise (one element per row, as
  rowwise_adagrad keeps). A scalar is one row. The block's step counter (one per block, read
  by Adam's bias correction) is the largest of the old blocks it takes rows from: under sync
  every block applies the same updates and they are equal; under async they may differ by
  the pushes in flight at the cut, and a larger step only shrinks the first updates after
  the restore, where a smaller one would enlarge them. The block counts as written if any
  of those old blocks was; an empty block is neither written nor stepped.
- Whole-table items, kept per shard, cannot be cut by key: the admission sketch (count:K)
  is the elementwise sum of the sketches of the old shards read, saturating at 255 like the
  sketch itself. A key of shard k was counted on exactly one old shard, one of those read,
  so the sum never undercounts it; it overcounts more (more keys share each bucket), so an id
  may be admitted a little early. The evicted-id bits (what the `readmitted` counter checks
  new rows against) are the OR of those shards' bits, for the same reason: an id evicted
  before still counts as readmitted when its row comes back here, at the price of more bits
  set (a statistic only).
- `meta`: the checkpoint's cut is one point in the job's progress, which every shard saw
  through its own clock board and push ledger. Of the old shards read: the open clock and
  the count of closed clocks are the smallest (as the manifest's clock is); each worker's
  clock is the largest (a worker rejoining after the restore ticks every shard up to its
  largest anyway); the live workers are the union. The push ledger keeps, per worker, its
  newest incarnation, with the union of the push numbers the old shards applied for it
  (numbers are unique per incarnation across shards, so a retried push is acknowledged, never
  applied twice; after a restore workers rejoin as new incarnations, whose numbering starts
  afresh) above the highest window floor. `positions` (each worker's data position at the
  cut, recorded alike on every shard) is carried as the union of the old maps. The mode must
  agree; `incarnation` (of the server that wrote a shard) is the newest; any other item must
  be equal on every old shard and is carried as it is. `resharded_from` records the
  checkpoint id and its shard count. Under sync every shard cuts at the same clock and
  these merges change nothing but the ledger.

Restoring onto the same count needs none of this: with N == M `reshard` returns the old
state of shard k itself, unchanged.

Memory: `states` may be an iterator that reads one old shard at a time; `reshard` keeps only
shard k's share of each and drops the rest before asking for the next. Old shards read
through `routes_here` hold only that share to begin with, and read into the slices
`JoinedRows` hands out (coordination does both) they are the share already: `reshard`
returns those tensors without joining them, so a server holds its own share of the model
and no more.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from protos.partition import RowRange, dense_placement, key_range, shard_of_keys
from ps.checkpoint import CheckpointError, ShardState, TableState
from ps.errors import PSError
from ps.tables import DenseTable, TableSpec

# Per-row tensors of a sparse table's snapshot (besides "state.<slot>"), and the whole-table
# ones with how they merge.
_SPARSE_ROWS = ("keys", "value", "step", "touched")
_SKETCH = "sketch"
_EVICTED_BITS = "evicted_bits"
# Board and ledger items of a shard's meta (Shard._snapshot), merged as the module says.
_CLOCK_ITEMS = ("open_clock", "clocks_closed")


class ReshardError(CheckpointError):
    """The states given are not the shards of one checkpoint, or disagree in a way no
    resharding can reconcile; nothing was built."""


def shards_needed(old_num_shards: int, shard: int, num_shards: int,
                  specs: Iterable[dict[str, Any]] = ()) -> list[int]:
    """The old shards (of `old_num_shards`) that hold rows of shard `shard` of `num_shards`:
    those whose key range (`protos.partition.key_range`) overlaps its own, and, for each
    dense table of `specs` (the `TableState.spec` of a checkpoint's tables), those whose
    block overlaps its block. The others hold none of its rows and need not be read. With
    the same count, `shard` alone. ReshardError for a spec that cannot be read. Pure."""
    _check_target(shard, num_shards)
    lo, hi = key_range(shard, num_shards)
    needed = {i for i in range(old_num_shards)
              if (r := key_range(i, old_num_shards))[0] < hi and lo < r[1]}
    for spec_dict in specs:
        if spec_dict.get("kind") != "dense":
            continue
        spec = _dense_spec(spec_dict)
        new = dense_placement(spec.name, spec.shape, spec.itemsize, num_shards)[shard]
        needed.update(r.shard for r in dense_placement(spec.name, spec.shape, spec.itemsize,
                                                       old_num_shards)
                      if r.start < new.end and new.start < r.end)
    return sorted(needed)


def routes_here(shard: int, num_shards: int) -> Callable[[np.ndarray], np.ndarray]:
    """The key filter of shard `shard` of `num_shards` (`ps.checkpoint.read_shard`'s `keep`):
    one bool per key, true for the keys `protos.partition.shard_of_keys` routes there. An old
    shard read through it holds exactly the rows `reshard` would take from it. Pure."""
    _check_target(shard, num_shards)
    return lambda keys: shard_of_keys(keys, num_shards) == shard


def reshard(states: Iterable[ShardState], shard: int, num_shards: int) -> ShardState:
    """The state shard `shard` of `num_shards` holds, from the shards of one checkpoint.

    `states` are shards (any order) of one checkpoint of one job, among them at least those
    `shards_needed` names (all N will do; the others are passed over, so the result is the
    same either way): ReshardError otherwise, or when they disagree on a table (its spec, its
    tensors, their shapes) or on an item of `meta` that cannot be merged. Pure: reads
    `states` once, in order, keeping only the target's share of each (a tensor taken whole
    may be shared with the input rather than copied). Returns a state of the same job and
    checkpoint id, at the smallest clock of the shards it read; with the same count, the
    old shard `shard` itself. Does not block; thread-safe.
    """
    _check_target(shard, num_shards)
    builder: _Builder | None = None
    for state in states:
        if builder is None:
            builder = _Builder(state, shard, num_shards)
        builder.add(state)
        # Dropped before the next is read: an iterator that loads shards one at a time then
        # keeps one in memory, not two.
        del state
    if builder is None:
        raise ReshardError("reshard got no shard states; pass every shard of the checkpoint")
    return builder.result()


def _check_target(shard: int, num_shards: int) -> None:
    if (isinstance(shard, bool) or isinstance(num_shards, bool) or num_shards < 1
            or not 0 <= shard < num_shards):
        raise ReshardError(
            f"target shard {shard!r} of {num_shards!r}: need 0 <= shard < num_shards")


def _dense_spec(spec: dict[str, Any]) -> TableSpec:
    try:
        return TableSpec.from_dict(dict(spec))
    except (PSError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ReshardError(
            f"table {spec.get('name')!r}: its spec cannot be read ({exc!r})") from exc


class _Builder:
    """Folds the old shards of one checkpoint, one at a time, into shard k of M."""

    def __init__(self, first: ShardState, shard: int, num_shards: int) -> None:
        self.job, self.checkpoint_id = first.job, first.checkpoint_id
        self.old = first.num_shards
        self.shard, self.num_shards = shard, num_shards
        if self.old < 1:
            raise ReshardError(f"checkpoint {self.checkpoint_id!r} has {self.old} shards")
        self.needed = shards_needed(self.old, shard, num_shards,
                                    [t.spec for t in first.tables])
        self.seen: list[int] = []
        self.tables: dict[str, _SparseShare | _DenseShare] = {}
        self.meta = _MetaMerge()
        self.clock: int | None = None
        self.same: ShardState | None = None  # N == M: old shard k, returned as it is

    def add(self, state: ShardState) -> None:
        what = f"shard {state.shard} of {state.num_shards} of checkpoint {state.checkpoint_id!r}"
        if (state.job, state.checkpoint_id, state.num_shards) != (
                self.job, self.checkpoint_id, self.old):
            raise ReshardError(
                f"{what} (job {state.job!r}) is not of checkpoint {self.checkpoint_id!r} of "
                f"job {self.job!r} with {self.old} shards; pass the shards of one checkpoint")
        if not 0 <= state.shard < self.old or state.shard in self.seen:
            raise ReshardError(f"{what} is given twice or is out of range")
        self.seen.append(state.shard)
        if state.shard not in self.needed:
            return
        self.clock = state.clock if self.clock is None else min(self.clock, state.clock)
        if self.old == self.num_shards:
            if state.shard == self.shard:
                self.same = state
            return
        self.meta.add(state)
        names = set()
        for table in state.tables:
            if table.name in names:
                raise ReshardError(f"{what} holds table {table.name!r} twice")
            names.add(table.name)
            share = self.tables.get(table.name)
            if share is None:
                share = self.tables[table.name] = _share(table, self.old, self.shard,
                                                         self.num_shards)
            elif share.spec_dict != table.spec:
                raise ReshardError(
                    f"table {table.name!r} has another spec in {what} than in the shards "
                    f"before it; the checkpoint mixes jobs")
            share.add(state.shard, table.tensors)

    def result(self) -> ShardState:
        missing = sorted(set(self.needed) - set(self.seen))
        if missing:
            raise ReshardError(
                f"checkpoint {self.checkpoint_id!r} of job {self.job!r} has {self.old} shards; "
                f"shard(s) {missing} were not given, and they hold rows of shard "
                f"{self.shard} of {self.num_shards}")
        if self.same is not None:
            return self.same
        for name, share in self.tables.items():
            if len(share.shards) != len(self.needed):
                absent = sorted(set(self.needed) - share.shards)
                raise ReshardError(
                    f"table {name!r} is missing from shard(s) {absent} of checkpoint "
                    f"{self.checkpoint_id!r}; its rows there cannot be rebuilt")
        meta = self.meta.result()
        meta["resharded_from"] = {"checkpoint": self.checkpoint_id, "num_shards": self.old}
        clock = self.clock if self.clock is not None else 0
        return ShardState(
            job=self.job, shard=self.shard, num_shards=self.num_shards,
            checkpoint_id=self.checkpoint_id, clock=clock, meta=meta,
            tables=[share.result() for share in self.tables.values()],
        )


def _share(table: TableState, old: int, shard: int, num_shards: int) -> _SparseShare | _DenseShare:
    kind = table.spec.get("kind")
    if kind == "sparse":
        return _SparseShare(table, shard, num_shards)
    if kind == "dense":
        return _DenseShare(table, old, shard, num_shards)
    raise ReshardError(f"table {table.name!r} has kind {kind!r}; this build reshards "
                       "'sparse' and 'dense' tables")


class _SparseShare:
    """The rows of one sparse table that route to shard k of M, and its whole-table items."""

    def __init__(self, table: TableState, shard: int, num_shards: int) -> None:
        self.name, self.spec_dict = table.name, table.spec
        self.shard, self.num_shards = shard, num_shards
        self.names = set(table.tensors)
        self.shards: set[int] = set()
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.sketch: torch.Tensor | None = None  # int32 sum, clamped at the end
        self.bits: torch.Tensor | None = None

    def add(self, old_shard: int, tensors: dict[str, torch.Tensor]) -> None:
        where = f"table {self.name!r} of shard {old_shard}"
        if set(tensors) != self.names:
            raise ReshardError(
                f"{where} holds tensors {sorted(tensors)}, the shards before it "
                f"{sorted(self.names)}; the checkpoint mixes versions or is damaged")
        for name in tensors:
            if not (name in _SPARSE_ROWS or name.startswith("state.")
                    or name in (_SKETCH, _EVICTED_BITS)):
                raise ReshardError(f"{where} holds tensor {name!r}, which this build does not "
                                   "know how to reshard")
        keys = tensors.get("keys")
        if keys is None or keys.dtype != torch.int64 or keys.dim() != 1:
            raise ReshardError(f"{where} has no 1-d int64 'keys' tensor")
        n = len(keys)
        target = shard_of_keys(keys.numpy(), self.num_shards) == self.shard
        taken = int(target.sum())
        at = torch.from_numpy(np.flatnonzero(target))
        for name, tensor in tensors.items():
            if name in (_SKETCH, _EVICTED_BITS):
                continue
            if tensor.dim() < 1 or tensor.shape[0] != n:
                raise ReshardError(
                    f"{where}: tensor {name!r} has shape {list(tensor.shape)}, not one row "
                    f"for each of its {n} keys")
            part = tensor if taken == n else tensor.index_select(0, at)
            self.rows.setdefault(name, []).append(part)
        if _SKETCH in tensors:
            self.sketch = _merged(self.sketch, tensors[_SKETCH], where, _SKETCH,
                                  lambda a, b: a.add_(b.to(torch.int32)))
        if _EVICTED_BITS in tensors:
            self.bits = _merged(self.bits, tensors[_EVICTED_BITS], where, _EVICTED_BITS,
                                lambda a, b: a.bitwise_or_(b))
        self.shards.add(old_shard)

    def result(self) -> TableState:
        tensors = {name: _joined(parts) for name, parts in self.rows.items()}
        self.rows.clear()
        if self.sketch is not None:
            tensors[_SKETCH] = self.sketch.clamp_(max=255).to(torch.uint8)
        if self.bits is not None:
            tensors[_EVICTED_BITS] = self.bits
        return TableState(self.name, self.spec_dict, tensors)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)`, emptying `parts`. Parts that are consecutive slices covering one
    tensor (read in place: `JoinedRows`) are that tensor, with no copy. Otherwise each part
    no one else holds is freed once copied, so the join holds its result and one part at a
    time, not two copies of the share (the result's fresh pages take memory only as they
    are written)."""
    if len(parts) == 1:
        return parts.pop()
    whole = _tiled(parts)
    if whole is not None:
        parts.clear()
        return whole
    out = torch.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
    at = 0
    while parts:
        part = parts.pop(0)
        out[at:at + len(part)].copy_(part)
        at += len(part)
        del part
    return out


def _tiled(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor that `parts` are, in order, consecutive slices of along dim 0, covering it
    whole; None when they are not."""
    found = getattr(parts[0], "_base", None)
    if not isinstance(found, torch.Tensor):
        return None
    base: torch.Tensor = found
    if base.dim() < 1 or not base.is_contiguous():
        return None
    row_bytes = base.element_size() * math.prod(base.shape[1:])
    rows = 0
    for part in parts:
        if not len(part):
            continue
        if (getattr(part, "_base", None) is not base or not part.is_contiguous()
                or part.data_ptr() != base.data_ptr() + rows * row_bytes):
            return None
        rows += len(part)
    return base if rows == len(base) else None


class JoinedRows:
    """Where each old shard's rows go in shard k's share, so that old shards read in place
    (`ps.checkpoint.read_shard`'s `into`) leave `reshard` nothing to join: each sparse
    tensor of the share is allocated once, and old shard i fills the slice after the rows
    of the shards before it. `counts[i]` is old shard i's kept rows per table
    (`ps.checkpoint.kept_rows`), None for one not read in place. Thread-safe."""

    def __init__(self, counts: Sequence[Mapping[str, int] | None]) -> None:
        self._counts = list(counts)
        self._offsets: list[dict[str, int] | None] = []
        self._totals: dict[str, int] = {}
        for found in self._counts:
            if found is None:
                self._offsets.append(None)
                continue
            self._offsets.append({t: self._totals.get(t, 0) for t in found})
            for table, rows in found.items():
                self._totals[table] = self._totals.get(table, 0) + rows
        self._lock = threading.Lock()
        self._tensors: dict[tuple[str, str], torch.Tensor] = {}

    def into(self, index: int) -> Callable[[str, str, torch.dtype, tuple[int, ...]],
                                           torch.Tensor | None] | None:
        """`read_shard`'s `into` for old shard `index` (in the order of `counts`)."""
        offsets, counts = self._offsets[index], self._counts[index]
        if offsets is None or counts is None:
            return None

        def place(table: str, name: str, dtype: torch.dtype,
                  shape: tuple[int, ...]) -> torch.Tensor | None:
            if table not in offsets or not shape or shape[0] != counts[table]:
                return None
            with self._lock:
                whole = self._tensors.get((table, name))
                if whole is None:
                    whole = torch.empty((self._totals[table], *shape[1:]), dtype=dtype)
                    self._tensors[(table, name)] = whole
            if whole.dtype != dtype or tuple(whole.shape[1:]) != tuple(shape[1:]):
                return None
            return whole[offsets[table]:offsets[table] + shape[0]]

        return place


def _merged(acc: torch.Tensor | None, tensor: torch.Tensor, where: str, name: str,
            fold: Any) -> torch.Tensor:
    """`tensor` folded into `acc` (a fresh copy for the first): a sketch summed in int32, bits
    OR-ed. ReshardError when it differs in shape or dtype from the ones before."""
    if acc is None:
        if name == _SKETCH:
            if tensor.dtype != torch.uint8:
                raise ReshardError(f"{where}: the sketch is {tensor.dtype}, not uint8")
            return tensor.to(torch.int32)
        return tensor.clone()
    if tensor.shape != acc.shape or (name == _EVICTED_BITS and tensor.dtype != acc.dtype) or (
            name == _SKETCH and tensor.dtype != torch.uint8):
        raise ReshardError(
            f"{where}: {name!r} has shape {list(tensor.shape)} ({tensor.dtype}), unlike the "
            f"shards before it ({list(acc.shape)}); the checkpoint mixes versions")
    result: torch.Tensor = fold(acc, tensor)
    return result


class _DenseShare:
    """Rows [start, end) of a dense table under M shards, filled from the old blocks."""

    def __init__(self, table: TableState, old: int, shard: int, num_shards: int) -> None:
        self.name, self.spec_dict = table.name, table.spec
        self.spec = spec = _dense_spec(table.spec)
        self.old = dense_placement(spec.name, spec.shape, spec.itemsize, old)
        self.new = dense_placement(spec.name, spec.shape, spec.itemsize, num_shards)[shard]
        self.optimizer = spec.optimizer.build()
        self.shards: set[int] = set()
        self.filled = 0  # rows of the new block copied so far
        self.step = 0
        self.written = False
        self.targets: dict[str, torch.Tensor] = {}

    def _shapes(self, placement: RowRange) -> dict[str, tuple[int, ...]]:
        block = DenseTable.block_shape_for(self.spec, placement)
        shapes = {"value": block}
        shapes.update({f"state.{s}": self.optimizer.slot_shape(s, block)
                       for s in self.optimizer.slots})
        return shapes

    def add(self, old_shard: int, tensors: dict[str, torch.Tensor]) -> None:
        where = f"table {self.name!r} of shard {old_shard}"
        placement = self.old[old_shard]
        shapes = self._shapes(placement)
        expected = {*shapes, "step", "written"}
        if not {*shapes, "step"} <= set(tensors) <= expected:
            raise ReshardError(
                f"{where} holds tensors {sorted(tensors)}; a dense table with optimizer "
                f"{self.optimizer.name!r} keeps {sorted(expected)}")
        for name, shape in shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise ReshardError(
                    f"{where}: {name!r} has shape {list(tensors[name].shape)}, but rows "
                    f"[{placement.start}, {placement.end}) of shape {list(self.spec.shape)} "
                    f"make {list(shape)}")
        step = tensors["step"]
        if step.dtype != torch.int64 or step.numel() != 1:
            raise ReshardError(f"{where}: 'step' is not one int64 counter")
        if not self.targets:
            self.targets = {name: torch.empty(shape, dtype=tensors[name].dtype)
                            for name, shape in self._shapes(self.new).items()}
        start, end = max(placement.start, self.new.start), min(placement.end, self.new.end)
        if start < end:
            for name, target in self.targets.items():
                source = tensors[name]
                if source.dtype != target.dtype:
                    raise ReshardError(f"{where}: {name!r} is {source.dtype}, the shards before "
                                       f"it {target.dtype}")
                _rows(target)[start - self.new.start:end - self.new.start].copy_(
                    _rows(source)[start - placement.start:end - placement.start])
            self.filled += end - start
            self.step = max(self.step, int(step.item()))
            written = tensors.get("written")
            # A block saved before `written` was kept counts as written (DenseTable.restore).
            self.written |= True if written is None else bool(written.item())
        self.shards.add(old_shard)

    def result(self) -> TableState:
        if self.filled != self.new.rows:  # every old shard was given, so it cannot be short
            raise ReshardError(f"table {self.name!r}: {self.filled} of rows "
                               f"[{self.new.start}, {self.new.end}) were found")
        tensors = dict(self.targets)
        tensors["step"] = torch.tensor([self.step], dtype=torch.int64)
        tensors["written"] = torch.tensor(self.written)
        return TableState(self.name, self.spec_dict, tensors)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """A block or slot as [rows, elements per row] (a 0-d one is one row): a view of a
    contiguous tensor (the targets are), a copy of another."""
    if tensor.dim() == 0:
        return tensor.reshape(1, 1)
    return tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:]))


class _MetaMerge:
    """The old shards' meta, merged as the module docstring says."""

    def __init__(self) -> None:
        self.count = 0
        self.mode: object = None
        self.incarnation: int | None = None
        self.clock_items: dict[str, int] = {}
        self.clocks: dict[str, int] | None = None
        self.live: set[int] | None = None
        self.ledger: dict[int, list[Any]] | None = None
        self.positions: dict[str, object] | None = None
        self.other: dict[str, object] = {}
        self.other_keys: set[str] | None = None

    def add(self, state: ShardState) -> None:
        meta, where = state.meta, f"meta of shard {state.shard}"
        try:
            self._add(meta, where)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ReshardError(
                f"{where} is malformed ({exc!r}); the checkpoint is damaged") from exc
        self.count += 1

    def _add(self, meta: dict[str, Any], where: str) -> None:
        if "mode" in meta:
            if self.count and meta["mode"] != self.mode:
                raise ReshardError(f"{where} has mode {meta['mode']!r}, the shards before it "
                                   f"{self.mode!r}")
            self.mode = meta["mode"]
        if "incarnation" in meta:
            self.incarnation = max(int(meta["incarnation"]), self.incarnation or 0)
        for name in _CLOCK_ITEMS:
            if name in meta:
                value = int(meta[name])
                self.clock_items[name] = min(value, self.clock_items.get(name, value))
        if "clocks" in meta:
            self.clocks = self.clocks or {}
            for worker, clock in dict(meta["clocks"]).items():
                self.clocks[str(worker)] = max(int(clock), self.clocks.get(str(worker), -1))
        if "live" in meta:
            self.live = (self.live or set()) | {int(w) for w in meta["live"]}
        if "ledger" in meta:
            self.ledger = self.ledger if self.ledger is not None else {}
            for worker, incarnation, floor, applied in meta["ledger"]:
                entry = [int(worker), int(incarnation), int(floor), {int(s) for s in applied}]
                held = self.ledger.get(int(worker))
                if held is None or entry[1] > held[1]:
                    self.ledger[int(worker)] = entry
                elif entry[1] == held[1]:
                    held[2] = max(held[2], entry[2])
                    held[3] |= entry[3]
        if "positions" in meta:
            self.positions = self.positions if self.positions is not None else {}
            for worker, position in dict(meta["positions"]).items():
                if self.positions.get(worker, position) != position:
                    raise ReshardError(
                        f"{where} records position {position!r} for worker {worker}, another "
                        f"shard {self.positions[worker]!r}; the checkpoint is not one cut")
                self.positions[worker] = position
        known = {"mode", "incarnation", *_CLOCK_ITEMS, "clocks", "live", "ledger", "positions",
                 "resharded_from"}
        other = {k: v for k, v in meta.items() if k not in known}
        if self.other_keys is None:
            self.other, self.other_keys = other, set(other)
        elif other != self.other:
            differ = sorted(set(other) ^ self.other_keys
                            | {k for k in other if k in self.other and other[k] != self.other[k]})
            raise ReshardError(
                f"{where} differs from the shards before it in {differ}, which this build does "
                "not know how to merge")

    def result(self) -> dict[str, object]:
        meta: dict[str, object] = {}
        if self.mode is not None:
            meta["mode"] = self.mode
        if self.incarnation is not None:
            meta["incarnation"] = self.incarnation
        meta.update(self.clock_items)
        if self.clocks is not None:
            meta["clocks"] = dict(sorted(self.clocks.items(), key=lambda kv: int(kv[0])))
        if self.live is not None:
            meta["live"] = sorted(self.live)
        if self.ledger is not None:
            meta["ledger"] = [[w, inc, floor, sorted(s for s in applied if s >= floor)]
                              for w, (_, inc, floor, applied) in sorted(self.ledger.items())]
        if self.positions is not None:
            meta["positions"] = dict(sorted(self.positions.items()))
        meta.update(self.other)
        return meta
