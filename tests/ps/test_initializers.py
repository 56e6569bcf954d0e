"""ps.initializers: rows are a pure function of (seed, key, column), with sound statistics."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from ps.errors import InvalidArgumentError
from ps.initializers import InitSpec, init_rows

UNIFORM = InitSpec("uniform", -0.05, 0.05)
NORMAL = InitSpec("normal", 0.5, 2.0)
RANDOM_SPECS = [UNIFORM, NORMAL]
SPEC_IDS = ["uniform", "normal"]


def _keys(n: int, seed: int = 0) -> np.ndarray:
    # Spread over the whole int64 range, negatives included, as hashed feature ids are.
    return np.random.default_rng(seed).integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)


# A from-scratch Python rendering of the scheme the module docstring specifies. Checking the
# vectorised code against it guards the contract itself: a restarted or resharded run must
# rebuild the same rows.
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _reference_bits(seed: int, key: int, pair: int) -> tuple[int, int]:
    key_hash = _mix(_mix((key + _GOLDEN) & _MASK) ^ _mix((seed + _GOLDEN) & _MASK))
    z = _mix((key_hash + (pair + 1) * _GOLDEN) & _MASK)
    return (z & 0xFFFFFFFF) >> 8, (z >> 32) >> 8


def _reference_row(seed: int, key: int, dim: int, spec: InitSpec) -> list[float]:
    row: list[float] = []
    for pair in range((dim + 1) // 2):
        low, high = _reference_bits(seed, key, pair)
        if spec.kind == "uniform":
            scale = np.float32((spec.b - spec.a) * 2.0**-24)
            row += [float(np.float32(bits) * scale + np.float32(spec.a)) for bits in (low, high)]
        else:
            radius = spec.b * math.sqrt(-2.0 * math.log((low + 1) * 2.0**-24))
            angle = 2.0 * math.pi * high * 2.0**-24
            row += [spec.a + radius * math.cos(angle), spec.a + radius * math.sin(angle)]
    return row[:dim]


@pytest.mark.parametrize("spec", RANDOM_SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("seed", [0, 12345, -7, 2**70])
def test_rows_follow_the_documented_hash(spec: InitSpec, seed: int) -> None:
    keys = np.array([0, 1, -1, 2**40 + 3, -(2**63), 2**63 - 1], dtype=np.int64)
    got = init_rows(keys, 5, spec, seed)
    expected = torch.tensor([_reference_row(seed, int(k), 5, spec) for k in keys])
    # Uniform is exact float32 arithmetic; normal differs only by float32 log/sin/cos.
    atol = 0.0 if spec.kind == "uniform" else 1e-5
    torch.testing.assert_close(got, expected.float(), atol=atol, rtol=0)


def test_pinned_values() -> None:
    # Changing these changes the initial state of every table in every checkpointed run.
    keys = np.array([0, 1, -1, 2**40 + 3], dtype=np.int64)
    uniform = init_rows(keys, 3, InitSpec("uniform", -1.0, 1.0), 0)
    normal = init_rows(keys, 3, InitSpec("normal", 0.0, 1.0), 12345)
    torch.testing.assert_close(
        uniform,
        torch.tensor(
            [
                [-0.03815305233001709, 0.7666215896606445, 0.26347029209136963],
                [-0.6223323345184326, -0.9024769067764282, 0.6382777690887451],
                [-0.9189788103103638, -0.5662083625793457, -0.5975667238235474],
                [0.3293236494064331, 0.6898312568664551, -0.09563136100769043],
            ]
        ),
        atol=0.0,
        rtol=0,
    )
    torch.testing.assert_close(
        normal,
        torch.tensor(
            [
                [-1.658170223236084, -0.1007700115442276, -0.2864532768726349],
                [0.39462727308273315, -2.2245984077453613, 0.6028035283088684],
                [0.3082829415798187, 2.0244200229644775, 0.8186066746711731],
                [-1.3007011413574219, -0.9277532696723938, -1.6051167249679565],
            ]
        ),
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize("spec", RANDOM_SPECS, ids=SPEC_IDS)
def test_repeated_calls_agree(spec: InitSpec) -> None:
    keys = _keys(1000)
    assert torch.equal(init_rows(keys, 16, spec, 3), init_rows(keys, 16, spec, 3))


@pytest.mark.parametrize("spec", RANDOM_SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("split", [0, 1, 17, 999, 1000])
def test_any_split_of_the_keys_gives_the_same_rows(spec: InitSpec, split: int) -> None:
    keys = _keys(1000)
    whole = init_rows(keys, 12, spec, 9)
    parts = torch.cat([init_rows(keys[:split], 12, spec, 9), init_rows(keys[split:], 12, spec, 9)])
    assert torch.equal(whole, parts)


@pytest.mark.parametrize("spec", RANDOM_SPECS, ids=SPEC_IDS)
def test_row_order_and_neighbours_do_not_matter(spec: InitSpec) -> None:
    keys = _keys(500)
    order = np.random.default_rng(1).permutation(len(keys))
    whole = init_rows(keys, 6, spec, 4)
    assert torch.equal(init_rows(keys[order], 6, spec, 4), whole[torch.from_numpy(order)])
    # Duplicates (two shards, or a retried batch) get identical rows.
    twice = init_rows(np.concatenate([keys[:10], keys[:10]]), 6, spec, 4)
    assert torch.equal(twice[:10], twice[10:])


@pytest.mark.parametrize("spec", RANDOM_SPECS, ids=SPEC_IDS)
def test_columns_do_not_depend_on_dim(spec: InitSpec) -> None:
    keys = _keys(300)
    wide = init_rows(keys, 10, spec, 5)
    for dim in (1, 2, 7):
        narrow = init_rows(keys, dim, spec, 5)
        assert narrow.is_contiguous()
        assert torch.equal(narrow, wide[:, :dim])


def test_key_dtype_does_not_matter() -> None:
    keys = np.array([-3, -1, 0, 5, 2**31 - 1], dtype=np.int64)
    expected = init_rows(keys, 4, UNIFORM, 1)
    for dtype in (np.int32, np.uint64):
        assert torch.equal(init_rows(keys.astype(dtype), 4, UNIFORM, 1), expected), dtype
    small = np.array([-3, 0, 5], dtype=np.int8)
    assert torch.equal(init_rows(small, 4, UNIFORM, 1), expected[[0, 2, 3]])


@pytest.mark.parametrize("spec", RANDOM_SPECS, ids=SPEC_IDS)
def test_different_seeds_and_keys_give_different_rows(spec: InitSpec) -> None:
    keys = _keys(200)
    by_seed = [init_rows(keys, 8, spec, seed) for seed in (0, 1, 2**32)]
    for i in range(len(by_seed)):
        for j in range(i + 1, len(by_seed)):
            # Independent draws: essentially no element coincides.
            assert (by_seed[i] == by_seed[j]).float().mean().item() < 0.01
    rows = by_seed[0]
    assert len({tuple(r) for r in rows.tolist()}) == len(keys)


def test_uniform_statistics_and_range() -> None:
    low, high = -0.05, 0.05
    values = init_rows(np.arange(15_625, dtype=np.int64), 64, UNIFORM, 11).double()
    assert values.numel() == 1_000_000
    std = (high - low) / math.sqrt(12)
    # Five standard errors of the mean; the sample std of 1M draws is good to about 0.1%.
    assert abs(values.mean().item() - (low + high) / 2) < 5 * std / 1000
    assert values.std().item() == pytest.approx(std, rel=5e-3)
    assert values.min().item() >= low and values.max().item() < high
    # Each tenth of the interval gets its tenth of the draws (binomial sd is 0.0003).
    counts = torch.histc(values, bins=10, min=low, max=high) / values.numel()
    assert torch.all((counts - 0.1).abs() < 0.0015)


def test_uniform_stays_below_b_when_rounding_would_reach_it() -> None:
    spec = InitSpec("uniform", 1.0, 1.0 + 2**-20)
    values = init_rows(np.arange(20_000, dtype=np.int64), 16, spec, 0)
    assert values.min().item() >= spec.a
    assert values.max().item() < spec.b


def test_normal_statistics() -> None:
    mean, std = NORMAL.a, NORMAL.b
    values = init_rows(np.arange(15_625, dtype=np.int64), 64, NORMAL, 13).double()
    assert values.numel() == 1_000_000
    assert torch.isfinite(values).all()
    assert abs(values.mean().item() - mean) < 5 * std / 1000
    assert values.std().item() == pytest.approx(std, rel=5e-3)
    z = (values - mean) / std
    # Shape, not just moments: mass within 1 and 2 sd, symmetry, kurtosis.
    assert (z.abs() < 1).double().mean().item() == pytest.approx(0.6827, abs=0.003)
    assert (z.abs() < 2).double().mean().item() == pytest.approx(0.9545, abs=0.002)
    assert abs((z**3).mean().item()) < 0.02
    assert (z**4).mean().item() == pytest.approx(3.0, abs=0.05)
    # The two columns of a Box-Muller pair must be uncorrelated.
    pairs = z.reshape(-1, 32, 2)
    assert abs((pairs[..., 0] * pairs[..., 1]).mean().item()) < 0.01


@pytest.mark.parametrize(
    ("spec", "value"), [(InitSpec("zeros"), 0.0), (InitSpec("constant", 0.25, 0.0), 0.25)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_constant_kinds(spec: InitSpec, value: float, dtype: torch.dtype) -> None:
    values = init_rows(_keys(7), 3, spec, 0, dtype)
    assert values.dtype == dtype
    assert torch.equal(values, torch.full((7, 3), value, dtype=dtype))


@pytest.mark.parametrize("spec", RANDOM_SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_are_the_float32_values_cast(spec: InitSpec, dtype: torch.dtype) -> None:
    keys = _keys(100)
    values = init_rows(keys, 9, spec, 2, dtype)
    assert values.dtype == dtype and values.shape == (100, 9) and values.is_contiguous()
    assert torch.equal(values, init_rows(keys, 9, spec, 2).to(dtype))


def test_default_dtype_is_float32_and_empty_keys_work() -> None:
    assert init_rows(_keys(3), 2, UNIFORM, 0).dtype == torch.float32
    empty = init_rows(np.empty(0, dtype=np.int64), 5, NORMAL, 0)
    assert empty.shape == (0, 5) and empty.dtype == torch.float32


@pytest.mark.parametrize("spec", RANDOM_SPECS, ids=SPEC_IDS)
def test_no_numpy_warnings_escape(spec: InitSpec) -> None:
    # The hash wraps uint64 on purpose; callers running with errors raised must not notice.
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        init_rows(_keys(100), 8, spec, 2**63 + 5)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"kind": "xavier"}, "InitSpec.kind must be one of ['zeros', 'constant', 'uniform', "),
        ({"kind": "uniform", "a": 0.1, "b": 0.1}, "needs a < b, got a=0.1 and b=0.1"),
        ({"kind": "uniform", "a": 1.0, "b": -1.0}, "needs a < b, got a=1.0 and b=-1.0"),
        ({"kind": "normal", "a": 0.0, "b": 0.0}, "standard deviation b > 0, got b=0.0"),
        ({"kind": "normal", "a": 0.0, "b": -1.0}, "standard deviation b > 0, got b=-1.0"),
        ({"kind": "constant", "a": float("nan")}, "InitSpec.a must be finite, got nan"),
        ({"kind": "uniform", "b": float("inf")}, "InitSpec.b must be finite, got inf"),
        ({"kind": "constant", "a": True}, "InitSpec.a must be a real number, got True"),
        ({"kind": "constant", "a": "1"}, "got '1' of type str"),
    ],
)
def test_bad_specs_are_rejected(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        InitSpec(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"keys": np.zeros((2, 2), dtype=np.int64)}, "got a 2-D int64 array"),
        ({"keys": np.zeros(3, dtype=np.float64)}, "got a 1-D float64 array"),
        ({"keys": [1, 2, 3]}, "got [1, 2, 3]"),
        ({"dim": 0}, "dim must be a positive int, got 0"),
        ({"dim": 2.0}, "dim must be a positive int, got 2.0"),
        ({"seed": True}, "seed must be an int, got True"),
        ({"seed": 1.5}, "seed must be an int, got 1.5"),
        ({"dtype": torch.int32}, "got torch.int32"),
    ],
)
def test_bad_arguments_are_rejected(args: dict[str, Any], fragment: str) -> None:
    call: dict[str, Any] = {
        "keys": np.arange(3, dtype=np.int64),
        "dim": 4,
        "spec": UNIFORM,
        "seed": 0,
        "dtype": torch.float32,
    }
    call.update(args)
    with pytest.raises(InvalidArgumentError) as info:
        init_rows(**call)
    assert fragment in str(info.value)
