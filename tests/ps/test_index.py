"""Tests for ps.index.KeyIndex and the raw C extension ps._index.Int64Index."""

from __future__ import annotations

import array

import numpy as np
import pytest

from ps._index import Int64Index
from ps.errors import InvalidArgumentError
from ps.index import MAX_ROWS, SLOT_BYTES, KeyIndex, capacity_for, count_distinct

I64_MIN = np.iinfo(np.int64).min
I64_MAX = np.iinfo(np.int64).max
EDGE_KEYS = np.array([-1, 0, I64_MIN, I64_MAX, 1, I64_MIN + 1, I64_MAX - 1], dtype=np.int64)


def random_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(I64_MIN, I64_MAX, size=n, dtype=np.int64, endpoint=True)


def first_appearance(keys: np.ndarray) -> np.ndarray:
    """Distinct keys in order of first appearance."""
    _, first = np.unique(keys, return_index=True)
    return keys[np.sort(first)]


def check_against(index: KeyIndex, expected: dict[int, int]) -> None:
    """Asserts that ``index`` holds exactly the mapping ``expected``."""
    assert len(index) == len(expected)
    keys = np.fromiter(expected.keys(), dtype=np.int64, count=len(expected))
    rows = np.fromiter(expected.values(), dtype=np.int64, count=len(expected))
    np.testing.assert_array_equal(index.lookup(keys), rows)
    by_row = np.empty(len(expected), dtype=np.int64)
    by_row[rows] = keys
    np.testing.assert_array_equal(index.keys_by_row(), by_row)


@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1])
def test_round_trip_random_and_edge_keys(seed: int) -> None:
    rng = np.random.default_rng(seed % 1000)
    keys = np.concatenate([EDGE_KEYS, random_keys(rng, 5000)])
    index = KeyIndex(seed=seed)
    rows, n_new = index.lookup_or_insert(keys)
    assert n_new == len(keys) == len(index)
    np.testing.assert_array_equal(rows, np.arange(len(keys)))
    np.testing.assert_array_equal(index.lookup(keys), rows)
    np.testing.assert_array_equal(index.keys_by_row(), keys)
    again, n_again = index.lookup_or_insert(keys[::-1])
    assert n_again == 0
    np.testing.assert_array_equal(again, rows[::-1])


@pytest.mark.parametrize(
    ("batches", "expected_rows", "expected_new"),
    [
        # duplicates within one call share the row of their first appearance
        ([[7, 7, 7]], [[0, 0, 0]], [1]),
        ([[5, -1, 5, -1, 9]], [[0, 1, 0, 1, 2]], [3]),
        # rows continue densely from len() across calls, old keys keep theirs
        ([[3, 4], [4, 5, 3, 6, 5]], [[0, 1], [1, 2, 0, 3, 2]], [2, 2]),
        ([[I64_MIN, I64_MAX], [-1, I64_MIN, 0]], [[0, 1], [2, 0, 3]], [2, 2]),
        ([[], [1], []], [[], [0], []], [0, 1, 0]),
    ],
)
def test_dense_rows_in_first_appearance_order(
    batches: list[list[int]], expected_rows: list[list[int]], expected_new: list[int]
) -> None:
    index = KeyIndex()
    for batch, want_rows, want_new in zip(batches, expected_rows, expected_new, strict=True):
        rows, n_new = index.lookup_or_insert(np.array(batch, dtype=np.int64))
        assert rows.dtype == np.int64
        np.testing.assert_array_equal(rows, want_rows)
        assert n_new == want_new


def test_new_rows_are_those_at_or_above_previous_length() -> None:
    rng = np.random.default_rng(3)
    index = KeyIndex()
    index.lookup_or_insert(rng.integers(0, 1000, size=500, dtype=np.int64))
    before = len(index)
    keys = rng.integers(0, 2000, size=1000, dtype=np.int64)
    rows, n_new = index.lookup_or_insert(keys)
    new_mask = rows >= before
    assert n_new == len(index) - before == len(np.unique(rows[new_mask]))
    np.testing.assert_array_equal(np.unique(rows[new_mask]), np.arange(before, len(index)))
    np.testing.assert_array_equal(index.keys_by_row()[before:], first_appearance(keys[new_mask]))


def test_growth_over_many_doublings_matches_dict() -> None:
    rng = np.random.default_rng(42)
    index = KeyIndex()
    expected: dict[int, int] = {}
    capacities = {index.capacity}
    pool = random_keys(rng, 100_000)
    while len(expected) < 200_000:
        # batches grow with the table so that every doubling from 8 slots up is crossed; each is
        # a mix of fresh keys, keys likely seen before (from the pool) and in-batch duplicates
        size = min(4000, 1 + len(expected) // 3)
        batch = np.concatenate([random_keys(rng, size), rng.choice(pool, size=size)])
        rows, n_new = index.lookup_or_insert(batch)
        before = len(expected)
        for key in batch.tolist():
            expected.setdefault(key, len(expected))
        np.testing.assert_array_equal(rows, [expected[k] for k in batch.tolist()])
        assert n_new == len(expected) - before
        capacities.add(index.capacity)
    assert len(capacities) >= 16  # 8 slots up to at least 2**18, one doubling at a time
    assert len(index) <= 0.7 * index.capacity
    check_against(index, expected)


def test_lookup_of_absent_keys_inserts_nothing() -> None:
    index = KeyIndex()
    index.lookup_or_insert(np.array([1, 2, 3], dtype=np.int64))
    rows = index.lookup(np.array([4, -1, 2, I64_MIN, 4], dtype=np.int64))
    np.testing.assert_array_equal(rows, [-1, -1, 1, -1, -1])
    assert len(index) == 3
    np.testing.assert_array_equal(index.keys_by_row(), [1, 2, 3])
    np.testing.assert_array_equal(KeyIndex().lookup(EDGE_KEYS), np.full(len(EDGE_KEYS), -1))


def test_empty_index_exports_nothing() -> None:
    index = KeyIndex()
    assert len(index) == 0
    assert index.keys_by_row().shape == (0,)
    assert index.lookup(np.array([], dtype=np.int64)).shape == (0,)


def test_non_contiguous_keys_are_accepted() -> None:
    keys = np.arange(20, dtype=np.int64)[::2]
    index = KeyIndex()
    rows, _ = index.lookup_or_insert(keys)
    np.testing.assert_array_equal(rows, np.arange(10))
    np.testing.assert_array_equal(index.lookup(np.arange(20, dtype=np.int64)[::-2]), [-1] * 10)


def test_reserve_then_insert_does_not_rehash() -> None:
    index = KeyIndex()
    index.reserve(10_000)
    capacity = index.capacity
    assert capacity >= 10_000 / 0.7
    assert capacity & (capacity - 1) == 0
    assert index.nbytes == 12 * capacity
    index.lookup_or_insert(np.arange(10_000, dtype=np.int64))
    assert index.capacity == capacity
    index.reserve(5)  # never shrinks
    assert index.capacity == capacity
    assert KeyIndex(capacity_hint=10_000).capacity == capacity


def test_clear_keeps_capacity_and_restarts_rows() -> None:
    index = KeyIndex()
    index.lookup_or_insert(np.arange(1000, dtype=np.int64))
    capacity = index.capacity
    index.clear()
    assert len(index) == 0
    assert index.capacity == capacity
    np.testing.assert_array_equal(index.lookup(np.arange(3, dtype=np.int64)), [-1, -1, -1])
    rows, n_new = index.lookup_or_insert(np.array([999, 5], dtype=np.int64))
    np.testing.assert_array_equal(rows, [0, 1])
    assert n_new == 2


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (np.array([1.0, 2.0]), "float64"),
        (np.array([1, 2], dtype=np.int32), "int32"),
        (np.array([1, 2], dtype=np.uint64), "uint64"),
        (np.array([1, 2], dtype=">i8"), ">i8"),
        (np.array(["a"]), "<U1"),
        (np.zeros((2, 2), dtype=np.int64), "1-D"),
        (np.int64(3), "ndarray"),
        ([1, 2, 3], "list"),
    ],
)
def test_invalid_keys_raise_invalid_argument(keys: object, message: str) -> None:
    index = KeyIndex()
    for call in (index.lookup, index.lookup_or_insert):
        with pytest.raises(InvalidArgumentError, match=message):
            call(keys)  # type: ignore[arg-type]
    assert len(index) == 0


@pytest.mark.parametrize("method", ["lookup", "lookup_or_insert"])
def test_raw_extension_length_mismatch(method: str) -> None:
    index = Int64Index()
    with pytest.raises(ValueError, match=r"keys has 3 elements, out has 2"):
        getattr(index, method)(np.zeros(3, dtype=np.int64), np.zeros(2, dtype=np.int64))
    assert len(index) == 0


@pytest.mark.parametrize(
    ("keys", "out", "error"),
    [
        (np.zeros(3, dtype=np.float64), np.zeros(3, dtype=np.int64), TypeError),
        (np.zeros(3, dtype=np.uint64), np.zeros(3, dtype=np.int64), TypeError),
        (np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int32), TypeError),
        (np.zeros((3, 1), dtype=np.int64), np.zeros(3, dtype=np.int64), ValueError),
        (np.zeros(6, dtype=np.int64)[::2], np.zeros(3, dtype=np.int64), ValueError),
        (b"01234567", np.zeros(1, dtype=np.int64), TypeError),
        (np.zeros(3, dtype=np.int64), bytes(24), (TypeError, BufferError)),
        (np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64)[:], None),
    ],
)
def test_raw_extension_buffer_checks(
    keys: object, out: object, error: type[Exception] | tuple[type[Exception], ...] | None
) -> None:
    index = Int64Index()
    if error is None:
        assert index.lookup_or_insert(keys, out) == 1  # type: ignore[arg-type]
        return
    with pytest.raises(error):
        index.lookup_or_insert(keys, out)  # type: ignore[arg-type]
    assert len(index) == 0


def test_raw_extension_accepts_any_int64_buffer_and_in_place() -> None:
    index = Int64Index(capacity_hint=4, seed=7)
    keys = array.array("q", [10, 20, 10])
    out = array.array("q", [0, 0, 0])
    assert index.lookup_or_insert(keys, out) == 2
    assert out.tolist() == [0, 1, 0]
    # out may be keys itself: each key is read before its own output is written
    buf = np.array([20, 30, 10, 30], dtype=np.int64)
    assert index.lookup_or_insert(buf, buf) == 1
    np.testing.assert_array_equal(buf, [1, 2, 0, 2])
    # but a partial overlap is refused
    data = np.arange(5, dtype=np.int64)
    with pytest.raises(ValueError, match="overlap"):
        index.lookup(data[:4], data[1:])
    exported = np.empty(len(index), dtype=np.int64)
    index.export(exported)
    np.testing.assert_array_equal(exported, [10, 20, 30])
    with pytest.raises(ValueError, match="3 keys"):
        index.export(np.empty(2, dtype=np.int64))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"capacity_hint": -1}, ValueError),
        ({"seed": -1}, ValueError),
        ({"seed": 2**64}, OverflowError),
        ({"seed": 1.5}, TypeError),
        ({"capacity_hint": 2**62}, MemoryError),
    ],
)
def test_raw_extension_constructor_checks(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        Int64Index(**kwargs)  # type: ignore[arg-type]


def test_raw_extension_reserve_checks() -> None:
    index = Int64Index()
    with pytest.raises(ValueError):
        index.reserve(-1)
    with pytest.raises(MemoryError):
        index.reserve(2**62)
    assert index.capacity == 8  # a failed reserve leaves the table as it was


def int64_view(n: int) -> memoryview:
    return memoryview(bytearray(8 * n)).cast("q")


@pytest.mark.parametrize(
    ("method", "n_keys", "n_out", "error"),
    [
        ("lookup_or_insert", 3, 3, None),
        ("lookup", 3, 3, None),
        ("lookup", 3, 2, ValueError),  # length mismatch
        ("lookup_or_insert", 2, 3, ValueError),
        ("lookup", 3, -1, TypeError),  # out has the wrong format, after keys was acquired
        ("lookup_or_insert", 3, -1, TypeError),
    ],
)
def test_raw_extension_releases_buffers_on_every_path(
    method: str, n_keys: int, n_out: int, error: type[Exception] | None
) -> None:
    # memoryview.release() raises BufferError while an export is still held, so a Py_buffer
    # leaked on any success or error path fails the release() calls below.
    index = Int64Index()
    keys = int64_view(n_keys)
    out = int64_view(n_out) if n_out >= 0 else memoryview(bytearray(4 * n_keys)).cast("i")
    if error is None:
        getattr(index, method)(keys, out)
    else:
        with pytest.raises(error):
            getattr(index, method)(keys, out)
    keys.release()
    out.release()
    for n, export_error in ((len(index), None), (len(index) + 1, ValueError)):
        keys_out = int64_view(n)
        if export_error is None:
            index.export(keys_out)
        else:
            with pytest.raises(export_error):
                index.export(keys_out)
        keys_out.release()


@pytest.mark.parametrize(
    ("rows", "expected"),
    [([], -1), ([0], -1), ([3, 1, 2, 0], -1), ([2, 1, 2], 2), ([0, 0], 1), ([5, 4, 3, 4, 5], 3)],
)
def test_first_repeat_finds_first_repeated_position(rows: list[int], expected: int) -> None:
    index = KeyIndex()
    index.lookup_or_insert(np.arange(6, dtype=np.int64))
    array = np.array(rows, dtype=np.int64)
    assert index.first_repeat(array) == expected
    # The bitmap is clean afterwards: the same rows without the repeat are all distinct.
    assert index.first_repeat(np.unique(array)) == -1


def test_first_repeat_rejects_rows_outside_the_index() -> None:
    index = KeyIndex()
    index.lookup_or_insert(np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError, match="outside the bitmap"):
        index.first_repeat(np.array([0, 1 << 40], dtype=np.int64))
    assert index.first_repeat(np.array([0, 1, 2], dtype=np.int64)) == -1


@pytest.mark.parametrize("n", [0, 1, 5, 6, 11, 12, 100, 717, 718, 10_000, 734_003, 734_004])
def test_capacity_for_is_the_capacity_the_index_takes(n: int) -> None:
    """The projection memory accounting makes before inserting equals what the C index
    reserves, at and around its load limit (0.7 of a power of two)."""
    index = KeyIndex()
    index.lookup_or_insert(np.arange(n, dtype=np.int64))
    assert index.capacity == capacity_for(n) == KeyIndex(capacity_hint=n).capacity
    assert index.nbytes == SLOT_BYTES * capacity_for(n)


@pytest.mark.parametrize(
    ("keys", "distinct"),
    [([], 0), ([7], 1), ([7, 7], 1), ([1, 2, 3], 3), ([3, 1, 3, 2, 1], 3),
     ([I64_MIN, I64_MAX, -1, I64_MIN], 3)],
)
def test_count_distinct(keys: list[int], distinct: int) -> None:
    assert count_distinct(np.array(keys, dtype=np.int64)) == distinct


# ---- deletion and explicit rows (tables that evict) ------------------------------------------


def check_items(index: KeyIndex, expected: dict[int, int]) -> None:
    """Asserts that ``index`` holds exactly ``expected``, through lookup and items."""
    assert len(index) == len(expected)
    keys, rows = index.items()
    assert dict(zip(keys.tolist(), rows.tolist(), strict=True)) == expected
    if expected:
        probe = np.fromiter(expected, dtype=np.int64, count=len(expected))
        np.testing.assert_array_equal(index.lookup(probe), list(expected.values()))


@pytest.mark.parametrize("seed", [0, 7])
def test_random_deletes_and_reinserts_match_a_dict(seed: int) -> None:
    # Small key space and small table: long probe runs that wrap around, so backward-shift
    # deletion must keep every key reachable.
    rng = np.random.default_rng(seed)
    index = KeyIndex(0, seed)
    expected: dict[int, int] = {}
    free: list[int] = []
    for _ in range(300):
        batch = np.unique(rng.integers(-40, 40, size=int(rng.integers(1, 12)))).astype(np.int64)
        if rng.random() < 0.5:
            rows = index.delete(batch)
            assert rows.tolist() == [expected.get(int(k), -1) for k in batch]
            for k in batch.tolist():
                if k in expected:
                    free.append(expected.pop(k))
        else:
            fresh = np.array([k for k in batch.tolist() if k not in expected], dtype=np.int64)
            take = [free.pop() if free else index.row_limit + i for i in range(len(fresh))]
            # Fresh rows past the limit are numbered in order; reused ones come first.
            top = index.row_limit
            take = [r if r < top else top + j for j, r in enumerate(take)]
            index.insert_rows(fresh, np.array(take, dtype=np.int64))
            expected.update(zip(fresh.tolist(), take, strict=True))
        check_items(index, expected)
        absent = np.arange(-60, -41, dtype=np.int64)
        assert (index.lookup(absent) == -1).all()


def test_delete_absent_and_repeated_keys_removes_once() -> None:
    index = KeyIndex()
    index.lookup_or_insert(np.array([5, 6, 7], dtype=np.int64))
    rows = index.delete(np.array([6, 9, 6], dtype=np.int64))
    assert rows.tolist() == [1, -1, -1]
    check_items(index, {5: 0, 7: 2})
    assert index.row_limit == 3


def test_lookup_or_insert_after_delete_continues_past_row_limit() -> None:
    index = KeyIndex()
    index.lookup_or_insert(np.array([1, 2, 3], dtype=np.int64))
    index.delete(np.array([3], dtype=np.int64))
    rows, created = index.lookup_or_insert(np.array([4, 1], dtype=np.int64))
    assert (rows.tolist(), created) == ([3, 0], 1)
    check_items(index, {1: 0, 2: 1, 4: 3})


def test_keys_by_row_refuses_an_index_with_holes() -> None:
    index = KeyIndex()
    index.lookup_or_insert(np.array([1, 2], dtype=np.int64))
    index.delete(np.array([1], dtype=np.int64))
    with pytest.raises(ValueError, match="use items"):
        index.keys_by_row()


def test_insert_rows_is_all_or_nothing() -> None:
    index = KeyIndex()
    index.lookup_or_insert(np.array([10, 11], dtype=np.int64))
    with pytest.raises(ValueError, match="key 11 at position 2 is already in the index"):
        index.insert_rows(np.array([20, 21, 11], dtype=np.int64),
                          np.array([5, 6, 7], dtype=np.int64))
    check_items(index, {10: 0, 11: 1})
    with pytest.raises(ValueError, match="row -3 at position 0 is negative"):
        index.insert_rows(np.array([20], dtype=np.int64), np.array([-3], dtype=np.int64))
    check_items(index, {10: 0, 11: 1})
    assert index.row_limit == 2


def test_delete_then_reinsert_keeps_capacity() -> None:
    # Deleting leaves no tombstones: cycles of insert/delete never grow the slot array.
    index = KeyIndex(100)
    slots = index.capacity
    for cycle in range(50):
        keys = np.arange(cycle * 100, cycle * 100 + 60, dtype=np.int64)
        index.insert_rows(keys, np.arange(60, dtype=np.int64))
        assert (index.delete(keys) >= 0).all()
    assert (len(index), index.capacity) == (0, slots)


def test_rows_past_the_int32_limit_are_refused_and_change_nothing() -> None:
    index = KeyIndex()
    index.insert_rows(np.array([7], dtype=np.int64), np.array([MAX_ROWS - 1], dtype=np.int64))
    assert index.row_limit == MAX_ROWS
    with pytest.raises(OverflowError, match=r"row 2147483647 at position 1 is past"):
        index.insert_rows(np.array([8, 9], dtype=np.int64),
                          np.array([3, MAX_ROWS], dtype=np.int64))
    check_items(index, {7: MAX_ROWS - 1})
    # Known keys still resolve; a new one would need row id MAX_ROWS.
    with pytest.raises(OverflowError, match="limit of 2\\*\\*31 - 1 rows per index"):
        index.lookup_or_insert(np.array([7, 8, 7, 9], dtype=np.int64))
    check_items(index, {7: MAX_ROWS - 1})
    assert (index.row_limit, len(index)) == (MAX_ROWS, 1)
    rows, created = index.lookup_or_insert(np.array([7, 7], dtype=np.int64))
    assert (rows.tolist(), created) == ([MAX_ROWS - 1] * 2, 0)
    # `out` is `keys`: the refused call still finds the keys it inserted, to take them out.
    raw = Int64Index()
    raw.insert_rows(np.array([7], dtype=np.int64), np.array([MAX_ROWS - 2], dtype=np.int64))
    batch = np.array([8, 7, 9], dtype=np.int64)
    with pytest.raises(OverflowError):
        raw.lookup_or_insert(batch, batch)
    probe = np.array([7, 8, 9], dtype=np.int64)
    assert raw.lookup(probe, probe) == 1 and probe.tolist() == [MAX_ROWS - 2, -1, -1]


def test_a_refused_insert_near_the_limit_takes_out_the_rows_it_made() -> None:
    index = KeyIndex()
    index.insert_rows(np.array([1], dtype=np.int64), np.array([MAX_ROWS - 3], dtype=np.int64))
    # Rows MAX_ROWS - 2 and - 1 fit; the third new key does not: none of the three stay.
    with pytest.raises(OverflowError):
        index.lookup_or_insert(np.array([5, 1, 6, 5, 7], dtype=np.int64))
    check_items(index, {1: MAX_ROWS - 3})
    rows, created = index.lookup_or_insert(np.array([5, 6], dtype=np.int64))
    assert (rows.tolist(), created) == ([MAX_ROWS - 2, MAX_ROWS - 1], 2)


@pytest.mark.parametrize(("max_slots", "max_items"), [(64, 1000), (10_000, 37), (7, 5)])
def test_a_windowed_scan_visits_every_key_once(max_slots: int, max_items: int) -> None:
    rng = np.random.default_rng(11)
    keys = np.unique(random_keys(rng, 3000))
    index = KeyIndex()
    index.lookup_or_insert(keys)
    seen_keys, seen_rows = [], []
    cursor, windows = 0, 0
    while True:
        k, r, cursor = index.scan(cursor, max_slots, max_items)
        assert len(k) <= max_items
        seen_keys.append(k)
        seen_rows.append(r)
        windows += 1
        if cursor == 0:
            break
    got_keys, got_rows = np.concatenate(seen_keys), np.concatenate(seen_rows)
    # One pass, in slot order: what items() lists, each key once with its row.
    assert np.array_equal(got_keys, index.items()[0])
    assert np.array_equal(got_rows, index.items()[1])
    assert np.array_equal(np.sort(got_keys), keys)
    assert np.array_equal(index.lookup(got_keys), got_rows)
    assert windows >= index.capacity // max_slots


def test_a_scan_window_is_bounded_and_checks_its_start() -> None:
    index = KeyIndex()
    index.lookup_or_insert(np.arange(100, dtype=np.int64))
    k, r, cursor = index.scan(0, index.capacity, 10)
    assert len(k) == len(r) == 10 and 0 < cursor < index.capacity
    k, _, cursor = index.scan(5, 0, 10)
    assert (len(k), cursor) == (0, 5)
    with pytest.raises(ValueError, match="start must be in"):
        index.scan(index.capacity, 1, 1)
    with pytest.raises(ValueError, match="start must be in"):
        index.scan(-1, 1, 1)
