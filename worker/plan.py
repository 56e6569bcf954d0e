"""An exchange's plan: a step's pushes and pulls cut into one request per shard, and the
shards' answers put back together in the caller's order.

Every data call of the worker is an exchange (a single pull or push is an exchange of one
item), so this is the one place that lays data out on the wire. No I/O: `requests()` says
what to send, `unpack()` takes what came back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from protos import codec
from protos import pstrain_pb2 as pb
from protos.partition import RowRange
from worker.errors import PSClientError, UnknownTableError
from worker.routing import (
    KeysLike,
    TableInfo,
    as_keys,
    coalesce,
    dense_blocks,
    route_keys,
    unique_keys,
)


@dataclass(frozen=True)
class Push:
    """A gradient for `PSClient.exchange`: of a dense table (`keys` None) or of sparse rows.
    `assign` overwrites the values instead (keys must then be unique); `if_absent` with it
    (dense only) overwrites only shards whose block was never written."""

    table: str
    grad: torch.Tensor
    keys: KeysLike | None = None
    assume_unique: bool = False
    assign: bool = False
    if_absent: bool = False


@dataclass(frozen=True)
class Pull:
    """What `PSClient.exchange` pulls: a dense table whole (`keys` None) or sparse rows."""

    table: str
    keys: KeysLike | None = None
    assume_unique: bool = False


@dataclass
class _PullOut:
    """Where the shards' answers to one pull land."""

    shape: tuple[int, ...]  # dense: the table's; sparse: [unique keys, dim]
    dtype: torch.dtype
    parts: int  # how many shards answer it
    inverse: np.ndarray | None = None  # sparse: each asked key's row in `values`
    dense_width: int = 0  # dense: elements per row
    # Made up front when several shards answer (their answers land in parallel); a pull that
    # one shard answers may keep that answer's memory instead.
    values: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.parts != 1:
            self.values = torch.empty(self.shape, dtype=self.dtype)

    def target(self) -> torch.Tensor:
        if self.values is None:
            self.values = torch.empty(self.shape, dtype=self.dtype)
        return self.values


# (pull index, where its rows go: a dense block, sparse positions, or None for all of it)
_Route = tuple[int, RowRange | np.ndarray | None]


class ExchangePlan:
    """One exchange's per-shard requests. Not thread-safe: one plan, one exchange."""

    def __init__(self, header: pb.ExchangeRequest, tables: Callable[[str, str], TableInfo],
                 num_shards: int, seq: Iterator[int]) -> None:
        """`header`: the request fields every shard gets (worker, clocks, ...); `tables`
        finds a declared table by (name, kind); `seq` numbers pushes."""
        self.header = header
        self._tables = tables
        self.num_shards = num_shards
        self._seq = seq
        self._shards: dict[int, tuple[pb.ExchangeRequest, codec.Payload]] = {}
        self._routes: dict[int, list[_Route]] = {}
        self._outputs: list[_PullOut] = []
        self._answer_bytes: dict[int, int] = {}
        if header.end_iteration or header.cut:  # both reach every shard
            for index in range(num_shards):
                self._request(index)

    def _request(self, index: int) -> tuple[pb.ExchangeRequest, codec.Payload]:
        found = self._shards.get(index)
        if found is None:
            msg = pb.ExchangeRequest()
            msg.CopyFrom(self.header)
            found = self._shards[index] = (msg, codec.Payload())
            self._routes[index] = []
        return found

    def push(self, push: Push) -> None:
        if push.keys is None:
            table = self._tables(push.table, "dense")
            dtype = wire_dtype(push.grad.dtype)
            for r, shape, block in dense_blocks(table, push.grad):
                msg, payload = self._request(r.shard)
                msg.pushes.add(
                    table=push.table, seq=next(self._seq), dtype=dtype, dense=True,
                    shape=shape, values=payload.add(codec.tensor_bytes(block)),
                    assign=push.assign, if_absent=push.if_absent,
                )
            return
        table = self._tables(push.table, "sparse")
        unique, grads = coalesce(table, push.keys, push.grad, push.assume_unique or push.assign)
        dtype = wire_dtype(grads.dtype)
        for shard, positions in route_keys(unique, self.num_shards):
            keys = unique if positions is None else unique[positions]
            rows = grads if positions is None else grads[torch.from_numpy(positions)]
            msg, payload = self._request(shard)
            msg.pushes.add(
                table=push.table, seq=next(self._seq), dtype=dtype, dim=table.dim,
                keys=payload.add(codec.keys_bytes(keys)),
                values=payload.add(codec.tensor_bytes(rows)), assign=push.assign,
                if_absent=push.if_absent,
            )

    def pull(self, pull: Pull) -> None:
        index = len(self._outputs)
        if pull.keys is None:
            table = self._tables(pull.table, "dense")
            blocks = table.used_blocks()
            out = _PullOut(table.shape, table.dtype, len(blocks),
                           dense_width=table.dense_width)
            row_bytes = out.dense_width * table.dtype.itemsize
            for r in blocks:
                msg, _ = self._request(r.shard)
                msg.pulls.add(table=pull.table, dense=True)
                self._routes[r.shard].append((index, r))
                self._expect(r.shard, r.rows * row_bytes)
        else:
            table = self._tables(pull.table, "sparse")
            unique, inverse = unique_keys(as_keys(pull.keys), pull.assume_unique)
            routes = route_keys(unique, self.num_shards)
            out = _PullOut((len(unique), table.dim), table.dtype, len(routes), inverse)
            row_bytes = table.dim * table.dtype.itemsize
            for shard, positions in routes:
                keys = unique if positions is None else unique[positions]
                msg, payload = self._request(shard)
                msg.pulls.add(table=pull.table, keys=payload.add(codec.keys_bytes(keys)))
                self._routes[shard].append((index, positions))
                self._expect(shard, len(keys) * row_bytes)
        self._outputs.append(out)

    def _expect(self, index: int, nbytes: int) -> None:
        self._answer_bytes[index] = self._answer_bytes.get(index, 0) + nbytes

    def requests(self) -> list[tuple[int, pb.ExchangeRequest, codec.Payload, int]]:
        """(shard, request, its payload, the answer's payload bytes) per shard involved, in
        shard order."""
        return [
            (i, msg, payload, self._answer_bytes.get(i, 0))
            for i, (msg, payload) in sorted(self._shards.items())
        ]

    def unpack(self, index: int, msg: pb.ExchangeResponse, payload: codec.Received) -> None:
        """Puts shard `index`'s answer (its pulled parts in `payload`) where the pulls want
        it. A pull answered whole by one shard keeps a writable `payload`'s memory as its
        tensor (no copy); read-only answers are copied."""
        routes = self._routes[index]
        if len(msg.pulled) != len(routes):
            raise PSClientError(
                f"shard {index} answered {len(msg.pulled)} pulls of {len(routes)}"
            )
        for (pull, where), part in zip(routes, msg.pulled, strict=True):
            out = self._outputs[pull]
            data = payload.span(part.values, f"shard {index}'s answer")
            shape = tuple(part.shape)
            values = codec.tensor_from_bytes(data, out.dtype, shape)
            if out.parts == 1 and not data.readonly and values.numel():
                out.values = values if shape == out.shape else values.view(out.shape)
            elif isinstance(where, RowRange):
                flat = out.target().view(-1)
                start = where.start * out.dense_width
                flat[start : start + values.numel()].copy_(values.reshape(-1))
            elif where is None:
                out.target().copy_(values.view(out.shape))
            else:
                out.target().index_copy_(0, torch.from_numpy(where), values)

    def results(self) -> list[torch.Tensor]:
        """One tensor per pull, in order: a dense table whole, or a sparse pull's rows in
        the order of the keys asked."""
        found = [out.target() for out in self._outputs]
        return [
            values if out.inverse is None else values[torch.from_numpy(out.inverse)]
            for out, values in zip(self._outputs, found, strict=True)
        ]


def wire_dtype(dtype: torch.dtype) -> pb.DType:
    """The wire code of a tensor's dtype; PSClientError for dtypes the wire does not carry."""
    try:
        return codec.dtype_to_wire(dtype)
    except codec.WireError as exc:
        raise PSClientError(str(exc)) from exc


def table_lookup(tables: Mapping[str, TableInfo]) -> Callable[[str, str], TableInfo]:
    """A `tables` function for ExchangePlan over declared tables; UnknownTableError names an
    undeclared one, PSClientError a table of the other kind."""

    def find(name: str, kind: str) -> TableInfo:
        table = tables.get(name)
        if table is None:
            raise UnknownTableError(
                f"table {name!r} is not declared by this client; call declare_{kind} first "
                "(declaring an existing table with the same spec is harmless)"
            )
        if table.kind != kind:
            raise PSClientError(f"table {name!r} is {table.kind}, not {kind}")
        return table

    return find
