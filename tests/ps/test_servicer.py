"""Bad input against a real server: the right status, a message naming the bad value, and
no change to the table. Requests are built by hand so the server's own checks are tested,
not the client's."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from procs import REPO, Proc, Procs

from protos import codec, rpc
from protos import pstrain_pb2 as pb
from protos.parts import cut
from worker.client import PSClient
from worker.errors import RemoteError

_PATHS = {m.name: m.path for m in rpc.METHODS}


@dataclass
class Raw:
    channel: grpc.Channel
    client: PSClient
    server: Proc

    def exchange(self, request: bytes) -> pb.ExchangeResponse:
        call = self.channel.unary_unary(_PATHS["Exchange"])
        return pb.ExchangeResponse.FromString(call(request, timeout=10))

    def stream(self, parts: list[bytes]) -> list[bytes]:
        call = self.channel.stream_stream(_PATHS["ExchangeStream"])
        return list(call(iter(parts), timeout=10))

    def call(self, method: str, request: bytes) -> bytes:
        result: bytes = self.channel.unary_unary(_PATHS[method])(request, timeout=10)
        return result

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor, int, list[tuple[int, int]]]:
        dense = self.client.pull_dense("w")
        sparse = self.client.pull_sparse("e", KEYS)
        stats = self.client.stats()[0]
        applied = sum(t.pushes_applied for t in stats.tables)
        return dense, sparse, applied, sorted((c.worker, c.clock) for c in stats.clocks)


KEYS = np.array([1, 2, 3], dtype=np.int64)
_seq = iter(range(1, 10_000))


def _one(add: Callable[[pb.ExchangeRequest, codec.Payload], None]) -> tuple[
    pb.ExchangeRequest, codec.Payload
]:
    msg = pb.ExchangeRequest(worker=1, incarnation=1)
    payload = codec.Payload()
    add(msg, payload)
    return msg, payload


def _sparse_push(keys: bytes | memoryview, values: bytes | memoryview, *, table: str = "e",
                 dtype: int = pb.FLOAT32, dim: int = 4) -> bytes:
    """A request of one sparse push."""
    def add(msg: pb.ExchangeRequest, payload: codec.Payload) -> None:
        msg.pushes.append(pb.ExchangePush(
            table=table, seq=next(_seq), dtype=dtype, dim=dim,  # type: ignore[arg-type]
            keys=payload.add(keys), values=payload.add(values),
        ))
    msg, payload = _one(add)
    return codec.encode(msg, {"payload": payload.parts})


def _dense_push(values: torch.Tensor, shape: list[int], dtype: int = pb.FLOAT32) -> bytes:
    """A request of one dense push."""
    msg, payload = _one(_then_dense(values, shape, dtype))
    return codec.encode(msg, {"payload": payload.parts})


def _assign_w(value: float, *, assign: bool = True, if_absent: bool = True) -> bytes:
    """A request of one dense assign (if absent) of "w" to `value`."""
    def add(msg: pb.ExchangeRequest, payload: codec.Payload) -> None:
        msg.pushes.append(pb.ExchangePush(
            table="w", seq=next(_seq), dtype=pb.FLOAT32, dense=True, shape=[8, 4],
            values=payload.add(codec.tensor_bytes(torch.full((8, 4), value))),
            assign=assign, if_absent=if_absent,
        ))
    msg, payload = _one(add)
    return codec.encode(msg, {"payload": payload.parts})


def _sparse_if_absent(msg: pb.ExchangeRequest, payload: codec.Payload) -> None:
    """Makes the exchange's first push (sparse, to "e") an assign if absent."""
    msg.pushes[0].assign = True
    msg.pushes[0].if_absent = True


def _sparse_pull(keys: bytes, table: str = "e") -> bytes:
    """A request of one sparse pull."""
    def add(msg: pb.ExchangeRequest, payload: codec.Payload) -> None:
        msg.pulls.append(pb.ExchangePull(table=table, keys=payload.add(keys)))
    msg, payload = _one(add)
    return codec.encode(msg, {"payload": payload.parts})


def _streamed(values: torch.Tensor, chunk_bytes: int = 40) -> list[bytes]:
    """The parts of a streamed request of one dense push to "w"."""
    msg, payload = _one(_then_dense(values, list(values.shape)))
    return list(cut(pb.ExchangePart, msg, payload.parts, payload.nbytes, chunk_bytes))


def _exchange(then: Callable[[pb.ExchangeRequest, codec.Payload], None]) -> bytes:
    """An exchange whose first push is good, followed by whatever `then` adds; it ends
    worker 1's iteration, so a refused one must leave the clocks alone too."""
    msg = pb.ExchangeRequest(worker=1, incarnation=1, end_iteration=True)
    payload = codec.Payload()
    msg.pushes.append(pb.ExchangePush(
        table="e", seq=next(_seq), dtype=pb.FLOAT32, dim=4,
        keys=payload.add(codec.keys_bytes(KEYS)), values=payload.add(_values(3)),
    ))
    then(msg, payload)
    return codec.encode(msg, {"payload": payload.parts})


def _then_dense(values: torch.Tensor, shape: list[int], dtype: int = pb.FLOAT32) -> Callable[
    [pb.ExchangeRequest, codec.Payload], None
]:
    def add(msg: pb.ExchangeRequest, payload: codec.Payload) -> None:
        msg.pushes.append(pb.ExchangePush(
            table="w", seq=next(_seq), dtype=dtype, dense=True, shape=shape,  # type: ignore[arg-type]
            values=payload.add(codec.tensor_bytes(values)),
        ))
    return add


def _clock(clock: int) -> Callable[[pb.ExchangeRequest, codec.Payload], None]:
    def add(msg: pb.ExchangeRequest, payload: codec.Payload) -> None:
        msg.push_clock = clock
    return add


def _worker(worker: int) -> Callable[[pb.ExchangeRequest, codec.Payload], None]:
    def add(msg: pb.ExchangeRequest, payload: codec.Payload) -> None:
        msg.worker = worker
    return add


def _dense_pulls(times: int) -> Callable[[pb.ExchangeRequest, codec.Payload], None]:
    def add(msg: pb.ExchangeRequest, payload: codec.Payload) -> None:
        msg.pulls.extend(pb.ExchangePull(table="w", dense=True) for _ in range(times))
    return add


def _sparse_spec(name: str, dim: int) -> pb.TableSpec:
    return pb.TableSpec(name=name, sparse=pb.SparseSpec(dim=dim, dtype=pb.FLOAT32))


def _dense_spec(name: str, shape: list[int]) -> pb.TableSpec:
    return pb.TableSpec(name=name, dense=pb.DenseSpec(shape=shape, dtype=pb.FLOAT32))


def _declare(*specs: pb.TableSpec) -> bytes:
    return pb.DeclareTablesRequest(tables=list(specs)).SerializeToString()


def _restore(**fields: object) -> Callable[[Raw], bytes]:
    """A Restore request of `fields`, sent raw."""
    return lambda r: r.call("Restore", pb.RestoreRequest(**fields).SerializeToString())


def _then_pull(table: str, span: pb.Span | None = None) -> Callable[
    [pb.ExchangeRequest, codec.Payload], None
]:
    def add(msg: pb.ExchangeRequest, payload: codec.Payload) -> None:
        keys = span if span is not None else payload.add(codec.keys_bytes(KEYS))
        msg.pulls.append(pb.ExchangePull(table=table, keys=keys))
    return add


@contextmanager
def started(procs: Procs) -> Iterator[Raw]:
    """A server with tight limits, holding dense "w" and sparse "e", and raw access to it."""
    server = procs.server(extra=["--max-message-mib", "4", "--chunk-mib", "1",
                                 "--max-answer-mib", "0.001", "--max-table-mib", "1",
                                 "--max-dim", "64", "--max-tables", "45",
                                 "--max-declare-tables", "50", "--max-new-rows", "999"])
    client = PSClient([server.address])
    client.declare_dense("w", (8, 4), optimizer="sgd", lr=1.0, init=("uniform", -1, 1))
    client.declare_sparse("e", 4, optimizer="adagrad", lr=0.1)
    channel = grpc.insecure_channel(server.address)
    try:
        yield Raw(channel, client, server)
    finally:
        channel.close()
        client.close()


@pytest.fixture(scope="module")
def raw(module_procs: Procs) -> Iterator[Raw]:
    """One server for the module's tests that change nothing on it (each checks it did not,
    and declares no table)."""
    with started(module_procs) as shared:
        yield shared


@pytest.fixture
def own(procs: Procs) -> Iterator[Raw]:
    """A server of the test's own, for a test that changes what the server holds."""
    with started(procs) as alone:
        yield alone


def _values(n: int, dim: int = 4, dtype: torch.dtype = torch.float32) -> memoryview:
    return codec.tensor_bytes(torch.ones(n, dim, dtype=dtype))


CASES = [
    pytest.param(
        lambda r: r.exchange(_sparse_push(codec.keys_bytes(KEYS),
                                              _values(3, dtype=torch.float64),
                                              dtype=pb.FLOAT64)),
        "INVALID_ARGUMENT", "holds float32 rows; the push carries float64", id="wrong-dtype",
    ),
    pytest.param(
        lambda r: r.exchange(_dense_push(torch.ones(8, 5), [8, 5])),
        "INVALID_ARGUMENT", "block shape [8, 4]; the push carries shape [8, 5]", id="wrong-shape",
    ),
    pytest.param(
        lambda r: r.exchange(_sparse_push(codec.keys_bytes(KEYS), _values(3, dim=6),
                                              dim=6)),
        "INVALID_ARGUMENT", "has dim 4; the push carries dim 6", id="wrong-dim",
    ),
    pytest.param(
        lambda r: r.exchange(_sparse_push(codec.keys_bytes(KEYS).cast("B")[:20], _values(3))),
        "INVALID_ARGUMENT", "20 bytes, not a multiple of 8", id="keys-not-multiple-of-8",
    ),
    pytest.param(
        lambda r: r.exchange(_assign_w(3.0, assign=False)),
        "INVALID_ARGUMENT", "asks for if_absent without assign", id="if-absent-without-assign",
    ),
    pytest.param(
        lambda r: r.exchange(_exchange(_sparse_if_absent)),
        "INVALID_ARGUMENT", "table 'e' is sparse; if_absent applies to dense tables only",
        id="if-absent-on-sparse",
    ),
    pytest.param(
        lambda r: r.exchange(_sparse_pull(b"\x00" * 12)),
        "INVALID_ARGUMENT", "12 bytes, not a multiple of 8", id="pull-keys-not-multiple-of-8",
    ),
    pytest.param(
        lambda r: r.exchange(_sparse_push(codec.keys_bytes(KEYS), _values(2))),
        "INVALID_ARGUMENT", "carries 3 keys but 2 rows of values", id="counts-disagree",
    ),
    pytest.param(
        lambda r: r.exchange(_sparse_push(codec.keys_bytes(KEYS), _values(3),
                                              table="nope")),
        "NOT_FOUND", "no table 'nope'", id="unknown-table",
    ),
    pytest.param(
        lambda r: r.exchange(_sparse_pull(codec.keys_bytes(KEYS).tobytes(), "nope")),
        "NOT_FOUND", "no table 'nope'", id="unknown-table-pull",
    ),
    pytest.param(
        lambda r: r.exchange(_dense_push(torch.ones(8, 4), [8, 4]) + b"\x00" * (5 << 20)),
        "RESOURCE_EXHAUSTED", "larger than max", id="over-size-limit",
    ),
    pytest.param(
        lambda r: r.exchange(_sparse_push(
            codec.keys_bytes(KEYS),
            codec.tensor_bytes(torch.tensor([[1.0, 2, 3, 4], [1, float("nan"), 1, 1],
                                             [1, 1, 1, 1]])))),
        "INVALID_ARGUMENT", "non-finite value (nan) at flat element 5", id="nan-gradient",
    ),
    pytest.param(
        lambda r: r.exchange(_dense_push(torch.full((8, 4), float("inf")), [8, 4])),
        "INVALID_ARGUMENT", "non-finite value (inf) at flat element 0", id="inf-gradient",
    ),
    # A streamed exchange applies nothing until all of it has arrived and been checked.
    pytest.param(
        lambda r: r.stream(_streamed(torch.ones(8, 4))[:-1]),
        "INVALID_ARGUMENT", "the stream ended after 120 of the 128 bytes announced",
        id="stream-ended-short",
    ),
    pytest.param(
        lambda r: r.stream([_streamed(torch.ones(8, 4))[0], *_streamed(torch.ones(8, 4))[2:]]),
        "INVALID_ARGUMENT", "a part at byte 80 does not follow the 40 bytes received",
        id="stream-part-out-of-order",
    ),
    pytest.param(
        lambda r: r.stream(_streamed(torch.ones(8, 4))[1:]),
        "INVALID_ARGUMENT", "the first part of a stream must carry the request",
        id="stream-without-request",
    ),
    pytest.param(
        lambda r: r.stream([codec.encode(pb.ExchangePart(request=pb.ExchangeRequest(worker=1),
                                                         payload_bytes=1 << 40))]),
        "RESOURCE_EXHAUSTED", "request of 1099511627776 bytes is over this server's limit",
        id="stream-over-request-limit",
    ),
    pytest.param(
        lambda r: r.stream([codec.encode(pb.ExchangePart(
            request=pb.ExchangeRequest(worker=1, pushes=[pb.ExchangePush(table="nope",
                                                                         dense=True)]),
            payload_bytes=1 << 30))]),
        "NOT_FOUND", "no table 'nope'", id="stream-unknown-table-refused-on-its-first-part",
    ),
    pytest.param(
        lambda r: r.stream(_streamed(torch.full((8, 4), float("nan")))),
        "INVALID_ARGUMENT", "non-finite value (nan) at flat element 0", id="stream-nan",
    ),
    # Requests that do not decode, and integers past what the server stores.
    pytest.param(
        lambda r: r.call("Exchange", b"\xff\xff\xff"),
        "INVALID_ARGUMENT", "Exchange: the request is not a valid ExchangeRequest",
        id="undecodable-exchange",
    ),
    pytest.param(
        lambda r: r.exchange(_exchange(_clock(2**63 - 1))),
        "INVALID_ARGUMENT", "the push clock must lie in [0, 4611686018427387904), got "
        "9223372036854775807", id="clock-out-of-range",
    ),
    pytest.param(
        lambda r: r.exchange(_exchange(_worker(-1))),
        "INVALID_ARGUMENT", "the worker id must lie in [0, 2147483648), got -1",
        id="negative-worker",
    ),
    pytest.param(
        lambda r: r.call("Join", pb.JoinRequest(worker=1, incarnation=1,
                                                generation=2**63 - 1).SerializeToString()),
        "INVALID_ARGUMENT", "the generation must lie in [0, 4611686018427387904)",
        id="join-generation-out-of-range",
    ),
    pytest.param(
        lambda r: r.call("SetMembership",
                         pb.MembershipRequest(live_workers=[0, 2**40]).SerializeToString()),
        "INVALID_ARGUMENT", "a live worker id must lie in [0, 2147483648), got 1099511627776",
        id="membership-worker-out-of-range",
    ),
    pytest.param(
        _restore(generation=2**63 - 1),
        "INVALID_ARGUMENT", "the generation must lie in [0, 4611686018427387904)",
        id="restore-generation-out-of-range",
    ),
    # Restore finds a checkpoint by id in the server's own directory, never by a path.
    pytest.param(
        _restore(checkpoint_id="../../etc/passwd", sha256="0" * 64),
        "INVALID_ARGUMENT", "checkpoint id '../../etc/passwd' cannot name a directory",
        id="restore-path-as-id",
    ),
    pytest.param(
        _restore(checkpoint_id="c1"),
        "INVALID_ARGUMENT", "the shard's sha256 must be 64 lowercase hex digits",
        id="restore-without-digest",
    ),
    pytest.param(
        _restore(checkpoint_id="c1", sha256="0" * 64),
        "FAILED_PRECONDITION", "this server has no checkpoint directory",
        id="restore-without-directory",
    ),
    # What one request may make the server build or hold.
    pytest.param(
        lambda r: r.exchange(_exchange(_dense_pulls(2))),
        "INVALID_ARGUMENT", "pulls dense table 'w' twice", id="dense-pulled-twice",
    ),
    pytest.param(
        lambda r: r.exchange(_sparse_pull(codec.keys_bytes(np.arange(100)).tobytes())),
        "RESOURCE_EXHAUSTED", "answer would hold 1600 bytes, over this server's limit of 1048 "
        "(--max-answer-mib)", id="answer-over-budget",
    ),
    pytest.param(
        lambda r: r.call("DeclareTables", _declare(_sparse_spec("x", 4), _sparse_spec("x", 8))),
        "INVALID_ARGUMENT", "one declare names table(s) 'x' twice", id="declare-name-twice",
    ),
    pytest.param(
        lambda r: r.call("DeclareTables", _declare(_sparse_spec("wide", 65))),
        "INVALID_ARGUMENT", "table 'wide': dim 65 is over this server's limit of 64",
        id="declare-over-dim",
    ),
    pytest.param(
        lambda r: r.call("DeclareTables", _declare(_dense_spec("huge", [2**40]))),
        "INVALID_ARGUMENT", "table 'huge': shape [1099511627776] of torch.float32 is "
        "4398046511104 bytes, over this server's limit of 1048576", id="declare-over-bytes",
    ),
    pytest.param(
        lambda r: r.call("DeclareTables",
                         _declare(*[_sparse_spec(f"t{i}", 4) for i in range(51)])),
        "RESOURCE_EXHAUSTED", "one declare names 51 tables; this server takes at most 50",
        id="declare-too-many-at-once",
    ),
    pytest.param(
        lambda r: r.call("DeclareTables",
                         _declare(*[_sparse_spec(f"t{i}", 4) for i in range(50)])),
        "RESOURCE_EXHAUSTED", "holds 2 tables and takes at most 45 (--max-tables); 50 more do "
        "not fit", id="declare-past-table-count",
    ),
    pytest.param(
        lambda r: r.exchange(_sparse_push(codec.keys_bytes(np.arange(100, 1100)), _values(1000))),
        "RESOURCE_EXHAUSTED", "this exchange would create 1000 new rows (table 'e': 1000), over "
        "this server's limit of 999 per request (--max-new-rows); send fewer new keys",
        id="new-rows-over-limit",
    ),
    # An exchange is checked whole before its first push applies or its iteration ends.
    pytest.param(
        lambda r: r.exchange(_exchange(_then_dense(torch.ones(8, 5), [8, 5]))),
        "INVALID_ARGUMENT", "block shape [8, 4]; the push carries shape [8, 5]",
        id="exchange-wrong-shape",
    ),
    pytest.param(
        lambda r: r.exchange(_exchange(_then_dense(torch.ones(7, 4), [8, 4]))),
        "INVALID_ARGUMENT", "carries 112 bytes but shape [8, 4] of float32 needs 128",
        id="exchange-bytes-disagree",
    ),
    pytest.param(
        lambda r: r.exchange(_exchange(_then_dense(torch.full((8, 4), float("nan")), [8, 4]))),
        "INVALID_ARGUMENT", "non-finite value (nan) at flat element 0", id="exchange-nan",
    ),
    pytest.param(
        lambda r: r.exchange(_exchange(_then_pull("nope"))),
        "NOT_FOUND", "no table 'nope'", id="exchange-unknown-pull",
    ),
    pytest.param(
        lambda r: r.exchange(_exchange(_then_pull("e", pb.Span(offset=8, length=1 << 20)))),
        "INVALID_ARGUMENT", "names bytes [8, 1048584) of a 72-byte payload",
        id="exchange-span-past-payload",
    ),
]


@pytest.mark.parametrize(("request_", "code", "message"), CASES)
def test_bad_input_gets_status_and_changes_nothing(
    raw: Raw, request_: object, code: str, message: str
) -> None:
    before = raw.snapshot()
    with pytest.raises(grpc.RpcError) as err:
        request_(raw)  # type: ignore[operator]
    assert err.value.code().name == code
    assert message in (err.value.details() or "")
    after = raw.snapshot()
    torch.testing.assert_close(after[0], before[0], atol=0, rtol=0)
    torch.testing.assert_close(after[1], before[1], atol=0, rtol=0)
    assert after[2:] == before[2:]
    assert {t.name for t in raw.client.stats()[0].tables} == {"w", "e"}


def test_an_assign_if_absent_answers_whether_it_was_kept(own: Raw) -> None:
    """A refused if_absent (no assign) leaves the block unwritten: the next assign if absent
    takes, and every later one is answered `kept` with nothing changed."""
    with pytest.raises(grpc.RpcError):
        own.exchange(_assign_w(3.0, assign=False))
    first = own.exchange(_assign_w(5.0)).pushes[0]
    assert (first.kept, first.duplicate, first.elements) == (False, False, 32)
    assert own.exchange(_assign_w(6.0)).pushes[0].kept
    torch.testing.assert_close(own.client.pull_dense("w"), torch.full((8, 4), 5.0))
    stats = next(t for t in own.client.stats()[0].tables if t.name == "w")
    assert (stats.pushes_applied, stats.pushes_kept) == (1, 1)


def test_non_finite_allowed_per_table(own: Raw) -> None:
    own.client.declare_sparse("loose", 4, optimizer="sgd", lr=1.0, init=("zeros", 0, 0),
                              allow_non_finite=True)
    keys = np.array([1], dtype=np.int64)
    own.client.push_sparse("loose", keys, torch.tensor([[float("nan"), 1.0, 0.0, 0.0]]))
    row = own.client.pull_sparse("loose", keys)[0]
    assert torch.isnan(row[0]) and row[1].item() == -1.0


def test_redeclare_with_other_spec_shows_both(raw: Raw) -> None:
    with pytest.raises(Exception) as err:
        raw.client.declare_sparse("e", 8, optimizer="adagrad", lr=0.1)
    text = str(err.value)
    assert "FAILED_PRECONDITION" in text and "held:     sparse dim=4" in text
    assert "declared: sparse dim=8" in text


def test_bad_optimizer_is_invalid_argument(raw: Raw) -> None:
    with pytest.raises(Exception) as err:
        raw.client.declare_sparse("f", 8, optimizer="adamw")
    assert "INVALID_ARGUMENT" in str(err.value) and "adamw" in str(err.value)


def test_health_service_reports_serving(raw: Raw) -> None:
    stub = health_pb2_grpc.HealthStub(raw.channel)
    for service in ("", "pstrain.v1.ParameterServer"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "keys", [[1, 2, 1], [5, 6, 5], [1, 9, 9]], ids=["known-keys", "new-keys", "mixed"]
)
def test_repeated_key_in_one_push_is_refused_and_creates_nothing(
    raw: Raw, keys: list[int]
) -> None:
    before = raw.snapshot()
    rows_before = next(t.rows for t in raw.client.stats()[0].tables if t.name == "e")
    array = np.array(keys, dtype=np.int64)
    with pytest.raises(grpc.RpcError) as err:
        raw.exchange(_sparse_push(codec.keys_bytes(array), _values(3)))
    assert err.value.code().name == "INVALID_ARGUMENT"
    repeated = next(k for i, k in enumerate(keys) if k in keys[:i])
    assert f"key {repeated} appears more than once" in (err.value.details() or "")
    after = raw.snapshot()
    torch.testing.assert_close(after[1], before[1], atol=0, rtol=0)
    assert after[2] == before[2]
    rows_after = next(t.rows for t in raw.client.stats()[0].tables if t.name == "e")
    assert rows_after == rows_before


@pytest.mark.parametrize(
    ("consistency", "staleness", "message"),
    [
        (pb.SYNC, 2, "table 'm': only ssp takes a staleness bound, got sync with 2"),
        (pb.MODE_UNSPECIFIED, 1, "table 'm': a staleness bound (1) needs the mode SSP"),
        (pb.SSP, -1, "table 'm': the ssp staleness bound must be an int >= 0, got -1"),
        (7, None, "table 'm': unknown consistency mode 7 on the wire"),
    ],
)
def test_a_bad_mode_on_the_wire_is_refused_and_declares_nothing(
    raw: Raw, consistency: int, staleness: int | None, message: str
) -> None:
    spec = pb.TableSpec(name="m", sparse=pb.SparseSpec(dim=2, dtype=pb.FLOAT32),
                        consistency=consistency, staleness=staleness)  # type: ignore[arg-type]
    declare = raw.channel.unary_unary(_PATHS["DeclareTables"])
    with pytest.raises(grpc.RpcError) as err:
        declare(pb.DeclareTablesRequest(tables=[spec]).SerializeToString(), timeout=10)
    assert err.value.code().name == "INVALID_ARGUMENT"
    assert message in (err.value.details() or "")
    assert "m" not in {t.name for t in raw.client.stats()[0].tables}


@pytest.mark.parametrize("method", [m.name for m in rpc.METHODS if not m.streams_in])
def test_an_undecodable_request_to_any_method_is_invalid_argument_without_a_traceback(
    raw: Raw, method: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        raw.call(method, b"\x0a\xff\xff\xff\xff\x0f")  # a field that claims 4 GiB
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(f"{method}: the request is not a valid ")
    assert "Exception deserializing" not in raw.server.log()
    assert "Traceback" not in raw.server.log()
    raw.client.stats()  # still serving


def test_an_undecodable_streamed_part_is_invalid_argument(raw: Raw) -> None:
    with pytest.raises(grpc.RpcError) as err:
        raw.stream([b"\x0a\xff\xff\xff\xff\x0f"])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "ExchangeStream: the request is not a valid ExchangePart" in (
        err.value.details() or "")


def test_not_found_names_a_few_tables_however_many_there_are(own: Raw) -> None:
    own.call("DeclareTables", _declare(*[_sparse_spec(f"t{i:02d}", 4) for i in range(40)]))
    with pytest.raises(grpc.RpcError) as err:
        own.exchange(_sparse_pull(codec.keys_bytes(KEYS).tobytes(), "nope"))
    details = err.value.details() or ""
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "no table 'nope' (tables: 'e', 't00', 't01', 't02', 't03' and 37 more)" in details
    assert len(details) < 200


def test_a_clock_past_the_limit_leaves_stats_and_membership_working(own: Raw) -> None:
    with pytest.raises(grpc.RpcError):
        own.exchange(_exchange(_clock(2**63 - 1)))
    own.client.stats()
    own.call("SetMembership", pb.MembershipRequest(live_workers=[0, 1]).SerializeToString())


def test_stalled_streams_are_cancelled_and_free_their_threads(procs: Procs) -> None:
    """Two clients each send the first part of a streamed exchange and then nothing, on a
    server with two threads for data calls: each stream is cancelled once idle for
    --stream-idle-s, and the server answers other calls again, with nothing applied."""
    server = procs.server(extra=["--stream-idle-s", "1", "--grpc-threads", "4"])
    client = PSClient([server.address])
    client.declare_dense("w", (8, 4), optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
    first = _streamed(torch.ones(8, 4))[0]
    release = threading.Event()

    def stalled() -> Iterator[bytes]:
        yield first
        release.wait(60)

    channel = grpc.insecure_channel(server.address)
    call = channel.stream_stream(_PATHS["ExchangeStream"])
    errors: list[grpc.StatusCode] = []

    def send() -> None:
        with pytest.raises(grpc.RpcError) as err:
            list(call(stalled(), timeout=30))
        errors.append(err.value.code())

    start = time.monotonic()
    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    took = time.monotonic() - start
    release.set()
    assert errors == [grpc.StatusCode.CANCELLED] * 2 and took < 10, (errors, took)
    torch.testing.assert_close(client.pull_dense("w"), torch.zeros(8, 4))
    assert "sent nothing for 1 s; cancelling it" in server.log()
    channel.close()
    client.close()


# ---- the memory budget ---------------------------------------------------------------------

MiB = 1 << 20
# What a server holds beyond its tables while it serves steps of BATCH new keys: the
# request's gRPC message and decoded arrays, new rows' initial values and the optimizer's
# temporaries, kept on the heap for reuse (20 to 22 MiB measured at this batch), and, now
# and then, up to the key index's size again (8 MiB here, twice over at most) when heap the
# index once advised onto huge pages (ps/_index.c) is reused and faulted in 2 MiB at a time.
# Without the budget the server passes 64 MiB + this within 45 batches; with storage on the
# heap (freed copies of a grown table kept for reuse), within 30.
REQUEST_SLACK = 48 * MiB
BATCH, DIM = 8192, 32


def _rss(pid: int) -> int:
    """The process's resident memory (VmRSS), bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"process {pid} reports no VmRSS")


def _emb_step(known: np.ndarray, new: np.ndarray) -> bytes:
    """Worker 1 pushes gradients of `known` and `new` keys of "emb", ends its iteration and
    pulls the new keys: a worker's usual step, in one exchange."""
    msg = pb.ExchangeRequest(worker=1, incarnation=1, end_iteration=True)
    payload = codec.Payload()
    keys = np.concatenate([known, new])
    msg.pushes.append(pb.ExchangePush(
        table="emb", seq=next(_seq), dtype=pb.FLOAT32, dim=DIM,
        keys=payload.add(codec.keys_bytes(keys)),
        values=payload.add(codec.tensor_bytes(torch.ones(len(keys), DIM))),
    ))
    msg.pulls.append(pb.ExchangePull(table="emb", keys=payload.add(codec.keys_bytes(new))))
    return codec.encode(msg, {"payload": payload.parts})


def test_a_server_at_its_memory_budget_refuses_new_rows_and_stays_within_it(
    procs: Procs,
) -> None:
    """New keys are pushed in batches until the server refuses one: it refuses before it
    holds more than its budget (resident memory stays within it, past an empty server's),
    names the table and the budget, and changes nothing; the rows it holds are still pulled
    and pushed, and it goes on serving."""
    server = procs.server(extra=["--memory-budget", "64MiB"])
    client = PSClient([server.address], transport="grpc")
    client.declare_sparse("emb", DIM, optimizer="adagrad", lr=0.1)
    baseline = _rss(server.pid)
    grads = torch.ones(BATCH, DIM)
    refused: RemoteError | None = None
    start = 0
    while start < 64 * BATCH:  # the rows of more than twice the budget
        try:
            client.push_sparse("emb", np.arange(start, start + BATCH), grads, assume_unique=True)
        except RemoteError as exc:
            refused = exc
            break
        start += BATCH
        grown = _rss(server.pid) - baseline
        assert grown < 64 * MiB + REQUEST_SLACK, f"{grown / MiB:.1f} MiB after {start} rows"
    assert refused is not None, f"{start} rows pushed, none refused"
    assert refused.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details.startswith(f"table 'emb': creating {BATCH} new rows would take "
                                      "this server to ")
    assert "over its --memory-budget of 64 MiB (it holds " in refused.details
    assert refused.details.endswith("raise the budget, add servers, send fewer new keys, or "
                                    "declare the table with max_rows or a TTL to evict rows")

    channel = grpc.insecure_channel(server.address)
    exchange = channel.unary_unary(_PATHS["Exchange"])
    probe = np.arange(0, start, 997)

    def state() -> tuple[list[object], list[tuple[int, int]], torch.Tensor]:
        stats = client.stats()[0]
        tables = [(t.rows, t.memory_bytes, t.pushes_applied) for t in stats.tables]
        return tables, sorted((c.worker, c.clock) for c in stats.clocks), client.pull_sparse(
            "emb", probe, clock=0)

    before = state()
    assert before[0][0][0] == start and before[0][0][1] <= 64 * MiB
    with pytest.raises(grpc.RpcError) as err:
        # The batch refused above, with pushes to rows held: nothing of it is applied.
        exchange(_emb_step(np.arange(10), np.arange(start, start + BATCH)), timeout=30)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"table 'emb': creating {BATCH} new rows" in (err.value.details() or "")
    after = state()
    assert after[:2] == before[:2]
    torch.testing.assert_close(after[2], before[2], atol=0, rtol=0)

    # The rows it holds are served and updated; a dense table past the budget is refused.
    client.push_sparse("emb", probe, torch.ones(len(probe), DIM), assume_unique=True)
    assert not torch.equal(client.pull_sparse("emb", probe, clock=0), before[2])
    with pytest.raises(RemoteError, match="table 'big': declaring it would take this server"):
        client.declare_dense("big", (4096, 1024), optimizer="sgd", lr=0.1)
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert _rss(server.pid) - baseline < 64 * MiB + REQUEST_SLACK
    channel.close()
    client.close()


def test_a_server_that_cannot_allocate_new_rows_refuses_them_whole_and_goes_on(
    procs: Procs,
) -> None:
    """Without a memory budget, the OS is what says no: the server's address space is
    limited (prlimit) until growing a table fails. That exchange is refused naming the table,
    no key of it gets a row, the rows held are served as before, and once memory can be had
    again the same keys are created as if never refused."""
    server = procs.server()
    client = PSClient([server.address], transport="grpc")
    client.declare_sparse("emb", DIM, optimizer="adagrad", lr=0.1)
    client.pull_sparse("emb", np.arange(BATCH), clock=0)
    pages = int(Path(f"/proc/{server.pid}/statm").read_text().split()[0])
    limit = pages * 4096 + 256 * MiB
    subprocess.run(["prlimit", "--pid", str(server.pid), f"--as={limit}:unlimited"],
                   check=True, timeout=30)
    refused: RemoteError | None = None
    start = BATCH
    try:
        while start < 400 * BATCH:  # rows of about 1.6 GiB: past the limit
            try:
                client.pull_sparse("emb", np.arange(start, start + BATCH), clock=0)
            except RemoteError as exc:
                refused = exc
                break
            start += BATCH
        assert refused is not None, f"{start} rows created, none refused"
        assert refused.code is grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert refused.details.startswith(f"table 'emb': this server could not allocate "
                                          f"memory for {BATCH} new rows ("), refused.details
        assert "none of them was created" in refused.details
        (table,) = client.stats()[0].tables
        assert table.rows == start
        held = np.arange(0, start, 997)
        first = client.pull_sparse("emb", held, clock=0)
        # The refused keys have no rows: asked again they are refused again, the same way.
        with pytest.raises(RemoteError, match="could not allocate memory") as again:
            client.pull_sparse("emb", np.arange(start, start + BATCH), clock=0)
        assert again.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        # Any other request the OS refuses memory for says the same, and leaves nothing.
        with pytest.raises(RemoteError, match="could not allocate memory for the request"
                           ) as dense:
            client.declare_dense("big", (8192, 8192), optimizer="adam", lr=0.1)
        assert dense.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [t.name for t in client.stats()[0].tables] == ["emb"]
    finally:
        subprocess.run(["prlimit", "--pid", str(server.pid), "--as=unlimited:unlimited"],
                       check=True, timeout=30)
    fresh = np.arange(start, start + BATCH)
    created = client.pull_sparse("emb", fresh, clock=0)
    # The same rows as another server creates for those keys (initialised from the key).
    other = PSClient([procs.server().address], transport="grpc")
    other.declare_sparse("emb", DIM, optimizer="adagrad", lr=0.1)
    torch.testing.assert_close(created, other.pull_sparse("emb", fresh, clock=0), atol=0,
                               rtol=0)
    torch.testing.assert_close(client.pull_sparse("emb", held, clock=0), first, atol=0, rtol=0)
    client.push_sparse("emb", fresh, torch.ones(BATCH, DIM), assume_unique=True)
    assert client.stats()[0].tables[0].rows == start + BATCH
    client.declare_dense("big", (8192, 8192), optimizer="adam", lr=0.1)
    assert client.pull_dense("big").shape == (8192, 8192)
    other.close()
    client.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--memory-budget", "8XB"], "pstrain server: --memory-budget: '8XB' is not a size; "
         "give bytes, or a number with a unit such as 512MiB, 8GiB or 1.5GB"),
        (["--memory-budget=-1GiB"], "--memory-budget: '-1GiB' is not a size"),
        (["--max-new-rows", "0"], "pstrain server: max_new_rows must be >= 1, got 0"),
    ],
)
def test_a_bad_limit_flag_stops_the_server_naming_it(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ps", "--bind", "127.0.0.1:0", "--restore", "none", *flags],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=False,
    )
    assert done.returncode == 2 and message in done.stderr, (done.returncode, done.stderr)
