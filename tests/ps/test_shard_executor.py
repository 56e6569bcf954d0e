"""The shard's executor driven directly: no gRPC, no processes, time from a fake clock.

A blocked call runs on a thread of its own, joined with a bound. Whether it is blocked is
read from the thread's stack (parked in a threading wait), never guessed from a sleep; after
the clocks move, a parked call is known to have looked again once it has read the clock again
(a waiting executor reads it to compute what is left of its deadline).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

from protos import codec, modes
from protos.partition import RowRange
from ps.checkpoint import materialized
from ps.clocks import Quorum
from ps.errors import (
    ClockWaitTimeoutError,
    InvalidArgumentError,
    ResourceExhaustedError,
    RolledBackError,
)
from ps.index import capacity_for
from ps.initializers import InitSpec
from ps.limits import Limits
from ps.row_policy import admitted_by_probability
from ps.shard import (
    DensePush,
    Exchange,
    Pull,
    PullRecord,
    PushMeta,
    PushOutcome,
    Shard,
    ShardConfig,
    Skipped,
    SparsePush,
    format_size,
)
from ps.tables import DenseTable, OptimizerConfig, SparseTable, TableSpec

BOUND_S = 5.0  # the longest any test here waits for a thread, in real time
F32 = torch.float32
SGD_1 = OptimizerConfig("sgd", (("lr", 1.0),))
ONES = InitSpec("constant", 1.0, 0.0)


class FakeClock:
    """Monotonic time that moves only when a test sets it; counts its reads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        with self._cond:
            self.reads += 1
            return self._now

    def set(self, now: float) -> None:
        with self._cond:
            self._now = now


class Call(threading.Thread):
    """Runs one blocking call; `outcome` joins it (bounded) and returns or raises its result."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self._result: Any = None
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:
            self._error = exc

    def outcome(self) -> Any:
        self.join(BOUND_S)
        assert not self.is_alive(), f"the call still blocks after {BOUND_S} s"
        if self._error is not None:
            raise self._error
        return self._result

    def parked(self) -> bool:
        """Whether the thread is inside a threading wait (a Condition's or an Event's)."""
        # With a collection running inside it, sys._current_frames() can deadlock against
        # the interpreter lock (CPython gh-106883, fixed in 3.11.9; seen here on 3.11.7).
        collecting = gc.isenabled()
        gc.disable()
        try:
            frame = sys._current_frames().get(self.ident or -1)
        finally:
            if collecting:
                gc.enable()
        while frame is not None:
            if frame.f_code.co_name == "wait" and frame.f_code.co_filename == threading.__file__:
                return True
            frame = frame.f_back
        return False


def settle(call: Call, clock: FakeClock, reads_before: int = -1) -> bool:
    """True once `call` is parked (having read the clock since `reads_before`), False once it
    has finished; fails the test if neither happens within the bound."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if not call.is_alive():
            return False
        if call.parked() and clock.reads > reads_before:
            return True
        time.sleep(0.0005)
    raise AssertionError(f"the call neither parked nor finished within {BOUND_S} s")


def make_shard(mode: str, workers: int = 2, staleness: int = 0, max_wait_s: float = 10.0,
               ) -> tuple[Shard, FakeClock]:
    clock = FakeClock()
    config = ShardConfig(0, 1, mode=modes.parse(mode), staleness=staleness, quorum=Quorum(workers),
                         max_wait_s=max_wait_s)
    shard = Shard(config, clock=clock)
    shard.declare([
        TableSpec("w", "dense", F32, shape=(4,), init=ONES, optimizer=SGD_1),
        TableSpec("emb", "sparse", F32, dim=2, init=ONES, optimizer=SGD_1),
    ])
    return shard, clock



# ---- one-item exchanges, as a worker's single pull or push arrives ------------------------------


def _one(shard: Shard, worker: int, push: SparsePush | DensePush | None = None,
         pull: Pull | None = None, clock: int = 0, wait_s: float = 0.0) -> Any:
    exchange = Exchange(worker=worker, incarnation=push.meta.incarnation if push else 1,
                        generation=0, push_clock=clock, pushes=[push] if push else [],
                        end_iteration=False, pull_clock=clock, pulls=[pull] if pull else [],
                        wait_s=wait_s)
    result = shard.exchange(exchange)
    return result.outcomes[0] if push else result.pulled[0]


def pull_dense(shard: Shard, name: str, worker: int, clock: int,
               wait_s: float = 0.0) -> torch.Tensor:
    pulled: torch.Tensor = _one(shard, worker, pull=Pull(name), clock=clock, wait_s=wait_s)
    return pulled


def pull_sparse(shard: Shard, name: str, worker: int, clock: int, keys: np.ndarray,
                wait_s: float = 0.0) -> Any:
    return _one(shard, worker, pull=Pull(name, keys), clock=clock, wait_s=wait_s)


def push_dense(shard: Shard, name: str, meta: PushMeta, values: torch.Tensor) -> PushOutcome:
    push = DensePush(name, meta, values.dtype, tuple(values.shape), [(0, values.reshape(-1))])
    outcome: PushOutcome = _one(shard, meta.worker, push, clock=meta.clock)
    return outcome


def push_sparse(shard: Shard, name: str, meta: PushMeta, dim: int, keys: np.ndarray,
                values: memoryview) -> PushOutcome:
    outcome: PushOutcome = _one(shard, meta.worker, SparsePush(name, meta, F32, dim, keys,
                                                                values), clock=meta.clock)
    return outcome

def push_w(shard: Shard, worker: int, seq: int, clock: int, value: float,
           wait_s: float = 0.0) -> PushOutcome:
    meta = PushMeta(worker, 1, seq, clock, wait_s=wait_s)
    return push_dense(shard, "w", meta, torch.full((4,), value))


def push_emb(shard: Shard, worker: int, seq: int, keys: list[int], rows: list[list[float]]
             ) -> PushOutcome:
    values = codec.tensor_bytes(torch.tensor(rows, dtype=F32).reshape(len(keys), 2))
    return push_sparse(shard, "emb", PushMeta(worker, 1, seq), 2,
                       np.array(keys, dtype=np.int64), values)


def values(shard: Shard) -> tuple[list[float], dict[int, list[float]]]:
    """The dense table and every sparse row, read without counting as a pull."""
    state = materialized(shard.snapshot("probe"))
    tables = {t.name: t.tensors for t in state.tables}
    rows = {int(k): v.tolist() for k, v in zip(tables["emb"]["keys"], tables["emb"]["value"],
                                                strict=True)}
    return tables["w"]["value"].tolist(), rows


# ---- waiting for clocks ------------------------------------------------------------------------


def test_a_sync_pull_waits_until_its_clock_closes() -> None:
    shard, clock = make_shard("sync")
    assert push_w(shard, 0, 1, 0, 2.0) is PushOutcome.APPLIED
    assert shard.tick(0, 1, 0) == 0  # worker 1 has not finished clock 0
    pull = Call(lambda: pull_dense(shard, "w", 0, 1).clone())
    assert settle(pull, clock), "a pull for clock 1 was served while clock 0 was open"
    # A pull at the open clock is served at once, without the unfinished clock's gradients.
    assert pull_dense(shard, "w", 1, 0).tolist() == [1.0] * 4
    assert push_w(shard, 1, 1, 0, 4.0) is PushOutcome.APPLIED
    assert shard.tick(1, 1, 0) == 1
    assert pull.outcome().tolist() == [1 - (2 + 4) / 2] * 4  # the mean, applied once
    state = shard.clock_state(history=True)
    assert (state.open_clock, state.clocks_closed, state.history) == (1, 1, ((0, 2, 0),))
    assert shard.clock_state().history == ()  # copied only when asked for


def test_a_pull_that_waits_for_its_clock_gives_its_turn_to_the_calls_it_waits_for() -> None:
    shard, clock = make_shard("sync")
    shard.turn.wait_s = BOUND_S
    assert shard.tick(0, 1, 0) == 0  # worker 1 has not finished clock 0

    def waiting_pull() -> torch.Tensor:
        with shard.turn.taken():  # as the servicer runs every data call
            return pull_dense(shard, "w", 0, 1).clone()

    pull = Call(waiting_pull)
    assert settle(pull, clock)
    start = time.monotonic()
    with shard.turn.taken():  # worker 1's call: it must not wait for the parked pull
        assert time.monotonic() - start < BOUND_S / 2, "the waiting pull kept its turn"
        assert shard.tick(1, 1, 0) == 1
    assert pull.outcome().tolist() == [1.0] * 4


def test_an_ssp_pull_is_released_when_the_slowest_worker_advances() -> None:
    shard, clock = make_shard("ssp", workers=3, staleness=1)
    for c in range(3):
        shard.tick(0, 1, c)  # worker 0 reaches clock 3
    for c in range(2):
        shard.tick(1, 1, c)  # worker 1 reaches clock 2; worker 2 stays at 0
    pull = Call(lambda: pull_dense(shard, "w", 0, 3).clone())  # needs every worker at >= 2
    assert settle(pull, clock)
    reads = clock.reads
    shard.tick(2, 1, 0)  # the slowest reaches 1: not enough
    assert settle(pull, clock, reads), "released with the slowest worker at clock 1"
    shard.tick(2, 1, 1)  # the slowest reaches 2
    pull.outcome()
    assert shard.pull_log() == [PullRecord("w", 0, 3, 2)]
    # A pull within the bound never waits.
    pull_dense(shard, "w", 2, 3)
    assert shard.pull_log()[-1] == PullRecord("w", 2, 3, 2)


def _step(shard: Shard, worker: int, incarnation: int, generation: int, clock: int,
          value: float) -> PushOutcome:
    """One sync step of a worker: its push of `value` to "w" at `clock`, and the clock's end."""
    meta = PushMeta(worker, incarnation, clock + 1, clock, generation=generation)
    push = DensePush("w", meta, F32, (4,), [(0, torch.full((4,), value))])
    result = shard.exchange(Exchange(
        worker=worker, incarnation=incarnation, generation=generation, push_clock=clock,
        pushes=[push], end_iteration=True, pull_clock=clock + 1, pulls=[]))
    outcome: PushOutcome = result.outcomes[0]
    return outcome


def test_a_push_waiting_for_its_clock_across_a_rollback_is_refused_not_counted() -> None:
    # A worker of the timeline a rollback ends can have a push waiting for a clock the new
    # timeline reaches later (its connection outlives it): it must not join that clock's sum.
    shard, clock = make_shard("sync")
    start = shard.snapshot("start")
    for w in (0, 1):
        _step(shard, w, 1, 0, 0, 2.0)
    early = Call(lambda: _step(shard, 0, 1, 0, 2, 100.0))  # clock 2 is not open: it waits
    assert settle(early, clock)
    shard.restore(start, generation=1)
    with pytest.raises(RolledBackError, match=r"restored from checkpoint start \(generation 1\)"):
        early.outcome()
    for w in (0, 1):
        assert shard.join(w, 2, 1)[0] == 0
    for c, pushed in enumerate([(2.0, 2.0), (1.0, 3.0), (0.5, 0.5)]):
        for w in (0, 1):
            assert _step(shard, w, 2, 1, c, pushed[w]) is PushOutcome.APPLIED
    assert values(shard)[0] == [1.0 - 2.0 - 2.0 - 0.5] * 4  # the means, and nothing else
    assert shard.clock_state(history=True).history[-1] == (2, 2, 0)


def test_an_async_push_that_a_restore_overtakes_is_refused_not_acknowledged() -> None:
    # An async push applies to the table it found when it arrived; a restore that lands
    # while it applies replaces that table. Its answer must not say the push counts.
    shard, _ = make_shard("async")
    start = shard.snapshot("start")
    table = shard._table("w")[0]
    apply = table.apply

    def overtaken(*args: Any) -> bool:
        applied: bool = apply(*args)
        shard.restore(start, generation=1)
        return applied

    table.apply = overtaken  # type: ignore[method-assign]
    with pytest.raises(RolledBackError, match=r"restored from checkpoint start \(generation 1\)"):
        push_w(shard, 0, 1, 0, 5.0)
    assert values(shard)[0] == [1.0] * 4  # the restored state, without the push


@pytest.mark.parametrize(
    ("mode", "call", "message"),
    [
        ("sync", lambda s: pull_dense(s, "w", 0, 1),
         "waited 10.0 s: pull of sync table 'w' by worker 0 at clock 1 needs clock 0 closed, but "
         "clock 0 is open (0 of quorum 2 counted); waiting for workers 0 (clock 0), 1 (clock 0)"),
        ("ssp", lambda s: pull_sparse(s, "emb", 1, 1, np.array([5], dtype=np.int64), wait_s=10.0),
         "waited 10.0 s: pull of ssp table 'emb' by worker 1 at clock 1 needs every live worker "
         "at clock >= 1 (staleness 0); waiting for workers 0 (clock 0), 1 (clock 0)"),
        ("sync", lambda s: push_w(s, 0, 1, 1, 2.0, wait_s=25.0),  # over the limit: the limit
         "waited 10.0 s: push to sync table 'w' by worker 0 for clock 1 needs clock 0 closed "
         "first; waiting for workers 0 (clock 0), 1 (clock 0)"),
    ],
    ids=["sync-pull", "ssp-pull", "sync-push"],
)
def test_a_wait_times_out_at_the_fake_deadline(
    mode: str, call: Callable[[Shard], Any], message: str
) -> None:
    shard, clock = make_shard(mode, max_wait_s=10.0)
    blocked = Call(lambda: call(shard))
    try:
        assert settle(blocked, clock)
        clock.set(9.5)
        reads = clock.reads
        shard.set_live([0, 1])  # the same members: only wakes the waiter
        assert settle(blocked, clock, reads), "timed out before its deadline"
        clock.set(10.0)
        shard.set_live([0, 1])
        with pytest.raises(ClockWaitTimeoutError) as caught:
            blocked.outcome()
        assert str(caught.value) == message
    finally:
        clock.set(1e9)  # whatever happened, let the thread go
        shard.set_live([0, 1])
        blocked.join(BOUND_S)
    before = values(shard)
    assert before == ([1.0] * 4, {})  # the timed-out push was not applied, nor a row created
    assert shard.clock_state().open_clock == 0


# ---- exactly once -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["async", "ssp", "sync"])
def test_a_duplicate_push_is_applied_once(mode: str) -> None:
    shard, _ = make_shard(mode)
    assert push_w(shard, 0, 7, 0, 2.0) is PushOutcome.APPLIED
    assert push_w(shard, 0, 7, 0, 2.0) is PushOutcome.DUPLICATE  # a retry
    assert push_emb(shard, 0, 8, [3], [[1.0, 1.0]]) is PushOutcome.APPLIED
    assert push_emb(shard, 0, 8, [3], [[1.0, 1.0]]) is PushOutcome.DUPLICATE
    divisor = 1
    if mode == "sync":
        shard.tick(0, 1, 0)
        shard.tick(1, 1, 0)  # finished without a gradient: counts, adds nothing
        divisor = 2
    dense, rows = values(shard)
    assert dense == [1 - 2.0 / divisor] * 4
    assert rows == {3: [1 - 1.0 / divisor] * 2}
    stats = {s.name: s.counters for s, _ in shard.stats()}
    assert (stats["w"].pushes_applied, stats["w"].pushes_duplicate) == (1, 1)
    assert (stats["emb"].pushes_applied, stats["emb"].pushes_duplicate) == (1, 1)


def test_the_same_number_from_a_new_incarnation_is_a_new_push() -> None:
    shard, _ = make_shard("async")
    meta = PushMeta(0, 1, 7)
    grad = torch.ones(4)
    assert push_dense(shard, "w", meta, grad) is PushOutcome.APPLIED
    restarted = PushMeta(0, 2, 7)
    assert push_dense(shard, "w", restarted, grad) is PushOutcome.APPLIED
    assert values(shard)[0] == [-1.0] * 4


# ---- assign if absent ---------------------------------------------------------------------------


def assign_w(shard: Shard, worker: int, seq: int, value: float, *, incarnation: int = 1,
             if_absent: bool = True) -> PushOutcome:
    meta = PushMeta(worker, incarnation, seq, assign=True, if_absent=if_absent)
    return push_dense(shard, "w", meta, torch.full((4,), value))


@pytest.mark.parametrize("mode", ["async", "ssp", "sync"])
def test_an_assign_if_absent_writes_once_and_is_kept_after(mode: str) -> None:
    shard, _ = make_shard(mode)
    assert assign_w(shard, 0, 1, 5.0) is PushOutcome.APPLIED
    assert assign_w(shard, 0, 1, 5.0) is PushOutcome.DUPLICATE  # a retry of the same push
    assert assign_w(shard, 1, 1, 7.0) is PushOutcome.KEPT  # another worker's, later
    assert assign_w(shard, 1, 1, 7.0) is PushOutcome.DUPLICATE  # kept counts as done
    # A restarted worker (a new incarnation) reusing the number is a new push, and kept.
    assert assign_w(shard, 0, 1, 9.0, incarnation=2) is PushOutcome.KEPT
    assert values(shard)[0] == [5.0] * 4
    counters = {s.name: s.counters for s, _ in shard.stats()}["w"]
    assert (counters.pushes_applied, counters.pushes_kept, counters.pushes_duplicate) == (1, 2, 2)
    # A plain assign still overwrites.
    assert assign_w(shard, 1, 2, 7.0, if_absent=False) is PushOutcome.APPLIED
    assert values(shard)[0] == [7.0] * 4


def test_an_applied_gradient_counts_as_written() -> None:
    shard, _ = make_shard("async")
    assert push_w(shard, 0, 1, 0, 2.0) is PushOutcome.APPLIED
    assert assign_w(shard, 1, 1, 5.0) is PushOutcome.KEPT
    assert values(shard)[0] == [-1.0] * 4


def test_of_workers_racing_to_assign_if_absent_exactly_one_writes() -> None:
    shard, _ = make_shard("async")
    barrier = threading.Barrier(8)
    outcomes: dict[int, PushOutcome] = {}

    def offer(worker: int) -> None:
        barrier.wait(timeout=BOUND_S)
        outcomes[worker] = assign_w(shard, worker, 1, float(worker))

    calls = [Call(partial(offer, w)) for w in range(8)]
    for call in calls:
        call.outcome()
    writers = [w for w, o in outcomes.items() if o is PushOutcome.APPLIED]
    assert len(writers) == 1
    assert sorted(o.value for o in outcomes.values()) == ["applied"] + ["kept"] * 7
    assert values(shard)[0] == [float(writers[0])] * 4


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_snapshot_restores_whether_a_dense_table_was_written(mode: str) -> None:
    shard, _ = make_shard(mode)
    blank = shard.snapshot("blank")
    assert assign_w(shard, 0, 1, 5.0) is PushOutcome.APPLIED
    written = shard.snapshot("written")
    shard.restore(blank)
    assert assign_w(shard, 1, 1, 6.0) is PushOutcome.APPLIED
    shard.restore(written)
    assert assign_w(shard, 1, 2, 7.0) is PushOutcome.KEPT
    assert values(shard)[0] == [5.0] * 4


def test_if_absent_is_refused_without_assign_and_on_sparse_tables() -> None:
    shard, _ = make_shard("async")
    with pytest.raises(InvalidArgumentError, match="if_absent without assign"):
        PushMeta(0, 1, 1, if_absent=True)
    before = values(shard)
    sparse = SparsePush("emb", PushMeta(0, 1, 1, assign=True, if_absent=True), F32, 2,
                        np.array([3], dtype=np.int64), codec.tensor_bytes(torch.ones(1, 2)))
    with pytest.raises(InvalidArgumentError, match="if_absent applies to dense tables only"):
        _one(shard, 0, sparse)
    assert values(shard) == before
    counters = {s.name: s.counters for s, _ in shard.stats()}["emb"]
    assert (counters.pushes_applied, counters.pushes_rejected) == (0, 1)
    # The number stays free.
    assert push_emb(shard, 0, 1, [3], [[1.0, 1.0]]) is PushOutcome.APPLIED


# ---- refusals change nothing --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "rows", "message"),
    [
        ([1, 2], [[0.0, float("nan")], [0.0, 0.0]], r"non-finite value \(nan\) at flat element 1"),
        ([1, 2], [[0.0, 0.0], [float("inf"), 0.0]], r"\(inf\) at flat element 2"),
        ([4, 4], [[1.0, 1.0], [1.0, 1.0]], "key 4 appears more than once"),
    ],
)
def test_a_refused_push_changes_nothing_and_its_number_stays_free(
    keys: list[int], rows: list[list[float]], message: str
) -> None:
    shard, _ = make_shard("async")
    push_emb(shard, 0, 1, [1, 4], [[0.5, 0.5], [0.5, 0.5]])
    before = values(shard)
    with pytest.raises(InvalidArgumentError, match=message):
        push_emb(shard, 0, 2, keys, rows)
    assert values(shard) == before
    counters = {s.name: s.counters for s, _ in shard.stats()}["emb"]
    assert (counters.pushes_applied, counters.pushes_rejected) == (1, 1)
    # The corrected push, sent again under the same number, is applied.
    assert push_emb(shard, 0, 2, [1, 2], [[1.0, 1.0], [1.0, 1.0]]) is PushOutcome.APPLIED
    assert values(shard)[1] == {1: [-0.5, -0.5], 4: [0.5, 0.5], 2: [0.0, 0.0]}


def test_a_table_that_allows_non_finite_values_takes_them() -> None:
    shard = Shard(ShardConfig(0, 1, mode=modes.ASYNC), clock=FakeClock())
    shard.declare([TableSpec("w", "dense", F32, shape=(2,), init=ONES, optimizer=SGD_1,
                             allow_non_finite=True)])
    grad = torch.tensor([float("inf"), 1.0])
    push_dense(shard, "w", PushMeta(0, 1, 1), grad)
    assert pull_dense(shard, "w", 0, 0).tolist() == [float("-inf"), 0.0]


def test_a_refused_exchange_changes_nothing() -> None:
    shard, _ = make_shard("sync")
    good = DensePush("w", PushMeta(0, 1, 1, 0), F32, (4,), [(0, torch.ones(4))])
    bad = SparsePush("emb", PushMeta(0, 1, 2, 0), F32, 3, np.array([1], dtype=np.int64),
                     codec.tensor_bytes(torch.ones(1, 3)))
    request = Exchange(worker=0, incarnation=1, generation=0, push_clock=0,
                       pushes=[good, bad], end_iteration=True, pull_clock=1,
                       pulls=[Pull("w")])
    with pytest.raises(InvalidArgumentError, match="has dim 2; the push carries dim 3"):
        shard.exchange(request)
    assert values(shard) == ([1.0] * 4, {})
    state = shard.clock_state()
    assert (state.open_clock, state.clocks) == (0, {0: 0, 1: 0})  # the iteration did not end
    # Its pushes' numbers are still free: the corrected exchange applies them.
    fixed = Exchange(worker=0, incarnation=1, generation=0, push_clock=0, pushes=[good],
                     end_iteration=True, pull_clock=0, pulls=[Pull("w")])
    result = shard.exchange(fixed)
    assert result.outcomes == [PushOutcome.APPLIED]
    assert result.open_clock == 0


# ---- what requests may make the shard hold -------------------------------------------------------

W = TableSpec("w", "dense", F32, shape=(4,), init=ONES, optimizer=SGD_1)
EMB = TableSpec("emb", "sparse", F32, dim=2, init=ONES, optimizer=SGD_1)


def budget_shard(rows: int = 0, mode: str = "async", workers: int = 2,
                 max_new_rows: int = 1 << 24) -> tuple[Shard, FakeClock, int]:
    """make_shard's tables on a shard whose memory budget holds "emb" at `rows` rows (its
    storage for exactly them, its index for them) beside "w"; no budget for 0 rows. Returns
    the budget too."""
    budget = rows and (DenseTable.bytes_for(W, RowRange(0, 0, 4))
                       + SparseTable.bytes_for(EMB, rows, capacity_for(rows)))
    clock = FakeClock()
    limits = Limits(memory_budget_bytes=budget, max_new_rows=max_new_rows)
    shard = Shard(ShardConfig(0, 1, mode=modes.parse(mode), quorum=Quorum(workers),
                              max_wait_s=10.0, limits=limits), clock=clock)
    shard.declare([W, EMB])
    return shard, clock, budget


def span(start: int, stop: int) -> np.ndarray:
    return np.arange(start, stop, dtype=np.int64)


def emb_push(worker: int, seq: int, keys: np.ndarray, clock: int = 0) -> SparsePush:
    return SparsePush("emb", PushMeta(worker, 1, seq, clock), F32, 2, keys,
                      codec.tensor_bytes(torch.ones(len(keys), 2)))


def step(shard: Shard, worker: int, pushes: list[SparsePush], pulls: list[Pull],
         end_iteration: bool = False, clock: int = 0) -> Any:
    return shard.exchange(Exchange(worker=worker, incarnation=1, generation=0,
                                   push_clock=clock, pushes=pushes,
                                   end_iteration=end_iteration, pull_clock=clock + end_iteration,
                                   pulls=pulls))


def held(shard: Shard) -> dict[str, tuple[int, int, Any]]:
    """Each table's rows, memory and counters."""
    return {s.name: (s.rows, s.memory_bytes, s.counters) for s, _ in shard.stats()}


def test_new_rows_past_the_memory_budget_are_refused_whole_and_change_nothing() -> None:
    shard, _, budget = budget_shard(3000)
    for seq, start in enumerate((0, 1000, 2000), 1):
        assert push_sparse(shard, "emb", PushMeta(0, 1, seq), 2, span(start, start + 1000),
                           codec.tensor_bytes(torch.ones(1000, 2))) is PushOutcome.APPLIED
    assert shard.memory_bytes() == budget  # filled to the byte, never past it
    before, stats, clocks = values(shard), held(shard), shard.clock_state()
    # Known and new keys pushed, the iteration ended, new keys pulled: refused as a whole.
    request = [emb_push(0, 4, np.concatenate([span(0, 10), span(5000, 5002)]))]
    with pytest.raises(ResourceExhaustedError) as err:
        step(shard, 0, request, [Pull("emb", span(6000, 6004)), Pull("w")], end_iteration=True)
    assert str(err.value) == (
        f"table 'emb': creating 6 new rows would take this server to "
        f"{format_size(budget + 6 * 8)}, over its --memory-budget of {format_size(budget)} "
        f"(it holds {format_size(budget)} now); raise the budget, add servers, send fewer "
        "new keys, or declare the table with max_rows or a TTL to evict rows"
    )
    assert (values(shard), held(shard), shard.clock_state()) == (before, stats, clocks)
    # A pull alone of one new key is refused too.
    with pytest.raises(ResourceExhaustedError, match="creating 1 new rows"):
        pull_sparse(shard, "emb", 1, 0, span(2999, 3001))
    assert (values(shard), held(shard)) == (before, stats)
    # The refused push's number is still free: the same number over known keys applies.
    result = step(shard, 0, [emb_push(0, 4, span(0, 10))], [Pull("emb", span(0, 3000))],
                  end_iteration=True)
    assert result.outcomes == [PushOutcome.APPLIED] and len(result.pulled[0]) == 3000
    assert values(shard)[1][0] == [-1.0, -1.0] and shard.memory_bytes() == budget


def test_a_bounded_table_at_max_rows_takes_new_keys_within_its_budget() -> None:
    """It evicts before it creates rows: a budget holding max_rows rows is enough."""
    bounded = TableSpec("lru", "sparse", F32, dim=2, init=ONES, optimizer=SGD_1,
                        max_rows=3000, ttl_clocks=100)
    budget = SparseTable.bytes_for(bounded, 3000, capacity_for(3000))
    limits = Limits(memory_budget_bytes=budget)
    shard = Shard(ShardConfig(0, 1, mode=modes.parse("async"), quorum=Quorum(1),
                              max_wait_s=10.0, limits=limits), clock=FakeClock())
    shard.declare([bounded])
    for clock, start in enumerate(range(0, 6000, 1000)):
        pull_sparse(shard, "lru", 0, clock, span(start, start + 1000))
        assert shard.memory_bytes() <= budget
    (stats, _), = shard.stats()
    assert (stats.rows, stats.counters.evicted) == (3000, 3000)
    # Its stamps are int32 clocks: a request past them is refused before room is reserved.
    with pytest.raises(InvalidArgumentError, match="clock 2147483648"):
        pull_sparse(shard, "lru", 0, 2**31, span(9000, 9010))
    assert shard.stats()[0][0].rows == 3000 and shard.memory_bytes() <= budget


def test_the_budget_counts_each_new_key_once_across_a_request() -> None:
    """Pushing new keys and pulling the same ones (a worker's usual step) asks for each row
    once; so does a pull that names a new key twice."""
    shard, _, budget = budget_shard(1024)  # a sparse table's first allocation
    keys = span(0, 1024)
    result = step(shard, 0, [emb_push(0, 1, keys)],
                  [Pull("emb", keys), Pull("emb", np.concatenate([keys[::-1], keys]))])
    assert result.outcomes == [PushOutcome.APPLIED]
    assert held(shard)["emb"][:2] == (1024, budget - DenseTable.bytes_for(W, RowRange(0, 0, 4)))


def test_a_table_near_the_budget_leaves_room_for_the_others() -> None:
    """Growth under a budget takes half the room left, not all of it: a second table still
    gets rows after the first grew near the budget."""
    shard, _, budget = budget_shard(3000)
    shard.declare([TableSpec("other", "sparse", F32, dim=2, init=ONES, optimizer=SGD_1)])
    step(shard, 0, [emb_push(0, 1, span(0, 2000))], [])
    assert shard.memory_bytes() < budget
    step(shard, 0, [], [Pull("other", span(0, 10))])
    assert held(shard)["other"][0] == 10 and shard.memory_bytes() <= budget


def test_rows_admitted_for_a_waiting_request_count_against_the_next() -> None:
    """An ssp pull of new keys waits for the clocks with its rows admitted but not yet made;
    a push of other new keys meanwhile, which would fit alone, is refused, and the room is
    given back once the pull is served."""
    shard, clock, budget = budget_shard(3000, mode="ssp")
    shard.tick(0, 1, 0)
    pull = Call(lambda: pull_sparse(shard, "emb", 0, 1, span(0, 2000)))
    assert settle(pull, clock)
    with pytest.raises(ResourceExhaustedError, match="creating 2000 new rows"):
        step(shard, 1, [emb_push(1, 1, span(10_000, 12_000))], [])
    assert held(shard)["emb"][0] == 0
    shard.tick(1, 1, 0)
    assert len(pull.outcome()) == 2000
    assert shard.memory_bytes() <= budget
    # What the pull reserved is back: its rows count now, as rows.
    step(shard, 1, [emb_push(1, 1, span(10_000, 11_000))], [], clock=1)
    assert held(shard)["emb"][0] == 3000 and shard.memory_bytes() <= budget


@pytest.mark.parametrize("budgeted", [False, True])
def test_max_new_rows_bounds_what_one_request_creates_over_all_its_tables(
    budgeted: bool,
) -> None:
    shard, _, _ = budget_shard(10_000 if budgeted else 0, max_new_rows=100)
    shard.declare([TableSpec("emb2", "sparse", F32, dim=2, init=ONES, optimizer=SGD_1)])
    keys = span(0, 100)
    step(shard, 0, [emb_push(0, 1, keys)], [Pull("emb", keys), Pull("emb", keys[::-1])])
    # Known keys are not counted: 100 known and 100 new pass.
    step(shard, 0, [], [Pull("emb", span(0, 200))])
    before, stats = values(shard), held(shard)
    with pytest.raises(ResourceExhaustedError) as err:
        step(shard, 0, [emb_push(0, 2, span(200, 260))], [Pull("emb2", span(0, 41))])
    assert str(err.value) == (
        "this exchange would create 101 new rows (table 'emb': 60, table 'emb2': 41), over "
        "this server's limit of 100 per request (--max-new-rows); send fewer new keys per "
        "request"
    )
    assert (values(shard), held(shard)) == (before, stats)


def test_a_declare_past_the_budget_is_refused_whole() -> None:
    shard, _, budget = budget_shard(3000)
    big = TableSpec("big", "dense", F32, shape=(1000, 100), init=ONES,
                    optimizer=OptimizerConfig("adam", (("lr", 0.1),)))
    small = TableSpec("small", "sparse", F32, dim=2, init=ONES, optimizer=SGD_1)
    held_now = shard.memory_bytes()
    with pytest.raises(ResourceExhaustedError) as err:
        shard.declare([small, big])
    projected = held_now + SparseTable.bytes_for(small) + 3 * 400_000 + 8
    assert str(err.value) == (
        f"table 'big': declaring it would take this server to {format_size(projected)}, over "
        f"its --memory-budget of {format_size(budget)} (it holds {format_size(held_now)} "
        "now); raise the budget, add servers, or declare a smaller table"
    )
    assert set(held(shard)) == {"w", "emb"}
    shard.declare([small])
    assert set(held(shard)) == {"w", "emb", "small"}


@pytest.mark.parametrize("admit", ["prob:0.25", "count:2"])
def test_ids_the_admission_rule_refuses_take_no_room_in_the_budget(admit: str) -> None:
    """A table under a budget for its admitted rows only serves pulls of four times as
    many ids: refused ids make no row, so the budget does not count them."""
    spec = TableSpec("adm", "sparse", F32, dim=2, init=ONES, optimizer=SGD_1, admit=admit)
    keys = span(0, 4000)
    admitted = (int(admitted_by_probability(keys, 0, 0.25).sum()) if admit.startswith("prob")
                else 1000)
    budget = SparseTable.bytes_for(spec, 1024, capacity_for(admitted))
    shard = Shard(ShardConfig(0, 1, limits=Limits(memory_budget_bytes=budget)),
                  clock=FakeClock())
    shard.declare([spec])
    if admit.startswith("count"):
        pull_sparse(shard, "adm", 1, 0, span(0, 1000))  # first sight: no rows
        pull_sparse(shard, "adm", 1, 0, np.concatenate([span(0, 1000), span(5000, 8000)]))
    else:
        pull_sparse(shard, "adm", 1, 0, keys)
    stats = next(s for s, _ in shard.stats() if s.name == "adm")
    assert stats.rows == admitted and shard.memory_bytes() <= budget


# ---- consistent cuts (async and ssp checkpoints) ----------------------------------------------


def tick_w(shard: Shard, worker: int, seq: int, clock: int, value: float, *, cut: str = "",
           cut_clock: int = 0, position: bytes = b"", acked_clock: int = 0) -> Any:
    """Worker `worker`'s step `clock`: a push to "w" and the end of the iteration, marking
    `cut` if given, its iterations before `acked_clock` answered by every shard."""
    push = DensePush("w", PushMeta(worker, 1, seq, clock), F32, (4,),
                     [(0, torch.full((4,), value))])
    return shard.exchange(Exchange(
        worker=worker, incarnation=1, generation=0, push_clock=clock, pushes=[push],
        end_iteration=True, pull_clock=clock + 1, pulls=[], position=position, cut=cut,
        cut_clock=cut_clock, acked_clock=acked_clock))


def steps(shard: Shard, clocks: range) -> None:
    """Workers 0 and 1 each step through `clocks`, every earlier iteration answered."""
    for clock in clocks:
        for worker in (0, 1):
            tick_w(shard, worker, clock + 1, clock, 0.0, acked_clock=clock)


def restored_behind(mode: str, staleness: int) -> tuple[Shard, FakeClock]:
    """A shard restored from its snapshot at clock 10 after workers 0 and 1 went on to 30:
    what an async or ssp shard is after a restart, its workers carrying on from their own
    clocks (they do not roll back)."""
    shard, clock = make_shard(mode, staleness=staleness)
    for worker in (0, 1):
        shard.join(worker, 1)
    steps(shard, range(10))
    state = shard.snapshot("at-10")
    steps(shard, range(10, 30))
    shard.restore(state)
    return shard, clock


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_restored_shard_follows_workers_that_went_on_from_their_own_clocks(mode: str) -> None:
    # The iterations since the checkpoint never tick here again, and each exchange's
    # acknowledged clock says so.
    shard, _ = restored_behind(mode, staleness=3)
    assert shard.clock_state().open_clock == 10
    steps(shard, range(30, 130))
    assert shard.clock_state().open_clock == 130
    assert shard.board.held() == 0  # nothing kept for clocks that never come


def test_a_restored_ssp_shard_serves_read_only_pulls_of_workers_that_went_on() -> None:
    # Workers past the checkpoint that only pull from the restored shard, as they do when
    # they evaluate after training: each pull's acknowledged clock says where its worker
    # is, so the staleness bound holds them only for each other.
    shard, clock = restored_behind("ssp", staleness=2)

    def read(worker: int) -> torch.Tensor:
        result = shard.exchange(Exchange(
            worker=worker, incarnation=1, generation=0, push_clock=30, pushes=[],
            end_iteration=False, pull_clock=30, pulls=[Pull("w")], acked_clock=30))
        pulled: torch.Tensor = result.pulled[0]
        return pulled.clone()

    first = Call(lambda: read(0))
    assert settle(first, clock)  # worker 1 is still at 10 here, as far as the shard knows
    # Worker 1 says it is at 30: both pulls are within the bound.
    assert Call(lambda: read(1)).outcome().shape == (4,)
    assert first.outcome().shape == (4,)


def test_a_sync_snapshot_takes_a_worker_that_ticked_early_at_the_open_clock() -> None:
    # Worker 1 had nothing to push to this shard in iterations 3 and 4: its tick for 4 came
    # before clock 4 opened. The snapshot at clock 4 holds clocks 0-3; a rollback to it
    # replays iteration 4 for every worker, so all of them rejoin at 4 and clock 4 closes.
    # (Taken at 5, worker 1 would resume at 5 everywhere: its gradients of iteration 4 to
    # the other shards lost, and clock 4 here waiting for its tick for good.)
    shard, _ = make_shard("sync", workers=2)
    for worker in (0, 1):
        shard.join(worker, 1)
    for clock in range(3):
        for worker in (0, 1):
            tick_w(shard, worker, clock + 1, clock, 1.0)
    for clock in (3, 4):
        shard.exchange(Exchange(worker=1, incarnation=1, generation=0, push_clock=clock,
                                pushes=[], end_iteration=True, pull_clock=clock + 1, pulls=[]))
    taken: list[Any] = []
    shard.snapshot_at(4, "clock-4", taken.append)
    tick_w(shard, 0, 4, 3, 1.0)  # closes clock 3: the snapshot
    deadline = time.monotonic() + BOUND_S
    while not taken and time.monotonic() < deadline:
        time.sleep(0.001)
    (state,) = taken
    assert state.clock == 4 and state.meta["clocks"] == {"0": 4, "1": 4}
    shard.restore(state, generation=1)
    assert [shard.join(worker, 2, 1)[0] for worker in (0, 1)] == [4, 4]
    for worker in (0, 1):
        shard.exchange(Exchange(worker=worker, incarnation=2, generation=1, push_clock=4,
                                pushes=[], end_iteration=True, pull_clock=5, pulls=[]))
    assert shard.clock_state().open_clock == 5


def test_a_sync_snapshot_at_a_clock_passed_says_it_was_skipped_and_one_ahead_is_taken() -> None:
    shard, _ = make_shard("sync", workers=1)
    shard.join(0, 1)
    for step in range(3):
        tick_w(shard, 0, step + 1, step, 1.0)
    taken: list[Any] = []
    shard.snapshot_at(1, "late", taken.append)  # the open clock is 3
    assert taken == [Skipped("late", "shard 0 was past clock 1 (at 3) when it was asked")]
    shard.snapshot_at(4, "ahead", taken.append)
    assert len(taken) == 1  # taken once clock 4 opens
    tick_w(shard, 0, 4, 3, 1.0)
    deadline = time.monotonic() + BOUND_S
    while len(taken) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [type(t).__name__ for t in taken] == ["Skipped", "ShardState"]
    assert taken[1].checkpoint_id == "ahead" and taken[1].clock == 4


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_cut_holds_each_worker_past_its_mark_until_every_worker_reached_it(mode: str) -> None:
    shard, clock = make_shard(mode, staleness=2)
    for worker in (0, 1):
        shard.join(worker, 1)  # as worker.init() does: a worker never seen is not waited for
    taken: list[Any] = []
    assert shard.cut("c1", taken.append)
    # Told of the cut by its next answer, each worker marks it on the exchange after.
    assert tick_w(shard, 0, 1, 0, 1.0, position=b"w0 after 0").cut == "c1"
    # Worker 0's next step lies past its mark (cut clock 1): it waits for worker 1.
    reads = clock.reads
    held = Call(partial(tick_w, shard, 0, 2, 1, 10.0, cut="c1", cut_clock=1,
                        position=b"w0 after 1"))
    assert settle(held, clock, reads)
    assert tick_w(shard, 1, 1, 0, 2.0, position=b"w1 after 0").cut == "c1"
    assert not taken
    # Worker 1 marks at its clock 1 too: every iteration before both marks has ticked.
    tick_w(shard, 1, 2, 1, 20.0, cut="c1", cut_clock=1, position=b"w1 after 1")
    held.outcome()
    deadline = time.monotonic() + BOUND_S
    while not taken and time.monotonic() < deadline:
        time.sleep(0.001)
    (state,) = taken
    w = {t.name: t.tensors for t in state.tables}["w"]["value"]
    # SGD with lr 1 from ones: the cut holds both workers' iteration 0 and nothing after.
    assert w.tolist() == [1.0 - 1.0 - 2.0] * 4
    assert state.meta["clocks"] == {"0": 1, "1": 1}
    assert state.meta["positions"] == {"0": "w0 after 0", "1": "w1 after 0"}
    # After the cut both iterations 1 applied, and answers no longer tell of it.
    assert values(shard)[0] == [1.0 - 3.0 - 30.0] * 4
    assert tick_w(shard, 0, 3, 2, 0.0).cut == ""


def test_a_cut_a_live_worker_never_reaches_is_given_up_at_the_wait_limit() -> None:
    shard, clock = make_shard("async", max_wait_s=10.0)
    for worker in (0, 1):
        shard.join(worker, 1)
    taken: list[Any] = []
    shard.cut("c1", taken.append)
    reads = clock.reads
    held = Call(partial(tick_w, shard, 0, 1, 0, 1.0, cut="c1", cut_clock=0))
    assert settle(held, clock, reads)
    # Worker 1 joined and is live but never steps: at the limit the cut is given up, and
    # the held step goes on.
    clock.set(11.0)
    held.outcome()
    deadline = time.monotonic() + BOUND_S
    while not taken and time.monotonic() < deadline:
        time.sleep(0.001)
    (skipped,) = taken
    assert isinstance(skipped, Skipped) and skipped.checkpoint_id == "c1"
    assert "worker(s) [1] did not reach it" in skipped.reason, skipped
    assert values(shard)[0] == [0.0] * 4
    # A new cut may start: the given-up one holds nothing back.
    assert shard.cut("c2", taken.append)


def test_a_late_mark_of_a_cut_that_is_over_does_not_count_for_the_next_one() -> None:
    # c1 was given up here; a worker's mark of c1 that arrives while c2 is under way is a
    # mark of a cut that is over. Counted for c2, it let c2 be taken without that worker.
    shard, clock = make_shard("async", max_wait_s=10.0)
    for worker in (0, 1):
        shard.join(worker, 1)
    taken: list[Any] = []
    shard.on_cut(taken.append)  # as a server does: a worker's mark may start a cut here
    shard.cut("c1", taken.append)
    clock.set(11.0)
    assert shard.cut("c2", taken.append)  # gives up c1, starts c2
    shard.exchange(Exchange(worker=1, incarnation=1, generation=0, push_clock=0, pushes=[],
                            end_iteration=False, pull_clock=0, pulls=[], cut="c1",
                            cut_clock=0))
    reads = clock.reads
    held = Call(partial(tick_w, shard, 0, 1, 0, 1.0, cut="c2", cut_clock=0))
    assert settle(held, clock, reads)  # c2 still waits for worker 1's own mark of it
    assert [t.checkpoint_id for t in taken] == ["c1"]
    shard.exchange(Exchange(worker=1, incarnation=1, generation=0, push_clock=0, pushes=[],
                            end_iteration=False, pull_clock=0, pulls=[], cut="c2",
                            cut_clock=0))
    held.outcome()
    deadline = time.monotonic() + BOUND_S
    while len(taken) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [t.checkpoint_id for t in taken] == ["c1", "c2"]


def mark(shard: Shard, worker: int, cut: str, cut_clock: int) -> Any:
    """An exchange that only marks `cut` (as a worker's probe does)."""
    return shard.exchange(Exchange(worker=worker, incarnation=1, generation=0, push_clock=0,
                                   pushes=[], end_iteration=False, pull_clock=0, pulls=[],
                                   cut=cut, cut_clock=cut_clock))


def taken_ids(taken: list[Any], count: int) -> list[str]:
    deadline = time.monotonic() + BOUND_S
    while len(taken) < count and time.monotonic() < deadline:
        time.sleep(0.001)
    return [t.checkpoint_id for t in taken]


def test_a_cut_marked_while_another_is_under_way_is_given_up_when_it_begins() -> None:
    # After a restart the shards may begin two cuts in different orders: here c1 is under
    # way when worker 0 marks c2 (begun first elsewhere). This shard cannot keep worker 0's
    # iterations after c2 apart from those before c1; it gave c2 up only after a minute of
    # holding the workers that marked it.
    shard, clock = make_shard("async", max_wait_s=120.0)
    for worker in (0, 1):
        shard.join(worker, 1)
    taken: list[Any] = []
    shard.on_cut(taken.append)
    assert shard.cut("c1", taken.append)
    mark(shard, 0, "c2", 0)
    assert not shard.cut_started("c2")
    for worker in (0, 1):
        mark(shard, worker, "c1", 0)
    assert taken_ids(taken, 1) == ["c1"]
    assert shard.cut("c2", taken.append)  # the server's request: given up at once
    assert taken_ids(taken, 2) == ["c1", "c2"]
    assert isinstance(taken[1], Skipped)
    assert "gave up its cut at once: worker 0 marked it while the cut of c1" in taken[1].reason
    # Nobody is held for it: worker 1 steps past its own late mark of c2.
    step = Call(partial(tick_w, shard, 1, 1, 0, 1.0, cut="c2", cut_clock=0))
    assert not settle(step, clock, clock.reads)
    step.outcome()
    assert values(shard)[0] == [0.0] * 4


def test_a_mark_that_comes_after_iterations_past_its_clock_gives_the_cut_up_at_once() -> None:
    # A shard that began the cut after the worker's mark went by (or restarted since) and
    # was told it again: the worker's iterations 0-2 are here, past its cut clock 1.
    shard, clock = make_shard("async", max_wait_s=120.0)
    for worker in (0, 1):
        shard.join(worker, 1)
    for step in range(3):
        tick_w(shard, 0, step + 1, step, 1.0)
    taken: list[Any] = []
    assert shard.cut("c1", taken.append)
    held = Call(partial(tick_w, shard, 1, 1, 0, 1.0, cut="c1", cut_clock=0))
    assert settle(held, clock, clock.reads)  # worker 1 marked: held for worker 0
    mark(shard, 0, "c1", 1)
    held.outcome()
    assert taken_ids(taken, 1) == ["c1"]
    assert isinstance(taken[0], Skipped)
    assert ("worker 0 marked it at clock 1 after its iterations up to 2 had reached this "
            "shard") in taken[0].reason
    assert shard.cut("c2", taken.append)  # the next cut may begin


def test_a_cut_waits_for_a_worker_that_joined_before_the_scheduler_lists_it_live() -> None:
    # Worker 1 restarted and joined every shard; the scheduler, late (Redis restarted
    # empty), has told another shard it is live but not this one yet. Taken without its
    # mark here, the cut held one iteration of it more than on the other shard.
    shard, _ = make_shard("async", max_wait_s=120.0)
    shard.set_live([0])
    shard.join(0, 1)
    shard.join(1, 1)  # new here: a restarted process
    taken: list[Any] = []
    assert shard.cut("c1", taken.append)
    mark(shard, 0, "c1", 0)
    assert not shard.cut("c2", taken.append)  # c1 is still under way: it waits for worker 1
    tick_w(shard, 1, 1, 0, 1.0, cut="c1", cut_clock=0)
    assert taken_ids(taken, 1) == ["c1"]
    w = {t.name: t.tensors for t in taken[0].tables}["w"]["value"]
    assert w.tolist() == [1.0] * 4  # worker 1's iteration 0 came after the cut
    assert values(shard)[0] == [0.0] * 4


def test_checkpoints_asked_while_a_cut_is_under_way_are_told_to_wait_once_per_cut(
        caplog: pytest.LogCaptureFixture) -> None:
    shard, clock = make_shard("async")
    for worker in (0, 1):
        shard.join(worker, 1)
    assert shard.cut("c1", lambda state: None)
    with caplog.at_level(logging.WARNING, logger="ps.shard"):
        for _ in range(5):  # the server asks on every heartbeat
            assert not shard.cut("c2", lambda state: None)
        assert not shard.cut("c3", lambda state: None)  # the next period's checkpoint
        clock.set(11.0)  # c1 is given up; c4 starts the next cut, which c5 waits for
        assert shard.cut("c4", lambda state: None)
        assert not shard.cut("c5", lambda state: None)
    said = [r.getMessage() for r in caplog.records if "is under way" in r.getMessage()]
    assert said == [f"shard 0: checkpoint {c} waits: the cut of {cut} is under way (later "
                    "checkpoints that wait for it are not logged)"
                    for c, cut in (("c2", "c1"), ("c5", "c4"))]


def test_a_cut_with_no_live_worker_is_taken_at_once_and_a_dead_worker_releases_one() -> None:
    shard, _ = make_shard("async")
    for worker in (0, 1):
        shard.join(worker, 1)
    taken: list[Any] = []
    shard.set_live([])
    shard.cut("idle", taken.append)
    shard.set_live([0, 1])
    shard.cut("c2", taken.append)
    tick_w(shard, 0, 1, 0, 1.0, cut="c2", cut_clock=1)
    shard.set_live([0])  # worker 1 was declared dead: the cut no longer waits for it
    deadline = time.monotonic() + BOUND_S
    while len(taken) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [s.checkpoint_id for s in taken] == ["idle", "c2"]


def test_a_worker_marking_a_cut_the_shard_has_not_heard_of_starts_it() -> None:
    shard, _ = make_shard("async", workers=1)
    taken: list[Any] = []
    tick_w(shard, 0, 1, 0, 1.0, cut="early", cut_clock=0)  # no writer yet: ignored
    assert not taken and not shard.cut_started("early")
    shard.on_cut(taken.append)
    tick_w(shard, 0, 2, 1, 1.0, cut="early", cut_clock=1)
    deadline = time.monotonic() + BOUND_S
    while not taken and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [s.checkpoint_id for s in taken] == ["early"]
    # The server's request, read after the mark, finds it started (and does not wait for
    # the write of this very cut as if it were an earlier one's).
    assert shard.cut_started("early") and not shard.cut_started("later")
    with pytest.raises(InvalidArgumentError, match="not a checkpoint id"):
        tick_w(shard, 0, 3, 2, 1.0, cut="../x", cut_clock=2)
