"""A checkpoint cut onto another number of servers: tables trained on real `SparseTable`s and
`DenseTable`s of N shards, snapshotted as a server snapshots them, resharded onto M, and
compared row by row (sparse rows by key, dense rows by their global row) with what the N
shards held; then restored into real `Shard`s of M."""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from protos.partition import dense_placement, shard_of_keys
from ps.checkpoint import ShardState, TableState, materialized
from ps.clocks import ClockBoard, Quorum
from ps.initializers import InitSpec
from ps.ledger import LedgerEntry, PushLedger
from ps.reshard import JoinedRows, ReshardError, reshard, routes_here, shards_needed
from ps.shard import Shard, ShardConfig
from ps.tables import DenseTable, OptimizerConfig, SparseTable, TableSpec

F32 = torch.float32
ADAM = OptimizerConfig("adam", (("lr", 0.05),))
ADAGRAD = OptimizerConfig("adagrad", (("lr", 0.1),))
ROWWISE = OptimizerConfig("rowwise_adagrad", (("lr", 0.1),))
UNIFORM = InitSpec("uniform", -1.0, 1.0)

SPECS = [
    # Adam keeps a step per row: every per-row tensor moves with its key.
    TableSpec("emb", "sparse", F32, dim=4, init=UNIFORM, seed=1, optimizer=ADAM),
    # Under eviction (stamps, evicted-id bits) and count admission (a sketch).
    TableSpec("ids", "sparse", F32, dim=3, init=UNIFORM, seed=2, optimizer=ADAGRAD,
              admit="count:2", ttl_clocks=3),
    TableSpec("rowwise", "sparse", F32, dim=5, init=UNIFORM, seed=3, optimizer=ROWWISE),
    # Split across shards with uneven rows (1001 = 500 + 501 = 333 + 334 + 334).
    TableSpec("w", "dense", F32, shape=(1001, 17), init=UNIFORM, seed=4, optimizer=ADAM),
    # Row-wise state for a dense table: one accumulator per row.
    TableSpec("wr", "dense", F32, shape=(1200, 16), init=UNIFORM, seed=5, optimizer=ROWWISE),
    # Too small to split: whole on one shard, empty blocks elsewhere; and a scalar.
    TableSpec("bias", "dense", F32, shape=(8,), init=UNIFORM, seed=6, optimizer=ADAM),
    TableSpec("scale", "dense", F32, shape=(), init=UNIFORM, seed=7, optimizer=ROWWISE),
]
KEYS = np.arange(-300, 900, 3, dtype=np.int64) * 7919


def grad_of(keys: np.ndarray, dim: int, step: int) -> torch.Tensor:
    """A gradient that differs by key and step, so misplaced rows cannot compare equal."""
    base = torch.from_numpy((keys % 97).astype(np.float32) / 97)[:, None]
    return base * torch.linspace(0.5, 1.5, dim)[None, :] + 0.1 * step


def trained(num_shards: int) -> list[ShardState]:
    """Every shard of one checkpoint of a job of `num_shards` servers, after training: a
    copy of its own for each test to change."""
    return [ShardState(**{**vars(s), "meta": copy.deepcopy(s.meta), "tables": [
        TableState(t.name, dict(t.spec), {n: v.clone() for n, v in t.tensors.items()})
        for t in s.tables]}) for s in _trained(num_shards)]


@functools.cache
def _trained(num_shards: int, workers: int = 3) -> list[ShardState]:
    states = []
    for shard in range(num_shards):
        tables: list[TableState] = []
        for spec in SPECS:
            if spec.kind == "sparse":
                tables.append(TableState(spec.name, spec.to_dict(),
                                         _trained_sparse(spec, shard, num_shards)))
                continue
            placement = dense_placement(spec.name, spec.shape, spec.itemsize, num_shards)[shard]
            table = DenseTable(spec, placement)
            for step in range(3 if placement.rows else 0):
                grad = torch.linspace(-1, 1, max(table.value.numel(), 1))[:table.value.numel()]
                table.apply([(0, grad * (step + 1))], assign=False)
            tables.append(TableState(spec.name, spec.to_dict(), table.snapshot()))
        board = ClockBoard(Quorum(workers))
        for worker in range(workers):
            board.report(worker, 10 + worker + shard)  # shards saw workers at other clocks
        board.open_clock, board.clocks_closed = 10 + shard, 9 + shard
        ledger = PushLedger()
        ledger.restore([LedgerEntry(0, 5 + shard, 0, (shard + 1, 10 + shard)),
                        LedgerEntry(shard + 1, 3, 0, (1,))])
        meta = {"mode": "sync", "incarnation": 100 + shard, **board.to_meta(),
                "ledger": ledger.to_meta(), "positions": {"0": "file-a:17", "1": "file-b:3"}}
        states.append(ShardState("job", shard, num_shards, "clock-10", 10 + shard, meta, tables))
    return states


def _trained_sparse(spec: TableSpec, shard: int, num_shards: int) -> dict[str, torch.Tensor]:
    table = SparseTable(spec, shard, num_shards)
    mine = KEYS[shard_of_keys(KEYS, num_shards) == shard]
    for step in range(4):
        table.observe_clock(step)
        seen = mine[(mine // 7919 + step) % 4 != 0]  # not every key every step: ttl evicts some
        table.pull(seen)
        table.apply(seen, grad_of(seen, spec.dim, step), assign=False)
    # Clocks later, a third of the keys come back: under a TTL the others are evicted.
    table.observe_clock(8)
    table.pull(mine[(mine // 7919) % 2 == 0])
    table.evict()
    return table.snapshot()


def rows_by_key(states: list[ShardState], table: str) -> dict[int, dict[str, torch.Tensor]]:
    """Key -> each per-row tensor's row, over every shard (a key twice fails the test)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for state in states:
        tensors = next(t for t in state.tables if t.name == table).tensors
        keys = tensors["keys"].tolist()
        for i, key in enumerate(keys):
            assert key not in out, f"key {key} of table {table!r} on two shards"
            out[key] = {n: t[i] for n, t in tensors.items() if n not in ("sketch", "evicted_bits")}
    return out


def global_rows(states: list[ShardState], table: str) -> dict[str, torch.Tensor]:
    """Each dense tensor (value, state.*) with the shards' blocks joined in row order."""
    blocks = [next(t for t in s.tables if t.name == table).tensors for s in
              sorted(states, key=lambda s: s.shard)]
    out = {}
    for name in blocks[0]:
        if name in ("step", "written"):
            continue
        parts = [b[name].reshape(1, -1) if b[name].dim() == 0 else b[name] for b in blocks]
        out[name] = torch.cat([p for p in parts if p.shape[0]])
    return out


def resharded(states: list[ShardState], num_shards: int) -> list[ShardState]:
    return [reshard(iter(states), k, num_shards) for k in range(num_shards)]


def assert_same_rows(old: list[ShardState], new: list[ShardState]) -> None:
    for spec in SPECS:
        if spec.kind == "sparse":
            before, after = rows_by_key(old, spec.name), rows_by_key(new, spec.name)
            assert before.keys() == after.keys() and before, spec.name
            for key, row in before.items():
                assert after[key].keys() == row.keys()
                for name, value in row.items():
                    assert torch.equal(after[key][name], value), (spec.name, key, name)
        else:
            before, after = global_rows(old, spec.name), global_rows(new, spec.name)
            assert before.keys() == after.keys() == {"value", *(f"state.{s}" for s in
                                                              spec.optimizer.build().slots)}
            for name, value in before.items():
                assert torch.equal(after[name], value), (spec.name, name)


def table_of(state: ShardState, name: str) -> dict[str, torch.Tensor]:
    return next(t for t in state.tables if t.name == name).tensors


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (1, 4), (4, 1)])
def test_every_row_and_its_optimizer_state_lands_on_its_new_shard(old: int, new: int) -> None:
    before = trained(old)
    after = resharded(before, new)
    assert [(s.shard, s.num_shards, s.checkpoint_id) for s in after] == [
        (k, new, "clock-10") for k in range(new)]
    assert_same_rows(before, after)
    for state in after:
        for spec in SPECS:
            tensors = table_of(state, spec.name)
            if spec.kind == "sparse":  # each key where the new count routes it
                keys = tensors["keys"].numpy()
                assert (shard_of_keys(keys, new) == state.shard).all()
            else:
                placement = dense_placement(spec.name, spec.shape, spec.itemsize,
                                            new)[state.shard]
                assert tuple(tensors["value"].shape) == DenseTable.block_shape_for(spec,
                                                                                   placement)


def test_a_dense_block_takes_the_largest_step_of_the_blocks_it_takes_rows_from() -> None:
    before = trained(2)
    table_of(before[1], "w")["step"].fill_(9)  # rows 500.. of 1001 stepped more
    table_of(before[0], "w")["written"].fill_(False)
    after = resharded(before, 3)
    w = [table_of(s, "w") for s in after]
    assert [int(t["step"]) for t in w] == [3, 9, 9]  # rows 0-332, 333-666, 667-1000
    assert [bool(t["written"]) for t in w] == [False, True, True]
    # A table too small to split lives on one shard; the others hold an empty block that was
    # never written or stepped.
    bias = [table_of(s, "bias") for s in after]
    assert sorted(t["value"].shape[0] for t in bias) == [0, 0, 8]
    assert sorted((int(t["step"]), bool(t["written"])) for t in bias) == [
        (0, False), (0, False), (3, True)]
    scale = [table_of(s, "scale")["value"] for s in after]
    assert sorted(tuple(v.shape) for v in scale) == [(), (0,), (0,)]


def needed(old: int, new: int) -> list[list[int]]:
    """The old shards each new shard reads (those holding its rows)."""
    return [shards_needed(old, k, new, [t.to_dict() for t in SPECS]) for k in range(new)]


def test_a_new_shard_reads_only_the_old_shards_that_hold_its_rows() -> None:
    # Key ranges: 2 -> 3 splits the middle shard's range over both old ones; 3 -> 2 takes
    # two each; 1 -> 3 reads the one. 4 -> 6: new shard 4's key range lies on old shards 2
    # and 3, and old shard 0 holds a small dense table (whole on one shard) that it now holds.
    assert needed(2, 3) == [[0], [0, 1], [1]]
    assert needed(3, 2) == [[0, 1], [1, 2]]
    assert needed(1, 3) == [[0], [0], [0]] and needed(2, 2) == [[0], [1]]
    assert needed(4, 6)[4] == [0, 2, 3]
    before = trained(2)
    with pytest.raises(ReshardError, match=r"shard\(s\) \[0\] were not given"):
        reshard(iter(before[1:]), 1, 3)
    # The shards it does not need are passed over: even a damaged one changes nothing.
    table_of(before[1], "emb")["value"] = torch.zeros(1)
    table_of(before[1], "w")["value"] = torch.zeros(1)
    alone, given_all = reshard(iter(before[:1]), 0, 3), reshard(iter(before), 0, 3)
    assert alone.meta == given_all.meta
    for table in given_all.tables:
        assert table.tensors.keys() == table_of(alone, table.name).keys()
        for name, tensor in table.tensors.items():
            assert torch.equal(tensor, table_of(alone, table.name)[name]), (table.name, name)


def test_whole_table_items_merge_sketches_by_sum_and_evicted_bits_by_or() -> None:
    before = trained(2)
    old = [table_of(s, "ids") for s in before]
    assert all(t["evicted_bits"].any() for t in old) and all(t["sketch"].any() for t in old)
    old[0]["sketch"][0, :4] = torch.tensor([250, 3, 0, 255], dtype=torch.uint8)
    old[1]["sketch"][0, :4] = torch.tensor([10, 4, 0, 255], dtype=torch.uint8)
    reads = needed(2, 3)
    assert [0, 1] in reads  # some new shard sums two sketches
    for state, read in zip(resharded(before, 3), reads, strict=True):
        new = table_of(state, "ids")
        total = sum(old[i]["sketch"].int() for i in read)
        bits = old[read[0]]["evicted_bits"].clone()
        for i in read[1:]:
            bits |= old[i]["evicted_bits"]
        assert new["sketch"].dtype == torch.uint8
        assert torch.equal(new["sketch"].int(), total.clamp(max=255))  # type: ignore[union-attr]
        if read == [0, 1]:
            assert new["sketch"][0, :4].tolist() == [255, 7, 0, 255]
        assert torch.equal(new["evicted_bits"], bits)


def test_meta_merges_clocks_ledger_and_positions_for_a_resumed_job() -> None:
    before = trained(3)
    for state, read in zip(resharded(before, 2), needed(3, 2), strict=True):
        meta, first, last = state.meta, min(read), max(read)
        assert len(read) >= 2
        assert state.clock == 10 + first  # the smallest, as the manifest's clock
        assert (meta["open_clock"], meta["clocks_closed"]) == (10 + first, 9 + first)
        # Each worker's largest clock; the live workers of every shard.
        assert meta["clocks"] == {str(w): 10 + w + last for w in range(3)}
        assert meta["live"] == [0, 1, 2]
        # Worker 0: its newest incarnation; the others as the shards read had them.
        assert meta["ledger"] == [[0, 5 + last, 0, [last + 1, 10 + last]],
                                  *([i + 1, 3, 0, [1]] for i in read)]
        assert meta["positions"] == {"0": "file-a:17", "1": "file-b:3"}
        assert meta["incarnation"] == 100 + last and meta["mode"] == "sync"
        assert meta["resharded_from"] == {"checkpoint": "clock-10", "num_shards": 3}


def test_one_incarnation_s_pushes_are_the_union_above_the_highest_floor() -> None:
    states = trained(2)
    states[0].meta["ledger"] = [[0, 5, 2, [2, 3, 8]]]
    states[1].meta["ledger"] = [[0, 5, 4, [4, 6]]]
    assert reshard(iter(states), 1, 3).meta["ledger"] == [[0, 5, 4, [4, 6, 8]]]


def test_the_same_count_returns_each_shard_s_own_state() -> None:
    before = trained(2)
    assert [reshard(iter(before), k, 2) is before[k] for k in range(2)] == [True, True]
    assert reshard(reversed(before), 1, 2) is before[1]


def test_there_and_back_gives_the_original_rows_and_steps() -> None:
    before = trained(2)
    again = resharded(resharded(before, 3), 2)
    assert_same_rows(before, again)
    for old, new in zip(before, again, strict=True):
        for spec in SPECS:
            if spec.kind == "dense":
                assert torch.equal(table_of(new, spec.name)["step"],
                                   table_of(old, spec.name)["step"])


def test_a_resharded_state_restores_into_real_shards_that_snapshot_it_back() -> None:
    before = trained(2)
    after = resharded(before, 3)
    snapshots = []
    for state, read in zip(after, needed(2, 3), strict=True):
        shard = Shard(ShardConfig(state.shard, 3, quorum=Quorum(3)))
        shard.restore(state)
        assert shard.clock_state().open_clock == 10 + min(read)
        assert shard.clock_state().clocks == {w: 10 + w + max(read) for w in range(3)}
        snapshots.append(materialized(shard.snapshot("again")))
    assert_same_rows(before, snapshots)


def test_each_old_shard_is_dropped_before_the_next_is_read() -> None:
    before = trained(3)
    values: list[weakref.ref[torch.Tensor]] = []

    def one_at_a_time() -> Iterator[ShardState]:
        """Fresh tensors for each old shard, as load_checkpoint reads them."""
        for k in range(3):
            assert all(v() is None for v in values), "an old shard outlived its turn"
            state = ShardState(**{**vars(before[k]), "tables": [
                TableState(t.name, t.spec, {n: v.clone() for n, v in t.tensors.items()})
                for t in before[k].tables]})
            values.append(weakref.ref(table_of(state, "emb")["value"]))
            yield state
            del state

    # Shard 1 of 2 takes part of old shard 1's rows and all of old shard 2's (key ranges).
    after = reshard(one_at_a_time(), 1, 2)
    assert len(values) == 3 and values[1]() is None
    assert len(table_of(after, "emb")["keys"]) > 0


def _damaged(how: str) -> list[ShardState]:
    states = trained(2)
    if how == "missing shard":
        return states[:1]
    if how == "shard twice":
        return [states[0], states[0], states[1]]
    if how == "another checkpoint":
        return [states[0], ShardState(**{**vars(states[1]), "checkpoint_id": "clock-11"})]
    if how == "another spec":
        w = states[1].tables[3]
        states[1].tables[3] = TableState(w.name, {**w.spec, "seed": 99}, w.tensors)
    elif how == "a block of another shape":
        table_of(states[1], "w")["value"] = torch.zeros(3, 17)
    elif how == "a sparse tensor too short":
        table_of(states[1], "emb")["step"] = table_of(states[1], "emb")["step"][:-1]
    elif how == "an unknown tensor":
        for state in states:
            table_of(state, "emb")["mystery"] = torch.zeros(1)
    elif how == "a table missing":
        states[1].tables.pop(0)
    elif how == "positions disagree":
        states[1].meta["positions"] = {"0": "file-a:18"}
    elif how == "an unknown item differs":
        states[0].meta["epoch"], states[1].meta["epoch"] = 1, 2
    return states


@pytest.mark.parametrize(("how", "message"), [
    ("missing shard", r"shard\(s\) \[1\] were not given"),
    ("shard twice", "is given twice"),
    ("another checkpoint", "is not of checkpoint 'clock-10'"),
    ("another spec", "table 'w' has another spec"),
    ("a block of another shape", r"'value' has shape \[3, 17\], but rows \[500, 1001\)"),
    ("a sparse tensor too short", "tensor 'step' has shape"),
    ("an unknown tensor", "tensor 'mystery', which this build does not know"),
    ("a table missing", r"table 'emb' is missing from shard\(s\) \[1\]"),
    ("positions disagree", "records position 'file-a:18' for worker 0"),
    ("an unknown item differs", r"differs from the shards before it in \['epoch'\]"),
])
def test_states_that_are_not_one_checkpoint_are_refused_naming_why(how: str,
                                                                    message: str) -> None:
    states = _damaged(how)
    with pytest.raises(ReshardError, match=message):
        reshard(iter(states), 1, 3)  # its rows are on both old shards


@pytest.mark.parametrize(("shard", "num_shards"), [(3, 3), (-1, 2), (0, 0)])
def test_a_target_outside_the_job_is_refused(shard: int, num_shards: int) -> None:
    with pytest.raises(ReshardError, match="need 0 <= shard < num_shards"):
        reshard(iter(trained(1)), shard, num_shards)


@pytest.mark.parametrize(("shard", "num_shards"), [(0, 1), (0, 3), (1, 3), (2, 3), (4, 5)])
def test_the_key_filter_of_a_shard_selects_the_keys_that_route_to_it(
        shard: int, num_shards: int) -> None:
    keys = np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 10_000, dtype=np.int64)
    keep = routes_here(shard, num_shards)(keys)
    assert keep.dtype == np.bool_ and keep.shape == keys.shape
    assert np.array_equal(keep, shard_of_keys(keys, num_shards) == shard)
    assert keep.any() and (num_shards == 1 or not keep.all())


@pytest.mark.parametrize(("shard", "num_shards"), [(-1, 2), (2, 2), (0, 0)])
def test_the_key_filter_of_a_shard_that_cannot_be_is_refused(shard: int, num_shards: int) -> None:
    with pytest.raises(ReshardError, match="need 0 <= shard < num_shards"):
        routes_here(shard, num_shards)


def test_old_shards_read_in_place_are_joined_without_a_copy() -> None:
    old = trained(2)
    expected = reshard(trained(2), 1, 3)
    keep = routes_here(1, 3)
    sparse = [{t.name: int(keep(t.tensors["keys"].numpy()).sum())
               for t in s.tables if "keys" in t.tensors} for s in old]
    layout = JoinedRows(sparse)
    placed: list[ShardState] = []
    first: dict[tuple[str, str], int] = {}
    for i, state in enumerate(old):
        into = layout.into(i)
        assert into is not None
        tables = []
        for table in state.tables:
            if "keys" not in table.tensors:
                tables.append(table)
                continue
            mask = torch.from_numpy(keep(table.tensors["keys"].numpy()))
            tensors = {}
            for name, tensor in table.tensors.items():
                if name in ("sketch", "evicted_bits"):
                    tensors[name] = tensor
                    continue
                kept = tensor[mask]
                target = into(table.name, name, kept.dtype, tuple(kept.shape))
                assert target is not None and target.shape == kept.shape
                tensors[name] = target.copy_(kept)  # what read_shard(into=...) does
                first.setdefault((table.name, name), target.data_ptr())
            tables.append(TableState(table.name, table.spec, tensors))
        placed.append(dataclasses.replace(state, tables=tables))
    got = reshard(placed, 1, 3)
    for mine, theirs in zip(got.tables, expected.tables, strict=True):
        assert mine.tensors.keys() == theirs.tensors.keys()
        for name, tensor in mine.tensors.items():
            assert torch.equal(tensor, theirs.tensors[name]), (mine.name, name)
            if (mine.name, name) in first:  # the tensor the parts were read into: no copy
                assert tensor.data_ptr() == first[(mine.name, name)], (mine.name, name)


def test_a_layout_places_nothing_it_did_not_plan() -> None:
    layout = JoinedRows([{"emb": 3}, None, {"emb": 2, "ids": 1}])
    assert layout.into(1) is None  # not read in place (a delta, say)
    first, third = layout.into(0), layout.into(2)
    assert first is not None and third is not None
    head = first("emb", "value", torch.float32, (3, 4))
    tail = third("emb", "value", torch.float32, (2, 4))
    assert head is not None and tail is not None
    assert tail.data_ptr() == head.data_ptr() + 3 * 4 * 4  # right after shard 0's rows
    assert first("emb", "value", torch.float32, (4, 4)) is None  # not the rows planned
    assert third("emb", "value", torch.float64, (2, 4)) is None  # not the tensor's dtype
    assert first("other", "value", torch.float32, (3, 4)) is None
