"""The server's edge of the wire: protobuf messages to domain values and back.

The servicer calls these and nothing else touches generated messages on the server's data
path. Conversions check what the wire form alone can tell (dtypes, byte counts against
shapes, spans inside the payload) and raise InvalidArgumentError or WireError; the domain
objects check the rest.
"""

from __future__ import annotations

import math

import torch

from protos import codec, modes
from protos import pstrain_pb2 as pb
from protos.codec import WireError
from protos.positions import MAX_POSITION_BYTES
from ps.checkpoint import CheckpointError, check_reference
from ps.errors import InvalidArgumentError
from ps.initializers import InitSpec
from ps.shard import (
    ClockState,
    DensePush,
    Exchange,
    ExchangeResult,
    Pull,
    PushMeta,
    PushOutcome,
    SparsePush,
)
from ps.tables import OptimizerConfig, TableSpec, TableStats

__all__ = ["clocks_to_proto", "exchange_from_proto", "exchange_to_proto",
           "restore_from_proto", "spec_from_proto", "stats_to_proto", "tables_named"]


def spec_from_proto(msg: pb.TableSpec) -> TableSpec:
    """A domain TableSpec from its wire form; InvalidArgumentError when it is malformed."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidArgumentError(f"table {msg.name!r}: set either dense or sparse")
    body = msg.dense if kind == "dense" else msg.sparse
    try:
        dtype = codec.dtype_from_wire(body.dtype)
    except WireError as exc:
        raise InvalidArgumentError(f"table {msg.name!r}: {exc}") from exc
    init = InitSpec(body.init.kind or "uniform", body.init.a, body.init.b) if body.HasField(
        "init"
    ) else InitSpec()
    optimizer = OptimizerConfig(
        msg.optimizer.name or "sgd", tuple(sorted(msg.optimizer.params.items()))
    )
    try:
        mode = modes.from_proto(
            msg.consistency, msg.staleness if msg.HasField("staleness") else None
        )
    except modes.ModeError as exc:
        raise InvalidArgumentError(f"table {msg.name!r}: {exc}") from exc
    return TableSpec(
        name=msg.name,
        kind=kind,
        dtype=dtype,
        shape=tuple(msg.dense.shape) if kind == "dense" else (),
        dim=msg.sparse.dim if kind == "sparse" else 0,
        init=init,
        seed=body.seed,
        optimizer=optimizer,
        allow_non_finite=msg.allow_non_finite,
        mode=mode,
        # A dense spec reads the defaults here (an unset message's fields).
        admit=msg.sparse.admit or "always",
        admit_default=msg.sparse.admit_default,
        ttl_clocks=msg.sparse.ttl_clocks,
        ttl_s=msg.sparse.ttl_s,
        max_rows=msg.sparse.max_rows,
    )


def _push_result(outcome: PushOutcome, elements: int) -> pb.PushResponse:
    return pb.PushResponse(
        duplicate=outcome is PushOutcome.DUPLICATE, dropped=outcome is PushOutcome.DROPPED,
        kept=outcome is PushOutcome.KEPT, elements=elements,
    )


def exchange_from_proto(msg: pb.ExchangeRequest, payload: codec.Received) -> Exchange:
    """A domain Exchange from its wire form; WireError or InvalidArgumentError if malformed.
    A dense push keeps the pieces its bytes arrived in (see DensePush)."""
    wait_s = msg.wait_ms / 1000
    pushes: list[SparsePush | DensePush] = []
    for p in msg.pushes:
        what = f"push to {p.table!r}"
        meta = PushMeta(worker=msg.worker, incarnation=msg.incarnation, seq=p.seq,
                        clock=msg.push_clock, assign=p.assign, wait_s=wait_s,
                        generation=msg.generation, if_absent=p.if_absent)
        dtype = codec.dtype_from_wire(p.dtype)
        if not p.dense:
            keys = codec.keys_from_bytes(payload.span(p.keys, what))
            values = payload.span(p.values, what)
            pushes.append(SparsePush(p.table, meta, dtype, p.dim, keys, values))
            continue
        shape = tuple(p.shape)
        itemsize = dtype.itemsize
        expected = math.prod(shape) * itemsize
        if p.values.length != expected:
            raise InvalidArgumentError(
                f"dense push to {p.table!r} carries {p.values.length} bytes but shape "
                f"{list(shape)} of {codec.dtype_name(p.dtype)} needs {expected}"
            )
        parts = [
            (offset, codec.tensor_from_bytes(view, dtype, (view.nbytes // itemsize,)))
            for offset, view in payload.elements(p.values, itemsize, what)
        ]
        pushes.append(DensePush(p.table, meta, dtype, shape, parts))
    pulls = [
        Pull(q.table) if q.dense else Pull(
            q.table, codec.keys_from_bytes(payload.span(q.keys, f"pull of {q.table!r}"))
        )
        for q in msg.pulls
    ]
    return Exchange(
        worker=msg.worker, incarnation=msg.incarnation, generation=msg.generation,
        push_clock=msg.push_clock, pushes=pushes, end_iteration=msg.end_iteration,
        pull_clock=msg.pull_clock, pulls=pulls, wait_s=wait_s,
        position=_position(msg), cut=msg.cut, cut_clock=msg.cut_clock,
        acked_clock=msg.acked_clock,
    )


def _position(msg: pb.ExchangeRequest) -> bytes:
    """The request's data position as UTF-8, checked: at most MAX_POSITION_BYTES."""
    position = msg.position.encode()
    if len(position) > MAX_POSITION_BYTES:
        raise InvalidArgumentError(
            f"the data position carries {len(position)} bytes; a server keeps at most "
            f"{MAX_POSITION_BYTES} per worker: keep a sampler's state small (a seed and a "
            "count, not the data)")
    return position


def exchange_to_proto(
    exchange: Exchange, result: ExchangeResult
) -> tuple[pb.ExchangeResponse, codec.Payload]:
    """The wire answer to `exchange`, and the bulk bytes it names."""
    response = pb.ExchangeResponse(
        pushes=[
            _push_result(outcome, _elements(push))
            for push, outcome in zip(exchange.pushes, result.outcomes, strict=True)
        ],
        open_clock=result.open_clock or 0, cut=result.cut,
    )
    payload = codec.Payload()
    for pulled in result.pulled:
        values = pulled if isinstance(pulled, torch.Tensor) else pulled.gather(0, len(pulled))
        response.pulled.append(pb.ExchangePulled(
            dtype=codec.dtype_to_wire(values.dtype), shape=list(values.shape),
            values=payload.add(codec.tensor_bytes(values)),
        ))
    return response, payload


def _elements(push: SparsePush | DensePush) -> int:
    return len(push.keys) * push.dim if isinstance(push, SparsePush) else math.prod(push.shape)


def stats_to_proto(s: TableStats, mode: modes.Mode) -> pb.TableStats:
    c = s.counters
    consistency, staleness = modes.to_proto(mode)
    return pb.TableStats(
        name=s.name, kind=s.kind, optimizer=s.optimizer, rows=s.rows,
        value_bytes=s.value_bytes, state_bytes=s.state_bytes, index_bytes=s.index_bytes,
        pushes_applied=c.pushes_applied, pushes_duplicate=c.pushes_duplicate,
        pushes_rejected=c.pushes_rejected, pulls=c.pulls, rows_pulled=c.rows_pulled,
        rows_pushed=c.rows_pushed, row_start=s.row_start, row_end=s.row_end,
        consistency=consistency, staleness=staleness or 0,
        pushes_dropped=c.pushes_dropped, gradients_aggregated=c.gradients_aggregated,
        pushes_kept=c.pushes_kept, memory_bytes=s.memory_bytes, admitted=c.admitted,
        refused_by_admission=c.refused_by_admission, evicted=c.evicted,
        readmitted=c.readmitted, metadata_bytes=s.metadata_bytes,
    )


def clocks_to_proto(state: ClockState) -> list[pb.WorkerClock]:
    return [
        pb.WorkerClock(worker=w, clock=c, live=w in state.live)
        for w, c in sorted(state.clocks.items())
    ]


def restore_from_proto(msg: pb.RestoreRequest) -> tuple[str, str]:
    """(checkpoint id, sha256) of a Restore, ("", "") for an empty shard;
    InvalidArgumentError unless the id can name a directory and the digest is one."""
    if not msg.checkpoint_id:
        return "", ""
    try:
        check_reference(msg.checkpoint_id, msg.sha256)
    except CheckpointError as exc:
        raise InvalidArgumentError(f"Restore: {exc}") from exc
    return msg.checkpoint_id, msg.sha256


def tables_named(msg: pb.ExchangeRequest) -> list[tuple[str, bool]]:
    """(table, dense) for every push and pull of `msg`: what its header alone tells."""
    return [(p.table, p.dense) for p in msg.pushes] + [(q.table, q.dense) for q in msg.pulls]
