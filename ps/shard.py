"""One shard of the parameter server: its tables, the push ledger and the consistency executor.

The shard validates a request against its table, admits a push through the exactly-once
ledger, asks the table's policy whether to serve now, and then waits, aggregates, applies or
drops as the policy says. Policies decide; only this module waits, locks and applies.
Every method is thread-safe and may be called from many gRPC threads at once.
"""

from __future__ import annotations

import collections
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from protos.codec import tensor_from_bytes
from protos.modes import ASYNC, Mode
from protos.partition import RowRange, dense_placement
from ps.aggregate import Aggregate, DenseSum, SparseSum
from ps.checkpoint import DELTA, FULL, ROWS, ShardState, TableState, materialized
from ps.clocks import ClockBoard, Quorum
from ps.concurrency import Turn
from ps.consistency import ClockView, Decision, Policy, make_policy
from ps.deltas import SnapshotLog
from ps.errors import (
    CallEndedError,
    ClockWaitTimeoutError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PSError,
    ResourceExhaustedError,
    RolledBackError,
)
from ps.index import count_distinct
from ps.ledger import Admission, PushLedger
from ps.limits import Limits, format_size
from ps.tables import (
    DenseTable,
    SparseRows,
    SparseTable,
    Table,
    TableSpec,
    TableStats,
    check_finite,
    check_same_spec,
    grown_capacity,
)

log = logging.getLogger(__name__)

S = TypeVar("S", DenseSum, SparseSum)

# Served ssp pulls remembered for inspection (GetStats with pull_log).
PULL_LOG_SIZE = 100_000


# Clocks, generations and worker ids beyond these are refused before they are stored: far
# past any job, and clock + 1 still fits every int64 field that reports it.
MAX_CLOCK = 1 << 62
# A checkpoint id, as a cut's mark carries it (the checkpoint module's name rule).
_CUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
MAX_WORKER = 1 << 31


# Whether the caller still waits for the answer (gRPC's context.is_active); None: always.
Alive = Callable[[], bool] | None
# How often a wait for the clocks looks whether its caller is still there.
ALIVE_POLL_S = 0.2
# The longest a checkpoint's cut may hold a worker (at most the shard's wait limit): a live
# worker that has stopped stepping (evaluating, stuck) makes the checkpoint fail, not the job.
CUT_WAIT_S = 60.0
# Recent cuts remembered (begun here, or crossed: marked while another was under way).
CUTS_KEPT = 64


def check_range(what: str, value: int, end: int) -> None:
    """InvalidArgumentError unless 0 <= value < end."""
    if not 0 <= value < end:
        raise InvalidArgumentError(f"{what} must lie in [0, {end}), got {value}")


@dataclass(frozen=True)
class ShardConfig:
    shard: int
    num_shards: int
    job: str = ""
    incarnation: int = 1
    mode: Mode = ASYNC  # of tables declared without a mode of their own
    staleness: int = 0  # the ssp bound of tables (and a default mode) declared "ssp" without one
    quorum: Quorum = field(default_factory=Quorum)
    # Longest a pull or push may wait for the clocks to move, unless the request asks less.
    max_wait_s: float = 300.0
    # How long a retried push waits for its first attempt, still being applied, to finish.
    inflight_wait_s: float = 30.0
    limits: Limits = field(default_factory=Limits)
    # A full snapshot every this many, the others deltas (ps/deltas.py); 1: all full.
    checkpoint_full_every: int = 1

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise InvalidArgumentError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard < self.num_shards:
            raise InvalidArgumentError(
                f"shard must be in [0, {self.num_shards}), got {self.shard}"
            )
        if self.staleness < 0:
            raise InvalidArgumentError(f"staleness must be >= 0, got {self.staleness}")
        if self.checkpoint_full_every < 1:
            raise InvalidArgumentError(
                f"checkpoint_full_every must be >= 1 (1: every checkpoint full), got "
                f"{self.checkpoint_full_every}"
            )
        if self.mode.staleness not in (None, self.staleness):
            raise InvalidArgumentError(
                f"mode {self.mode} and staleness {self.staleness} disagree; give the bound once"
            )


@dataclass(frozen=True)
class PushMeta:
    """Who sent a push and at which clock; (worker, incarnation, seq) makes it unique.

    `assign` overwrites values instead of running the optimizer; with `if_absent` too, only
    a dense block never written before is overwritten (InvalidArgumentError without assign).
    """

    worker: int
    incarnation: int
    seq: int
    clock: int = 0
    assign: bool = False
    wait_s: float = 0.0  # 0: the shard's limit
    generation: int = 0  # the job's rollback count the worker joined under
    if_absent: bool = False

    def __post_init__(self) -> None:
        if self.if_absent and not self.assign:
            raise InvalidArgumentError(
                f"push {self.seq} of worker {self.worker} asks for if_absent without assign; "
                "if_absent makes an assign conditional, so set assign too (or drop if_absent "
                "to push a gradient)"
            )


@dataclass(frozen=True)
class SparsePush:
    table: str
    meta: PushMeta
    dtype: torch.dtype
    dim: int
    keys: np.ndarray
    values: memoryview


@dataclass(frozen=True)
class DensePush:
    table: str
    meta: PushMeta
    dtype: torch.dtype
    shape: tuple[int, ...]
    # The block's gradient (or values) as (flat element offset, 1-d slice) parts covering it
    # once, as they came off the wire; empty for an empty block.
    parts: Sequence[tuple[int, torch.Tensor]]


@dataclass(frozen=True)
class Pull:
    table: str
    keys: np.ndarray | None = None  # None: the dense block


@dataclass(frozen=True)
class Exchange:
    """One worker step on this shard: pushes at `push_clock`, then (optionally) the end of
    iteration `push_clock`, then pulls at `pull_clock`."""

    worker: int
    incarnation: int
    generation: int
    push_clock: int
    pushes: Sequence[SparsePush | DensePush]
    end_iteration: bool
    pull_clock: int
    pulls: Sequence[Pull]
    wait_s: float = 0.0
    # With end_iteration: the worker's data position once iteration push_clock is done.
    position: bytes = b""
    # The worker has reached the cut of checkpoint `cut`: its iterations from cut_clock on
    # come after it.
    cut: str = ""
    cut_clock: int = 0
    # Every iteration of the worker before this one was answered by every shard.
    acked_clock: int = 0

    def __post_init__(self) -> None:
        check_range("the worker id", self.worker, MAX_WORKER)
        check_range("the generation", self.generation, MAX_CLOCK)
        check_range("the push clock", self.push_clock, MAX_CLOCK)
        check_range("the pull clock", self.pull_clock, MAX_CLOCK)
        check_range("the cut clock", self.cut_clock, MAX_CLOCK)
        check_range("the acknowledged clock", self.acked_clock, MAX_CLOCK)


@dataclass(frozen=True)
class _Prepared:
    """A push that passed every check, ready to go through the ledger and the policy."""

    name: str
    table: Table
    policy: Policy
    meta: PushMeta
    apply: Callable[[], bool]  # False: an assign if absent kept the table's values
    aggregate: Callable[[], None]
    # A sparse push: its keys (unique), with their row ids as checked, -1 where new.
    keys: np.ndarray | None = None
    known: np.ndarray | None = None


class PushOutcome(Enum):
    APPLIED = "applied"  # applied now, or aggregated into its sync clock
    DUPLICATE = "duplicate"  # applied before; nothing changed
    KEPT = "kept"  # an assign if absent found the block written; nothing changed
    DROPPED = "dropped"  # past its clock's quorum: counted, not applied


@dataclass(frozen=True)
class ExchangeResult:
    outcomes: list[PushOutcome]
    open_clock: int | None  # after the end of the iteration, when it was asked for
    pulled: list[torch.Tensor | SparseRows]
    cut: str = ""  # a checkpoint cut the worker has yet to mark


@dataclass(frozen=True)
class Skipped:
    """A checkpoint this shard did not take, and why (its writer reports it)."""

    checkpoint_id: str
    reason: str


# Who writes a snapshot the shard takes: gets it, or what it skipped. Runs on another thread.
Done = Callable[[ShardState | Skipped], None]


@dataclass
class _Cut:
    """A consistent cut under way (async and ssp checkpoints): each worker's cut clock as it
    marked it, and who writes the snapshot."""

    checkpoint_id: str
    started: float
    done: Done
    marked: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PullRecord:
    table: str
    worker: int
    clock: int
    min_live_clock: int


@dataclass(frozen=True)
class ClockState:
    open_clock: int
    clocks_closed: int
    clocks: dict[int, int]
    live: frozenset[int]
    history: tuple[tuple[int, int, int], ...] = ()  # (clock, workers counted, dropped)


class Shard:
    """Holds this shard's tables and applies pushes and pulls to them."""

    def __init__(self, config: ShardConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        # Data calls take it for their work (the servicer) and give it up before they wait.
        self.turn = Turn()
        self.ledger = PushLedger(before_wait=self.turn.give_up)
        self._now = clock
        # Guards _tables, _policies and _sums (the dicts, not the tables).
        self._lock = threading.Lock()
        self._tables: dict[str, Table] = {}
        self._policies: dict[str, Policy] = {}
        # Guards _pending, and makes each memory-budget check and the room it reserves one
        # step, so requests checked at once cannot each take the same room. Taken before
        # self._lock where both are held.
        self._memory_lock = threading.Lock()
        # New rows of requests admitted under the budget and still in flight, per table: the
        # room they reserved is theirs until they end, though their rows may not exist yet.
        self._pending: dict[SparseTable, int] = {}
        # Guards the clock board, the sync sums' contents and the pull log; waiters wait on it.
        self._clocks = threading.Condition(threading.Lock())
        self.board = ClockBoard(config.quorum)
        # The default mode's policy: asked when the shard-wide clock closes.
        self._clock_policy = make_policy(config.mode, config.staleness)
        self._sums: dict[str, Aggregate] = {}
        self._pull_log: collections.deque[PullRecord] = collections.deque(maxlen=PULL_LOG_SIZE)
        self._pending_snapshot: tuple[int, str, Done] | None = None
        # Full or delta, and what a delta builds on; whoever writes a snapshot reports to it.
        self.snapshots = SnapshotLog(config.checkpoint_full_every)
        self._periodic: tuple[int, Done] | None = None
        # The async/ssp cut under way (guarded by self._clocks), who writes cuts a worker
        # starts here, and the ids of recent cuts (a late marker of one starts nothing).
        self._cut: _Cut | None = None
        self._on_cut: Done | None = None
        self._cuts_seen: collections.deque[str] = collections.deque(maxlen=CUTS_KEPT)
        # Cuts a worker marked here while another was under way, and why each cannot be
        # taken here: given up as soon as they begin, holding nobody.
        self._crossed: dict[str, str] = {}
        self._cut_waiting = ""  # the cut under way that a checkpoint was told to wait for
        # The job's rollback count as of this shard's last restore; older workers are refused.
        self.generation = 0
        # How many restores this shard has had, and what the last one restored (written under
        # self._clocks): a call that began before a restore is refused where it would change
        # or read the clocks after it, and at its end, as it belongs to the timeline the
        # restore ended.
        self._restores = 0
        self._restored_from = ""
        # Called with (table, clocks behind the slowest live worker) for each served ssp or
        # sync pull: the metrics' staleness histogram.
        self.observe_staleness: Callable[[str, int], None] | None = None

    # ---- tables ----------------------------------------------------------------------------

    def declare(self, specs: Sequence[TableSpec]) -> list[RowRange]:
        """Creates the tables that do not exist yet; checks the others match. All or nothing.

        InvalidArgumentError for a name given twice or a table over the size limits;
        ResourceExhaustedError past the shard's table count or its memory budget."""
        limits = self.config.limits
        if len(specs) > limits.max_declare:
            raise ResourceExhaustedError(
                f"one declare names {len(specs)} tables; this server takes at most "
                f"{limits.max_declare} at a time (--max-declare-tables): declare in batches"
            )
        twice = sorted(n for n, k in collections.Counter(s.name for s in specs).items() if k > 1)
        if twice:
            raise InvalidArgumentError(f"one declare names table(s) {_some(twice)} twice; "
                                       "name each table once")
        for spec in specs:
            self._check_size(spec)
        with self._memory_lock, self._lock:
            for spec in specs:
                held = self._tables.get(spec.name)
                if held is not None:
                    check_same_spec(held.spec, spec)
                self._policy_for(spec)
            new = sum(1 for spec in specs if spec.name not in self._tables)
            if new and len(self._tables) + new > limits.max_tables:
                raise ResourceExhaustedError(
                    f"shard {self.config.shard} holds {len(self._tables)} tables and takes at "
                    f"most {limits.max_tables} (--max-tables); {new} more do not fit"
                )
            self._check_declare_budget([s for s in specs if s.name not in self._tables])
            placements = []
            for spec in specs:
                table = self._tables.get(spec.name)
                if table is None:
                    table = self._create(spec)
                    policy = self._policy_for(spec)
                    self._tables[spec.name] = table
                    self._policies[spec.name] = policy
                    if policy.aggregates:
                        self._sums[spec.name] = (
                            DenseSum(table) if isinstance(table, DenseTable) else SparseSum(table)
                        )
                    log.info("shard %d: created %s table %r (%s)", self.config.shard,
                             spec.kind, spec.name, policy.mode)
                placements.append(
                    table.placement
                    if isinstance(table, DenseTable)
                    else RowRange(self.config.shard, 0, 0)
                )
            return placements

    def _check_declare_budget(self, specs: Sequence[TableSpec]) -> None:
        """ResourceExhaustedError if creating the tables of `specs` would take the shard past
        its memory budget. Caller holds self._memory_lock and self._lock."""
        budget = self.config.limits.memory_budget_bytes
        if not budget or not specs:
            return
        held = sum(t.memory_bytes() for t in self._tables.values())
        projected = held
        for spec in specs:
            if spec.kind == "dense":
                placement = dense_placement(spec.name, spec.shape, spec.itemsize,
                                            self.config.num_shards)[self.config.shard]
                projected += DenseTable.bytes_for(spec, placement)
            else:
                projected += SparseTable.bytes_for(spec)
            if projected > budget:
                raise ResourceExhaustedError(
                    f"table {spec.name!r}: declaring it would take this server to "
                    f"{format_size(projected)}, over its --memory-budget of "
                    f"{format_size(budget)} (it holds {format_size(held)} now); raise the "
                    "budget, add servers, or declare a smaller table"
                )

    def _check_size(self, spec: TableSpec) -> None:
        limits = self.config.limits
        if spec.kind == "sparse" and spec.dim > limits.max_dim:
            raise InvalidArgumentError(
                f"table {spec.name!r}: dim {spec.dim} is over this server's limit of "
                f"{limits.max_dim} (--max-dim)"
            )
        if spec.kind == "dense":
            nbytes = math.prod(spec.shape) * spec.itemsize
            if nbytes > limits.max_table_bytes:
                raise InvalidArgumentError(
                    f"table {spec.name!r}: shape {list(spec.shape)} of {spec.dtype} is "
                    f"{nbytes} bytes, over this server's limit of {limits.max_table_bytes} "
                    "bytes for a dense table (--max-table-mib)"
                )

    def _policy_for(self, spec: TableSpec) -> Policy:
        return make_policy(spec.mode or self.config.mode, self.config.staleness)

    def _create(self, spec: TableSpec) -> Table:
        hogwild = self._policy_for(spec).hogwild
        if spec.kind == "sparse":
            return SparseTable(spec, self.config.shard, self.config.num_shards, hogwild,
                               self._now)
        ranges = dense_placement(spec.name, spec.shape, spec.itemsize, self.config.num_shards)
        return DenseTable(spec, ranges[self.config.shard], hogwild)

    def _table(self, name: str) -> tuple[Table, Policy]:
        with self._lock:
            table = self._tables.get(name)
            if table is None:
                raise NotFoundError(
                    f"shard {self.config.shard} has no table {name!r} (tables: "
                    f"{_some(sorted(self._tables)) or 'none'}); declare it first"
                )
            return table, self._policies[name]

    def check_tables(self, named: Iterable[tuple[str, bool]]) -> None:
        """NotFoundError or InvalidArgumentError unless each (table, dense) names a table
        of that kind here. Thread-safe; changes nothing."""
        for name, dense in named:
            if dense:
                self._dense(name)
            else:
                self._sparse(name)

    def _dense(self, name: str) -> tuple[DenseTable, Policy]:
        table, policy = self._table(name)
        if not isinstance(table, DenseTable):
            raise InvalidArgumentError(f"table {name!r} is sparse; use the sparse calls")
        return table, policy

    def _sparse(self, name: str) -> tuple[SparseTable, Policy]:
        table, policy = self._table(name)
        if not isinstance(table, SparseTable):
            raise InvalidArgumentError(f"table {name!r} is dense; use the dense calls")
        return table, policy

    # ---- pulls -----------------------------------------------------------------------------

    def check_generation(self, worker: int, generation: int) -> None:
        """RolledBackError for a worker from before the job's last rollback."""
        if generation < self.generation:
            raise RolledBackError(
                f"worker {worker} joined under generation {generation}, but the job has rolled "
                f"back to a checkpoint since (generation {self.generation}); this process must "
                "restart and rejoin"
            )

    def check_fenced(self, worker: int, incarnation: int) -> None:
        """FencedError for an incarnation the scheduler declared dead: it restarts."""
        with self._clocks:
            self.board.check_not_fenced(worker, incarnation)

    def _await_pull(
        self, name: str, policy: Policy, worker: int, clock: int, wait_s: float,
        alive: Alive, restores: int,
    ) -> None:
        if not policy.pull_waits:
            return
        with self._clocks:
            view = self._wait_for(
                lambda: self.board.view(worker, clock), policy.on_pull, wait_s, alive, restores,
                lambda last, waited: ClockWaitTimeoutError(
                    f"waited {waited:.1f} s: "
                    + policy.explain_pull_wait(name, last, self.board.waiters())
                ),
            )
            if policy.records_pulls:
                self._pull_log.append(PullRecord(name, worker, clock, view.min_live_clock))
            if self.observe_staleness is not None:
                self.observe_staleness(name, max(0, clock - view.min_live_clock))

    def _wait_for(
        self, view_fn: Callable[[], ClockView], decide: Callable[[ClockView], Decision],
        wait_s: float, alive: Alive, restores: int,
        on_timeout: Callable[[ClockView, float], PSError],
    ) -> ClockView:
        """Asks `decide` until it stops saying WAIT. Caller holds self._clocks.

        Past the wait's limit, raises what `on_timeout` makes of the last view and the
        seconds waited; CallEndedError as soon as `alive` says the caller has gone (looked
        at every ALIVE_POLL_S), so an abandoned call does not hold its thread; RolledBackError
        once the shard has been restored since the call began (`restores`, its count then).
        """
        limit = self.config.max_wait_s if wait_s <= 0 else min(wait_s, self.config.max_wait_s)
        start = self._now()
        while True:
            self._check_not_restored(restores)
            view = view_fn()
            if decide(view) is not Decision.WAIT:
                return view
            if alive is not None and not alive():
                raise CallEndedError(
                    f"the caller ended its call after {self._now() - start:.1f} s of waiting "
                    "for the clocks; nothing more of it was done"
                )
            remaining = start + limit - self._now()
            if remaining <= 0:
                raise on_timeout(view, self._now() - start)
            self._park(remaining if alive is None else min(remaining, ALIVE_POLL_S))

    def _park(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the clocks to change. Caller holds self._clocks. Its
        turn goes first: the calls it waits for need it."""
        self.turn.give_up()
        self._clocks.wait(timeout_s)

    # ---- pushes ----------------------------------------------------------------------------

    def _check_not_restored(self, restores: int) -> None:
        """RolledBackError if the shard was restored since a call began (`restores`: the
        count then): its clocks and pushes are of the timeline the restore ended, and a
        worker whose pushes waited for a clock across a rollback must not add them to the
        same clock of the new one. Needs no lock: a restore names what it restored before it
        counts, and a count read as it changes is a restore after the call."""
        if self._restores != restores:
            raise RolledBackError(
                f"this shard was restored from {self._restored_from} (generation "
                f"{self.generation}) while the call was in progress; nothing of it was done "
                "after the restore, and this process must restart and rejoin"
            )

    def exchange(self, request: Exchange, alive: Alive = None) -> ExchangeResult:
        """A worker's step in one call: its pushes, the end of its iteration, its pulls.

        Every push and pull is checked before anything changes, so a refused exchange
        changes nothing. Then the pushes apply in order (each at most once, as push_*),
        the iteration ends (if asked), and the pulls are served, waiting as their tables'
        modes say. Blocks like the calls it combines. RolledBackError if the shard was
        restored while the exchange was under way: what it did before the restore went
        with the state the restore replaced, and nothing after it was done.
        """
        worker, generation = request.worker, request.generation
        restores = self._restores  # before any check: a restore from here on is seen
        self.check_generation(worker, generation)
        self.check_fenced(worker, request.incarnation)
        if request.cut:
            self._mark_cut(worker, request.cut, request.cut_clock)
        if request.acked_clock > self.board.through.get(worker, 0):  # a hint; _acked locks
            self._acked(worker, request.acked_clock)
        if self._cut is not None and (request.pushes or request.end_iteration):
            self._hold_for_cut(worker, request.push_clock, alive)
        prepared = [
            self._prepare_sparse(p.table, p.meta, p.dtype, p.dim, p.keys, p.values)
            if isinstance(p, SparsePush)
            else self._prepare_dense(p.table, p.meta, p.dtype, p.shape, p.parts)
            for p in request.pushes
        ]
        # Resolved and checked once, here, before anything changes: each pull's policy and
        # how to read it once its clock allows.
        reads: list[tuple[Policy, Callable[[], torch.Tensor | SparseRows]]] = []
        answer_bytes = 0
        dense_pulls: set[str] = set()
        # What may create rows: (table, keys, row ids as checked or None, keys unique).
        touches: list[tuple[SparseTable, np.ndarray, np.ndarray | None, bool]] = [
            (p.table, p.keys, p.known, True) for p in prepared
            if isinstance(p.table, SparseTable) and p.keys is not None and p.known is not None
        ]
        for pull in request.pulls:
            if pull.keys is None:
                if pull.table in dense_pulls:
                    raise InvalidArgumentError(
                        f"the exchange pulls dense table {pull.table!r} twice; pull it once"
                    )
                dense_pulls.add(pull.table)
                dense, policy = self._dense(pull.table)
                answer_bytes += dense.value.numel() * dense.value.element_size()
                reads.append((policy, dense.read))
            else:
                sparse, policy = self._sparse(pull.table)
                sparse.check_keys(pull.keys)
                answer_bytes += len(pull.keys) * sparse.spec.dim * sparse.spec.itemsize
                reads.append((policy, partial(sparse.pull, pull.keys)))
                touches.append((sparse, pull.keys, None, False))
        if answer_bytes > self.config.limits.max_answer_bytes:
            raise ResourceExhaustedError(
                f"the exchange's answer would hold {answer_bytes} bytes, over this server's "
                f"limit of {self.config.limits.max_answer_bytes} (--max-answer-mib); pull "
                "fewer rows per request"
            )
        # Rows touched now are stamped with this clock (TTLs in clocks count from it). Before
        # the budget's check, which reserves room: a clock a table cannot stamp is refused
        # before anything is reserved.
        for table in {t for t, _, _, _ in touches}:
            table.observe_clock(max(request.push_clock, request.pull_clock))
        # Last of the checks, as it reserves room (never rows) for what passed all others.
        grant = self._admit_rows(touches)
        try:
            outcomes = [self._commit(p, alive, restores) for p in prepared]
            open_clock = None
            if request.end_iteration:
                open_clock = self.tick(worker, request.incarnation, request.push_clock,
                                       generation, request.position, restores)
            if self._cut is not None and request.pulls:
                self._hold_for_cut(worker, request.pull_clock, alive)
            pulled: list[torch.Tensor | SparseRows] = []
            for pull, (policy, read) in zip(request.pulls, reads, strict=True):
                self._await_pull(pull.table, policy, worker, request.pull_clock,
                                 request.wait_s, alive, restores)
                pulled.append(read())
        finally:
            self._release(grant)
        self._check_not_restored(restores)  # never acknowledge or return what a restore replaced
        cut = self._cut  # a moment's value: a worker told twice marks once
        announce = cut.checkpoint_id if cut is not None and worker not in cut.marked else ""
        return ExchangeResult(outcomes, open_clock, pulled, announce)

    def _admit_rows(
        self, touches: Sequence[tuple[SparseTable, np.ndarray, np.ndarray | None, bool]],
    ) -> dict[SparseTable, int]:
        """Checks the rows an exchange would create against --max-new-rows and the memory
        budget; under a budget, reserves their room and returns them (release them with
        `_release` when the exchange ends).

        ResourceExhaustedError, with nothing changed, past either limit. Costs nothing
        without a budget unless the request carries more keys than --max-new-rows; with one,
        a lookup of the pulled keys, and more only for keys that are new. Blocking (growing
        storage copies its rows); thread-safe.
        """
        limits = self.config.limits
        budget = limits.memory_budget_bytes
        if not budget and sum(len(keys) for _, keys, _, _ in touches) <= limits.max_new_rows:
            return {}
        fresh: dict[SparseTable, list[tuple[np.ndarray, bool]]] = {}
        touched: dict[SparseTable, int] = {}
        for table, keys, known, unique in touches:
            touched[table] = touched.get(table, 0) + len(keys)
            absent = table.absent(keys) if known is None else keys[known < 0]
            # Ids the table's admission rule refuses make no row, so take no room.
            absent = table.admissible(absent, sight=not unique)  # pulls: keys may repeat
            if len(absent):
                fresh.setdefault(table, []).append((absent, unique))
        new = {
            table: len(parts[0][0]) if len(parts) == 1 and parts[0][1]
            else count_distinct(np.concatenate([a for a, _ in parts]))
            for table, parts in fresh.items()
        }
        total = sum(new.values())
        if total > limits.max_new_rows:
            per_table = ", ".join(f"table {t.spec.name!r}: {n}" for t, n in
                                  sorted(new.items(), key=lambda tn: -tn[1])[:5])
            raise ResourceExhaustedError(
                f"this exchange would create {total} new rows ({per_table}), over this "
                f"server's limit of {limits.max_new_rows} per request (--max-new-rows); send "
                "fewer new keys per request"
            )
        if not budget or not new:
            return {}
        with self._memory_lock:
            with self._lock:
                tables = list(self._tables.values())
            held = sum(t.memory_bytes() for t in tables)
            projected = held
            plan: list[tuple[SparseTable, int, int]] = []
            for table in sorted(new, key=lambda t: t.spec.name):
                rows = table.rows + self._pending.get(table, 0) + new[table]
                if table.spec.max_rows:
                    # It evicts before it creates rows: only an exchange that alone uses more
                    # rows than max_rows (at most its keys) takes it past.
                    rows = min(rows, max(table.spec.max_rows, touched[table]))
                now = table.memory_bytes()
                least = projected + table.bytes_at(rows, rows) - now
                if least > budget:
                    raise ResourceExhaustedError(
                        f"table {table.spec.name!r}: creating {new[table]} new rows would take "
                        f"this server to {format_size(least)}, over its --memory-budget of "
                        f"{format_size(budget)} (it holds {format_size(held)} now); raise the "
                        "budget, add servers, send fewer new keys, or declare the table "
                        "with max_rows or a TTL to evict rows"
                    )
                spare = (budget - least) // table.bytes_per_row
                capacity = grown_capacity(rows, table.capacity, spare, table.spec.max_rows)
                projected += table.bytes_at(rows, capacity) - now
                plan.append((table, rows, capacity))
            taken: dict[SparseTable, int] = {}
            try:
                for table, rows, capacity in plan:
                    table.reserve(rows, capacity)
                    taken[table] = self._pending[table] = self._pending.get(table, 0) + new[table]
            except (MemoryError, OSError) as exc:
                self._give_back({t: new[t] for t in taken})
                raise ResourceExhaustedError(
                    f"this server could not allocate room for {total} new rows within its "
                    f"--memory-budget of {format_size(budget)} ({exc}); the host has less "
                    "memory free than the budget assumes: lower the budget or add memory"
                ) from exc
        return new

    def _release(self, grant: dict[SparseTable, int]) -> None:
        """Gives back what `_admit_rows` reserved for an exchange that has ended: its rows
        exist now (or never will), and the tables' own sizes count them.

        But a sync push's gradient makes its new rows when its clock closes, which may be
        after its exchange ends (not when the exchange also pulls at the next clock, as a
        training step does: that pull waits for the close). Such rows go uncounted until
        they exist: one clock's worth at most, each request within --max-new-rows.
        """
        if grant:
            with self._memory_lock:
                self._give_back(grant)

    def _give_back(self, grant: dict[SparseTable, int]) -> None:
        """Caller holds self._memory_lock."""
        for table, rows in grant.items():
            left = self._pending.get(table, 0) - rows
            if left > 0:
                self._pending[table] = left
            else:
                self._pending.pop(table, None)

    def _prepare_dense(
        self, name: str, meta: PushMeta, dtype: torch.dtype, shape: tuple[int, ...],
        received: Sequence[tuple[int, torch.Tensor]],
    ) -> _Prepared:
        table, policy = self._dense(name)
        try:
            table.check_push(dtype, shape)
            if not meta.assign and not table.spec.allow_non_finite:
                for offset, part in received:
                    check_finite(name, part, offset)
        except PSError:
            table.count(pushes_rejected=1)
            raise
        return _Prepared(
            name, table, policy, meta,
            apply=lambda: table.apply(received, meta.assign, meta.if_absent),
            aggregate=lambda: self._sum(name, DenseSum).add(received),
        )

    def _prepare_sparse(
        self, name: str, meta: PushMeta, dtype: torch.dtype, dim: int, keys: np.ndarray,
        values: memoryview,
    ) -> _Prepared:
        table, policy = self._sparse(name)
        try:
            if meta.if_absent:
                raise InvalidArgumentError(
                    f"table {name!r} is sparse; if_absent applies to dense tables only (a "
                    "sparse row is initialised from its key on first touch)"
                )
            table.check_push(dtype, dim, len(keys), values.nbytes)
            table.check_keys(keys)
            rows = tensor_from_bytes(values, dtype, (len(keys), dim))
            if not meta.assign and not table.spec.allow_non_finite:
                check_finite(name, rows)
            known = table.check_unique(keys)
        except PSError:
            table.count(pushes_rejected=1)
            raise

        def apply() -> bool:
            table.apply(keys, rows, meta.assign, known)
            return True

        return _Prepared(
            name, table, policy, meta, apply=apply,
            aggregate=lambda: self._sum(name, SparseSum).add(keys, rows), keys=keys, known=known,
        )

    def _commit(self, p: _Prepared, alive: Alive, restores: int) -> PushOutcome:
        """Applies (or aggregates, or drops, or keeps the values an assign if absent finds)
        a checked push once, as its table's mode says; answers when that is done."""
        name, table, policy, meta = p.name, p.table, p.policy, p.meta
        self.check_generation(meta.worker, meta.generation)
        admission = self.ledger.admit(
            meta.worker, meta.incarnation, meta.seq, self.config.inflight_wait_s
        )
        if admission is Admission.DUPLICATE:
            table.count(pushes_duplicate=1)
            return PushOutcome.DUPLICATE
        try:
            outcome = self._run_push(name, table, policy, meta, p.apply, p.aggregate, alive,
                                     restores)
        except BaseException:
            self.ledger.abandon(meta.worker, meta.incarnation, meta.seq)
            raise
        self.ledger.done(meta.worker, meta.incarnation, meta.seq)
        return outcome

    def _run_push(
        self, name: str, table: Table, policy: Policy, meta: PushMeta,
        apply: Callable[[], bool], aggregate: Callable[[], None], alive: Alive, restores: int,
    ) -> PushOutcome:
        if meta.assign:
            return PushOutcome.APPLIED if apply() else PushOutcome.KEPT
        if not policy.aggregates:
            with self._clocks:
                self.board.report(meta.worker, meta.clock)
            # Async and ssp apply at once; the table serialises whole pushes.
            apply()
            return PushOutcome.APPLIED
        with self._clocks:
            if meta.worker not in self.board.live:
                raise FailedPreconditionError(
                    f"worker {meta.worker} is not a live member of this job (live: "
                    f"{sorted(self.board.live)}); a removed worker must rejoin first"
                )
            view = self._wait_for(
                lambda: self.board.view(meta.worker, meta.clock), policy.on_push, meta.wait_s,
                alive, restores,
                lambda last, waited: ClockWaitTimeoutError(
                    f"waited {waited:.1f} s: "
                    + policy.explain_push_wait(name, last, self.board.waiters())
                ),
            )
            if policy.on_push(view) is Decision.DROP:
                table.count(pushes_dropped=1)
                self.board.count_drop(meta.clock)
                return PushOutcome.DROPPED
            self.board.report(meta.worker, meta.clock)
            self.board.claim(meta.worker)
            aggregate()
        return PushOutcome.APPLIED

    def _sum(self, name: str, kind: type[S]) -> S:
        """The sync sum of table `name`. Caller holds self._clocks."""
        with self._lock:
            total = self._sums[name]
        if not isinstance(total, kind):  # declare() pairs each table with its kind of sum
            raise TypeError(f"table {name!r} has a {type(total).__name__}, not a {kind.__name__}")
        return total

    # ---- clocks and membership -------------------------------------------------------------

    def tick(self, worker: int, incarnation: int, clock: int, generation: int = 0,
             position: bytes = b"", restores: int | None = None) -> int:
        """`worker` finished iteration `clock` on this shard, and was then at `position` in
        its data; returns the open sync clock. Its caller, `exchange`, has checked the ids
        and clock; `restores` is the shard's restore count when that call began (None: now)."""
        self.check_generation(worker, generation)
        self.ledger.check_incarnation(worker, incarnation)
        with self._clocks:
            if restores is not None:
                self._check_not_restored(restores)
            self.board.tick(worker, clock, position)
            self._close_ready()
            self._cut_if_ready()
            self._clocks.notify_all()
            return self.board.open_clock

    def join(
        self, worker: int, incarnation: int, generation: int = 0
    ) -> tuple[int, int, bool, bytes]:
        """A worker process announces itself: (its clock here, the open clock, is it live,
        its data position at its clock here)."""
        check_range("the worker id", worker, MAX_WORKER)
        check_range("the generation", generation, MAX_CLOCK)
        self.check_generation(worker, generation)
        self.check_fenced(worker, incarnation)
        new = self.ledger.check_incarnation(worker, incarnation)
        with self._clocks:
            clock = (self.board.restart(worker, incarnation, self._now()) if new
                     else self.board.clocks.get(worker, 0))
            self._close_ready()
            self._clocks.notify_all()
            # A join repeated by the same incarnation asks whether it is still live (a
            # finishing worker polls it): worth a line only the first time.
            log.log(logging.INFO if new else logging.DEBUG,
                    "shard %d: worker %d incarnation %d joined at clock %d",
                    self.config.shard, worker, incarnation, clock)
            return (clock, self.board.open_clock, worker in self.board.live,
                    self.board.position_before(worker, clock))

    def set_live(
        self, workers: Iterable[int], fenced: Mapping[int, int] | None = None
    ) -> ClockState:
        """Replaces the live set: the quorum and the ssp minimum follow at once. `fenced`
        (worker -> incarnation declared dead) adds to the incarnations refused from now on."""
        workers = list(workers)
        for worker in workers:
            check_range("a live worker id", worker, MAX_WORKER)
        for worker in fenced or {}:
            check_range("a fenced worker id", worker, MAX_WORKER)
        with self._clocks:
            self.board.fence(fenced or {})
            self.board.set_live(workers)
            log.info("shard %d: live workers %s (quorum %d)", self.config.shard,
                     sorted(self.board.live), self.board.quorum)
            self._close_ready()
            self._cut_if_ready()
            self._clocks.notify_all()
            return self._clock_state()

    def _close_ready(self) -> None:
        """Closes every sync clock whose quorum has finished. Caller holds self._clocks."""
        board = self.board
        while self._clock_policy.closes(
            len(board.contributors), len(board.finished), board.quorum
        ):
            divisor = len(board.contributors)
            with self._lock:
                sums = list(self._sums.values())
            for total in sums:
                used = total.apply(divisor)
                total.table.count(gradients_aggregated=used)
            log.debug("shard %d: clock %d closed with %d workers", self.config.shard,
                      board.open_clock, divisor)
            board.close()
            self._snapshot_if_due()

    def _snapshot_if_due(self) -> None:
        """After a clock closed: take the snapshots due at the new open clock."""
        clock = self.board.open_clock
        due: list[tuple[str, Done]] = []
        pending = self._pending_snapshot
        if pending is not None and pending[0] == clock:
            self._pending_snapshot = None
            due.append((pending[1], pending[2]))
        if self._periodic is not None and clock % self._periodic[0] == 0:
            due.append((f"clock-{clock:010d}", self._periodic[1]))
        for checkpoint_id, done in due:
            state = self._snapshot(checkpoint_id)
            # The write happens elsewhere: this thread holds the clocks.
            threading.Thread(target=done, args=(state,), daemon=True).start()

    def clock_state(self, history: bool = False) -> ClockState:
        """The clocks now; `history` adds the record of recent sync clocks (up to
        ps.clocks.HISTORY of them: a copy worth making only when asked for)."""
        with self._clocks:
            return self._clock_state(history)

    def _clock_state(self, history: bool = False) -> ClockState:
        return ClockState(
            self.board.open_clock, self.board.clocks_closed, dict(self.board.clocks),
            frozenset(self.board.live),
            tuple((c, used, dropped) for c, (used, dropped) in self.board.history.items())
            if history else (),
        )

    def pull_log(self) -> list[PullRecord]:
        with self._clocks:
            return list(self._pull_log)

    # ---- checkpoints -----------------------------------------------------------------------

    def snapshot(self, checkpoint_id: str) -> ShardState:
        """A consistent copy of the shard: tables, optimizer state, clocks, ledger; full, or
        a delta of the snapshot before (`self.snapshots` decides; whoever writes it reports
        how the write went there). Blocks pushes for as long as the copies take: a delta's
        changed rows, a full one's keys and dense blocks; a sparse table's rows are copied
        beside the training, and an update copies a row not copied yet before it changes it
        (`SparseTable.snapshot_later`; `ps.checkpoint.materialized` copies them out)."""
        with self._clocks:
            return self._snapshot(checkpoint_id)

    def snapshot_every(self, clocks: int, done: Done) -> None:
        """Snapshots whenever the open sync clock reaches a multiple of `clocks`.

        Every shard cuts at the same clocks without talking to the others, so together they
        make consistent checkpoints (ids "clock-<C>"). `done` runs on another thread.
        """
        with self._clocks:
            self._periodic = (clocks, done) if clocks > 0 else None

    def snapshot_at(self, clock: int, checkpoint_id: str,
                    done: Done) -> None:
        """Snapshots when sync clock `clock` opens (at once if it is open now), then calls
        `done` with it; with a Skipped if this shard is past `clock` already."""
        with self._clocks:
            if self.board.open_clock == clock:
                state: ShardState | Skipped = self._snapshot(checkpoint_id)
            elif self.board.open_clock > clock:
                state = Skipped(checkpoint_id, f"shard {self.config.shard} was past clock "
                                f"{clock} (at {self.board.open_clock}) when it was asked")
            else:
                self._pending_snapshot = (clock, checkpoint_id, done)
                return
        done(state)

    def cut(self, checkpoint_id: str, done: Done) -> bool:
        """Starts a consistent cut (async and ssp checkpoints); False when one is under way.

        Exchanges tell each worker of the cut; the worker marks it on its next exchange with
        its cut clock, the first iteration it has not sent yet (all before it were
        answered). Its exchanges from that clock on wait here; once every live worker has
        marked the cut and ticked every iteration before its cut clock, the shard takes the
        snapshot (each worker at its cut clock, with its data position of then) and calls
        `done` with it on another thread. Every shard cuts at the same worker clocks, as
        each worker marks all shards in one exchange: together the shards' snapshots are
        one consistent checkpoint. A cut that has not completed within the shard's wait
        limit (a live worker that stopped stepping) is given up: `done` gets a Skipped and the
        waiting exchanges go on. One that cannot be taken here is given up at once: a worker
        marked it while another cut was under way here (the shards began the two in
        different orders), or marked it after iterations it puts past the cut had arrived.
        A worker may start a cut here by marking it first.
        """
        with self._clocks:
            return self._start_cut(checkpoint_id, done)

    def cut_started(self, checkpoint_id: str) -> bool:
        """Whether the cut of `checkpoint_id` started here (it may be over)."""
        with self._clocks:
            return checkpoint_id in self._cuts_seen

    def on_cut(self, done: Done | None) -> None:
        """Who writes a cut that a worker's mark starts here (before the shard heard of it)."""
        with self._clocks:
            self._on_cut = done

    def _start_cut(self, checkpoint_id: str, done: Done) -> bool:
        """Caller holds self._clocks."""
        if checkpoint_id in self._cuts_seen:
            return True
        if self._cut is not None:
            if self._now() - self._cut.started < self._cut_wait_s():
                # Asked again every beat, and a new checkpoint every period while the cut
                # is held back: said once per cut.
                if self._cut_waiting != self._cut.checkpoint_id:
                    self._cut_waiting = self._cut.checkpoint_id
                    log.warning("shard %d: checkpoint %s waits: the cut of %s is under way "
                                "(later checkpoints that wait for it are not logged)",
                                self.config.shard, checkpoint_id, self._cut.checkpoint_id)
                return False
            self._give_up_cut()
        self._cuts_seen.append(checkpoint_id)
        self._cut = _Cut(checkpoint_id, self._now(), done)
        log.info("shard %d: cut %s begins (live workers: %s)", self.config.shard,
                 checkpoint_id, sorted(self.board.live))
        crossed = self._crossed.pop(checkpoint_id, None)
        if crossed is not None:
            self._give_up_cut(crossed)
            return True
        self._cut_if_ready()
        self._clocks.notify_all()
        return True

    def _acked(self, worker: int, acked_clock: int) -> None:
        """Every shard answered `worker`'s iterations before `acked_clock`: none of them is
        still on its way here (or it was lost with an earlier incarnation of this shard)."""
        with self._clocks:
            if self.board.acked(worker, acked_clock):
                self._close_ready()
                self._cut_if_ready()
                self._clocks.notify_all()

    def _mark_cut(self, worker: int, checkpoint_id: str, clock: int) -> None:
        if not _CUT_ID.fullmatch(checkpoint_id):
            raise InvalidArgumentError(
                f"the exchange marks a cut of {checkpoint_id[:80]!r}, which is not a checkpoint "
                "id (letters, digits, '.', '_', '-'; at most 200)")
        with self._clocks:
            cut = self._cut
            if cut is None or cut.checkpoint_id != checkpoint_id:
                if (cut is not None and checkpoint_id not in self._cuts_seen
                        and self._now() - cut.started < self._cut_wait_s()):
                    # The worker marked this cut after another that is under way here: its
                    # iterations from `clock` on come after this cut but may come before
                    # the one under way. This shard cannot keep them apart: the cut is
                    # given up here as soon as it begins, rather than held for a minute.
                    self._crossed.setdefault(checkpoint_id, (
                        f"worker {worker} marked it while the cut of {cut.checkpoint_id} was "
                        "under way here (the shards began the two in different orders, as "
                        "after a restart)"))
                    while len(self._crossed) > CUTS_KEPT:
                        del self._crossed[next(iter(self._crossed))]
                    return
                if self._on_cut is None or not self._start_cut(checkpoint_id, self._on_cut):
                    return
                cut = self._cut
                # None: taken at once (no live worker to wait for), or given up. Another cut:
                # this one is over here (taken or given up), and a late mark of it says
                # nothing of the cut under way.
                if cut is None or cut.checkpoint_id != checkpoint_id:
                    return
            if worker not in cut.marked and self.board.through.get(worker, 0) > clock:
                # A mark that comes after iterations it puts past the cut (a restarted shard,
                # or one that began the cut after the mark went by): no snapshot here can be
                # that cut.
                self._give_up_cut(
                    f"worker {worker} marked it at clock {clock} after its iterations up to "
                    f"{self.board.through[worker] - 1} had reached this shard (a restarted "
                    "shard, or a cut that began here after the worker marked it)")
                return
            cut.marked.setdefault(worker, clock)
            self._cut_if_ready()
            self._clocks.notify_all()

    def _cut_wait_s(self) -> float:
        return min(CUT_WAIT_S, self.config.max_wait_s)

    def _hold_for_cut(self, worker: int, clock: int, alive: Alive) -> None:
        """Waits while iteration `clock` of `worker` lies past its mark of the cut under way."""
        with self._clocks:
            while True:
                cut = self._cut
                if cut is None or clock < cut.marked.get(worker, MAX_CLOCK):
                    return
                remaining = cut.started + self._cut_wait_s() - self._now()
                if remaining <= 0:
                    self._give_up_cut()
                    return
                if alive is not None and not alive():
                    raise CallEndedError(
                        "the caller ended its call while it waited for a checkpoint's cut; "
                        "nothing of it was done")
                self._park(min(remaining, ALIVE_POLL_S))

    def _cut_if_ready(self) -> None:
        """Takes the cut under way once no live worker is short of it. Caller holds
        self._clocks."""
        cut = self._cut
        if cut is None or self.board.short_of_cut(cut.marked, self._now()):
            return
        self._cut = None
        copying = time.perf_counter()
        state = self._snapshot(cut.checkpoint_id, cut.marked)
        log.info("shard %d: cut %s taken %.3f s after it began (the copy: %.3f s)",
                 self.config.shard, cut.checkpoint_id, self._now() - cut.started,
                 time.perf_counter() - copying)
        threading.Thread(target=cut.done, args=(state,), daemon=True).start()

    def _give_up_cut(self, why: str = "") -> None:
        """Gives up the cut under way: past the wait limit, or at once `why` it cannot be
        taken here. Caller holds self._clocks."""
        cut = self._cut
        if cut is None:
            return
        self._cut = None
        if why:
            reason = f"shard {self.config.shard} gave up its cut at once: {why}"
        else:
            now = self._now()
            reason = (f"shard {self.config.shard} gave up its cut after "
                      f"{now - cut.started:.0f} s: worker(s) "
                      f"{self.board.short_of_cut(cut.marked, now)} did not reach it (a worker "
                      "that stops stepping without finishing holds a cut back)")
        self._clocks.notify_all()
        skipped = Skipped(cut.checkpoint_id, reason)
        threading.Thread(target=cut.done, args=(skipped,), daemon=True).start()

    def _snapshot(self, checkpoint_id: str, cut: Mapping[int, int] | None = None) -> ShardState:
        """Caller holds self._clocks. `cut`: each worker's cut clock (an async or ssp cut);
        None takes each worker at its clock here, with the position of its newest tick,
        but in sync mode at most at the open clock: the snapshot holds every clock below it,
        a rollback replays the rest, and a worker's tick that came early for the open clock
        (nothing to push here) is not part of it. Full or a delta of the snapshot before,
        as `self.snapshots` plans (every trigger comes here); whoever writes it reports how
        it went to `self.snapshots`."""
        if cut is None and self._clock_policy.aggregates:
            cut = dict.fromkeys(self.board.clocks, self.board.open_clock)
        with self._lock:
            tables = list(self._tables.items())
        kind, base = self.snapshots.plan(checkpoint_id)
        states = []
        for name, table in tables:
            spec = table.spec.to_dict()
            changes = table.snapshot_changes() if kind == DELTA else None
            if changes is None:
                tensors, later = table.snapshot_later()
                states.append(TableState(name, spec, tensors, later=later))
            elif changes:
                states.append(TableState(name, spec, changes, kind=ROWS))
        meta: dict[str, object] = {
            "mode": str(self.config.mode), "incarnation": self.config.incarnation,
            **self.board.to_meta(cut), "ledger": self.ledger.to_meta(),
        }
        state = ShardState(
            job=self.config.job or "standalone", shard=self.config.shard,
            num_shards=self.config.num_shards, checkpoint_id=checkpoint_id,
            clock=self.board.open_clock, meta=meta, tables=states, kind=kind, base=base,
        )
        self.snapshots.taken(state)
        return state

    def restore(self, state: ShardState | None, generation: int | None = None) -> None:
        """Replaces every table, clock and ledger entry with `state` (None: an empty shard).

        With `generation` (a rollback), requests of workers that joined under an older one
        are refused from now on. FailedPreconditionError if the snapshot is of another shard
        or shard count.
        """
        if generation is not None:
            check_range("the generation", generation, MAX_CLOCK)
        if state is not None and (state.shard, state.num_shards) != (
            self.config.shard, self.config.num_shards
        ):
            raise FailedPreconditionError(
                f"checkpoint {state.checkpoint_id} holds shard {state.shard} of "
                f"{state.num_shards}; this server is shard {self.config.shard} of "
                f"{self.config.num_shards}"
            )
        if state is not None and state.kind != FULL:
            raise FailedPreconditionError(
                f"checkpoint {state.checkpoint_id} is a {state.kind} of {state.base!r}, not a "
                "whole state: restore what ps.checkpoint.load_checkpoint returns"
            )
        if state is not None:
            state = materialized(state)  # one of this shard's own, read while it lives
        with self._clocks:
            self.snapshots.reset()
            if generation is not None:
                self.generation = max(self.generation, generation)
            self._restored_from = (f"checkpoint {state.checkpoint_id}" if state is not None
                                   else "the empty state")
            self._restores += 1
            with self._lock:
                self._tables.clear()
                self._policies.clear()
                self._sums.clear()
            self.board = ClockBoard(self.config.quorum)
            self._pending_snapshot = None
            if state is None:
                self.ledger.restore([])
                self._clocks.notify_all()
                return
            specs = [TableSpec.from_dict(t.spec) for t in state.tables]
            self.declare(specs)
            for t in state.tables:
                self._table(t.name)[0].restore(t.tensors)
            meta: dict[str, Any] = state.meta
            self.ledger.restore_meta(meta.get("ledger", []))
            self.board.restore_meta(meta, state.clock)
            self._clocks.notify_all()
        log.info("shard %d: restored checkpoint %s at clock %d (%d tables)", self.config.shard,
                 state.checkpoint_id, state.clock, len(state.tables))

    # ---- introspection ---------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """What this shard's tables hold, as --memory-budget counts it: dense blocks with
        their optimizer state, sparse storage at its reserved capacity, key indexes.
        Thread-safe; a moment's value."""
        with self._lock:
            tables = list(self._tables.values())
        return sum(t.memory_bytes() for t in tables)

    def stats(self) -> list[tuple[TableStats, Mode]]:
        """Each table's stats with its mode (bound filled in), counting every acknowledged
        push."""
        with self._lock:
            tables = [(t, self._policies[n].mode) for n, t in self._tables.items()]
        return [(t.stats(), mode) for t, mode in tables]


def _some(names: Sequence[str], shown: int = 5) -> str:
    """The first `shown` names, and how many more: error texts stay short however many."""
    head = ", ".join(repr(n) for n in names[:shown])
    return head if len(names) <= shown else f"{head} and {len(names) - shown} more"
