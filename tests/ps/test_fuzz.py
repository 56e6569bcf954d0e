"""Generated and mutated requests to every method of a real server (seeded, bounded).

Each request is built from the method's message type by walking its descriptor (edge-case
integers, table names known and unknown, NaN and huge floats, random bulk bytes and spans),
then sometimes mutated at the byte level. After each one the server must still answer its
health check, the status must be one the README documents, and a refused request must
leave every table's values and counters (but the counts of refusals and reads) as they were.

CI runs 600 seeded examples (about 10 s). `FUZZ_N=20000 FUZZ_RANDOM=1` runs more, unseeded.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from procs import Proc, Procs

from protos import codec
from protos import pstrain_pb2 as pb

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Every method of every service (the data and the admin service), and each one's path.
_METHODS = [m for service in pb.DESCRIPTOR.services_by_name.values() for m in service.methods]
_PATHS = {m.name: f"/{m.containing_service.full_name}/{m.name}" for m in _METHODS}
DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
}
KEYS = np.arange(4, dtype=np.int64)
# The reads that take the snapshot: a worker id and generation no generated request uses.
READER, READER_GENERATION = 2**31 - 1, 2**62 - 1

_INTS = [0, 1, 2, 3, 7, 64, 4097, -1, 2**31 - 1, 2**31, 2**32, 2**53, 2**62, 2**63 - 1, -(2**63)]
_FLOATS = [0.0, 1.0, -1.0, 0.5, 1e-9, 1e30, math.inf, -math.inf, math.nan]
_NAMES = ["w", "e", "", "new", "x" * 300, "../etc", "w\x00", "é"]
_I32, _I64 = (-(2**31), 2**31 - 1), (-(2**63), 2**63 - 1)
_U32, _U64 = (0, 2**32 - 1), (0, 2**64 - 1)
_T = FieldDescriptor
_INT_RANGE = {
    _T.TYPE_INT32: _I32, _T.TYPE_SINT32: _I32, _T.TYPE_SFIXED32: _I32, _T.TYPE_UINT32: _U32,
    _T.TYPE_FIXED32: _U32, _T.TYPE_INT64: _I64, _T.TYPE_SINT64: _I64, _T.TYPE_SFIXED64: _I64,
    _T.TYPE_UINT64: _U64, _T.TYPE_FIXED64: _U64,
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in _INT_RANGE:
        lo, hi = _INT_RANGE[field.type]
        edges = [v for v in _INTS if lo <= v <= hi]
        if field.name in ("generation", "incarnation", "worker", "seq", "push_clock",
                          "pull_clock", "wait_ms"):
            edges = [v for v in edges if 0 <= v <= 3]  # the reader's own ids stay apart
        return st.sampled_from(edges) | st.integers(max(lo, -4), min(hi, 4096))
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.sampled_from(_FLOATS)
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.sampled_from(_NAMES)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=96)
    if field.type == FieldDescriptor.TYPE_ENUM:
        known = len(field.enum_type.values) if field.enum_type is not None else 0
        return st.integers(0, known + 1)  # one past the known values
    raise AssertionError(f"no strategy for {field.full_name}")


@st.composite
def message(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0) -> Message:
    """A message of `descriptor` with a random subset of its fields set."""
    msg = pb.__dict__[descriptor.name]() if descriptor.file is pb.DESCRIPTOR else None
    if msg is None:  # pragma: no cover - every message of the service is in pstrain.proto
        raise AssertionError(descriptor.full_name)
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], \
                field.message_type.fields_by_name["value"]
            entries = draw(st.dictionaries(_scalar(key), _scalar(value), max_size=2))
            getattr(msg, field.name).update(entries)
            continue
        if field.message_type is not None:
            if depth >= 3:
                continue
            count = draw(st.integers(0, 3)) if field.is_repeated else 1
            for _ in range(count):
                part = draw(message(field.message_type, depth + 1))
                if field.is_repeated:
                    getattr(msg, field.name).add().CopyFrom(part)
                else:
                    getattr(msg, field.name).CopyFrom(part)
            continue
        if field.is_repeated:
            getattr(msg, field.name).extend(draw(st.lists(_scalar(field), max_size=4)))
        else:
            setattr(msg, field.name, draw(_scalar(field)))
    return msg


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """`data`, or it with some bytes flipped, cut short or run on."""
    how = draw(st.sampled_from(["same", "same", "flip", "cut", "extend"]))
    if how == "flip" and data:
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] ^= draw(st.integers(1, 255))
        return bytes(buf)
    if how == "cut" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "extend":
        return data + draw(st.binary(min_size=1, max_size=16))
    return data


_VALUES = st.sampled_from([0.5, -1.0, 0.0, 3.0]) | st.sampled_from([math.nan, math.inf])


@st.composite
def plausible_exchange(draw: st.DrawFn) -> bytes:
    """An Exchange much like a worker's (pushes to "e" and "w" whose payload fits them, and
    pulls), with one thing or another wrong now and then: so that requests get past the
    wire's checks to the tables' own."""
    payload = codec.Payload()
    msg = pb.ExchangeRequest(worker=draw(st.integers(0, 3)), incarnation=draw(st.integers(0, 3)),
                             push_clock=draw(st.integers(0, 3)),
                             end_iteration=draw(st.booleans()))
    for seq in range(1, draw(st.integers(1, 3)) + 1):
        dtype = draw(st.sampled_from([pb.FLOAT32] * 6 + [pb.FLOAT64, pb.INT64, 99]))
        width = 8 if dtype in (pb.FLOAT64, pb.INT64) else 4
        if draw(st.booleans()):
            keys = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, -1, 2**40, 2**63 - 1]),
                                 max_size=5))
            dim = draw(st.sampled_from([4, 4, 4, 3, 0]))
            values = draw(st.lists(_VALUES, min_size=len(keys) * dim,
                                   max_size=len(keys) * dim + draw(st.sampled_from([0, 0, 1]))))
            msg.pushes.add(table=draw(st.sampled_from(["e", "e", "w", "nope"])), seq=seq,
                           dtype=dtype, dim=dim, assign=draw(st.booleans()),
                           if_absent=draw(st.booleans()),
                           keys=payload.add(np.array(keys, dtype="<i8").tobytes()),
                           values=payload.add(bytes(np.array(values, dtype="<f4").tobytes()
                                                    * (width // 4))))
        else:
            shape = draw(st.sampled_from([[8, 4], [8, 4], [4, 8], [32], [8, 5]]))
            values = draw(st.lists(_VALUES, min_size=32, max_size=33))
            msg.pushes.add(table=draw(st.sampled_from(["w", "w", "e"])), seq=seq, dtype=dtype,
                           dense=True, shape=shape, assign=draw(st.booleans()),
                           if_absent=draw(st.booleans()),
                           values=payload.add(bytes(np.array(values, dtype="<f4").tobytes()
                                                    * (width // 4))))
    if draw(st.booleans()):
        msg.pulls.add(table="w", dense=True)
    if draw(st.booleans()):
        keys = draw(st.lists(st.sampled_from([0, 1, 2, 3, 7, 2**40]), max_size=4))
        msg.pulls.add(table="e", keys=payload.add(np.array(keys, dtype="<i8").tobytes()))
    if draw(st.booleans()) and msg.pushes:  # a span off by a few bytes
        push = msg.pushes[draw(st.integers(0, len(msg.pushes) - 1))]
        push.values.length = max(0, push.values.length
                                 + draw(st.sampled_from([-4, -1, 1, 4, 1 << 20])))
    data = bytearray(payload.nbytes)
    payload.copy_into(memoryview(data))
    return codec.encode(msg, {"payload": [memoryview(bytes(data))]})


@st.composite
def call(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """(method, its request's bytes: one message, or the parts of a stream)."""
    if draw(st.booleans()):
        return "Exchange", [draw(mutated(draw(plausible_exchange())))]
    method = draw(st.sampled_from(_METHODS))
    if method.client_streaming:
        parts = draw(st.lists(message(method.input_type), min_size=1, max_size=3))
        return method.name, [draw(mutated(p.SerializeToString())) for p in parts]
    request = draw(message(method.input_type))
    return method.name, [draw(mutated(request.SerializeToString()))]


@dataclass
class Target:
    server: Proc
    channel: grpc.Channel

    def send(self, method: str, data: list[bytes]) -> grpc.StatusCode:
        try:
            if method == "ExchangeStream":
                list(self.channel.stream_stream(_PATHS[method])(iter(data), timeout=10))
            else:
                self.channel.unary_unary(_PATHS[method])(data[0], timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    def reset(self) -> None:
        """Back to the two tables every run starts with (an accepted Restore or declare may
        have wiped or added some): an empty restore, then the declares and the rows read."""
        self.channel.unary_unary(_PATHS["Restore"])(b"", timeout=10)
        declare = pb.DeclareTablesRequest(tables=[
            pb.TableSpec(name="w", dense=pb.DenseSpec(
                shape=[8, 4], dtype=pb.FLOAT32, init=pb.Initializer(kind="uniform", a=-1, b=1)),
                optimizer=pb.OptimizerSpec(name="sgd", params={"lr": 1.0})),
            pb.TableSpec(name="e", sparse=pb.SparseSpec(dim=4, dtype=pb.FLOAT32),
                         optimizer=pb.OptimizerSpec(name="adagrad", params={"lr": 0.1})),
        ])
        self.channel.unary_unary(_PATHS["DeclareTables"])(declare.SerializeToString(),
                                                          timeout=10)
        self.snapshot()  # its read of KEYS creates those rows of "e"

    def healthy(self) -> bool:
        stub = health_pb2_grpc.HealthStub(self.channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def snapshot(self) -> tuple[Any, ...]:
        """Every table's counters (but refusals and reads) and sizes (but the key index's
        capacity), the clocks, and the values of "w" and of rows KEYS of "e" (where they
        exist)."""
        stats = pb.StatsResponse.FromString(
            self.channel.unary_unary(_PATHS["GetStats"])(b"", timeout=10))
        tables = []
        for t in stats.tables:
            t.ClearField("pushes_rejected")
            t.ClearField("pulls")
            t.ClearField("rows_pulled")
            # The key index's capacity: a read reserves room for its keys before it looks
            # them up (so an insert cannot fail half-way), which may grow it one batch early.
            t.ClearField("index_bytes")
            tables.append(t.SerializeToString(deterministic=True))
        values = [self._read(pb.ExchangePull(table="w", dense=True), b""),
                  self._read(pb.ExchangePull(table="e", keys=pb.Span(offset=0, length=32)),
                             codec.keys_bytes(KEYS).tobytes())]
        clocks = sorted((c.worker, c.clock, c.live) for c in stats.clocks)
        return sorted(tables), values, clocks

    def _read(self, pull: pb.ExchangePull, payload: bytes) -> bytes | str:
        request = pb.ExchangeRequest(worker=READER, incarnation=1, generation=READER_GENERATION,
                                     pulls=[pull])
        try:
            return bytes(self.channel.unary_unary(_PATHS["Exchange"])(
                codec.encode(request, {"payload": [memoryview(payload)]}), timeout=10))
        except grpc.RpcError as exc:
            return exc.code().name  # the table is gone or changed kind: compared as such


@pytest.fixture
def target(procs: Procs) -> Iterator[Target]:
    server = procs.server(extra=["--max-message-mib", "2", "--chunk-mib", "0.001",
                                 "--max-answer-mib", "0.01", "--max-table-mib", "1",
                                 "--max-dim", "64", "--max-tables", "40",
                                 "--max-declare-tables", "8", "--max-wait-s", "1",
                                 "--stream-idle-s", "5"])
    channel = grpc.insecure_channel(server.address)
    target = Target(server, channel)
    target.reset()
    yield target
    channel.close()


@pytest.mark.timeout(180)
def test_generated_requests_get_documented_statuses_and_refusals_change_nothing(
    target: Target,
) -> None:
    seen: dict[str, int] = {}
    history: list[object] = []

    @settings(max_examples=int(os.environ.get("FUZZ_N", "600")), deadline=None,
              derandomize="FUZZ_RANDOM" not in os.environ, database=None,
              suppress_health_check=list(HealthCheck))
    @given(call())
    def check(request: tuple[str, list[bytes]]) -> None:
        method, data = request
        before = target.snapshot()
        code = target.send(method, data)
        seen[code.name] = seen.get(code.name, 0) + 1
        assert code is grpc.StatusCode.OK or code in DOCUMENTED, (method, code, data)
        assert target.healthy(), (method, data)
        if code is not grpc.StatusCode.OK:
            assert target.snapshot() == before, (method, code, data, history[-3:])
        elif method in ("Restore", "DeclareTables", "SetMembership", "Join"):
            target.reset()  # the next request starts from the two tables again
        history.append((method, code.name, data))

    check()
    # The generated requests reach past decoding: some are applied, some refused by checks.
    assert seen.get("OK", 0) > 10 and seen.get("INVALID_ARGUMENT", 0) > 10, seen
