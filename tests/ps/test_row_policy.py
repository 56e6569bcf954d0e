"""Admission and eviction rules on their own (ps/row_policy.py): the grammar, the sketch,
the probability rule and the choice of rows to evict, as tables of cases."""

from __future__ import annotations

import numpy as np
import pytest

from ps.errors import InvalidArgumentError
from ps.row_policy import (
    AdmitRule,
    CountMinSketch,
    EvictRule,
    admitted_by_probability,
    expired,
    least_recent,
    parse_admit,
)


@pytest.mark.parametrize(
    ("text", "rule"),
    [("always", AdmitRule()), ("", AdmitRule()), ("count:1", AdmitRule("count", count=1)),
     ("count:255", AdmitRule("count", count=255)), (" count:3 ", AdmitRule("count", count=3)),
     ("prob:0.25", AdmitRule("prob", probability=0.25)),
     ("prob:1", AdmitRule("prob", probability=1.0))],
)
def test_the_admission_grammar_reads_back_what_it_writes(text: str, rule: AdmitRule) -> None:
    assert parse_admit(text) == rule
    assert parse_admit(str(rule)) == rule


@pytest.mark.parametrize(
    ("text", "message"),
    [("count:0", "admit 'count:0' is not a valid count"),
     ("count:256", "admit 'count:256' is not a valid count"),
     ("count:x", "admit 'count:x' is not a valid count"),
     ("prob:0", "admit 'prob:0' is not a valid probability"),
     ("prob:1.5", "admit 'prob:1.5' is not a valid probability"),
     ("prob:nan", "admit 'prob:nan' is not a valid probability"),
     ("sometimes", "admit 'sometimes' is not an admission rule"),
     ("always:3", "admit 'always:3' is not an admission rule")],
)
def test_a_bad_admission_value_is_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^table 'emb': {message}; use 'always'"):
        parse_admit(text, "emb")


def test_the_sketch_admits_on_the_kth_sight_and_never_undercounts() -> None:
    sketch = CountMinSketch(seed=3, width=1 << 10)
    keys = np.arange(500, dtype=np.int64) * 7919
    for sight in range(1, 4):
        estimates = sketch.add(keys)
        assert (estimates >= sight).all()
    counters = sketch.counters.copy()
    sketch.estimate(keys)
    assert np.array_equal(sketch.counters, counters)  # estimating counts nothing
    # 500 ids in 1024 buckets a row: most estimates are exact.
    assert (sketch.estimate(keys) == 3).mean() > 0.8
    assert (sketch.estimate(np.array([-1, 12345], dtype=np.int64)) <= 3).all()


def test_the_sketch_counts_keys_sharing_a_bucket_in_one_batch() -> None:
    sketch = CountMinSketch(seed=0, depth=1, width=1)  # every key shares the one bucket
    assert sketch.add(np.arange(3, dtype=np.int64)).tolist() == [3, 3, 3]


def test_the_sketch_saturates_instead_of_wrapping() -> None:
    sketch = CountMinSketch(seed=0, depth=2, width=8)
    key = np.array([42], dtype=np.int64)
    for _ in range(300):
        sketch.add(key)
    assert sketch.estimate(key).tolist() == [255]


def test_the_sketch_is_seeded_and_loads_its_counters() -> None:
    keys = np.arange(64, dtype=np.int64)
    a, b, c = (CountMinSketch(seed=s, width=16) for s in (1, 1, 2))
    a.add(keys)
    b.add(keys)
    c.add(keys)
    assert np.array_equal(a.counters, b.counters)
    assert not np.array_equal(a.counters, c.counters)
    fresh = CountMinSketch(seed=1, width=16)
    fresh.load(a.counters.copy())
    np.testing.assert_array_equal(fresh.estimate(keys), a.estimate(keys))
    with pytest.raises(InvalidArgumentError, match=r"shape \[4, 8\]"):
        fresh.load(np.zeros((4, 8), dtype=np.uint8))


def test_probability_admission_is_deterministic_and_near_its_share() -> None:
    keys = np.arange(100_000, dtype=np.int64)
    first = admitted_by_probability(keys, 5, 0.1)
    assert np.array_equal(first, admitted_by_probability(keys, 5, 0.1))
    assert abs(first.mean() - 0.1) < 0.005
    assert not np.array_equal(first, admitted_by_probability(keys, 6, 0.1))
    # A larger share admits a superset: raising P never takes a row away.
    assert (admitted_by_probability(keys, 5, 0.3) | ~first).all()
    assert admitted_by_probability(keys, 5, 1.0).all()


@pytest.mark.parametrize(
    ("rule", "clocks", "seconds", "now", "expected"),
    [
        (EvictRule(ttl_clocks=2), [5, 3, 4, -1], [0, 0, 0, 0], (5, 0.0), [0, 1, 0, 0]),
        (EvictRule(ttl_s=1.5), [0, 0, 0, -1], [9.0, 7.0, 8.4, 0.0], (0, 10.0), [0, 1, 1, 0]),
        (EvictRule(ttl_clocks=3, ttl_s=5.0), [9, 1, 9], [1.0, 9.0, 9.0], (10, 10.0),
         [1, 1, 0]),
        (EvictRule(max_rows=1), [0, 0], [0.0, 0.0], (100, 100.0), [0, 0]),
    ],
)
def test_expired_rows_are_those_past_a_ttl(
    rule: EvictRule, clocks: list[int], seconds: list[float], now: tuple[int, float],
    expected: list[int],
) -> None:
    got = expired(rule, np.array(clocks, dtype=np.int64), np.array(seconds), *now)
    assert got.astype(int).tolist() == expected


@pytest.mark.parametrize(
    ("clocks", "seconds", "n", "expected"),
    [
        ([4, 1, 3, 2], [0, 0, 0, 0], 2, [1, 3]),
        ([1, 1, 1], [3.0, 1.0, 2.0], 1, [1]),  # equal clocks: the older second goes
        ([5, -1, 2, -1], [0, 0, 0, 0], 5, [0, 2]),  # free slots are never chosen
        ([5, 2], [0, 0], 0, []),
    ],
)
def test_least_recent_picks_the_oldest_live_rows(
    clocks: list[int], seconds: list[float], n: int, expected: list[int]
) -> None:
    got = least_recent(np.array(clocks, dtype=np.int64), np.array(seconds, dtype=float), n)
    assert got.tolist() == expected


@pytest.mark.parametrize(
    ("kw", "message"),
    [({"ttl_clocks": -1}, "ttl_clocks must be >= 0 (0: off), got -1"),
     ({"ttl_s": float("inf")}, "ttl_s must be finite and >= 0 (0: off), got inf"),
     ({"max_rows": -5}, "max_rows must be >= 0 (0: no limit), got -5")],
)
def test_a_bad_eviction_value_is_refused_by_name(kw: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EvictRule(**kw)  # type: ignore[arg-type]
