"""`pstrain plan`: the memory a job's sparse tables take per server, before running it.

Given table declarations, the distinct ids each table is expected to hold and the number of
servers, the plan prints each table's rows and bytes per server (values, optimizer state, key
index, admission and eviction bookkeeping), as the servers themselves count them for
--memory-budget (`SparseTable.bytes_for`), and the budget a server needs. Pure arithmetic;
no server is contacted.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ps.errors import InvalidArgumentError, PSError
from ps.index import SLOT_BYTES, capacity_for
from ps.limits import format_size
from ps.tables import (
    INITIAL_SPARSE_ROWS,
    OptimizerConfig,
    SparseTable,
    TableSpec,
    grown_capacity,
)

__all__ = ["TablePlan", "main", "parse_table", "plan_table"]

# How many standard deviations above the mean the fullest server's share of a table's ids
# is taken to be: keys go to servers by a hash, so a server's count is binomial.
_SPREAD_SIGMAS = 4


@dataclass(frozen=True)
class TablePlan:
    """One sparse table on its fullest server."""

    spec: TableSpec
    ids: int  # distinct ids (admitted) in the whole table
    servers: int
    rows: int  # rows on the fullest server (at most max_rows)
    row_bytes: int  # storage per row: values, optimizer state, stamps
    capacity: int  # storage rows reserved without a budget (grown by doubling)
    index_slots: int

    @property
    def value_bytes(self) -> int:
        return self.rows * self.spec.dim * self.spec.itemsize

    @property
    def index_bytes(self) -> int:
        return self.index_slots * SLOT_BYTES

    @property
    def memory_bytes(self) -> int:
        """What the server counts for the table without a budget (storage grown by
        doubling, as it grows when there is room)."""
        return SparseTable.bytes_for(self.spec, self.capacity, self.index_slots)

    @property
    def budget_bytes(self) -> int:
        """The least the table needs under a budget: storage for its rows and no more."""
        return SparseTable.bytes_for(self.spec, max(self.rows, INITIAL_SPARSE_ROWS),
                                     self.index_slots)


def plan_table(spec: TableSpec, ids: int, servers: int) -> TablePlan:
    """The plan of sparse table `spec` holding `ids` distinct ids over `servers` servers.
    InvalidArgumentError for a dense table or counts below 0 (servers below 1). Pure."""
    if spec.kind != "sparse":
        raise InvalidArgumentError(f"table {spec.name!r}: plan covers sparse tables only")
    if ids < 0 or servers < 1:
        raise InvalidArgumentError(
            f"table {spec.name!r}: ids must be >= 0 and servers >= 1, got {ids} and {servers}"
        )
    mean = ids / servers
    rows = min(ids, math.ceil(mean + _SPREAD_SIGMAS * math.sqrt(mean * (1 - 1 / servers))))
    if spec.max_rows:
        rows = min(rows, spec.max_rows)
    # Without a budget storage doubles as rows arrive in requests smaller than the table; a
    # bounded table's stops at max_rows (it evicts before it creates rows).
    capacity = INITIAL_SPARSE_ROWS
    while capacity < rows:
        capacity = grown_capacity(capacity + 1, capacity, max_rows=spec.max_rows)
    return TablePlan(spec, ids, servers, rows, SparseTable.row_bytes(spec), capacity,
                     capacity_for(rows))


def parse_table(text: str) -> tuple[TableSpec, int]:
    """A table and its expected distinct ids from ``NAME:key=value,...`` with keys dim
    (required), ids (required), dtype, optimizer, admit, ttl_clocks, ttl_s, max_rows.
    InvalidArgumentError quoting a bad part. Pure."""
    name, _, rest = text.partition(":")
    fields: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise InvalidArgumentError(f"table {text!r}: {part!r} is not key=value")
        fields[key.strip()] = value.strip()
    known = {"dim", "ids", "dtype", "optimizer", "admit", "ttl_clocks", "ttl_s", "max_rows"}
    unknown = sorted(set(fields) - known)
    if unknown or "dim" not in fields or "ids" not in fields:
        raise InvalidArgumentError(
            f"table {text!r}: give NAME:dim=D,ids=N[,dtype=float32|float16|bfloat16|float64]"
            f"[,optimizer=NAME][,admit=RULE][,ttl_clocks=C][,ttl_s=S][,max_rows=R]"
            + (f"; unknown {', '.join(unknown)}" if unknown else "")
        )
    try:
        dtype = getattr(torch, fields.get("dtype", "float32"))
        if not isinstance(dtype, torch.dtype):
            raise TypeError(fields["dtype"])
        spec = TableSpec(
            name=name, kind="sparse", dtype=dtype, dim=int(fields["dim"]),
            optimizer=OptimizerConfig(fields.get("optimizer", "sgd")),
            admit=fields.get("admit", "always"), ttl_clocks=int(fields.get("ttl_clocks", 0)),
            ttl_s=float(fields.get("ttl_s", 0)), max_rows=int(fields.get("max_rows", 0)),
        )
        ids = int(float(fields["ids"]))
    except (AttributeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"table {text!r}: a value is not valid ({exc})") from exc
    return spec, ids


def render(plans: Sequence[TablePlan]) -> str:
    """The plan as `pstrain plan` prints it."""
    lines = [f"{'table':<16}{'rows/server':>13}{'B/row':>7}{'values':>11}{'state+meta':>12}"
             f"{'index':>11}{'memory':>11}{'at least':>11}"]
    for p in plans:
        rest = p.memory_bytes - p.value_bytes - p.index_bytes
        lines.append(
            f"{p.spec.name:<16}{p.rows:>13,}{p.row_bytes:>7}{format_size(p.value_bytes):>11}"
            f"{format_size(rest):>12}{format_size(p.index_bytes):>11}"
            f"{format_size(p.memory_bytes):>11}{format_size(p.budget_bytes):>11}"
        )
    total = sum(p.memory_bytes for p in plans)
    least = sum(p.budget_bytes for p in plans)
    servers = plans[0].servers if plans else 1
    lines.append(
        f"per server (the fullest of {servers}): {format_size(total)} as the tables grow "
        f"freely; with --memory-budget at least {format_size(least)} (storage grows only "
        "into the budget's room); leave room beside it for the process and its requests"
    )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """`pstrain plan` (run as `python -m ps.plan`)."""
    p = argparse.ArgumentParser(
        prog="pstrain plan",
        description="Memory per server of sparse tables, before running a job.",
    )
    p.add_argument("--table", action="append", required=True, metavar="NAME:dim=D,ids=N,...",
                   help="a sparse table and the distinct ids it will hold (admitted ones, "
                        "if it has an admission rule); repeat per table. Keys: dim, ids, "
                        "dtype, optimizer, admit, ttl_clocks, ttl_s, max_rows")
    p.add_argument("--servers", type=int, default=1, help="servers in the job (default 1)")
    a = p.parse_args(argv)
    try:
        plans = [plan_table(*parse_table(t), a.servers) for t in a.table]
    except PSError as exc:
        print(f"pstrain plan: {exc}", file=sys.stderr)
        return 2
    print(render(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
