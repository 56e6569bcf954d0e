"""One shard of the parameter server: its tables, the push ledger and the consistency policy.

The shard is the executor: it validates a request against the table, admits a push through
the exactly-once ledger, asks the table's policy whether to serve now, and calls the table.
Every method is thread-safe and may be called from many gRPC threads at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protos.codec import tensor_from_bytes
from protos.partition import RowRange, dense_placement
from ps.consistency import ClockView, Decision, Policy, make_policy
from ps.errors import InvalidArgumentError, NotFoundError, PSError
from ps.ledger import Admission, PushLedger
from ps.tables import (
    DenseTable,
    SparseRows,
    SparseTable,
    Table,
    TableSpec,
    TableStats,
    check_finite,
    check_same_spec,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardConfig:
    shard: int
    num_shards: int
    job: str = ""
    incarnation: int = 1
    mode: str = "async"
    # How long a retried push waits for its first attempt, still being applied, to finish.
    inflight_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise InvalidArgumentError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard < self.num_shards:
            raise InvalidArgumentError(
                f"shard must be in [0, {self.num_shards}), got {self.shard}"
            )
        make_policy(self.mode)


@dataclass(frozen=True)
class PushMeta:
    """Who sent a push and at which clock; (worker, incarnation, seq) makes it unique."""

    worker: int
    incarnation: int
    seq: int
    clock: int = 0
    assign: bool = False


class Shard:
    """Holds this shard's tables and applies pushes and pulls to them."""

    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        self.ledger = PushLedger()
        # Guards _tables and _policies (the dicts, not the tables).
        self._lock = threading.Lock()
        self._tables: dict[str, Table] = {}
        self._policies: dict[str, Policy] = {}

    # ---- tables ----------------------------------------------------------------------------

    def declare(self, specs: Sequence[TableSpec]) -> list[RowRange]:
        """Creates the tables that do not exist yet; checks the others match. All or nothing."""
        with self._lock:
            for spec in specs:
                held = self._tables.get(spec.name)
                if held is not None:
                    check_same_spec(held.spec, spec)
                make_policy(spec.mode or self.config.mode)
            placements = []
            for spec in specs:
                table = self._tables.get(spec.name)
                if table is None:
                    table = self._create(spec)
                    self._tables[spec.name] = table
                    self._policies[spec.name] = make_policy(spec.mode or self.config.mode)
                    log.info("shard %d: created %s table %r", self.config.shard, spec.kind,
                             spec.name)
                placements.append(
                    table.placement
                    if isinstance(table, DenseTable)
                    else RowRange(self.config.shard, 0, 0)
                )
            return placements

    def _create(self, spec: TableSpec) -> Table:
        if spec.kind == "sparse":
            return SparseTable(spec, self.config.shard, self.config.num_shards)
        ranges = dense_placement(spec.name, spec.shape, spec.itemsize, self.config.num_shards)
        return DenseTable(spec, ranges[self.config.shard])

    def _table(self, name: str) -> tuple[Table, Policy]:
        with self._lock:
            table = self._tables.get(name)
            if table is None:
                known = ", ".join(sorted(self._tables)) or "none"
                raise NotFoundError(
                    f"shard {self.config.shard} has no table {name!r} (tables: {known}); "
                    "declare it first"
                )
            return table, self._policies[name]

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

    # ---- data plane ------------------------------------------------------------------------

    def pull_dense(self, name: str, worker: int, clock: int) -> torch.Tensor:
        """This shard's block of dense table `name` (the live tensor, not a copy)."""
        table, policy = self._dense(name)
        self._await(policy.on_pull(ClockView(worker, clock)))
        return table.read()

    def pull_sparse(self, name: str, worker: int, clock: int, keys: np.ndarray) -> SparseRows:
        """Rows of `keys` from sparse table `name`, created on first touch, in key order."""
        table, policy = self._sparse(name)
        table.check_keys(keys)
        self._await(policy.on_pull(ClockView(worker, clock)))
        return table.pull(keys)

    def push_dense(
        self, name: str, meta: PushMeta, dtype: torch.dtype, shape: tuple[int, ...],
        parts: Iterable[tuple[int, torch.Tensor]],
    ) -> bool:
        """Applies a dense push once; returns True when it was a duplicate (nothing changed).

        `parts` yields (flat element offset, values) slices covering the block exactly once,
        typically as they come off the wire: each is checked on arrival, so validation
        overlaps the transfer, and nothing is applied until every part has passed.
        """
        table, policy = self._dense(name)
        check = not meta.assign and not table.spec.allow_non_finite
        received: list[tuple[int, torch.Tensor]] = []
        try:
            table.check_push(dtype, shape)
            for offset, part in parts:
                if check:
                    check_finite(name, part, offset)
                received.append((offset, part))
        except PSError:
            table.count(pushes_rejected=1)
            raise
        return self._apply(table, policy, meta, lambda: table.apply(received, meta.assign))

    def push_sparse(
        self, name: str, meta: PushMeta, dtype: torch.dtype, dim: int, keys: np.ndarray,
        values: memoryview,
    ) -> bool:
        """Applies a sparse push once; returns True when it was a duplicate (nothing changed).

        `values` are the raw row bytes in key order, checked against the keys here.
        """
        table, policy = self._sparse(name)
        try:
            table.check_push(dtype, dim, len(keys), values.nbytes)
            table.check_keys(keys)
            rows = tensor_from_bytes(values, dtype, (len(keys), dim))
            if not meta.assign and not table.spec.allow_non_finite:
                check_finite(name, rows)
            known = table.check_unique(keys)
        except PSError:
            table.count(pushes_rejected=1)
            raise
        return self._apply(
            table, policy, meta, lambda: table.apply(keys, rows, meta.assign, known)
        )

    def _apply(
        self, table: Table, policy: Policy, meta: PushMeta, apply: Callable[[], None]
    ) -> bool:
        admission = self.ledger.admit(
            meta.worker, meta.incarnation, meta.seq, self.config.inflight_wait_s
        )
        if admission is Admission.DUPLICATE:
            table.count(pushes_duplicate=1)
            return True
        try:
            if meta.assign or self._decide(policy.on_push(ClockView(meta.worker, meta.clock))):
                apply()
        except BaseException:
            self.ledger.abandon(meta.worker, meta.incarnation, meta.seq)
            raise
        self.ledger.done(meta.worker, meta.incarnation, meta.seq)
        return False

    def _decide(self, decision: Decision) -> bool:
        # Only the async policy exists so far; it never waits or drops.
        return decision is Decision.SERVE

    def _await(self, decision: Decision) -> None:
        if decision is not Decision.SERVE:
            raise InvalidArgumentError(f"pull decision {decision.value} is not supported yet")

    # ---- introspection ---------------------------------------------------------------------

    def stats(self) -> list[TableStats]:
        with self._lock:
            tables = list(self._tables.values())
        return [t.stats() for t in tables]
