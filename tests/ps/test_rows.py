"""ps.rows agrees with torch's index_select / index_copy_ / index_add_, and Adagrad and Adam
with the ops of torch.optim's, bit for bit, and its NaN/Inf scan with torch.isfinite."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps import rows
from ps._rows import adagrad, add, first_nonfinite, gather, scatter

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
                 lambda: adagrad(table.numpy(), torch.ones(100, 4).numpy(), 4, ids.numpy(),
                                 src.numpy(), 0.1, 1e-10, 0.0, False),
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
    rows.adagrad_(table, torch.zeros(10, 4), none, torch.empty(0, 4), 0.1, 1e-10, 0.0)
    assert torch.equal(table, before)


def _adagrad_rows(param: torch.Tensor, state_sum: torch.Tensor, ids: torch.Tensor,
                  grad: torch.Tensor, lr: float, eps: float, weight_decay: float) -> None:
    """torch.optim.Adagrad's single-tensor step (lr_decay 0) on rows `ids`, op for op: the
    fused multiply-adds by torch (add with alpha, addcmul_), the rest in numpy, whose
    square root is correctly rounded (torch's CPU sqrt is not: about one element in five
    is one unit in the last place off on this machine's AVX-512 kernels)."""
    g = grad.add(param.index_select(0, ids), alpha=weight_decay) if weight_decay else grad
    acc = state_sum.index_select(0, ids).addcmul_(g, g, value=1)
    state_sum.index_copy_(0, ids, acc)
    a, gn = acc.numpy(), g.numpy()
    dtype = a.dtype.type
    update = (gn * dtype(-lr)) / (np.sqrt(a) + dtype(eps))
    param.index_copy_(0, ids, torch.from_numpy(param.index_select(0, ids).numpy() + update))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("dim", [64, 3])
def test_adagrad_matches_its_ops_rounded_one_at_a_time(dtype: torch.dtype, weight_decay: float,
                                                     dim: int) -> None:
    param = _table(dtype, (3000, dim))
    state_sum = _table(dtype, (3000, dim), seed=4).abs()
    ours_p, ours_s, theirs_p, theirs_s = param.clone(), state_sum.clone(), param, state_sum
    for step in range(3):
        ids = _ids(3000, 1000, seed=10 + step)
        grad = _table(dtype, (1000, dim), seed=20 + step)
        before = grad.clone()
        rows.adagrad_(ours_p, ours_s, ids, grad, 0.05, 1e-10, weight_decay)
        _adagrad_rows(theirs_p, theirs_s, ids, grad, 0.05, 1e-10, weight_decay)
        assert torch.equal(grad, before)
    assert torch.equal(ours_s, theirs_s)
    assert torch.equal(ours_p, theirs_p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("beta1", "weight_decay"), [(0.9, 0.0), (0.9, 0.05), (0.3, 0.0)])
def test_adam_matches_its_ops_rounded_one_at_a_time(dtype: torch.dtype, beta1: float,
                                                    weight_decay: float) -> None:
    """torch.optim.Adam's single-tensor step, op for op: the fused ones by torch (add with
    alpha, lerp in both its forms, mul_ then addcmul_), the rest in numpy (beta1 0.3 puts
    lerp's weight over one half)."""
    beta2, lr, eps = 0.99, 0.01, 1e-8
    param = _table(dtype, (333, 7)).reshape(-1)
    ours = [param.clone(), torch.zeros_like(param), torch.zeros_like(param)]
    theirs = [param.clone(), torch.zeros_like(param), torch.zeros_like(param)]
    for step in range(1, 5):
        grad = _table(dtype, (333 * 7,), seed=30 + step)
        before = grad.clone()
        step_size = lr / (1 - beta1**step)
        root = (1 - beta2**step) ** 0.5
        rows.adam_(*ours, grad, beta1, beta2, step_size, root, eps, weight_decay)
        p, m, v = theirs
        g = grad.add(p, alpha=weight_decay) if weight_decay else grad
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t = p.numpy().dtype.type
        p.copy_(torch.from_numpy(
            p.numpy() + (t(-step_size) * m.numpy()) / (np.sqrt(v.numpy()) / t(root) + t(eps))))
        assert torch.equal(grad, before)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_adam_refuses_what_its_loop_cannot_take() -> None:
    block, grad = torch.zeros(12), torch.ones(12)
    with pytest.raises(ValueError, match="adam_ takes contiguous CPU float32"):
        rows.adam_(block.half(), block.half(), block.half(), grad.half(), 0.9, 0.99, 0.1, 1.0,
                   1e-8, 0.0)
    with pytest.raises(ValueError, match="adam_ takes contiguous CPU float32"):
        rows.adam_(block, block.clone(), block.clone(), torch.ones(24)[::2], 0.9, 0.99, 0.1,
                   1.0, 1e-8, 0.0)
    with pytest.raises(ValueError, match="grad is 40 bytes; param is 48"):
        rows.adam_(block, block.clone(), block.clone(), torch.ones(10), 0.9, 0.99, 0.1, 1.0,
                   1e-8, 0.0)
    assert torch.equal(block, torch.zeros(12))


def test_adagrad_refuses_what_its_loop_cannot_take() -> None:
    param, state_sum, ids = torch.zeros(10, 4), torch.zeros(10, 4), torch.tensor([1, 2])
    grad = torch.ones(2, 4)
    with pytest.raises(ValueError, match="adagrad_ takes CPU float32 or float64"):
        rows.adagrad_(param.half(), state_sum.half(), ids, grad.half(), 0.1, 1e-10, 0.0)
    with pytest.raises(ValueError, match="state_sum is 120 bytes, the table 160"):
        rows.adagrad_(param, torch.zeros(10, 3), ids, grad, 0.1, 1e-10, 0.0)
    with pytest.raises(ValueError, match="grad is 48 bytes; 2 rows of 16 bytes need 32"):
        rows.adagrad_(param, state_sum, ids, torch.zeros(3, 4), 0.1, 1e-10, 0.0)
    with pytest.raises((ValueError, BufferError), match="contiguous"):
        rows.adagrad_(torch.zeros(4, 10).t(), torch.zeros(4, 10).t(), ids, grad, 0.1, 1e-10,
                      0.0)
    assert torch.equal(param, torch.zeros(10, 4))


FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _torch_first_bad(values: torch.Tensor) -> int:
    bad = torch.nonzero(~torch.isfinite(values.reshape(-1)))
    return int(bad[0]) if len(bad) else -1


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_scan_finds_the_first_non_finite_element_as_torch_does(dtype: torch.dtype) -> None:
    n = 3 * 4096 + 17  # several of the scan's blocks and a ragged end
    clean = _table(dtype, (n,))
    clean[::5] = torch.finfo(dtype).max  # the largest finite values are not flagged
    clean[1::7] = torch.finfo(dtype).tiny / 2  # nor subnormals
    clean[2::11] = -0.0
    assert rows.first_nonfinite(clean) == -1 == _torch_first_bad(clean)
    for where in (0, 1, 4095, 4096, 8191, n - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            values = clean.clone()
            values[where] = bad
            values[min(n - 1, where + 3000)] = float("nan")  # a later one does not count
            assert rows.first_nonfinite(values) == where == _torch_first_bad(values)


@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_the_scan_reads_elements_behind_a_header_unaligned(offset: int) -> None:
    values = torch.ones(1000)
    values[777] = float("inf")
    raw = bytearray(offset) + bytearray(values.numpy().tobytes())
    assert first_nonfinite(memoryview(raw)[offset:], 4, 0x7F800000) == 777


def test_the_scan_takes_strided_integer_and_large_tensors() -> None:
    strided = torch.ones(50, 40).t()  # not contiguous: copied first
    strided[3, 7] = float("nan")
    assert rows.first_nonfinite(strided) == _torch_first_bad(strided) == 3 * 50 + 7
    assert rows.first_nonfinite(torch.arange(10)) == -1  # integers are always finite
    big = torch.zeros(5 << 20 >> 2)  # past the size where the scan lets go of the GIL
    big[-1] = float("-inf")
    assert rows.first_nonfinite(big) == big.numel() - 1
    assert rows.first_nonfinite(torch.empty(0)) == -1


def test_the_scan_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="width must be 2, 4 or 8 bytes, got 3"):
        first_nonfinite(bytes(12), 3, 0x7F)
    with pytest.raises(ValueError, match="is not an exponent mask of 4-byte floats"):
        first_nonfinite(bytes(8), 4, 0xFF800000)  # takes in the sign bit
    with pytest.raises(ValueError, match="is not an exponent mask of 2-byte floats"):
        first_nonfinite(bytes(8), 2, 0x7C01)  # not one run of bits
    with pytest.raises(ValueError, match="10 bytes is not a whole number of 4-byte elements"):
        first_nonfinite(bytes(10), 4, 0x7F800000)

