"""Dense and sparse tables on their own (no shard, no gRPC): specs, reads, updates, refusals.

Every refused push is checked to leave the table byte for byte as it was: values, optimizer
state, steps, keys and counters.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest
import torch
from procs import run_in_threads

from protos import modes
from protos.partition import RowRange, shard_of_keys
from ps import tables as tables_module
from ps.errors import FailedPreconditionError, InvalidArgumentError
from ps.initializers import InitSpec, init_rows
from ps.row_policy import admitted_by_probability
from ps.tables import (
    INITIAL_SPARSE_ROWS,
    STAMP_CLOCK_MAX,
    DenseTable,
    OptimizerConfig,
    SparseTable,
    TableSpec,
    check_finite,
    check_same_spec,
    grown_capacity,
)

SGD_HALF = OptimizerConfig("sgd", (("lr", 0.5),))
ADAM = OptimizerConfig("adam", (("lr", 0.1),))


def dense_spec(**kw: Any) -> TableSpec:
    fields: dict[str, Any] = {
        "name": "w", "kind": "dense", "dtype": torch.float32, "shape": (6, 3),
        "init": InitSpec("uniform", -1.0, 1.0), "seed": 7, "optimizer": SGD_HALF,
    }
    return TableSpec(**{**fields, **kw})


def sparse_spec(**kw: Any) -> TableSpec:
    fields: dict[str, Any] = {
        "name": "emb", "kind": "sparse", "dtype": torch.float32, "dim": 4,
        "init": InitSpec("uniform", -1.0, 1.0), "seed": 7, "optimizer": SGD_HALF,
    }
    return TableSpec(**{**fields, **kw})


def keys(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def image(table: DenseTable | SparseTable) -> dict[str, object]:
    """Everything a table holds, as bytes: what a refused request must leave untouched."""
    out: dict[str, object] = {
        name: (t.dtype, tuple(t.shape), bytes(t.contiguous().untyped_storage()))
        for name, t in table.snapshot().items()
    }
    out["counters"] = table.counters()
    return out


def warm_sparse(spec: TableSpec | None = None, shard: int = 0, num_shards: int = 1
                ) -> SparseTable:
    """A sparse table with three rows and one applied update, so state and steps are set."""
    table = SparseTable(spec or sparse_spec(optimizer=ADAM), shard, num_shards)
    held = _owned(keys(3, -5, 2**62, *range(100, 140)), shard, num_shards)
    table.pull(held)
    table.apply(held, torch.full((len(held), table.spec.dim), 0.25, dtype=table.spec.dtype),
                assign=False)
    return table


def warm_dense(spec: TableSpec | None = None) -> DenseTable:
    table = DenseTable(spec or dense_spec(optimizer=ADAM), RowRange(0, 0, 6))
    table.apply([(0, torch.full((18,), 0.25))], assign=False)
    return table


def _owned(candidates: np.ndarray, shard: int, num_shards: int) -> np.ndarray:
    return candidates[shard_of_keys(candidates, num_shards) == shard]


# ---- specs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: dense_spec(name=""), "non-empty name"),
        (lambda: dense_spec(dtype=torch.int64), "int64 is not a floating type"),
        (lambda: dense_spec(shape=(4, -1)), r"shape \[4, -1\] has a negative dimension"),
        (lambda: sparse_spec(dim=0), "sparse dim must be >= 1, got 0"),
        (lambda: dense_spec(kind="ragged"), "kind must be 'dense' or 'sparse', got 'ragged'"),
        (lambda: dense_spec(optimizer=OptimizerConfig("lamb")), "unknown optimizer 'lamb'"),
        (lambda: dense_spec(optimizer=OptimizerConfig("sgd", (("momentum", 0.9),))),
         "no hyperparameter 'momentum'"),
    ],
)
def test_a_bad_spec_is_refused_at_declaration(make: Any, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        make()


@pytest.mark.parametrize(
    "spec",
    [
        dense_spec(),
        dense_spec(shape=(), dtype=torch.bfloat16, mode=modes.SYNC),
        sparse_spec(optimizer=ADAM, allow_non_finite=True, init=InitSpec("normal", 0.0, 2.0)),
        sparse_spec(dtype=torch.float16, mode=modes.parse("ssp:3"), seed=-4),
    ],
)
def test_a_spec_survives_its_dict_form(spec: TableSpec) -> None:
    assert TableSpec.from_dict(spec.to_dict()) == spec


def test_the_same_spec_may_be_declared_again() -> None:
    check_same_spec(sparse_spec(), sparse_spec())


@pytest.mark.parametrize(
    ("declared", "held_text", "declared_text"),
    [
        (dense_spec(dtype=torch.float64), "dtype=float32", "dtype=float64"),
        (dense_spec(shape=(6, 4)), "shape=[6, 3]", "shape=[6, 4]"),
        (dense_spec(init=InitSpec("zeros")), "init=uniform(-1,1)", "init=zeros(-0.05,0.05)"),
        (dense_spec(seed=8), "seed=7", "seed=8"),
        (dense_spec(optimizer=OptimizerConfig("sgd", (("lr", 0.25),))),
         "optimizer=sgd(lr=0.5)", "optimizer=sgd(lr=0.25)"),
        (dense_spec(optimizer=ADAM), "optimizer=sgd(lr=0.5)", "optimizer=adam(lr=0.1)"),
        (dense_spec(allow_non_finite=True), "allow_non_finite=False", "allow_non_finite=True"),
        (dense_spec(mode=modes.SYNC), "mode=job default", "mode=sync"),
        (sparse_spec(name="w"), "dense shape=[6, 3]", "sparse dim=4"),
    ],
)
def test_a_different_redeclaration_is_refused_showing_both(
    declared: TableSpec, held_text: str, declared_text: str
) -> None:
    with pytest.raises(FailedPreconditionError) as caught:
        check_same_spec(dense_spec(), declared)
    held_line, declared_line = str(caught.value).splitlines()[1:3]
    assert held_line.strip().startswith("held:") and held_text in held_line
    assert declared_line.strip().startswith("declared:") and declared_text in declared_line
    assert "table 'w' already exists with another spec" in str(caught.value)


# ---- dense tables ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "placement", "block_shape"),
    [
        ((6, 3), RowRange(0, 0, 6), (6, 3)),
        ((6, 3), RowRange(1, 2, 5), (3, 3)),
        ((6, 2, 2), RowRange(2, 4, 6), (2, 2, 2)),
        ((6, 3), RowRange(3, 6, 6), (0, 3)),  # an empty share of a split tensor
        ((5,), RowRange(0, 1, 4), (3,)),
        ((), RowRange(0, 0, 1), ()),
    ],
)
def test_a_dense_block_holds_its_rows_as_initialised_from_their_global_index(
    shape: tuple[int, ...], placement: RowRange, block_shape: tuple[int, ...]
) -> None:
    spec = dense_spec(shape=shape)
    table = DenseTable(spec, placement)
    assert table.block_shape == block_shape
    width = int(np.prod(shape[1:])) if shape else 1
    rows = np.arange(placement.start, placement.end, dtype=np.int64)
    expected = init_rows(rows, width, spec.init, spec.seed, spec.dtype).reshape(block_shape)
    assert torch.equal(table.read(), expected)
    # The same row reads the same on any placement, so resharding keeps values.
    whole = DenseTable(spec, RowRange(0, 0, shape[0] if shape else 1)).read()
    block_of_whole = whole[placement.start : placement.end] if shape else whole
    assert torch.equal(table.read(), block_of_whole)


def test_dense_sgd_update_and_assignment() -> None:
    table = DenseTable(dense_spec(), RowRange(1, 2, 5))
    before = table.read().clone()
    grad = torch.arange(9, dtype=torch.float32)
    table.apply([(0, grad)], assign=False)
    assert torch.equal(table.read(), before - 0.5 * grad.reshape(3, 3))
    table.apply([(0, grad[:4]), (4, grad[4:])], assign=True)
    assert torch.equal(table.read(), grad.reshape(3, 3))
    assert table.counters().pushes_applied == 2
    assert table.counters().rows_pushed == 6


@pytest.mark.parametrize("cuts", [[0], [0, 5], [0, 1, 2, 17], [0, 9, 10]])
def test_a_dense_push_in_slices_equals_the_whole_push(cuts: list[int]) -> None:
    grad = torch.linspace(-2, 2, 18)
    whole, sliced = warm_dense(), warm_dense()
    whole.apply([(0, grad)], assign=False)
    ends = [*cuts[1:], 18]
    sliced.apply([(a, grad[a:b]) for a, b in zip(cuts, ends, strict=True)], assign=False)
    assert image(sliced) == image(whole)
    assert int(sliced.step) == 2  # one step per push, however many slices


@pytest.mark.parametrize(
    ("dtype", "shape", "message"),
    [
        (torch.float64, (6, 3), "holds float32 values; the push carries float64"),
        (torch.bfloat16, (6, 3), "Cast the gradient to float32"),
        (torch.float32, (6, 4), r"block shape \[6, 3\]; the push carries shape \[6, 4\]"),
        (torch.float32, (18,), r"the push carries shape \[18\]"),
        (torch.float32, (3, 3), r"rows \[0, 6\)"),
        (torch.float32, (), r"the push carries shape \[\]"),
    ],
)
def test_a_refused_dense_push_changes_nothing(
    dtype: torch.dtype, shape: tuple[int, ...], message: str
) -> None:
    table = warm_dense()
    before = image(table)
    with pytest.raises(InvalidArgumentError, match=message):
        table.check_push(dtype, shape)
    assert image(table) == before


def test_a_dense_pull_counts_and_returns_the_live_block() -> None:
    table = DenseTable(dense_spec(), RowRange(1, 2, 5))
    block = table.read()
    table.apply([(0, torch.ones(9))], assign=True)
    assert torch.equal(block, torch.ones(3, 3))  # the block itself, not a copy
    counters = table.counters()
    assert (counters.pulls, counters.rows_pulled) == (1, 3)


# ---- assign if absent ------------------------------------------------------------------------


def test_an_assign_if_absent_writes_a_fresh_block_once() -> None:
    table = DenseTable(dense_spec(), RowRange(1, 2, 5))
    first, second = torch.arange(9.0), torch.full((9,), -3.0)
    assert table.apply([(0, first)], assign=True, if_absent=True) is True
    assert table.apply([(0, second)], assign=True, if_absent=True) is False
    assert torch.equal(table.read(), first.reshape(3, 3))
    counters = table.counters()
    assert (counters.pushes_applied, counters.pushes_kept) == (1, 1)
    # A plain assign still overwrites what is there.
    assert table.apply([(0, second)], assign=True) is True
    assert torch.equal(table.read(), second.reshape(3, 3))


@pytest.mark.parametrize("write", ["gradient", "assign"])
def test_a_gradient_or_a_plain_assign_counts_as_written(write: str) -> None:
    table = DenseTable(dense_spec(), RowRange(0, 0, 6))
    table.apply([(0, torch.ones(18))], assign=write == "assign")
    held = table.read().clone()
    assert table.apply([(0, torch.zeros(18))], assign=True, if_absent=True) is False
    assert torch.equal(table.read(), held)


def test_if_absent_without_assign_is_refused_and_changes_nothing() -> None:
    table = DenseTable(dense_spec(), RowRange(0, 0, 6))
    before = image(table)
    with pytest.raises(InvalidArgumentError, match="if_absent applies to an assign"):
        table.apply([(0, torch.ones(18))], assign=False, if_absent=True)
    assert image(table) == before


@pytest.mark.parametrize("hogwild", [False, True])
def test_of_racing_assigns_if_absent_exactly_one_writes(hogwild: bool) -> None:
    """Many threads offer different values at once (a large block keeps each copy long):
    one takes, every other is kept, and the block holds that one's values unmixed."""
    spec = dense_spec(shape=(2048, 512), optimizer=OptimizerConfig("sgd", (("lr", 1.0),)))
    table = DenseTable(spec, RowRange(0, 0, 2048), hogwild=hogwild)
    threads = 8
    barrier = threading.Barrier(threads)
    took: list[int] = []

    def offer(k: int) -> None:
        values = torch.full((2048 * 512,), float(k))
        barrier.wait(timeout=10)
        if table.apply([(0, values)], assign=True, if_absent=True):
            took.append(k)

    run_in_threads(offer, threads)
    assert len(took) == 1
    assert torch.equal(table.read(), torch.full((2048, 512), float(took[0])))
    assert table.counters().pushes_kept == threads - 1


@pytest.mark.parametrize("written", [False, True])
def test_a_snapshot_keeps_whether_the_block_was_written(written: bool) -> None:
    source = DenseTable(dense_spec(), RowRange(0, 0, 6))
    if written:
        source.apply([(0, torch.ones(18))], assign=False)
    target = DenseTable(dense_spec(), RowRange(0, 0, 6))
    target.apply([(0, torch.ones(18))], assign=True)  # replaced by the restore
    target.restore(source.snapshot())
    assert target.apply([(0, torch.full((18,), 5.0))], assign=True, if_absent=True) is not written


def test_a_snapshot_from_before_the_written_state_counts_as_written() -> None:
    old = DenseTable(dense_spec(), RowRange(0, 0, 6)).snapshot()  # never written...
    del old["written"]  # ...but saved by a build that did not record it
    target = DenseTable(dense_spec(), RowRange(0, 0, 6))
    target.restore(old)
    held = target.read().clone()
    assert target.apply([(0, torch.zeros(18))], assign=True, if_absent=True) is False
    assert torch.equal(target.read(), held)


# ---- finite checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([0.0, float("nan"), 1.0], r"non-finite value \(nan\) at flat element 1"),
        ([float("inf"), 0.0], r"\(inf\) at flat element 0"),
        ([1.0, 2.0, 3.0, float("-inf")], r"\(-inf\) at flat element 3"),
        ([float("nan"), float("inf")], r"\(nan\) at flat element 0"),  # the first one
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_non_finite_gradient_is_named_with_its_position(
    values: list[float], message: str, dtype: torch.dtype
) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as caught:
        check_finite("emb", torch.tensor(values, dtype=dtype))
    assert "table 'emb'" in str(caught.value) and "allow_non_finite" in str(caught.value)


@pytest.mark.parametrize(
    "values",
    [torch.zeros(0), torch.tensor([3.4e38, -3.4e38]), torch.full((5, 4), 65504.0).half()],
)
def test_finite_gradients_pass(values: torch.Tensor) -> None:
    check_finite("emb", values)


# ---- sparse tables ---------------------------------------------------------------------------


def test_sparse_rows_are_created_on_first_pull_from_seed_and_key() -> None:
    spec = sparse_spec()
    table = SparseTable(spec, 0, 1)
    asked = keys(9, -1, 2**63 - 1, -(2**63), 0)
    rows = table.pull(asked)
    got = rows.gather(0, len(rows))
    assert torch.equal(got, init_rows(asked, 4, spec.init, spec.seed, spec.dtype))
    assert table.stats().rows == 5
    # Asked again in another order, with a new key: old rows are found, not re-created.
    again = table.pull(keys(0, 11, 9))
    row_11 = init_rows(keys(11), 4, spec.init, spec.seed, spec.dtype)[0]
    assert torch.equal(again.gather(0, 3), torch.stack([got[4], row_11, got[0]]))
    assert table.stats().rows == 6
    counters = table.counters()
    assert (counters.pulls, counters.rows_pulled) == (2, 8)


def test_sparse_rows_gather_in_slices() -> None:
    table = SparseTable(sparse_spec(), 0, 1)
    rows = table.pull(keys(*range(10)))
    whole = rows.gather(0, 10)
    out = torch.empty(3, 4)
    assert rows.gather(4, 7, out) is out
    assert torch.equal(out, whole[4:7])
    assert (len(rows), rows.dim, rows.dtype) == (10, 4, torch.float32)


def test_sparse_rows_grow_past_the_first_allocation() -> None:
    spec = sparse_spec(dim=2)
    table = SparseTable(spec, 0, 1)
    first = keys(*range(0, 3000, 3))
    values = table.pull(first).gather(0, len(first)).clone()
    more = keys(*range(1, 5000, 2))  # forces storage to reallocate
    table.pull(more)
    assert torch.equal(table.pull(first).gather(0, len(first)), values)
    assert table.stats().rows == len(first) + len(more) - len(np.intersect1d(first, more))


def test_sparse_sgd_update_and_assignment() -> None:
    table = SparseTable(sparse_spec(), 0, 1)
    asked = keys(4, -8)
    before = table.pull(asked).gather(0, 2).clone()
    grad = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.0, 0.5, 8.0]])
    table.apply(asked, grad, assign=False)
    assert torch.equal(table.pull(asked).gather(0, 2), before - 0.5 * grad)
    # A push to a new key creates its row first, then updates it.
    table.apply(keys(77), torch.ones(1, 4), assign=False)
    init = init_rows(keys(77), 4, table.spec.init, table.spec.seed, torch.float32)
    assert torch.equal(table.pull(keys(77)).gather(0, 1), init - 0.5)
    table.apply(asked, grad, assign=True)
    assert torch.equal(table.pull(asked).gather(0, 2), grad)
    assert table.counters().pushes_applied == 3
    assert table.counters().rows_pushed == 5


def test_sparse_adam_keeps_state_and_steps_per_row() -> None:
    table = SparseTable(sparse_spec(optimizer=ADAM), 0, 1)
    table.apply(keys(1, 2), torch.ones(2, 4), assign=False)
    table.apply(keys(2, 3), torch.ones(2, 4), assign=False)
    snap = table.snapshot()
    order = snap["keys"].tolist()
    steps = dict(zip(order, snap["step"].tolist(), strict=True))
    assert steps == {1: 1, 2: 2, 3: 1}
    assert set(snap) == {"keys", "value", "step", "state.exp_avg", "state.exp_avg_sq"}


@pytest.mark.parametrize(
    ("dtype", "dim", "num_keys", "value_bytes", "message"),
    [
        (torch.float64, 4, 2, 64, "holds float32 rows; the push carries float64"),
        (torch.float16, 4, 2, 16, "Cast the gradient to float32"),
        (torch.float32, 5, 2, 40, "has dim 4; the push carries dim 5"),
        (torch.float32, 4, 2, 16, "carries 2 keys but 1 rows of values"),
        (torch.float32, 4, 2, 24, r"carries 2 keys but 1\.5 rows of values \(24 bytes"),
        (torch.float32, 4, 0, 16, "carries 0 keys but 1 rows"),
        (torch.float32, 4, 3, 0, "carries 3 keys but 0 rows"),
    ],
)
def test_a_refused_sparse_push_header_changes_nothing(
    dtype: torch.dtype, dim: int, num_keys: int, value_bytes: int, message: str
) -> None:
    table = warm_sparse()
    before = image(table)
    with pytest.raises(InvalidArgumentError, match=message):
        table.check_push(dtype, dim, num_keys, value_bytes)
    assert image(table) == before


def test_a_well_formed_sparse_push_header_passes() -> None:
    warm_sparse().check_push(torch.float32, 4, 3, 3 * 4 * 4)


@pytest.mark.parametrize(
    ("pushed", "message"),
    [
        (keys(3, 3), "key 3 appears more than once"),  # a known key, twice
        (keys(-5, 8, 2**62, -5), "key -5 appears more than once"),
        (keys(10, 11, 10), "key 10 appears more than once"),  # new keys: none may be created
        (keys(3, 12, 12), "key 12 appears more than once"),
        (np.array([3, 4], dtype=np.int32), "keys must have dtype int64, got <i4"),
        (keys(3, 4).reshape(1, 2), r"keys must be 1-D, got shape \(1, 2\)"),
    ],
)
def test_a_push_with_repeated_or_malformed_keys_changes_nothing(
    pushed: np.ndarray, message: str
) -> None:
    table = warm_sparse()
    before = image(table)
    with pytest.raises(InvalidArgumentError, match=message):
        table.check_unique(pushed)
    assert image(table) == before


@pytest.mark.parametrize(
    ("pushed", "expected"),
    [
        (keys(), []),
        (keys(3, -5), [0, 1]),
        (keys(2**62, 99, 3), [2, -1, 0]),  # -1: new, and not inserted by the check
    ],
)
def test_unique_keys_pass_with_their_rows(pushed: np.ndarray, expected: list[int]) -> None:
    table = warm_sparse()
    before = image(table)
    assert table.check_unique(pushed).tolist() == expected
    assert image(table) == before


def test_a_key_of_another_shard_is_refused_naming_both_shards() -> None:
    candidates = keys(*range(-50, 50))
    owners = shard_of_keys(candidates, 4)
    table = warm_sparse(shard=1, num_shards=4)
    stranger = int(candidates[owners == 3][0])
    before = image(table)
    pushed = np.concatenate([candidates[owners == 1][:3], keys(stranger)])
    with pytest.raises(InvalidArgumentError,
                       match=f"key {stranger} of table 'emb' belongs to shard 3, not to this "
                             "shard 1 of 4"):
        table.check_keys(pushed)
    assert image(table) == before
    table.check_keys(candidates[owners == 1])
    table.check_keys(keys())


def test_a_single_shard_takes_every_key() -> None:
    SparseTable(sparse_spec(), 0, 1).check_keys(keys(-(2**63), -1, 0, 2**63 - 1))


# ---- snapshots and stats ---------------------------------------------------------------------


def test_a_snapshot_restores_into_a_fresh_table() -> None:
    source = warm_sparse()
    target = SparseTable(source.spec, 0, 1)
    target.pull(keys(1000))  # replaced by the restore
    target.restore(source.snapshot())
    assert {k: v for k, v in image(target).items() if k != "counters"} == {
        k: v for k, v in image(source).items() if k != "counters"
    }
    dense = warm_dense()
    copy = DenseTable(dense.spec, dense.placement)
    copy.restore(dense.snapshot())
    assert {k: v for k, v in image(copy).items() if k != "counters"} == {
        k: v for k, v in image(dense).items() if k != "counters"
    }


def test_a_snapshot_with_repeated_keys_is_refused() -> None:
    table = warm_sparse()
    snap = table.snapshot()
    snap["keys"] = torch.tensor([3, 3, 7])
    with pytest.raises(FailedPreconditionError, match="repeats keys; it cannot be restored"):
        table.restore(snap)


@pytest.mark.parametrize(
    ("spec", "rows", "value_bytes", "state_bytes"),
    [
        (sparse_spec(), 3, 3 * 4 * 4, 0),
        (sparse_spec(optimizer=ADAM), 3, 3 * 16, 3 * 16 * 2 + 3 * 8),  # two slots, int64 steps
        (sparse_spec(optimizer=OptimizerConfig("adagrad"), dtype=torch.float64, dim=2),
         3, 3 * 16, 3 * 16),
    ],
)
def test_sparse_stats(spec: TableSpec, rows: int, value_bytes: int, state_bytes: int) -> None:
    table = SparseTable(spec, 0, 1)
    table.pull(keys(1, 2, 3))
    stats = table.stats()
    assert (stats.name, stats.kind, stats.rows) == ("emb", "sparse", rows)
    assert (stats.value_bytes, stats.state_bytes) == (value_bytes, state_bytes)
    assert stats.index_bytes > 0
    assert stats.optimizer == spec.optimizer.describe()
    assert stats.counters.pulls == 1


@pytest.mark.parametrize(
    ("spec", "placement", "value_bytes", "state_bytes"),
    [
        (dense_spec(), RowRange(1, 2, 5), 9 * 4, 0),
        (dense_spec(optimizer=ADAM, dtype=torch.float64), RowRange(0, 0, 6), 18 * 8, 2 * 18 * 8),
        (dense_spec(shape=()), RowRange(0, 0, 1), 4, 0),
    ],
)
def test_dense_stats(spec: TableSpec, placement: RowRange, value_bytes: int,
                     state_bytes: int) -> None:
    stats = DenseTable(spec, placement).stats()
    assert (stats.kind, stats.rows, stats.row_start, stats.row_end) == (
        "dense", placement.rows, placement.start, placement.end)
    assert (stats.value_bytes, stats.state_bytes, stats.index_bytes) == (
        value_bytes, state_bytes, 0)


def test_counters_add_up_and_are_copies() -> None:
    table = SparseTable(sparse_spec(), 0, 1)
    table.count(pushes_rejected=2, pushes_dropped=1)
    table.count(pushes_rejected=1)
    seen = table.counters()
    assert (seen.pushes_rejected, seen.pushes_dropped) == (3, 1)
    seen.pushes_rejected = 100
    assert table.counters().pushes_rejected == 3
    assert dataclasses.asdict(table.stats().counters)["pushes_rejected"] == 3


# ---- memory, as the server's budget counts it ---------------------------------------------------


def allocated(table: DenseTable | SparseTable) -> int:
    """The bytes the table's tensors and index really hold, read from their storages."""
    tensors = [table.value, *table.state.values()]
    if table.step is not None:
        tensors.append(table.step)
    held = sum(t.untyped_storage().nbytes() for t in tensors)
    if isinstance(table, SparseTable):
        held += table.index.nbytes + table._changed.nbytes  # and each slot's change mark
    return held


@pytest.mark.parametrize(
    ("spec", "placement"),
    [
        (dense_spec(), RowRange(1, 2, 5)),
        (dense_spec(optimizer=ADAM, dtype=torch.float64), RowRange(0, 0, 6)),
        (dense_spec(shape=()), RowRange(0, 0, 1)),
        (dense_spec(shape=()), RowRange(1, 0, 0)),  # a scalar's other shards
        (dense_spec(shape=(6, 0)), RowRange(0, 0, 6)),
        (dense_spec(optimizer=OptimizerConfig("adagrad"), dtype=torch.bfloat16,
                    shape=(5, 2, 3)), RowRange(0, 0, 5)),
    ],
)
def test_a_dense_table_holds_what_its_spec_says_before_it_exists(
    spec: TableSpec, placement: RowRange
) -> None:
    """A declare is checked against the budget from the spec alone; the table then made
    holds exactly that, as its stats report."""
    table = DenseTable(spec, placement)
    assert DenseTable.bytes_for(spec, placement) == table.memory_bytes()
    # A one-element block sits in an 8-byte allocation.
    assert table.memory_bytes() <= allocated(table) <= table.memory_bytes() + 8
    assert table.stats().memory_bytes == table.memory_bytes()


@pytest.mark.parametrize("optimizer", [SGD_HALF, OptimizerConfig("adagrad"), ADAM])
def test_a_sparse_tables_memory_is_what_its_storage_and_index_allocate(
    optimizer: OptimizerConfig,
) -> None:
    """Counted at reserved capacity, not rows in use: growing in doubling steps, it is
    always what the tensors and the index really hold, and never less than the rows."""
    spec = sparse_spec(optimizer=optimizer, dim=8)
    table = SparseTable(spec, 0, 1)
    assert table.memory_bytes() == SparseTable.bytes_for(spec) == allocated(table)
    seen = [table.memory_bytes()]
    for start in range(0, 20_000, 1500):
        table.pull(np.arange(start, start + 1500, dtype=np.int64))
        held = table.memory_bytes()
        assert held == allocated(table) == table.stats().memory_bytes
        assert held >= table.rows * table.bytes_per_row + table.index.nbytes
        seen.append(held)
    assert seen == sorted(seen) and len(set(seen)) > 3, seen


@pytest.mark.parametrize("new", [1, 500, 1000, 1024, 3000, 50_000])
def test_the_projected_bytes_are_what_creating_the_rows_takes(new: int) -> None:
    """bytes_at, for the rows after a request and the capacity storage grows to, equals
    what the table holds once the request's rows exist."""
    table = SparseTable(sparse_spec(optimizer=ADAM), 0, 1)
    table.pull(np.arange(700, dtype=np.int64))
    rows = table.rows + new
    capacity = max(rows, 2 * table.capacity) if rows > table.capacity else table.capacity
    projected = table.bytes_at(rows, capacity)
    table.pull(np.arange(10_000_000, 10_000_000 + new, dtype=np.int64))
    assert table.memory_bytes() == projected == allocated(table)


def test_rows_created_after_a_reserve_allocate_nothing_more() -> None:
    table = SparseTable(sparse_spec(), 0, 1)
    table.reserve(5000, 6000)
    assert (table.rows, table.capacity) == (0, 6000)
    held = table.memory_bytes()
    before = table.snapshot()
    table.pull(np.arange(2500, dtype=np.int64))
    table.apply(np.arange(2500, 5000, dtype=np.int64), torch.ones(2500, 4), assign=False)
    assert (table.rows, table.capacity, table.memory_bytes()) == (5000, 6000, held)
    assert before["keys"].numel() == 0
    table.reserve(10, 10)  # never shrinks
    assert (table.capacity, table.memory_bytes()) == (6000, held)


def test_reading_known_keys_never_grows_the_index() -> None:
    """A pull or push of rows that exist allocates nothing, however many keys it names: only
    new keys take index room (the budget counts nothing else)."""
    table = SparseTable(sparse_spec(), 0, 1)
    held = keys(*range(700))  # 0.7 of the index's 1024 slots: full
    table.pull(held)
    slots, memory = table.index.capacity, table.memory_bytes()
    table.pull(held)
    table.apply(held, torch.ones(len(held), 4), assign=False)
    table.pull(keys(*range(699, -1, -1), *range(700)))
    assert (table.index.capacity, table.memory_bytes()) == (slots, memory)


def test_a_pull_naming_new_keys_more_than_once_creates_each_row_once() -> None:
    table = SparseTable(sparse_spec(), 0, 1)
    pulled = table.pull(keys(9, 5, 9, 9, 5, 9)).gather(0, 6)
    assert table.rows == 2
    assert table.index.capacity == 8  # room for 2 keys, not for 6
    np.testing.assert_array_equal(table.index.keys_by_row(), [9, 5])
    for i, j in [(0, 2), (0, 3), (0, 5), (1, 4)]:
        assert torch.equal(pulled[i], pulled[j])
    torch.testing.assert_close(table.pull(keys(5, 9)).gather(0, 2), pulled[[1, 0]])


def test_absent_names_the_new_keys_and_changes_nothing() -> None:
    table = warm_sparse()
    before = image(table)
    np.testing.assert_array_equal(table.absent(keys(3, 77, -5, 77, 8)), [77, 77, 8])
    assert image(table) == before


# ---- admission and eviction -------------------------------------------------------------------


class FakeTime:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def initial(table: SparseTable, *ids: int) -> torch.Tensor:
    return init_rows(keys(*ids), table.spec.dim, table.spec.init, table.spec.seed,
                     table.spec.dtype)


def pulled(table: SparseTable, *ids: int) -> torch.Tensor:
    rows = table.pull(keys(*ids))
    return rows.gather(0, len(rows))


def held_keys(table: SparseTable) -> set[int]:
    return set(table.snapshot()["keys"].tolist())


def test_an_id_below_its_admission_count_has_no_row_and_reads_the_default() -> None:
    table = SparseTable(sparse_spec(admit="count:3", admit_default=0.5), 0, 1)
    for sight in (1, 2):
        assert torch.equal(pulled(table, 10, 11), torch.full((2, 4), 0.5))
        assert table.rows == 0, f"a row after {sight} sights"
    # A push is no sight (a training step pushes what it pulled): its gradient is dropped
    # while the id has no row.
    table.apply(keys(11), torch.ones(1, 4), assign=False)
    assert table.rows == 0
    # The third pull admits both: fresh initial rows, then gradients apply.
    assert torch.equal(pulled(table, 10, 11), initial(table, 10, 11))
    assert table.rows == 2 and held_keys(table) == {10, 11}
    table.apply(keys(11), torch.ones(1, 4), assign=False)
    assert torch.equal(pulled(table, 11), initial(table, 11) - 0.5)
    c = table.counters()
    assert (c.admitted, c.refused_by_admission) == (2, 5)
    # The sketch and the evicted-id bits, and a change mark for each of the two rows.
    assert table.stats().metadata_bytes == SparseTable.fixed_bytes(table.spec) + 2 * 1


def test_a_pull_mixing_admitted_and_refused_ids_keeps_key_order() -> None:
    table = SparseTable(sparse_spec(admit="count:2"), 0, 1)
    pulled(table, 1)
    out = torch.empty(3, 4)
    rows = table.pull(keys(2, 1, 2))
    rows.gather(0, 3, out)
    np.testing.assert_array_equal(out[[0, 2]].numpy(), np.zeros((2, 4)))
    assert torch.equal(out[1], initial(table, 1)[0])


def test_probability_admission_gives_rows_to_the_same_ids_every_time() -> None:
    ids = np.arange(2000, dtype=np.int64)
    expected = set(ids[admitted_by_probability(ids, 7, 0.2)].tolist())
    for _ in range(2):
        table = SparseTable(sparse_spec(admit="prob:0.2"), 0, 1)
        table.pull(ids)
        assert held_keys(table) == expected
    assert 300 < len(expected) < 500


def test_admission_counts_survive_a_snapshot() -> None:
    spec = sparse_spec(admit="count:3")
    table = SparseTable(spec, 0, 1)
    pulled(table, 5)
    pulled(table, 5)
    restored = SparseTable(spec, 0, 1)
    restored.restore(table.snapshot())
    assert restored.rows == 0
    pulled(restored, 5)
    assert held_keys(restored) == {5}
    # A snapshot from before admission existed (no sketch) starts the counts at zero.
    old = {k: v for k, v in table.snapshot().items() if k != "sketch"}
    fresh = SparseTable(spec, 0, 1)
    fresh.restore(old)
    pulled(fresh, 5)
    assert fresh.rows == 0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: sparse_spec(admit="count:0"), "table 'emb': admit 'count:0' is not a valid"),
        (lambda: sparse_spec(admit="prob:2"), "table 'emb': admit 'prob:2' is not a valid"),
        (lambda: sparse_spec(ttl_clocks=-2), "table 'emb': ttl_clocks must be >= 0 .* got -2"),
        (lambda: sparse_spec(ttl_s=-1.0), "table 'emb': ttl_s must be finite .* got -1.0"),
        (lambda: sparse_spec(max_rows=-3), "table 'emb': max_rows must be >= 0 .* got -3"),
        (lambda: sparse_spec(admit_default=float("nan")), "admit_default must be finite, got nan"),
        (lambda: dense_spec(max_rows=5), "table 'w' is dense: admission .* sparse tables only"),
    ],
)
def test_bad_admission_and_eviction_options_are_refused_naming_the_value(
    make: Any, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        make()


def test_admission_and_eviction_options_survive_the_dict_form() -> None:
    spec = sparse_spec(admit="prob:0.5", admit_default=-1.0, ttl_clocks=3, ttl_s=2.5,
                       max_rows=10)
    assert TableSpec.from_dict(spec.to_dict()) == spec
    assert TableSpec.from_dict(sparse_spec().to_dict()).admit == "always"
    assert "admit" not in sparse_spec().to_dict()  # stored as before the options existed


def test_ttl_in_clocks_evicts_the_rows_untouched_that_long() -> None:
    table = SparseTable(sparse_spec(ttl_clocks=2), 0, 1)
    table.observe_clock(1)
    pulled(table, 1, 2, 3)
    table.observe_clock(2)
    pulled(table, 2)
    table.observe_clock(3)
    assert table.evict() == 2  # 1 and 3, last touched at clock 1
    assert held_keys(table) == {2}
    assert table.counters().evicted == 2


def test_ttl_in_seconds_evicts_the_rows_untouched_that_long() -> None:
    now = FakeTime()
    table = SparseTable(sparse_spec(ttl_s=10.0), 0, 1, clock=now)
    pulled(table, 1, 2)
    now.now += 6
    pulled(table, 2, 3)
    now.now += 6
    pulled(table, 3)  # each exchange runs an eviction step: 1 goes
    assert held_keys(table) == {2, 3}
    now.now += 30
    assert table.evict() == 2 and table.rows == 0


def test_max_rows_evicts_the_least_recently_touched() -> None:
    now = FakeTime()
    table = SparseTable(sparse_spec(max_rows=3), 0, 1, clock=now)
    for key in (1, 2, 3):
        pulled(table, key)
        now.now += 1
    pulled(table, 1)  # 2 is now the oldest
    now.now += 1
    pulled(table, 4)
    assert held_keys(table) == {1, 3, 4}
    table.apply(keys(5, 6), torch.zeros(2, 4), assign=False)
    assert held_keys(table) == {4, 5, 6}
    assert table.counters().evicted == 3


def test_an_evicted_id_comes_back_with_its_initial_row_and_fresh_state() -> None:
    now = FakeTime()
    table = SparseTable(sparse_spec(optimizer=ADAM, max_rows=1), 0, 1, clock=now)
    table.apply(keys(7), torch.ones(1, 4), assign=False)
    trained = pulled(table, 7)
    assert not torch.equal(trained, initial(table, 7))
    now.now += 1
    pulled(table, 8)  # 7 is evicted; 8 takes its slot
    now.now += 1
    assert torch.equal(pulled(table, 7), initial(table, 7))
    table.apply(keys(7), torch.ones(1, 4), assign=False)
    assert torch.equal(pulled(table, 7), trained)  # first Adam step again: state was fresh
    c = table.counters()
    assert (c.admitted, c.evicted, c.readmitted) == (3, 2, 1)


def test_freed_slots_are_reused_so_storage_stops_growing() -> None:
    now = FakeTime()
    table = SparseTable(sparse_spec(optimizer=ADAM, max_rows=500), 0, 1, clock=now)
    for cycle in range(40):
        table.pull(np.arange(cycle * 200, cycle * 200 + 200, dtype=np.int64))
        now.now += 1
    assert table.rows == 500
    # Rows are evicted before new ones take slots: the slots in use, never 8000.
    assert table.index.row_limit == 500
    assert table.capacity == 1024 and table.counters().evicted == 7500


def slots_accounted_once(table: SparseTable) -> bool:
    """Every row slot below row_limit is held by one key or free, never both or twice."""
    _, rows = table.index.items()
    free = table._free[:table._free_len]
    return bool(np.array_equal(np.sort(np.concatenate([rows, free])),
                               np.arange(table.index.row_limit)))


@pytest.mark.parametrize("window", [(1 << 16, 1 << 18), (16, 64)])
def test_room_is_made_before_new_rows_so_storage_stays_at_max_rows(
        window: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    # A small window makes each request's room take many windows of the key index, with
    # deletions moving entries between them.
    monkeypatch.setattr(tables_module, "EVICT_SCAN_ROWS", window[0])
    monkeypatch.setattr(tables_module, "EVICT_SCAN_SLOTS", window[1])
    now = FakeTime()
    table = SparseTable(sparse_spec(max_rows=1500), 0, 1, clock=now)
    rng = np.random.default_rng(5)
    for step in range(60):
        held = np.fromiter(held_keys(table), dtype=np.int64)
        again = rng.choice(held, min(len(held), 100), replace=False) if len(held) else held
        new = np.arange(step * 300, step * 300 + 300, dtype=np.int64) + 10**6
        table.pull(np.concatenate([again, new]))
        now.now += 1
        assert table.rows <= 1500 and table.index.row_limit <= 1500
        assert set(again.tolist()) <= held_keys(table)  # the request's own rows stay
        assert slots_accounted_once(table)
    assert table.rows == 1500 and table.capacity == 1500
    assert table.counters().evicted == 60 * 300 - 1500


def test_making_room_never_evicts_a_row_the_request_uses() -> None:
    now = FakeTime()
    table = SparseTable(sparse_spec(max_rows=3), 0, 1, clock=now)
    table.apply(keys(1, 2), torch.tensor([[10.0], [20.0]]).repeat(1, 4), assign=True)
    now.now += 1
    table.apply(keys(3), torch.full((1, 4), 30.0), assign=True)
    now.now += 1
    # 1 and 2 are the least recently touched, but this request uses them: 3 goes.
    got = pulled(table, 2, 5, 1)
    assert got[:, 0].tolist() == [20.0, initial(table, 5)[0, 0].item(), 10.0]
    assert held_keys(table) == {1, 2, 5}
    assert table.capacity == 1024 and table.counters().evicted == 1


def test_a_request_needing_more_rows_than_max_rows_gets_them() -> None:
    now = FakeTime()
    table = SparseTable(sparse_spec(max_rows=2), 0, 1, clock=now)
    table.apply(keys(1, 2), torch.tensor([[10.0], [20.0]]).repeat(1, 4), assign=True)
    now.now += 1
    got = pulled(table, 1, 2, 3, 4)  # none of its four rows goes before it is read
    assert got[:2, 0].tolist() == [10.0, 20.0]
    assert torch.equal(got[2:], initial(table, 3, 4))
    assert table.rows == 2 and slots_accounted_once(table)  # its eviction step ran after


def test_a_clock_past_what_stamps_hold_is_refused_on_an_evicting_table() -> None:
    table = SparseTable(sparse_spec(ttl_clocks=5), 0, 1)
    table.observe_clock(STAMP_CLOCK_MAX)
    pulled(table, 1)
    with pytest.raises(InvalidArgumentError, match="clock 2147483648"):
        table.observe_clock(STAMP_CLOCK_MAX + 1)
    assert table.snapshot()["touched"].tolist() == [STAMP_CLOCK_MAX]
    SparseTable(sparse_spec(), 0, 1).observe_clock(2**62 - 1)  # no stamps: any clock


def test_a_checkpoint_with_int64_stamps_restores() -> None:
    """Checkpoints from before int32 stamps hold "touched" as int64."""
    table = SparseTable(sparse_spec(max_rows=10, ttl_clocks=100), 0, 1)
    table.observe_clock(40)
    pulled(table, 1, 2, 3)
    snap = table.snapshot()
    assert snap["touched"].dtype == torch.int32
    old = {**snap, "touched": snap["touched"].to(torch.int64)}
    restored = SparseTable(sparse_spec(max_rows=10, ttl_clocks=100), 0, 1)
    restored.restore(old)
    again = restored.snapshot()
    assert again["touched"].dtype == torch.int32 and again["touched"].tolist() == [40] * 3
    assert held_keys(restored) == {1, 2, 3}
    restored.observe_clock(139)
    restored.evict()
    assert restored.rows == 3  # stamped at clock 40: expire at 140
    restored.observe_clock(140)
    assert restored.evict() == 3
    past = {**snap, "touched": torch.full((3,), STAMP_CLOCK_MAX + 1, dtype=torch.int64)}
    with pytest.raises(FailedPreconditionError, match="past the 2147483647"):
        table.restore(past)
    assert held_keys(table) == {1, 2, 3}  # refused before anything changed


def test_a_snapshot_after_eviction_holds_only_the_rows_left() -> None:
    now = FakeTime()
    spec = sparse_spec(optimizer=ADAM, max_rows=3)
    table = SparseTable(spec, 0, 1, clock=now)
    for key in (1, 2, 3, 4, 5):
        table.apply(keys(key), torch.full((1, 4), float(key)), assign=False)
        now.now += 1
    snap = table.snapshot()
    assert sorted(snap["keys"].tolist()) == [3, 4, 5]
    restored = SparseTable(spec, 0, 1)
    restored.restore(snap)
    for key in (3, 4, 5):
        assert torch.equal(pulled(restored, key), pulled(table, key))
    # A restored table respects max_rows: the rows touched last stay.
    smaller = dataclasses.replace(spec, max_rows=2)
    snap["touched"] = torch.tensor([5, 9, 7])
    kept = SparseTable(smaller, 0, 1)
    kept.restore(snap)
    order = snap["keys"].tolist()
    assert held_keys(kept) == {order[1], order[2]}


@pytest.mark.parametrize("hogwild", [False, True])
def test_racing_pulls_and_pushes_on_an_evicting_table_see_only_their_own_rows(
        hogwild: bool) -> None:
    # Each thread owns its ids and assigns each row its own id: a pull that read a slot
    # given to another id in between would see another thread's value.
    table = SparseTable(sparse_spec(max_rows=300, ttl_clocks=3), 0, 1, hogwild)

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        for step in range(150):
            ids = np.unique(rng.integers(0, 200, size=40)) + 1000 * (k + 1)
            table.observe_clock(step)
            table.apply(ids, torch.from_numpy(ids).float()[:, None].repeat(1, 4), assign=True)
            got = pulled(table, *ids.tolist())
            written = got[:, 0] == torch.from_numpy(ids).float()
            # A row evicted between the push and the pull reads its initial values.
            fresh = (got == initial(table, *ids.tolist())).all(dim=1)
            assert bool((written | fresh).all()), (k, step)

    run_in_threads(work, 4)
    assert table.rows <= 300 + 4 * 40
    _, rows = table.index.items()
    assert len(np.unique(rows)) == len(rows) and (rows < table.capacity).all()


@pytest.mark.parametrize(
    ("rows", "capacity", "spare", "max_rows", "grown"),
    [
        (10, 1024, None, 0, 1024),  # fits: unchanged
        (1024, 1024, 0, 0, 1024),
        (1025, 1024, None, 0, 2048),  # doubles
        (5000, 1024, None, 0, 5000),  # at least what is asked
        (1025, 1024, 10_000, 0, 2048),  # room to spare: doubles as without a budget
        (1025, 1024, 1000, 0, 1525),  # near the budget: half the room left
        (1025, 1024, 0, 0, 1025),  # at the budget: exactly what is asked
        (1025, 1024, 1, 0, 1025),
        (1025, 1024, None, 1100, 1100),  # bounded: at most max_rows
        (1025, 1024, None, 8000, 2048),  # far from its bound: doubles
        (1500, 1024, None, 1100, 1500),  # past the bound by one request: what is asked
        (1025, 1024, 1000, 1100, 1100),
    ],
)
def test_grown_capacity(rows: int, capacity: int, spare: int | None, max_rows: int,
                        grown: int) -> None:
    assert grown_capacity(rows, capacity, spare, max_rows) == grown


# ---- change tracking (delta snapshots) ---------------------------------------------------------


def changed_keys(table: SparseTable) -> list[int]:
    changes = table.snapshot_changes()
    assert changes is not None
    return sorted(changes["keys"].tolist()) if changes else []


def test_a_new_or_restored_table_is_snapshot_whole_then_only_its_changes() -> None:
    table = SparseTable(sparse_spec(optimizer=ADAM), 0, 1)
    table.pull(keys(1, 2, 3))
    assert table.snapshot_changes() is None  # new since the last snapshot: whole
    snap = table.snapshot()
    assert table.snapshot_changes() == {}  # nothing changed since
    table.pull(keys(1, 2, 4))  # 4 is created; 1 and 2 are only read
    table.apply(keys(2, 5), torch.ones(2, 4), assign=False)  # 5 created by the push
    changes = table.snapshot_changes()
    assert changes is not None and sorted(changes["keys"].tolist()) == [2, 4, 5]
    rows = {int(k): i for i, k in enumerate(changes["keys"].tolist())}
    assert torch.equal(changes["value"][rows[2]], pulled(table, 2)[0])
    assert int(changes["step"][rows[2]]) == 1 and int(changes["step"][rows[4]]) == 0
    assert set(changes) == {"keys", "value", "state.exp_avg", "state.exp_avg_sq", "step"}
    assert table.snapshot_changes() == {}  # taken: unchanged again
    back = SparseTable(sparse_spec(optimizer=ADAM), 0, 1)
    back.snapshot()
    back.restore(snap)
    assert back.snapshot_changes() is None


def test_changes_survive_storage_growth() -> None:
    table = SparseTable(sparse_spec(), 0, 1)
    table.pull(keys(1, 2))
    table.snapshot()
    table.apply(keys(1), torch.ones(1, 4), assign=False)
    capacity = table.capacity
    table.pull(np.arange(10, 10 + 3 * capacity, dtype=np.int64))  # storage moves
    assert table.capacity > capacity
    assert changed_keys(table) == [1, *range(10, 10 + 3 * capacity)]


def test_under_eviction_a_delta_lists_the_keys_evicted_and_the_stamps_and_bits() -> None:
    now = FakeTime()
    table = SparseTable(sparse_spec(max_rows=2), 0, 1, clock=now)
    pulled(table, 1, 2)
    table.snapshot()
    now.now += 1
    table.observe_clock(3)
    pulled(table, 2)  # touched: its stamp changed
    now.now += 1
    pulled(table, 3)  # 1 is evicted for 3
    changes = table.snapshot_changes()
    assert changes is not None
    assert sorted(changes["keys"].tolist()) == [2, 3]
    assert changes["evicted_keys"].tolist() == [1]
    assert changes["touched"].tolist() == [3, 3]
    assert "evicted_bits" in changes
    assert table.snapshot_changes() == {}


def test_a_delta_lists_up_to_an_eighth_of_the_rows_evicted_and_past_that_is_whole() -> None:
    now = FakeTime()
    table = SparseTable(sparse_spec(max_rows=4), 0, 1, clock=now)
    listed = max(table.capacity, INITIAL_SPARSE_ROWS) // 8  # what the table may list

    def evict(start: int, count: int) -> None:
        for first in range(start, start + count, 4):  # 4 new rows evict 4 old ones
            pulled(table, *range(first, first + 4))
            now.now += 1

    evict(0, 4)
    table.snapshot()
    evict(4, listed)
    changes = table.snapshot_changes()
    assert changes is not None and len(changes["evicted_keys"]) == listed
    evict(4 + listed, listed + 4)  # past the share: the list goes, the table is whole
    assert table.snapshot_changes() is None
    table.snapshot()
    assert table.snapshot_changes() == {}


def test_a_dense_block_is_whole_in_a_delta_when_it_changed() -> None:
    table = DenseTable(dense_spec(), RowRange(0, 0, 6))
    assert table.snapshot_changes() is None  # new
    table.snapshot()
    assert table.snapshot_changes() == {}
    table.apply([(0, torch.full((18,), 0.25))], assign=False)
    assert table.snapshot_changes() is None
    table.snapshot()
    kept = table.apply([(0, torch.ones(18))], assign=True, if_absent=True)
    assert not kept and table.snapshot_changes() == {}  # an assign if absent that kept it


def test_a_delta_holds_the_admission_sketch_when_pulls_counted_sights() -> None:
    table = SparseTable(sparse_spec(admit="count:3"), 0, 1)
    table.snapshot()
    table.apply(keys(1), torch.ones(1, 4), assign=False)  # a push counts no sight
    assert table.snapshot_changes() == {}
    pulled(table, 1, 2)
    changes = table.snapshot_changes()
    assert changes is not None and list(changes["keys"]) == []
    assert int(changes["sketch"].max()) == 1


# ---- copy-on-write snapshots ----------------------------------------------------------------


def read_later(later: dict[str, Any], order: torch.Tensor | None = None) -> dict[str, bytes]:
    """Every row tensor of a copy-on-write snapshot, read as a writer reads it (in `order`,
    in pieces of 5 rows), as bytes in snapshot row order."""
    out = {}
    for name, rows in later.items():
        count = rows.shape[0]
        at = torch.arange(count) if order is None else order
        parts = [rows.gather(at[i : i + 5]) for i in range(0, count, 5)]
        got = torch.cat(parts) if parts else torch.empty((0, *rows.shape[1:]), dtype=rows.dtype)
        back = torch.empty_like(got)
        back[at] = got
        out[name] = bytes(back.contiguous().untyped_storage())
    return out


def eager_rows(snap: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: bytes(t.contiguous().untyped_storage()) for name, t in snap.items()
            if name in ("value", "step") or name.startswith("state.")}


def join_snapshot_copies() -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("snapshot-copy-"):
            thread.join(30)


def test_a_copy_on_write_snapshot_reads_its_rows_as_they_were(
        monkeypatch: pytest.MonkeyPatch) -> None:
    table = warm_sparse()
    expected = table.snapshot()
    copies: list[Any] = []
    monkeypatch.setattr(SparseTable, "_copy_snapshot", lambda self, cow: copies.append(cow))
    small, later = table.snapshot_later()  # its background copy held back
    assert set(later) == {"value", "state.exp_avg", "state.exp_avg_sq", "step"}
    assert torch.equal(small["keys"], expected["keys"]) and "value" not in small
    assert later["value"].shape == tuple(expected["value"].shape)
    changed = keys(3, 100, 101)
    table.apply(changed, torch.ones(3, 4), assign=False)  # value, state and steps change
    table.apply(keys(-5), torch.full((1, 4), 9.0), assign=True)
    table.pull(keys(777, 778))  # new rows after the snapshot: not in it
    table.apply(changed, torch.ones(3, 4), assign=False)  # a second change copies nothing
    (cow,) = copies
    assert int(cow.copied.sum()) == 4 and not cow.done  # each changed row, once
    assert read_later(later, torch.randperm(len(expected["keys"]))) == eager_rows(expected)
    monkeypatch.undo()
    table._copy_snapshot(cow)  # the rest, as its thread copies it
    assert cow.done and bool(cow.copied.all())
    table.apply(keys(102), torch.ones(1, 4), assign=False)
    assert read_later(later) == eager_rows(expected)


def test_a_copy_on_write_snapshot_lasts_while_its_rows_live_and_one_at_a_time() -> None:
    table = warm_sparse()
    _, first = table.snapshot_later()
    second_small, second = table.snapshot_later()  # while the first lives: copies
    assert second == {} and torch.equal(second_small["value"], first["value"].gather(
        torch.arange(first["value"].shape[0])))
    del first
    join_snapshot_copies()
    table.apply(keys(3), torch.ones(1, 4), assign=False)
    assert table._cow is not None and table._cow() is None  # gone with its rows
    _, third = table.snapshot_later()
    assert set(third) == {"value", "state.exp_avg", "state.exp_avg_sq", "step"}


def hold_back_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots taken from now on are copied only by the updates of their rows."""
    monkeypatch.setattr(SparseTable, "_copy_snapshot", lambda self, cow: None)


def test_a_copy_on_write_snapshot_keeps_rows_whose_slots_eviction_gave_to_new_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hold_back_copies(monkeypatch)
    now = FakeTime()
    table = SparseTable(sparse_spec(optimizer=ADAM, max_rows=3), 0, 1, clock=now)
    for key in (1, 2, 3):
        table.apply(keys(key), torch.full((1, 4), float(key)), assign=False)
        now.now += 1
    expected = table.snapshot()
    _, later = table.snapshot_later()
    for key in (4, 5, 6):  # each evicts the oldest row and takes its slot
        now.now += 1
        table.apply(keys(key), torch.full((1, 4), float(key)), assign=True)
    assert held_keys(table) == {4, 5, 6}
    assert read_later(later) == eager_rows(expected)


def test_a_copy_on_write_snapshot_survives_growth_and_a_restore(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hold_back_copies(monkeypatch)
    table = warm_sparse()
    expected = table.snapshot()
    _, later = table.snapshot_later()
    table.pull(np.arange(10_000, 10_000 + 3 * INITIAL_SPARSE_ROWS, dtype=np.int64))  # grows
    assert read_later(later) == eager_rows(expected)
    table.restore(warm_sparse(sparse_spec(optimizer=ADAM, seed=99)).snapshot())
    assert read_later(later) == eager_rows(expected)


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("hogwild", [False, True])
def test_a_copy_on_write_snapshot_read_beside_racing_updates_is_its_cut(
        hogwild: bool, background: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not background:
        hold_back_copies(monkeypatch)
    table = SparseTable(sparse_spec(optimizer=ADAM), 0, 1, hogwild)
    held = np.arange(2000, dtype=np.int64)
    table.apply(held, torch.ones(len(held), 4), assign=False)
    expected = table.snapshot()
    _, later = table.snapshot_later()
    got: dict[str, bytes] = {}

    def work(k: int) -> None:
        if k == 0:
            got.update(read_later(later, torch.randperm(len(held))))
            return
        rng = np.random.default_rng(k)
        for _ in range(200):
            ids = np.unique(rng.integers(0, 2500, size=64))
            table.apply(ids, torch.full((len(ids), 4), float(k)), assign=bool(k % 2))

    run_in_threads(work, 3)
    assert got == eager_rows(expected)
