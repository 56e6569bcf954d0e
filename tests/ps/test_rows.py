"""ps.rows agrees with torch's index_select / index_copy_ / index_add_, bit for bit."""

from __future__ import annotations

import pytest
import torch

from ps import rows
from ps._rows import add, gather, scatter

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


@pytest.fixture(autouse=True)
def every_size_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C loops for any row count, so small tables exercise them (one test puts the
    thresholds back)."""
    monkeypatch.setattr(rows, "_MIN_ROWS", 0)
    monkeypatch.setattr(rows, "_MIN_GATHER_ROWS", 0)


def _table(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _ids(capacity: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randperm(capacity, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1000, 64), (1000, 3), (1000,)])
def test_gather_and_scatter_match_torch(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    table = _table(dtype, shape)
    ids = _ids(shape[0], 300)
    assert torch.equal(rows.gather(table, ids), table.index_select(0, ids))
    out = torch.empty((300, *shape[1:]), dtype=dtype)
    assert rows.gather(table, ids, out) is out and torch.equal(out, table.index_select(0, ids))
    src = _table(dtype, (300, *shape[1:]), seed=2)
    ours, theirs = table.clone(), table.clone()
    rows.scatter_(ours, ids, src)
    theirs.index_copy_(0, ids, src)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [1.0, -0.01, 3.5])
def test_add_matches_scaling_then_index_add(dtype: torch.dtype, alpha: float) -> None:
    table = _table(dtype, (5000, 64))
    ids = _ids(5000, 2000)
    src = _table(dtype, (2000, 64), seed=3)
    ours, theirs = table.clone(), table.clone()
    rows.add_(ours, ids, src, alpha)
    theirs.index_add_(0, ids, src * alpha)
    assert torch.equal(ours, theirs)


def test_the_c_loops_run_where_they_apply_and_torch_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Strided tensors, other dtypes and few rows take torch's ops; the C loops the rest."""
    calls: list[str] = []
    for name in ("_gather", "_scatter", "_add"):
        real = getattr(rows, name)
        monkeypatch.setattr(rows, name, lambda *a, real=real, name=name: (
            calls.append(name), real(*a))[1])
    table = _table(torch.float32, (100, 8))
    ids = _ids(100, 10)
    rows.gather(table, ids)
    rows.scatter_(table, ids, torch.ones(10, 8))
    rows.add_(table, ids, torch.ones(10, 8), 2.0)
    assert calls == ["_gather", "_scatter", "_add"]
    calls.clear()
    strided = torch.ones(100, 16)[:, ::2]
    rows.gather(strided, ids)
    rows.scatter_(strided, ids, torch.ones(10, 8))
    rows.add_(table.half(), ids, torch.ones(10, 8).half())
    rows.gather(table, ids.to(torch.int32))
    assert calls == []
    monkeypatch.setattr(rows, "_MIN_ROWS", 11)
    monkeypatch.setattr(rows, "_MIN_GATHER_ROWS", 11)
    rows.gather(table, ids)
    rows.scatter_(table, ids, torch.ones(10, 8))
    rows.add_(table, ids, torch.ones(10, 8), 2.0)
    assert calls == []


@pytest.mark.parametrize("bad", [-1, 100, 2**40])
def test_an_outside_row_is_refused_before_anything_is_written(bad: int) -> None:
    table = torch.zeros(100, 4)
    ids = torch.tensor([3, 7, bad, 9])
    src = torch.ones(4, 4)
    for call in (lambda: scatter(table.numpy(), 16, ids.numpy(), src.numpy()),
                 lambda: add(table.numpy(), 4, ids.numpy(), src.numpy(), 1.0, False),
                 lambda: gather(table.numpy(), 16, ids.numpy(), src.numpy())):
        with pytest.raises(ValueError, match=f"row {bad} at position 2 is outside the table's "
                                             "100 rows"):
            call()
    assert torch.equal(table, torch.zeros(100, 4))


def test_sizes_that_disagree_are_refused() -> None:
    table, ids = torch.zeros(10, 4), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="src is 48 bytes; 2 rows of 16 bytes need 32"):
        scatter(table.numpy(), 16, ids.numpy(), torch.zeros(3, 4).numpy())
    with pytest.raises(ValueError, match="not a whole number of 12-byte rows"):
        scatter(table.numpy(), 12, ids.numpy(), torch.zeros(2, 3).numpy())
    with pytest.raises(ValueError, match="not int64 row ids"):
        gather(table.numpy(), 16, ids.to(torch.int32).numpy()[:1], torch.zeros(1, 4).numpy())
    with pytest.raises(BufferError):  # a read-only table cannot be written
        scatter(bytes(160), 16, ids.numpy(), torch.zeros(2, 4).numpy())


def test_no_rows_is_a_no_op() -> None:
    table = _table(torch.float32, (10, 4))
    before = table.clone()
    none = torch.empty(0, dtype=torch.int64)
    assert rows.gather(table, none).shape == (0, 4)
    rows.scatter_(table, none, torch.empty(0, 4))
    rows.add_(table, none, torch.empty(0, 4), 2.0)
    assert torch.equal(table, before)
